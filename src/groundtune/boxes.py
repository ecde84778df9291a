"""Every box convention groundtune knows, in one place.

The only box stored anywhere is the canonical one: xyxy in absolute pixels of the ORIGINAL image.
Everything a model reads or writes is computed from it here, and everything a model answers is
mapped back to it here. Training targets, evaluation, rewards, predict and serve all call these
functions, so a convention bug shows up everywhere at once instead of silently in one stage.

The three model families and what their boxes mean:

=============  ===================================  ==========================================
family         coordinate space                     answer text
=============  ===================================  ==========================================
qwen2.5-vl     absolute pixels of the image AFTER   ``[{"bbox_2d": [x1, y1, x2, y2], "label": ..}]``
               smart_resize
qwen2-vl       0-1000 of the image                  ``<|object_ref_start|>label<|object_ref_end|>``
                                                    ``<|box_start|>(x1,y1),(x2,y2)<|box_end|>``
qwen3-vl       0-1000 of the image                  ``[{"bbox_2d": [x1, y1, x2, y2], "label": ..}]``
=============  ===================================  ==========================================

Which family uses which coordinates and answer form is its record in groundtune/families.py (with
its resize factor and the pixel budget Qwen ships); here a resize is a ResizeSpec, whatever family
it came from.

A phrase may name several boxes, or none. Several are written in one answer in READING ORDER (by
their centres: top to bottom, then left to right), so a training target is one string, whatever
order the data listed them in: one JSON list, or one ``<|box_start|>...<|box_end|>`` span after
another. None is the empty list, ``[]``, in every family (Qwen2-VL has no form of its own for it),
and the parser reads ``[]`` as "no target", never as a failure to answer.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Sequence

from groundtune import families
from groundtune.families import NORM_1000, SPECIAL_TOKENS

Box = list[float]  # [x1, y1, x2, y2]
NO_TARGET = "[]"  # every family's answer when the phrase names nothing in the image
Size = tuple[int, int]  # (width, height): PIL's order. smart_resize alone keeps qwen-vl-utils' (h, w).

MAX_RATIO = 200  # longer side / shorter side above which smart_resize refuses an image, as the reference does

FAMILIES = tuple(families.FAMILIES)  # the names (a command line's choices); each one's facts: groundtune.families
NORM_SCALE = 1000


# --------------------------------------------------------------------------------------------
# Resizing


class ResizeError(ValueError):
    """An image smart_resize cannot represent (aspect ratio over MAX_RATIO, or no pixels). Callers
    that know the image's file add its name."""


def _round_by_factor(number: float, factor: int) -> int:
    return round(number / factor) * factor


def _ceil_by_factor(number: float, factor: int) -> int:
    return math.ceil(number / factor) * factor


def _floor_by_factor(number: float, factor: int) -> int:
    return math.floor(number / factor) * factor


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Return ``(resized_height, resized_width)`` as qwen-vl-utils' ``smart_resize`` does.

    Each side is rounded to a multiple of ``factor``; if the area is then above ``max_pixels`` the
    image is scaled down (sides floored), if below ``min_pixels`` scaled up (sides ceiled). Aspect
    ratios above 200 are refused, as the reference refuses them. Where the reference floors a very
    thin image's short side to 0 (39 x 3092 at max_pixels 50,176), each side stays at least one
    ``factor``, as transformers' own smart_resize keeps it: the area may then exceed max_pixels a little.
    """
    if height <= 0 or width <= 0:
        raise ResizeError(f"image size must be positive, got height={height}, width={width}")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ResizeError(f"aspect ratio {max(height, width) / min(height, width):.1f} is above {MAX_RATIO}, "
                          "which Qwen-VL's resize refuses; crop or pad the image")
    h_bar = max(factor, _round_by_factor(height, factor))
    w_bar = max(factor, _round_by_factor(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, _floor_by_factor(height / beta, factor))
        w_bar = max(factor, _floor_by_factor(width / beta, factor))
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = _ceil_by_factor(height * beta, factor)
        w_bar = _ceil_by_factor(width * beta, factor)
    return h_bar, w_bar


@dataclass(frozen=True)
class ResizeSpec:
    """The pixel budget of a run. Saved with every checkpoint and export, read back by eval,
    predict and serve, so the model never sees images resized differently from training. A
    family's default (the budget Qwen ships) is ``models.qwen.Family.default_resize()``."""

    factor: int
    min_pixels: int
    max_pixels: int

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"factor must be positive, got {self.factor}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"need 0 < min_pixels <= max_pixels, got min_pixels={self.min_pixels}, "
                f"max_pixels={self.max_pixels}"
            )

    def resized_size(self, size: Size) -> Size:
        """(width, height) of the image the model sees, for an original (width, height)."""
        width, height = size
        rh, rw = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return rw, rh

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ResizeSpec":
        return cls(factor=int(d["factor"]), min_pixels=int(d["min_pixels"]), max_pixels=int(d["max_pixels"]))

    def __str__(self) -> str:
        return f"factor {self.factor}, {self.min_pixels:,}..{self.max_pixels:,} pixels"


