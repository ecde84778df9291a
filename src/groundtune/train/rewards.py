"""The RL rewards: pure functions of one answer and its sample, using the box module's parser, IoU
and matching, so a reward reads and pairs boxes exactly as eval does. An answer that cannot be
parsed earns the floor, never an exception.

    reward(pred_boxes, true_boxes, image_size, RewardWeights())  ->  {"reward", "iou", "format"}

``pred_boxes`` is the answer as read: its boxes, ``[]`` for a no-target answer, or None when it
could not be read (``infer.Prediction``: ``boxes``, ``no_target``).

The box term scores a SET (a phrase names one box, several or none). Predicted and true boxes are
matched one to one by ``boxes.match_boxes`` (the function eval counts its true positives with,
here with every pair allowed, so the matching maximises the summed overlap), and

    box = (sum of the matched pairs' overlap + floor x unmatched boxes) / max(|predicted|, |true|)

with overlap IoU (floor 0) or GIoU (floor -1). Each box the answer misses or adds beyond the
smaller side counts as the worst overlap there is: IoU's 0, GIoU's -1, so extra boxes never dilute
a bad score and the result stays in [0, 1] (IoU) or [-1, 1] (GIoU). Two cases have no pairs:
an empty answer (``[]``) to a no-target phrase earns 1, the best there is; an answer that was not
read earns the floor. One predicted box against one true box gives that pair's IoU (or GIoU):
the single-box reward as it always was.

A missed box and an extra one cost alike in the box term. ``RewardWeights.missed`` (0 by default)
subtracts, on top, that weight times the share of the true boxes the answer does not find at IoU >=
0.5 (eval's recall, from 1): a model that lists too few boxes is pushed to list them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from groundtune import boxes


@dataclass(frozen=True)
class RewardWeights:
    box: float = 1.0  # weight of the box term: matched IoU (or GIoU) of the answer's set of boxes
    format: float = 0.1  # weight of the format term: the answer was read (boxes inside the image, or [])
    giou: bool = False  # GIoU in [-1, 1] instead of IoU in [0, 1]: disjoint boxes still get a signal
    missed: float = 0.0  # subtracted x the share of the true boxes not found at IoU >= 0.5


def format_reward(pred_boxes: Sequence[boxes.Box] | None, image_size: boxes.Size) -> float:
    """1 when the answer was read: the no-target answer ``[]``, or boxes that all lie inside the
    image (a pixel of slack for rounding); 0 when it was not read. ``[]`` earns format credit even
    on a phrase that has a target: it is well formed, and its box term is 0 there."""
    if pred_boxes is None:
        return 0.0
    w, h = image_size
    return float(all(-1 <= x1 < x2 <= w + 1 and -1 <= y1 < y2 <= h + 1 for x1, y1, x2, y2 in pred_boxes))


def box_reward(pred_boxes: Sequence[boxes.Box] | None, true_boxes: Sequence[boxes.Box],
               use_giou: bool = False) -> float:
    """The set's matched IoU (or GIoU) over max(|predicted|, |true|), unmatched boxes at the
    overlap's floor (the module docstring has the formula); 1 for ``[]`` to a no-target phrase."""
    overlap, floor = (boxes.giou, -1.0) if use_giou else (boxes.iou, 0.0)
    if pred_boxes is None:
        return floor
    if not pred_boxes and not true_boxes:
        return 1.0
    pairs = boxes.match_boxes(pred_boxes, true_boxes, overlap)
    n = max(len(pred_boxes), len(true_boxes))
    return (sum(value for _, _, value in pairs) + floor * (n - len(pairs))) / n


def missed_share(pred_boxes: Sequence[boxes.Box] | None, true_boxes: Sequence[boxes.Box]) -> float:
    """The share of the true boxes that no answered box finds at IoU >= 0.5, matched one to one as
    eval matches them (1 - recall@0.5); 0 for a phrase naming nothing, 1 for an unread answer."""
    if not true_boxes:
        return 0.0
    found = len(boxes.match_boxes(pred_boxes or [], true_boxes, boxes.iou, boxes.MATCH_IOU))
    return 1.0 - found / len(true_boxes)


def reward(pred_boxes: Sequence[boxes.Box] | None, true_boxes: Sequence[boxes.Box], image_size: boxes.Size,
           weights: RewardWeights) -> dict[str, float]:
    """The weighted reward of one answer, with its parts (``iou`` is always the plain-IoU box
    term, for logs and the curriculum: a single box's IoU, 1 for ``[]`` to a no-target phrase)."""
    fmt = format_reward(pred_boxes, image_size)
    box = box_reward(pred_boxes, true_boxes, weights.giou)
    total = weights.box * box + weights.format * fmt
    if weights.missed:
        total -= weights.missed * missed_share(pred_boxes, true_boxes)
    return {"reward": total, "iou": box_reward(pred_boxes, true_boxes), "format": fmt}
