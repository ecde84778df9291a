"""The RL rewards: pure functions of one answer and its sample, using the box module's parser and
IoU, so a reward reads boxes exactly as eval does. An answer that cannot be parsed earns 0, never
an exception.

    reward(prediction, true_boxes, image_size, RewardWeights())  ->  {"reward", "iou", "format"}
"""

from __future__ import annotations

from dataclasses import dataclass

from groundtune import boxes


@dataclass(frozen=True)
class RewardWeights:
    box: float = 1.0  # weight of the box term: IoU (or GIoU) with the best-matching true box
    format: float = 0.1  # weight of the format term: a box was parsed and lies inside the image
    giou: bool = False  # GIoU in [-1, 1] instead of IoU in [0, 1]: disjoint boxes still get a signal


def format_reward(pred_box: boxes.Box | None, image_size: boxes.Size) -> float:
    """1 when the answer held a box inside the image (a pixel of slack for rounding), else 0."""
    if pred_box is None:
        return 0.0
    w, h = image_size
    x1, y1, x2, y2 = pred_box
    return float(-1 <= x1 < x2 <= w + 1 and -1 <= y1 < y2 <= h + 1)


def box_reward(pred_box: boxes.Box | None, true_boxes: list[boxes.Box], use_giou: bool = False) -> float:
    """IoU (or GIoU) of the predicted box with the best-matching true box; 0 without a box."""
    return boxes.best_iou(pred_box, true_boxes, boxes.giou if use_giou else boxes.iou)


def reward(pred_box: boxes.Box | None, true_boxes: list[boxes.Box], image_size: boxes.Size,
           weights: RewardWeights) -> dict[str, float]:
    """The weighted reward of one answer, with its parts (``iou`` is always plain IoU, for logs)."""
    fmt = format_reward(pred_box, image_size)
    box = box_reward(pred_box, true_boxes, weights.giou)
    return {"reward": weights.box * box + weights.format * fmt, "iou": box_reward(pred_box, true_boxes),
            "format": fmt}
