"""Augmentations keep boxes true, checked by drawing: paint the box, transform picture and sample
together, and measure where the paint went."""

from __future__ import annotations

import random

import numpy as np
import pytest
from PIL import Image, ImageDraw

from groundtune.data.augment import hflip, is_positional, scale_crop, swap_left_right

RED, BLUE = (255, 0, 0), (0, 0, 255)


def _canvas(size, boxes_colours):
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    for (x1, y1, x2, y2), colour in boxes_colours:
        draw.rectangle([x1, y1, x2 - 1, y2 - 1], fill=colour)  # pixels [x1, x2) x [y1, y2)
    return image


def _painted_box(image: Image.Image, colour) -> list[float]:
    """Bounding box (xyxy edges) of pixels closer to `colour` than to white: half-covered edge
    pixels after resampling count as in, less-than-half ones as out."""
    a = np.asarray(image).astype(int)
    near = np.abs(a - np.array(colour)).sum(-1) < np.abs(a - 255).sum(-1)
    ys, xs = np.nonzero(near)
    assert len(xs), "the paint disappeared"
    return [float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)]


def _close(a, b, tol=1.0):
    return all(abs(x - y) <= tol for x, y in zip(a, b))


# --------------------------------------------------------------------------------------------
# hflip


def test_hflip_moves_the_box_with_the_paint():
    box = [10, 20, 41, 35]
    image = _canvas((120, 90), [(box, RED)])  # not square: a W/H mix-up would show
    sample = {"width": 120, "height": 90, "phrase": "the red square on the left", "bbox": [float(v) for v in box]}
    out_image, out = hflip(image, sample)
    assert out["bbox"] == [120 - 41, 20, 120 - 10, 35]
    assert _painted_box(out_image, RED) == out["bbox"]
    assert out["phrase"] == "the red square on the right"
    assert (out["width"], out["height"]) == (120, 90)
    assert sample["bbox"] == [10.0, 20.0, 41.0, 35.0] and "left" in sample["phrase"]  # input untouched


def test_hflip_twice_is_identity_and_handles_bboxes():
    boxes = [[3.0, 4.0, 20.0, 30.0], [60.0, 50.0, 100.0, 70.0]]
    image = _canvas((110, 80), [(boxes[0], RED), (boxes[1], BLUE)])
    sample = {"width": 110, "height": 80, "phrase": "the leftmost and rightmost boxes", "bboxes": boxes}
    im1, s1 = hflip(image, sample)
    assert "bbox" not in s1
    assert _painted_box(im1, RED) == s1["bboxes"][0] and _painted_box(im1, BLUE) == s1["bboxes"][1]
    assert s1["phrase"] == "the rightmost and leftmost boxes"
    im2, s2 = hflip(im1, s1)
    assert s2 == sample
    assert np.array_equal(np.asarray(im2), np.asarray(image))


@pytest.mark.parametrize(
    "phrase, swapped",
    [
        ("the circle left of the red square", "the circle right of the red square"),
        ("the leftmost shape", "the rightmost shape"),
        ("the rightmost circle", "the leftmost circle"),
        ("Left of the tree, the RIGHT one", "Right of the tree, the LEFT one"),
        ("the man on the left-hand side", "the man on the right-hand side"),
        ("the bright light, rightly placed, copyright", "the bright light, rightly placed, copyright"),
        ("the top circle below the blue square", "the top circle below the blue square"),
    ],
)
def test_left_right_words_swap_whole_words_only(phrase, swapped):
    assert swap_left_right(phrase) == swapped
    assert swap_left_right(swapped) == phrase


# --------------------------------------------------------------------------------------------
# scale_crop