# --------------------------------------------------------------------------------------------
# Plain geometry


def xywh_to_xyxy(box: Sequence[float]) -> Box:
    x, y, w, h = (float(v) for v in box)
    return [x, y, x + w, y + h]


def xyxy_to_xywh(box: Sequence[float]) -> Box:
    x1, y1, x2, y2 = (float(v) for v in box)
    return [x1, y1, x2 - x1, y2 - y1]


def scale_box(box: Sequence[float], from_size: Size, to_size: Size) -> Box:
    """Map a pixel box between two sizes of the same picture (the picture is stretched, not cropped)."""
    sx = to_size[0] / from_size[0]
    sy = to_size[1] / from_size[1]
    x1, y1, x2, y2 = box
    return [x1 * sx, y1 * sy, x2 * sx, y2 * sy]


def original_to_resized(box: Sequence[float], original_size: Size, resized_size: Size) -> Box:
    return scale_box(box, original_size, resized_size)


def resized_to_original(box: Sequence[float], resized_size: Size, original_size: Size) -> Box:
    return scale_box(box, resized_size, original_size)


def to_norm1000(box: Sequence[float], size: Size) -> Box:
    return scale_box(box, size, (NORM_SCALE, NORM_SCALE))


def from_norm1000(box: Sequence[float], size: Size) -> Box:
    return scale_box(box, (NORM_SCALE, NORM_SCALE), size)


def to_unit(box: Sequence[float], size: Size) -> Box:
    """Pixels of an image of ``size`` -> fractions of its width and height: what a box head
    predicts (models/head.py). Resizing scales each axis, so a box's fractions of the image the
    model sees are its fractions of the original: no resized size is needed either way."""
    return scale_box(box, size, (1, 1))


def from_unit(box: Sequence[float], size: Size) -> Box:
    return scale_box(box, (1, 1), size)


def as_box(value) -> Box | None:
    """``value`` as four floats when it is a list/tuple of exactly four finite numbers, else None.
    The one test of "is this a box" for records, checks and the answer parser: a bool is not a
    number here (``true`` in a box is a bug, not 1), and NaN/inf are not coordinates."""
    if not isinstance(value, (list, tuple)) or len(value) != 4:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value):
        return None
    return [float(v) for v in value]


def clip_box(box: Sequence[float], size: Size) -> Box:
    w, h = size
    x1, y1, x2, y2 = box
    return [min(max(x1, 0.0), w), min(max(y1, 0.0), h), min(max(x2, 0.0), w), min(max(y2, 0.0), h)]


def box_area(box: Sequence[float]) -> float:
    return max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])


def has_area(box: Sequence[float]) -> bool:
    """Whether an xyxy box is one: its corners in order with room between them (x1 < x2 and
    y1 < y2). [40, 5, 10, 30] is not a box turned round: nothing says which corner was meant, so
    it has no area, scores IoU 0 and is shown as invalid, never as the box its sorted corners make."""
    return box[0] < box[2] and box[1] < box[3]


