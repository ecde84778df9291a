"""Augmentations that keep boxes true.

Each takes ``(image, sample)`` and returns a new ``(image, sample)``: the pixels, every target box
(``bbox`` or ``bboxes``, canonical xyxy pixels) and ``width``/``height`` move together, and the
phrase is changed where the picture change makes it false. The input sample is not modified.
Only the target boxes are moved: another box-valued extra field in a record would go stale.
"""

from __future__ import annotations

import math
import re
from PIL import Image

from groundtune.boxes import Box, Size, clip_box, scale_box
from groundtune.data.records import sample_boxes

_LEFT_RIGHT = {"left": "right", "right": "left", "leftmost": "rightmost", "rightmost": "leftmost"}
_LEFT_RIGHT_RE = re.compile(r"\b(leftmost|rightmost|left|right)\b", re.IGNORECASE)


def _same_case(word: str, like: str) -> str:
    if like.isupper():
        return word.upper()
    if like[:1].isupper():
        return word.capitalize()
    return word


def swap_left_right(phrase: str) -> str:
    """left <-> right and leftmost <-> rightmost, whole words only, case kept ("bright" stays)."""
    return _LEFT_RIGHT_RE.sub(lambda m: _same_case(_LEFT_RIGHT[m.group(0).lower()], m.group(0)), phrase)


_POSITION_RE = re.compile(
    r"\b(left|right|leftmost|rightmost|top|topmost|bottom|bottommost|above|below|under|over|upper|lower|"
    r"middle|center|centre|between|next|beside|behind|front|near|far|closest|furthest|farthest|"
    r"first|second|third|last)\b",
    re.IGNORECASE,
)


def is_positional(phrase: str) -> bool:
    """Does the phrase name its target by position or by other objects? Then scale_crop may make it
    false (see there) and a caller should skip the crop; hflip is always safe."""
    return bool(_POSITION_RE.search(phrase))


def _with_boxes(sample: dict, boxes: list[Box], size: Size) -> dict:
    """A copy of sample with its target boxes replaced, in the field (bbox/bboxes) it used."""
    out = dict(sample)
    if sample.get("bboxes") is not None:
        out["bboxes"] = boxes
    else:
        out["bbox"] = boxes[0]
    out["width"], out["height"] = size
    return out


def hflip(image: Image.Image, sample: dict) -> tuple[Image.Image, dict]:
    """Mirror left-right: x1' = W - x2, x2' = W - x1, and swap left/right words in the phrase.

    "the circle left of the red square" stays true of the mirrored picture as "the circle right of
    the red square". Vertical words (top, bottom, above, below) are unaffected by a horizontal
    flip and are left alone.
    """
    width, height = image.size
    flipped = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    boxes = [[width - x2, y1, width - x1, y2] for x1, y1, x2, y2 in sample_boxes(sample)]
    out = _with_boxes(sample, boxes, (width, height))
    if "phrase" in out:
        out["phrase"] = swap_left_right(out["phrase"])
    return flipped, out


def _randint(rng, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi] from a numpy Generator or a random.Random."""
    if hasattr(rng, "integers"):
        return int(rng.integers(lo, hi + 1))
    return rng.randint(lo, hi)


def scale_crop(
    image: Image.Image,
    sample: dict,
    rng,
    min_scale: float = 0.6,
    max_scale: float = 1.0,
    out_size: Size | None = None,
) -> tuple[Image.Image, dict]:
    """Crop a random window that contains every target box, then resize it to ``out_size``
    (default: the input size, i.e. a zoom in) and move the boxes exactly.

    The window keeps the image's aspect ratio and has sides ``scale`` x the image's, ``scale``
    drawn uniformly from [min_scale, max_scale] and raised if the boxes would not fit. It lies on
    whole pixels, so the crop is exact; the resize maps pixel edges linearly (PIL's convention), so
    the boxes follow through boxes.scale_box. ``rng``: numpy Generator or random.Random.

    Only the targets are kept whole. A phrase that names its target by position or through other
    objects ("the circle left of the red square", "the leftmost shape", "the man on the left") can
    become false when the crop cuts those objects away or changes what is leftmost; skip the crop
    for such phrases (``is_positional``). Phrases by attribute ("the red circle") stay true.
    """
    if not 0 < min_scale <= max_scale <= 1:
        raise ValueError(f"need 0 < min_scale <= max_scale <= 1, got {min_scale}, {max_scale}")
    width, height = image.size
    out_size = tuple(out_size) if out_size is not None else (width, height)
    boxes = sample_boxes(sample)
    if boxes:  # the smallest whole-pixel region holding every target box
        ux1, uy1, ux2, uy2 = clip_box(
            [min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes)],
            (width, height),
        )
        ux1, uy1, ux2, uy2 = math.floor(ux1), math.floor(uy1), math.ceil(ux2), math.ceil(uy2)
    else:  # no target: any window will do (a crop only removes objects, and names none)
        ux1, uy1, ux2, uy2 = width, height, 0, 0

    scale = float(rng.uniform(min_scale, max_scale))
    scale = max(scale, (ux2 - ux1) / width, (uy2 - uy1) / height)  # never cut a target
    cw = min(width, max(ux2 - ux1, round(scale * width)))
    ch = min(height, max(uy2 - uy1, round(scale * height)))
    # any left edge that keeps [ux1, ux2) inside [x0, x0 + cw) and the window inside the image
    x0 = _randint(rng, max(0, ux2 - cw), min(ux1, width - cw))
    y0 = _randint(rng, max(0, uy2 - ch), min(uy1, height - ch))

    cropped = image.resize(out_size, Image.Resampling.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
    moved = [scale_box([x1 - x0, y1 - y0, x2 - x0, y2 - y0], (cw, ch), out_size) for x1, y1, x2, y2 in boxes]
    return cropped, _with_boxes(sample, moved, out_size)

