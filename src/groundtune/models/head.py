"""Box-head mode (``head: box``): the boxes read off the language model's hidden states in one
forward pass, instead of written as text token by token.

The head looks at the image through the language model's own states. Its query is the hidden
state of the prompt's LAST token: in a causal model only a late position has seen the whole image
and the whole phrase (the first has seen nothing, so a "[CLS]" state would be useless), and the
prompt ends with the opening of the family's text answer up to its first coordinate
(``prompt_end``: ``[{"bbox_2d": [``), the state a text-answering model writes the box's first
number from. The query attends over the sample's image tokens: their last hidden states, plus
Fourier features of where each token's cell is, which the grid says (``image_tokens``). A box
comes from that attention map: its centre is the map's weighted mean of the cells' centres, its
width and height sqrt(12 var + cell^2) of the map's spread (a map spread evenly over n cells gives
n cells). A small MLP on the query and the attended states corrects it (centre added, size scaled
in log space); its last layer starts at zero, so at first the box is the map's.

Why a map: an MLP regressing four numbers from the query state alone (hidden -> 512 -> GELU -> 4)
learned slowly: on the quickstart's variant task it reached 0.31-0.43 Acc@0.5 after 500 steps,
against the text head's 0.655. The map reaches 0.725-0.75 in the same steps and less time
(docs/benchmarks-history.md, "A box head that looks at the image"). The map puts the box where the image is,
cell by cell, so the head need not learn coordinates from nothing.

A phrase names a SET: 0, 1 or several boxes, so the head answers candidates, each a box and an
objectness score, in one of two layouts (``head_slots``).

CELLS (``head_slots`` 0; quickstart-every's): one candidate per image token. Token t's candidate
box is its own cell, corrected by an MLP on the query state, the token's state, where the cell lies
and the product of query and token projections (the phrase's "red circle" meeting the cell's); its
objectness is that MLP's logit plus the query's attention score on the token. Why: a cell owns its
region, so no two candidates start alike, and the matching pairs each true box with the cells under
it from the first step. The slots below, which do not see one another, never learned to split a set
between them: `groundtune train quickstart-every head=box` from tiny 2's first model gave F1@0.5
0.085 with 8 slots, 0.38-0.45 with cells, against the text answer's 0.507 (docs/box-head.md). A
phrase's boxes are those of the cells whose score reaches the threshold; a padding token (a batch's
smaller image) never answers.

SLOTS (``head_slots`` K > 0, the default, 8): K query slots, DETR's answer, and the better boxes
where a phrase names one thing (a cell's box is its cell moved and resized, a slot's is read off an
attention map over every cell: on the quickstart's variant, Acc@0.5 0.685 against 0.495): slot k's
query is the query state plus a learned offset, each slot makes its own map, box and objectness
score (the MLP's features, one more output). Slot 0's offset starts at zero and the others near it
(``box_head.SLOT_SPREAD``), so one slot IS the single-box head, and K slots start as K near-copies
of it that the matching pulls apart. Why offsets on the query state rather than K queries of their
own: every slot keeps reading the phrase and the image through the state the single-box head was
measured on; an offset only moves where in the image it looks.

Training matches candidates (cells or slots) to true boxes one-to-one with the Hungarian algorithm
(``set_loss``). The cost of giving true box j to candidate k is exactly what that changes in the
loss: the pair's 1 - GIoU + ``head_l1_weight`` x L1, plus the candidate's objectness loss as
"object" minus as "no object" (-logit for binary cross-entropy). The matching therefore minimises
the loss itself over every assignment (DETR's cost has the same three terms, weighted on their
own). Loss per sample: the matched pairs' box losses + binary cross-entropy of every candidate's
objectness (matched: 1, others: 0), as fractions of the image (``boxes.to_unit``). A no-target
phrase trains every candidate towards 0; a single-target one trains one candidate's box. An answer
keeps the candidates whose score (sigmoid) is at least the head's threshold (saved with the head; a
run with eval data chooses it there, the one of best F1@0.5), boxes in reading order.

The head is a submodule of the model it reads (``model.box_head``): it trains, is checkpointed,
sharded and all-reduced with the model's trainable weights without any code of its own, and it
is saved beside the model as ``box_head.safetensors`` (``groundtune.json`` says ``head: box``),
its threshold in that file's metadata. A file of the single-box head of before sets loads as one
slot that always answers (``box_head.load_head``).

The head itself (``BoxHead``, its map and features) is models/box_head.py, a module that imports
no groundtune: a box-head export carries a copy (``SCRIPT_FILE``), which runs the export with
transformers alone. Here: the rest of box-head mode (reading a batch, the loss, saving, loading).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from groundtune import boxes
from groundtune.config import TrainConfig
from groundtune.errors import ModelError, TrainingError
from groundtune.models.box_head import HEAD_FILE, BoxHead, ImageTokens, cells, load_head, save_head
from groundtune.models.qwen import IGNORE_INDEX

ATTRIBUTE = "box_head"  # the head's name on the model it reads (and the prefix of its weights' names)
# A box head pre-trained with a model that answers in text (tiny's): not used for its answers (its
# groundtune.json says no head), only the weights a head=box run on that model starts from
# (``start_file``); a head drawn anew needs far more than a CPU's minutes (docs/box-head.md)
PRETRAINED_FILE = "box_head_pretrained.safetensors"
SCRIPT_FILE = "box_head.py"  # the head's own module, copied into a box-head export: it runs the export
# The weight of a slot's "no object" loss against "object" (DETR's eos_coef, 0.1 for its 100
# slots). 1: with K = 8 slots and 0-3 true boxes the unmatched outnumber the matched a few to one,
# not DETR's ~30, and an unweighted score stays the probability that a slot holds a true box,
# which is what one fixed threshold (0.5 by default) reads. A lower weight would raise every
# score, duplicates' too.
NO_OBJECT_WEIGHT = 1.0


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
         tokens: ImageTokens) -> tuple[torch.Tensor, torch.Tensor]:
    """``box_head`` on the hidden states of a batch (batch, length, hidden): the query states at
    ``query`` (rows, columns), the image tokens at ``tokens`` -> (samples, slots, 4) xyxy
    fractions and (samples, slots) objectness logits."""
    rows, columns = (t.to(hidden.device) for t in query)
    return box_head(hidden[rows, columns], hidden[tokens.rows, tokens.columns], tokens)


def script_source() -> str:
    """The head's module as copied into a box-head export (models/box_head.py)."""
    return (Path(__file__).parent / SCRIPT_FILE).read_text()


