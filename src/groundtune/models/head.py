"""Box-head mode (``head: box``): the box read off the language model's hidden states in one
forward pass, instead of written as text token by token.

The head looks at the image through the language model's own states. Its query is the hidden
state of the prompt's LAST token: in a causal model only a late position has seen the whole image
and the whole phrase (the first has seen nothing, so a "[CLS]" state would be useless), and the
prompt ends with the opening of the family's text answer up to its first coordinate
(``prompt_end``: ``[{"bbox_2d": [``), the state a text-answering model writes the box's first
number from. The query attends over the sample's image tokens: their last hidden states, plus
Fourier features of where each token's cell is, which the grid says (``image_tokens``). The box
comes from that attention map: its centre is the map's weighted mean of the cells' centres, its
width and height sqrt(12 var + cell^2) of the map's spread (a map spread evenly over n cells gives
n cells). A small MLP on the query and the attended states corrects it (centre added, size scaled
in log space); its last layer starts at zero, so at first the box is the map's. Trained with
1 - GIoU + ``head_l1_weight`` x L1 (the mean over the four coordinates), per sample, as fractions
of the image (``boxes.to_unit``), written out as xyxy.

Why a map: an MLP regressing four numbers from the query state alone (hidden -> 512 -> GELU -> 4)
learned slowly: on the quickstart's variant task it reached 0.31-0.43 Acc@0.5 after 500 steps,
against the text head's 0.655. This head reaches 0.725-0.75 in the same steps and less time
(BENCHMARKS.md, "A box head that looks at the image"). The map puts the box where the image is,
cell by cell, so the head need not learn coordinates from nothing.

The head is a submodule of the model it reads (``model.box_head``): it trains, is checkpointed,
sharded and all-reduced with the model's trainable weights without any code of its own, and it
is saved beside the model as ``box_head.safetensors`` (``groundtune.json`` says ``head: box``).
A phrase with several boxes gets one: the head predicts the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from groundtune import boxes
from groundtune.errors import ModelError
from groundtune.models.qwen import IGNORE_INDEX

HEAD_FILE = "box_head.safetensors"
ATTRIBUTE = "box_head"  # the head's name on the model it reads (and the prefix of its weights' names)
WIDTH = 512  # the correcting MLP's width
KEY_WIDTH = 128  # the width of the query and the image tokens' keys
FREQUENCIES = 4  # Fourier features of a cell's (x, y): sin and cos at pi x 1, 2, 4, 8


@dataclass
class ImageTokens:
    """Where the image tokens of a batch are and where their cells lie in the image: each image's
    tokens once (``rows``/``columns`` in the hidden states; ``xy`` each cell's centre and ``cell``
    its width and height, as fractions of the image), and each sample's tokens among them
    (``index``, (samples, most tokens), valid where ``mask``)."""

    rows: torch.Tensor
    columns: torch.Tensor
    xy: torch.Tensor
    cell: torch.Tensor
    index: torch.Tensor
    mask: torch.Tensor


class BoxHead(torch.nn.Module):
    def __init__(self, hidden_size: int, width: int = WIDTH, key_width: int = KEY_WIDTH):
        super().__init__()
        self.query = torch.nn.Linear(hidden_size, key_width)
        # no bias on the keys: one added to every key of a sample shifts all its scores alike, which
        # the softmax ignores (its gradient would be rounding noise, which Adam scales up to steps)
        self.key = torch.nn.Linear(hidden_size, key_width, bias=False)
        self.where = torch.nn.Linear(2 + 4 * FREQUENCIES, key_width, bias=False)
        # the MLP's first layer on [query, attended states], split so that each image token is
        # projected once, before the per-sample sum (the same map, a fraction of the memory)
        self.from_query = torch.nn.Linear(hidden_size, width)
        self.from_image = torch.nn.Linear(hidden_size, width, bias=False)
        self.out = torch.nn.Linear(width, 4)
        torch.nn.init.zeros_(self.out.weight)
        torch.nn.init.zeros_(self.out.bias)

    def forward(self, query: torch.Tensor, image: torch.Tensor, tokens: ImageTokens) -> torch.Tensor:
        """``query`` (samples, hidden): each sample's query state; ``image`` (image tokens, hidden):
        the states of ``tokens``'s image tokens, in its order -> (samples, 4) boxes, xyxy as
        fractions of the image."""
        dtype = self.query.weight.dtype
        query, image, xy, cell = query.to(dtype), image.to(dtype), tokens.xy.to(dtype), tokens.cell.to(dtype)
        keys = self.key(image) + self.where(fourier(xy))  # (image tokens, key width)
        q = self.query(query)
        scores = torch.einsum("nk,ntk->nt", q, keys[tokens.index]) / q.shape[-1] ** 0.5
        p = torch.softmax(scores.masked_fill(~tokens.mask, float("-inf")), dim=-1)[..., None]  # (samples, T, 1)
        centre, size = map_box(p, xy[tokens.index], cell[tokens.index])
        correction = self.out(F.gelu(self.from_query(query) + (p * self.from_image(image)[tokens.index]).sum(1)))
        cx, cy = (centre + correction[:, :2]).unbind(-1)
        w, h = (size * torch.exp(correction[:, 2:])).unbind(-1)
        return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


def map_box(p: torch.Tensor, xy: torch.Tensor, cell: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The box an attention map over cells points at: ``p`` (samples, T, 1) the map, ``xy`` and
    ``cell`` (samples, T, 2) its cells' centres and sizes -> (samples, 2) centre and width/height.
    A map spread evenly over a block of cells gives that block: a uniform spread over a width w
    has variance (w^2 - cell^2) / 12 between cell centres."""
    centre = (p * xy).sum(1)
    spread = (p * (xy - centre[:, None]) ** 2).sum(1)
    return centre, torch.sqrt(12 * spread + (p * cell).sum(1) ** 2)