def box_centre(box: Sequence[float]) -> tuple[float, float]:
    """The (x, y) centre of an xyxy box."""
    return (box[0] + box[2]) / 2, (box[1] + box[3]) / 2


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two xyxy boxes; 0 when the union is empty."""
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(0.0, iw) * max(0.0, ih)
    union = box_area(a) + box_area(b) - inter
    return inter / union if union > 0 else 0.0


def giou(a: Sequence[float], b: Sequence[float]) -> float:
    """Generalised IoU (Rezatofighi et al. 2019), in [-1, 1]: IoU minus the share of the smallest
    enclosing box that neither box covers, so disjoint boxes still get a distance signal."""
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(0.0, iw) * max(0.0, ih)
    union = box_area(a) + box_area(b) - inter
    hull = (max(a[2], b[2]) - min(a[0], b[0])) * (max(a[3], b[3]) - min(a[1], b[1]))
    if union <= 0 or hull <= 0:
        return 0.0
    return inter / union - (hull - union) / hull


def best_iou(pred_box: Sequence[float] | None, true_boxes: Sequence[Sequence[float]], overlap=iou) -> float:
    """The overlap (IoU, or ``giou``) of a predicted box with the best-matching true box: how eval
    scores an answer and RL rewards it. 0 without a prediction: a missing box is never guessed."""
    if pred_box is None or not true_boxes:
        return 0.0
    return max(overlap(pred_box, t) for t in true_boxes)


MATCH_IOU = 0.5  # a predicted box counts for a true box at IoU >= 0.5, as in RefCOCO and gRefCOCO


def match_boxes(pred_boxes: Sequence[Sequence[float]], true_boxes: Sequence[Sequence[float]], overlap=iou,
                min_overlap: float | None = None) -> list[tuple[int, int, float]]:
    """The optimal one-to-one matching of predicted to true boxes: ``(pred index, true index,
    overlap)`` per pair, by pred index. Only pairs at ``overlap >= min_overlap`` may match (every
    pair when None); the matching pairs as many boxes as it can, and among those the largest summed
    overlap. How eval counts true positives (IoU >= 0.5) and how an RL reward scores a set.

    Most boxes first, then overlap: with a threshold, a larger sum can come from fewer pairs
    (two at 1.0 against three at 0.55), and precision/recall count pairs. Without one, every full
    matching pairs min(|pred|, |true|) boxes and the sum alone decides."""
    if not pred_boxes or not true_boxes:
        return []
    values = [[overlap(p, t) for t in true_boxes] for p in pred_boxes]
    allowed = [[min_overlap is None or v >= min_overlap for v in row] for row in values]
    if len(pred_boxes) == 1 or len(true_boxes) == 1:  # one pair at most: the best allowed one is exact
        pairs = [(i, j) for i in range(len(pred_boxes)) for j in range(len(true_boxes)) if allowed[i][j]]
        if not pairs:
            return []
        i, j = max(pairs, key=lambda ij: values[ij[0]][ij[1]])
        return [(i, j, values[i][j])]
    # Hungarian algorithm (scipy's, exact). Imported here: it costs ~0.4 s, and single boxes never
    # need it. A pair's weight is big + overlap, big above twice the most pairs there can be
    # (overlap lies in [-1, 1] for GIoU), so one more pair always outweighs any gain in overlap;
    # a pair not allowed weighs 0 and is dropped after.
    from scipy.optimize import linear_sum_assignment

    big = 2 * min(len(pred_boxes), len(true_boxes)) + 2
    weights = [[big + v if ok else 0.0 for v, ok in zip(row, oks)] for row, oks in zip(values, allowed)]
    rows, cols = linear_sum_assignment(weights, maximize=True)
    return [(int(i), int(j), values[i][j]) for i, j in zip(rows, cols) if allowed[i][j]]


# --------------------------------------------------------------------------------------------
# Model coordinates: original pixels <-> what a family reads and writes


def to_model_coords(box: Sequence[float], family: str, original_size: Size, resized_size: Size) -> list[int]:
    """Original-pixel xyxy -> the integer coordinates the family writes in its answer."""
    if families.family(family).coordinates == NORM_1000:
        coords = to_norm1000(box, original_size)
        limit = (NORM_SCALE, NORM_SCALE)
    else:
        coords = original_to_resized(box, original_size, resized_size)
        limit = resized_size
    # Round half up (not Python's half-to-even) so corners one unit apart never collapse together.
    x1, y1, x2, y2 = (math.floor(v + 0.5) for v in coords)
    x1, x2 = _keep_one_unit(x1, x2, limit[0])
    y1, y2 = _keep_one_unit(y1, y2, limit[1])
    return [x1, y1, x2, y2]


def _keep_one_unit(lo: int, hi: int, limit: int) -> tuple[int, int]:
    """Clamp to [0, limit] and keep at least one unit between the corners: a box smaller than the
    coordinate grid must stay a box in the target text, not become a line the parser rejects."""
    lo, hi = min(max(lo, 0), limit), min(max(hi, 0), limit)
    if hi <= lo:
        hi = min(lo + 1, limit)
        lo = hi - 1
    return lo, hi


def from_model_coords(coords: Sequence[float], family: str, original_size: Size, resized_size: Size) -> Box:
    """The family's answer coordinates -> original-pixel xyxy (not clipped)."""
    if families.family(family).coordinates == NORM_1000:
        return from_norm1000(coords, original_size)
    return resized_to_original(coords, resized_size, original_size)