def prompt_end(family: str) -> str:
    """What a box-head model's prompts end with: the opening of ``family``'s text answer."""
    return boxes.answer_opening(family)


def attach(model, hidden_size: int, slots: int = TrainConfig.head_slots,
           threshold: float = TrainConfig.head_threshold) -> BoxHead:
    """A new head of ``slots`` slots on ``model`` (initialised from the current seed), in fp32 on its
    device; its answers keep the slots whose score is at least ``threshold``."""
    device = next(model.parameters()).device
    head = BoxHead(hidden_size, slots, threshold).to(device)
    setattr(model, ATTRIBUTE, head)
    return head


def start_file(folder: Path, meta: dict) -> Path | None:
    """The head a ``head=box`` run on the model in ``folder`` starts from: a box-head model's own
    (``meta``, its groundtune.json, says ``head: box``), else one pre-trained with it
    (``PRETRAINED_FILE``), else None (a new head)."""
    own, pretrained = folder / HEAD_FILE, folder / PRETRAINED_FILE
    if meta.get("head") == "box" and own.exists():
        return own
    return pretrained if pretrained.exists() else None


def attach_from(model, file: Path, hidden_size: int, slots: int, threshold: float) -> BoxHead | None:
    """The head saved in ``file`` on ``model`` (fp32, as load_head builds it, whatever the file's
    dtype; trainable), answering at ``threshold``; None where its layout is not ``slots`` (another
    layout is a different head: the caller draws one)."""
    head = read_file(file, hidden_size)
    if len(head.slots) != slots:
        return None
    head.threshold = threshold
    setattr(model, ATTRIBUTE, head.to(next(model.parameters()).device))
    return head


def head_of(model) -> BoxHead | None:
    return getattr(model, ATTRIBUTE, None)


def model_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model's weights by full name without its box head's: the head is saved in a file of its
    own (``save``), never in the model's, which then loads as the text model it was built as."""
    return {k: v for k, v in weights.items() if not k.startswith(f"{ATTRIBUTE}.")}