@pytest.mark.parametrize("seed", range(25))
def test_scale_crop_moves_the_box_with_the_paint(seed):
    r = random.Random(seed)
    w, h = r.randint(80, 160), r.randint(60, 140)
    bw, bh = r.randint(6, w // 2), r.randint(6, h // 2)
    x1, y1 = r.randint(0, w - bw), r.randint(0, h - bh)
    box = [x1, y1, x1 + bw, y1 + bh]
    image = _canvas((w, h), [(box, RED)])
    sample = {"width": w, "height": h, "phrase": "the box", "bbox": [float(v) for v in box]}
    out_size = None if seed % 2 else (64, 48)
    out_image, out = scale_crop(image, sample, np.random.default_rng(seed), out_size=out_size)
    ow, oh = out_image.size
    assert (ow, oh) == (out_size or (w, h))
    assert (out["width"], out["height"]) == (ow, oh)
    b = out["bbox"]
    assert 0 <= b[0] < b[2] <= ow and 0 <= b[1] < b[3] <= oh
    assert _close(_painted_box(out_image, RED), b), (_painted_box(out_image, RED), b)
    assert out["phrase"] == "the box"


def test_scale_crop_keeps_every_target_of_bboxes():
    boxes = [[5.0, 5.0, 25.0, 20.0], [90.0, 60.0, 115.0, 85.0]]
    image = _canvas((120, 90), [(boxes[0], RED), (boxes[1], BLUE)])
    sample = {"width": 120, "height": 90, "phrase": "both", "bboxes": boxes}
    for seed in range(10):
        out_image, out = scale_crop(image, sample, np.random.default_rng(seed), min_scale=0.3)
        assert _close(_painted_box(out_image, RED), out["bboxes"][0])
        assert _close(_painted_box(out_image, BLUE), out["bboxes"][1])


def test_scale_crop_full_scale_is_identity_and_big_boxes_are_never_cut():
    box = [2.0, 3.0, 98.0, 77.0]
    image = _canvas((100, 80), [(box, RED)])
    sample = {"width": 100, "height": 80, "phrase": "p", "bbox": box}
    same_image, same = scale_crop(image, sample, random.Random(0), min_scale=1.0, max_scale=1.0)
    assert same["bbox"] == box and np.array_equal(np.asarray(same_image), np.asarray(image))
    # a window of 0.5 cannot hold this box: it grows instead of cutting it
    out_image, out = scale_crop(image, sample, random.Random(1), min_scale=0.5, max_scale=0.5)
    assert _close(_painted_box(out_image, RED), out["bbox"])
    assert out["bbox"][2] - out["bbox"][0] >= 96 - 1e-9


def test_scale_crop_refuses_bad_scales():
    image = _canvas((50, 50), [])
    with pytest.raises(ValueError, match="min_scale"):
        scale_crop(image, {"bbox": [1, 1, 5, 5]}, random.Random(0), min_scale=0.0)


def test_positional_phrases_are_recognised():
    # the crop may cut the red square or a further-left shape away: these must skip scale_crop
    for phrase in ["the circle left of the red square", "the leftmost shape", "the top circle",
                   "the red square at the bottom", "the triangle below the blue circle", "Man on the Right"]:
        assert is_positional(phrase), phrase
    for phrase in ["the red circle", "the triangle", "the green shape", "the bright copyright sign"]:
        assert not is_positional(phrase), phrase


def test_a_no_target_sample_stays_one_through_flip_and_crop():
    """A phrase that names nothing in its image names nothing in a flip or a crop of it either:
    the record keeps "bboxes": [], the crop may lie anywhere in the image."""
    image = _canvas((120, 80), [((10, 10, 30, 30), RED)])
    sample = {"id": "n", "phrase": "the dog on the left", "width": 120, "height": 80, "bboxes": []}
    flipped, flipped_sample = hflip(image, sample)
    assert flipped_sample["bboxes"] == [] and "bbox" not in flipped_sample
    assert flipped_sample["phrase"] == "the dog on the right"
    corners = set()
    for seed in range(20):
        cropped, cropped_sample = scale_crop(image, sample, random.Random(seed), min_scale=0.5, max_scale=0.5)
        assert cropped.size == (120, 80) and cropped_sample["bboxes"] == []
        corners.add(tuple(np.asarray(cropped)[0, 0]))
    assert len(corners) > 1  # not always the same window