def format_target(
    boxes: Sequence[Sequence[float]],
    label: str | None,
    family: str,
    original_size: Size,
    resized_size: Size,
) -> str:
    """The answer text a model of ``family`` should produce for these original-pixel boxes, in
    reading order (``reading_order``); ``[]`` for none. ``label=None`` leaves the phrase out of the
    answer (shorter answers, the same boxes)."""
    if not boxes:
        return NO_TARGET
    coords = [to_model_coords(b, family, original_size, resized_size) for b in reading_order(boxes)]
    if families.family(family).answer == SPECIAL_TOKENS:
        spans = "".join(f"<|box_start|>({c[0]},{c[1]}),({c[2]},{c[3]})<|box_end|>" for c in coords)
        ref = f"<|object_ref_start|>{label}<|object_ref_end|>" if label is not None else ""
        return ref + spans
    items = [{"bbox_2d": c, "label": label} if label is not None else {"bbox_2d": c} for c in coords]
    return json.dumps(items, ensure_ascii=False)


def reading_order(boxes: Sequence[Sequence[float]]) -> list[Sequence[float]]:
    """Boxes top to bottom, then left to right, by their centres: the one order every answer
    lists them in."""
    return sorted(boxes, key=lambda b: box_centre(b)[::-1])


def answer_opening(family: str) -> str:
    """The text every box answer of ``family`` starts with, up to its first coordinate, with no
    label (``[{"bbox_2d": [`` or ``<|box_start|>(``): a box head's prompts end with it
    (models/head.py). Read off ``format_target`` itself, so it can never disagree with it."""
    marker = 777  # a first coordinate no other part of the answer's text contains
    target = format_target([[marker, 0, 999, 999]], None, family, (1000, 1000), (1000, 1000))
    return target[: target.index(str(marker))]


# --------------------------------------------------------------------------------------------
# Parsing model output


@dataclass
class ParsedAnswer:
    """What a model answered, in original pixels. ``boxes`` is empty and ``error`` says why when
    nothing usable was found: a caller counts that as a parse failure, never as a guessed box."""

    boxes: list[Box] = field(default_factory=list)
    labels: list[str | None] = field(default_factory=list)
    error: str | None = None
    no_target: bool = False  # the answer was the empty list: "nothing here matches"

    @property
    def ok(self) -> bool:
        """An answer that was read: boxes, or a no-target answer."""
        return self.error is None and (bool(self.boxes) or self.no_target)

    @property
    def box(self) -> Box | None:
        return self.boxes[0] if self.boxes else None