def save(head: BoxHead, folder: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
    """The head's weights and threshold into ``folder`` (``weights``: the model's, gathered whole,
    by full name)."""
    state = None
    if weights is not None:
        state = {k.split(f"{ATTRIBUTE}.", 1)[1]: v for k, v in weights.items() if f"{ATTRIBUTE}." in k}
    save_head(head, Path(folder) / HEAD_FILE, state)


def load(model, folder: Path, hidden_size: int) -> BoxHead:
    """The head saved in ``folder``, attached to ``model`` on its device. A single-box head of
    before sets loads as one slot that always answers (``box_head.load_head``)."""
    head = read_file(Path(folder) / HEAD_FILE, hidden_size).to(next(model.parameters()).device)
    setattr(model, ATTRIBUTE, head)
    return head


def read_file(file: Path, hidden_size: int) -> BoxHead:
    """The head in ``file`` (``box_head.load_head``), in fp32; a file that is none this version
    reads (cut short, not safetensors, the head of an earlier design, weights of another shape) is
    a ModelError naming it."""
    from safetensors import SafetensorError

    try:
        with safe_open(str(file), "pt") as f:
            former = "mlp.0.weight" in f.keys()
        if not former:
            return load_head(file, hidden_size)
    except (OSError, SafetensorError, ValueError, KeyError, RuntimeError) as e:
        raise ModelError(f"{file}: not a box head this groundtune can read ({str(e).splitlines()[0][:200]})") from None
    raise ModelError(f"{file}: a box head of an earlier groundtune (one MLP on the query state), which "
                     "this version's head (models/head.py) replaced; train the run again")


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
    """Generalised IoU of xyxy boxes (..., 4), broadcast against each other (``boxes.giou``, for
    tensors): rows of (n, 4) pair by pair, or (k, 1, 4) against (1, n, 4) every pair."""
    area_a = (a[..., 2] - a[..., 0]).clamp(min=0) * (a[..., 3] - a[..., 1]).clamp(min=0)
    area_b = (b[..., 2] - b[..., 0]).clamp(min=0) * (b[..., 3] - b[..., 1]).clamp(min=0)
    inter = ((torch.minimum(a[..., 2], b[..., 2]) - torch.maximum(a[..., 0], b[..., 0])).clamp(min=0)
             * (torch.minimum(a[..., 3], b[..., 3]) - torch.maximum(a[..., 1], b[..., 1])).clamp(min=0))
    union = area_a + area_b - inter
    hull = ((torch.maximum(a[..., 2], b[..., 2]) - torch.minimum(a[..., 0], b[..., 0]))
            * (torch.maximum(a[..., 3], b[..., 3]) - torch.minimum(a[..., 1], b[..., 1])))
    return inter / union.clamp(min=1e-9) - (hull - union) / hull.clamp(min=1e-9)


def box_loss(predicted: torch.Tensor, target: torch.Tensor, l1_weight: float) -> torch.Tensor:
    """1 - GIoU + ``l1_weight`` x the mean absolute error of the four coordinates, of boxes (..., 4)
    broadcast against each other (as ``giou``)."""
    return 1 - giou(predicted, target) + l1_weight * (predicted - target).abs().mean(dim=-1)


def set_loss(predicted: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, counts: torch.Tensor,
             l1_weight: float) -> torch.Tensor:
    """Per sample, the head's loss for sets: ``predicted`` (samples, slots, 4) boxes and ``logits``
    (samples, slots) objectness against ``targets`` (samples, most boxes, 4), of which the first
    ``counts[i]`` are sample i's true boxes. The slots are matched to the true boxes one-to-one
    (``match``) at the cost each pair adds to the loss, so the loss is its minimum over every
    assignment: the matched pairs' ``box_loss`` + every slot's objectness cross-entropy (matched:
    1, others: 0, weighted ``NO_OBJECT_WEIGHT``)."""
    slots = predicted.shape[1]
    most = int(counts.max()) if len(counts) else 0
    if most > slots:
        raise TrainingError(f"a phrase has {most} true boxes and the box head {slots} candidates, one box each: "
                            f"train with head_slots={most} or more, or head_slots=0 (a candidate per image cell) "
                            "on images of more cells")
    logits = logits.float()
    pairs = box_loss(predicted.float()[:, :, None], targets.float()[:, None], l1_weight)  # (samples, slots, boxes)
    is_object = F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits), reduction="none")
    no_object = NO_OBJECT_WEIGHT * F.binary_cross_entropy_with_logits(logits, torch.zeros_like(logits),
                                                                       reduction="none")
    sample, slot, box = match(pairs + (is_object - no_object)[..., None], counts)
    matched = torch.zeros_like(logits, dtype=torch.bool)
    matched[sample, slot] = True
    loss = torch.where(matched, is_object, no_object).sum(dim=1)
    return loss.index_add(0, sample, pairs[sample, slot, box])


def match(cost: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one-to-one assignment of slots to true boxes of least total ``cost`` (samples, slots,
    boxes) in each sample (its first ``counts[i]`` boxes), with scipy's Hungarian algorithm
    (``linear_sum_assignment``): the matched (sample, slot, box) triples as three index tensors on
    ``cost``'s device. One copy of the costs to the CPU per batch."""
    from scipy.optimize import linear_sum_assignment

    # a non-finite cost still gets an assignment: the loss stays non-finite, and the training
    # loop's guard skips the step as it skips any other
    table = torch.nan_to_num(cost.detach().float(), nan=1e9, posinf=1e9, neginf=-1e9).cpu().numpy()
    found = [[], [], []]
    for i, n in enumerate(counts.tolist()):
        slots, targets = linear_sum_assignment(table[i, :, :n])
        found[0] += [i] * len(slots)
        found[1] += slots.tolist()
        found[2] += targets.tolist()
    return tuple(torch.tensor(index, dtype=torch.long, device=cost.device) for index in found)
