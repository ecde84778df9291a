"""Box-head mode (``head: box``): the box read off the language model's hidden state in one
forward pass, instead of written as text token by token.

A small MLP (hidden -> 512 -> GELU -> 4) on the hidden state of the prompt's LAST token. In a
causal model only a late position has seen the whole image and the whole phrase (the first has
seen nothing, so a "[CLS]" state would be useless). The prompt ends with the opening of the
family's text answer up to its first coordinate (``prompt_end``: ``[{"bbox_2d": [``), so the state
read is the one a text-answering model uses to write the box's first number: on the quickstart's
task it learns far faster than the state where the answer begins (0.425 against 0.275 Acc@0.5 after
500 steps) or a learned query embedding appended to the prompt (0.205; BENCHMARKS.md, "Box head").
It predicts (centre x, centre y, width, height) through a sigmoid, as fractions of the image
(``boxes.to_unit``), written out as xyxy. Trained with 1 - GIoU + ``head_l1_weight`` x L1 (the
mean over the four coordinates), per sample.

The head is a submodule of the model it reads (``model.box_head``): it trains, is checkpointed,
sharded and all-reduced with the model's trainable weights without any code of its own, and it
is saved beside the model as ``box_head.safetensors`` (``groundtune.json`` says ``head: box``).
A phrase with several boxes gets one: the head predicts the first.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from groundtune import boxes
from groundtune.models.qwen import IGNORE_INDEX

HEAD_FILE = "box_head.safetensors"
ATTRIBUTE = "box_head"  # the head's name on the model it reads (and the prefix of its weights' names)
WIDTH = 512


class BoxHead(torch.nn.Module):
    def __init__(self, hidden_size: int, width: int = WIDTH):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden_size, width), torch.nn.GELU(),
                                       torch.nn.Linear(width, 4))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden) -> (n, 4) boxes, xyxy as fractions of the image."""
        cx, cy, w, h = torch.sigmoid(self.mlp(hidden.to(self.mlp[0].weight.dtype))).unbind(-1)
        return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


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
    head.load_state_dict(load_file(Path(folder) / HEAD_FILE))
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