_NUM = r"-?\d+(?:\.\d+)?"
_SPECIAL_BOX = re.compile(
    rf"(?:<\|box_start\|>)?\s*\(\s*({_NUM})\s*,\s*({_NUM})\s*\)\s*,\s*\(\s*({_NUM})\s*,\s*({_NUM})\s*\)\s*(?:<\|box_end\|>)?"
)
_REF = re.compile(r"<\|object_ref_start\|>(.*?)<\|object_ref_end\|>", re.S)
# A bracketed list of exactly four numbers (the closing bracket may be cut off at the end of a
# truncated answer). The key "bbox_2d" holds a digit, so numbers are only ever read from inside
# brackets, never "the first four numbers after the key".
_BARE_LIST = re.compile(rf"\[\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*(?:\]|$)")
_BOX_KEYS = ("bbox_2d", "bbox", "box", "bbox2d")


def _json_candidates(text: str) -> list:
    """Every JSON value that starts at a '[' or '{' in the text, outermost first."""
    decoder = json.JSONDecoder()
    found, i = [], 0
    while i < len(text):
        if text[i] in "[{":
            try:
                value, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                i += 1
                continue
            found.append(value)
            i = end
        else:
            i += 1
    return found


def _boxes_from_json(value) -> list[tuple[list[float], str | None]]:
    if as_box(value) is not None:
        return [(as_box(value), None)]
    if isinstance(value, dict):
        for key in _BOX_KEYS:
            if as_box(value.get(key)) is not None:
                label = value.get("label")
                return [(as_box(value[key]), label if isinstance(label, str) else None)]
        return [b for v in value.values() if isinstance(v, (list, dict)) for b in _boxes_from_json(v)]
    if isinstance(value, list):
        return [b for v in value for b in _boxes_from_json(v)]
    return []


def _raw_boxes(text: str) -> list[tuple[list[float], str | None]]:
    """Coordinates as written, in the order they appear; tries the strictest reading first."""
    # 1. Special-token form (Qwen2-VL), with or without the tokens around the two points.
    if "<|box_start|>" in text or re.search(r"\(\s*" + _NUM + r"\s*,", text):
        labels = _REF.findall(text)
        found = [([float(g) for g in m.groups()], None) for m in _SPECIAL_BOX.finditer(text)]
        if found:
            if len(labels) == len(found):
                found = [(b, lab.strip()) for (b, _), lab in zip(found, labels)]
            elif len(labels) == 1:
                found = [(b, labels[0].strip()) for b, _ in found]
            return found
    # 2. JSON anywhere in the text (code fences and chatter around it are ignored).
    found = [b for value in _json_candidates(text) for b in _boxes_from_json(value)]
    if found:
        return found
    # 3. Truncated or malformed JSON: bracketed four-number lists anywhere.
    return [([float(g) for g in m.groups()], None) for m in _BARE_LIST.finditer(text)]


def parse_answer(text: str, family: str, original_size: Size, resized_size: Size) -> ParsedAnswer:
    """Read every box in a model's answer and map it to original pixels, clipped to the image.

    Tolerates JSON with or without code fences, the special-token form, bare ``[x1, y1, x2, y2]``
    lists, several boxes and extra text. Corners given in the wrong order are put in order; a box
    that has no area once clipped to the image is dropped and, if none is left, reported.
    """
    families.family(family)  # an unknown family is an error even when the answer holds no box
    raw = _raw_boxes(text or "")
    if not raw:
        answers = _json_candidates(text or "")
        if answers and all(a == [] for a in answers):  # "[]", in code fences or words: none is there
            return ParsedAnswer(no_target=True)
        return ParsedAnswer(error="no box found in the answer")
    boxes, labels = [], []
    for coords, label in raw:
        x1, y1, x2, y2 = coords
        ordered = [min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)]
        box = clip_box(from_model_coords(ordered, family, original_size, resized_size), original_size)
        if box_area(box) > 0:
            boxes.append(box)
            labels.append(label)
    if not boxes:
        return ParsedAnswer(error="every box in the answer is empty or outside the image")
    return ParsedAnswer(boxes=boxes, labels=labels)