def fourier(xy: torch.Tensor) -> torch.Tensor:
    """(tokens, 2) positions in [0, 1] -> (tokens, 2 + 4 FREQUENCIES): them, then sin and cos."""
    angles = xy[..., None] * (torch.pi * 2 ** torch.arange(FREQUENCIES, device=xy.device, dtype=xy.dtype))
    return torch.cat([xy, angles.sin().flatten(-2), angles.cos().flatten(-2)], dim=-1)


def cells(grid_thw: list[int], merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's tokens' cells, in the order the prompt holds the tokens (the merged grid row by
    row, as ``qwen.mrope_positions`` lays it out): (tokens, 2) centres and (tokens, 2) sizes, as
    fractions of the image."""
    frames, height, width = (int(n) for n in grid_thw)
    rows, cols = height // merge_size, width // merge_size
    y = ((torch.arange(rows) + 0.5) / rows).repeat_interleave(cols).repeat(frames)
    x = ((torch.arange(cols) + 0.5) / cols).repeat(rows * frames)
    return torch.stack([x, y], dim=-1), torch.tensor([1 / cols, 1 / rows]).expand(len(x), 2)


def image_tokens(batch: dict[str, torch.Tensor], config, image_of_sample: list[int] | None = None) -> ImageTokens:
    """The ``ImageTokens`` of a batch (``input_ids`` padded, or one packed row) of a model with
    ``config`` (its image token and merge size), whose images, in ``image_grid_thw``'s order, are
    its image tokens' in row-major order. Sample i shows image i, or ``image_of_sample[i]`` (a row
    in which an image's phrases share its tokens: ``qwen.collate_shared``)."""
    input_ids = batch["input_ids"]
    where = (input_ids == config.image_token_id).nonzero()
    merge_size = config.vision_config.spatial_merge_size
    per_image = [cells(g, merge_size) for g in batch["image_grid_thw"].tolist()]
    counts = torch.tensor([len(xy) for xy, _ in per_image])
    if int(counts.sum()) != len(where):
        raise ValueError(f"the batch has {len(where)} image tokens, its images {int(counts.sum())}")
    shown = torch.tensor(image_of_sample) if image_of_sample is not None else torch.arange(len(counts))
    starts = F.pad(counts.cumsum(0), (1, 0))[:-1]
    steps = torch.arange(int(counts.max()))
    mask = steps[None] < counts[shown][:, None]
    index = torch.where(mask, starts[shown][:, None] + steps[None], 0)
    device = input_ids.device
    return ImageTokens(where[:, 0], where[:, 1], torch.cat([xy for xy, _ in per_image]).to(device),
                       torch.cat([cell for _, cell in per_image]).to(device), index.to(device), mask.to(device))


def read(box_head: BoxHead, hidden: torch.Tensor, query: tuple[torch.Tensor, torch.Tensor],
         tokens: ImageTokens) -> torch.Tensor:
    """``box_head`` on the hidden states of a batch (batch, length, hidden): the query states at
    ``query`` (rows, columns), the image tokens at ``tokens`` -> (samples, 4) xyxy fractions."""
    rows, columns = (t.to(hidden.device) for t in query)
    return box_head(hidden[rows, columns], hidden[tokens.rows, tokens.columns], tokens)


def prompt_end(family: str) -> str:
    """What a box-head model's prompts end with: the opening of ``family``'s text answer."""
    return boxes.answer_opening(family)


def attach(model, hidden_size: int) -> BoxHead:
    """A new head on ``model`` (initialised from the current seed), in fp32 on its device."""
    device = next(model.parameters()).device
    head = BoxHead(hidden_size).to(device)
    setattr(model, ATTRIBUTE, head)
    return head


def head_of(model) -> BoxHead | None:
    return getattr(model, ATTRIBUTE, None)


def save(head: BoxHead, folder: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
    """The head's weights into ``folder`` (``weights``: the model's, gathered whole, by full name)."""
    if weights is not None:
        state = {k.split(f"{ATTRIBUTE}.", 1)[1]: v for k, v in weights.items() if f"{ATTRIBUTE}." in k}
    else:
        state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    save_file(state, Path(folder) / HEAD_FILE)


def load(model, folder: Path, hidden_size: int) -> BoxHead:
    head = attach(model, hidden_size)
    weights = load_file(Path(folder) / HEAD_FILE)
    if "mlp.0.weight" in weights:
        raise ModelError(f"{Path(folder) / HEAD_FILE}: a box head of an earlier groundtune (one MLP on the query "
                         "state), which this version's head (models/head.py) replaced; train the run again")
    head.load_state_dict(weights)
    return head


def query_positions(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each sample's last prompt token in ``batch``: the token before its first
    labelled one when the batch has labels (training: prompt + answer), else its last token
    (inference: prompts alone, right-padded or packed in one row)."""
    labels = batch.get("labels")
    if "cu_seq_lens_q" in batch:  # packed: one row, samples one after another
        bounds = batch["cu_seq_lens_q"].tolist()
        columns = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if labels is None:
                columns.append(end - 1)
            else:
                labelled = (labels[0, start:end] != IGNORE_INDEX).nonzero()
                columns.append(start + int(labelled[0]) - 1)
        columns = torch.tensor(columns, device=batch["input_ids"].device)
        return torch.zeros_like(columns), columns
    rows = torch.arange(batch["input_ids"].shape[0], device=batch["input_ids"].device)
    if labels is not None:
        return rows, (labels != IGNORE_INDEX).int().argmax(dim=1) - 1
    return rows, batch["attention_mask"].sum(dim=1) - 1


def giou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Generalised IoU of (n, 4) xyxy boxes, row by row (``boxes.giou``, for tensors)."""
    area_a = (a[:, 2] - a[:, 0]).clamp(min=0) * (a[:, 3] - a[:, 1]).clamp(min=0)
    area_b = (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)
    inter = ((torch.minimum(a[:, 2], b[:, 2]) - torch.maximum(a[:, 0], b[:, 0])).clamp(min=0)
             * (torch.minimum(a[:, 3], b[:, 3]) - torch.maximum(a[:, 1], b[:, 1])).clamp(min=0))
    union = area_a + area_b - inter
    hull = ((torch.maximum(a[:, 2], b[:, 2]) - torch.minimum(a[:, 0], b[:, 0]))
            * (torch.maximum(a[:, 3], b[:, 3]) - torch.minimum(a[:, 1], b[:, 1])))
    return inter / union.clamp(min=1e-9) - (hull - union) / hull.clamp(min=1e-9)


def box_loss(predicted: torch.Tensor, target: torch.Tensor, l1_weight: float) -> torch.Tensor:
    """Per sample: 1 - GIoU + ``l1_weight`` x the mean absolute error of the four coordinates."""
    return 1 - giou(predicted, target) + l1_weight * F.l1_loss(predicted, target, reduction="none").mean(dim=-1)
