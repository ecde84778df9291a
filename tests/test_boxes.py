"""The box conventions, both ways: table-driven cases and round-trip properties."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from groundtune import boxes, families
from groundtune.boxes import ResizeSpec, format_target, parse_answer, smart_resize

# qwen-vl-utils' own defaults (factor 28, 3,136 .. 12,845,056): the cases below are its answers
REFERENCE = {"factor": 28, "min_pixels": 3136, "max_pixels": 12845056}
MIN_PIXELS = REFERENCE["min_pixels"]


# ---------------------------------------------------------------------------- smart_resize
# Expected values worked by hand from qwen-vl-utils' algorithm (round each side to the factor;
# floor after scaling down past max_pixels; ceil after scaling up past min_pixels).
@pytest.mark.parametrize(
    "h, w, kwargs, expected",
    [
        (427, 640, {}, (420, 644)),  # plain rounding: 427/28=15.25 -> 15, 640/28=22.86 -> 23
        (427, 640, {"max_pixels": 1003520}, (420, 644)),  # under the budget: unchanged
        (28, 28, {}, (56, 56)),  # below min_pixels 3136 -> scaled up, ceil
        (10, 10, {}, (56, 56)),
        (4000, 3000, {"max_pixels": 1003520}, (1148, 840)),  # beta=3.458: 1156.7->1148, 867.5->840
        (112, 112, {}, (112, 112)),
        (112, 112, {"factor": 32}, (128, 128)),  # Qwen3-VL factor
        (1, 150, {}, (28, 140)),  # ratio 150 allowed; 1 px side rounds up to one factor
        (14, 14, {"factor": 28, "min_pixels": 28 * 28}, (28, 28)),  # round(0.5)=0 -> max(factor, .)
        (42, 42, {}, (56, 56)),  # round(1.5)=2 (banker's rounding, as the reference)
        (70, 70, {}, (56, 56)),  # round(2.5)=2 (banker's rounding, as the reference)
        # the reference floors the short side to 0 here (a crash later); transformers' smart_resize
        # keeps it at one factor, and so do we: (28, 1988), as transformers answers
        (39, 3092, {"max_pixels": 50176}, (28, 1988)),
        (3092, 39, {"max_pixels": 50176}, (1988, 28)),
    ],
)
def test_smart_resize_table(h, w, kwargs, expected):
    assert smart_resize(h, w, **{**REFERENCE, **kwargs}) == expected


def test_smart_resize_rejects_extreme_aspect_ratio():
    with pytest.raises(boxes.ResizeError, match="aspect ratio"):
        smart_resize(1, 201, **REFERENCE)
    with pytest.raises(boxes.ResizeError, match="positive"):
        smart_resize(0, 20, **REFERENCE)


@given(
    h=st.integers(1, 5000),
    w=st.integers(1, 5000),
    factor=st.sampled_from([28, 32]),
    max_pixels=st.sampled_from([1003520, 12845056, 200704, 50176]),
)
def test_smart_resize_properties(h, w, factor, max_pixels):
    if max(h, w) / min(h, w) > 200:
        return
    rh, rw = smart_resize(h, w, factor=factor, min_pixels=MIN_PIXELS, max_pixels=max_pixels)
    assert rh % factor == 0 and rw % factor == 0
    assert rh >= factor and rw >= factor  # never a side of 0
    rounded = (max(factor, round(h / factor) * factor), max(factor, round(w / factor) * factor))
    if MIN_PIXELS <= rounded[0] * rounded[1] <= max_pixels:
        assert (rh, rw) == rounded  # inside the budget: each side only rounded to the factor
    elif rounded[0] * rounded[1] > max_pixels:
        # scaled to the budget, never past it (a side may still grow: beta < 1 when only the
        # rounding pushed the area over, as in the reference, e.g. 210x4495 -> 196x4620), unless
        # a side would fall under one factor: it stays one factor, the other side within budget
        beta = math.sqrt(h * w / max_pixels)
        scaled = (math.floor(h / beta / factor) * factor, math.floor(w / beta / factor) * factor)
        if min(scaled) >= factor:
            assert (rh, rw) == scaled and rh * rw <= max_pixels
        else:  # the reference's 0 becomes one factor; the other side is the reference's
            assert (rh, rw) == (max(factor, scaled[0]), max(factor, scaled[1]))
    else:
        # scaled up to the minimum; a side grows unless only the rounding pushed the area under (then
        # beta < 1, as in the reference, e.g. 38x85 -> 56x84)
        assert rh * rw >= MIN_PIXELS
        if h * w < MIN_PIXELS:
            assert rh >= h and rw >= w


def test_resize_spec_order_and_round_trip():
    spec = ResizeSpec(28, 3136, 1003520)
    assert spec.resized_size((640, 427)) == (644, 420)  # (width, height) order, unlike smart_resize
    assert ResizeSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="min_pixels"):
        ResizeSpec(28, min_pixels=10, max_pixels=5)
    with pytest.raises(ValueError, match="unknown model family"):
        parse_answer("[1, 2, 3, 4]", "llava", (10, 10), (10, 10))


# ---------------------------------------------------------------------------- geometry
@pytest.mark.parametrize(
    "xywh, xyxy",
    [([10, 20, 30, 40], [10, 20, 40, 60]), ([0, 0, 1, 1], [0, 0, 1, 1]), ([5.5, 1, 0.5, 2], [5.5, 1, 6, 3])],
)
def test_xywh_xyxy_both_ways(xywh, xyxy):
    assert boxes.xywh_to_xyxy(xywh) == xyxy
    assert boxes.xyxy_to_xywh(xyxy) == [float(v) for v in xywh]


@pytest.mark.parametrize(
    "a, b, expected_iou, expected_giou",
    [
        ([0, 0, 10, 10], [0, 0, 10, 10], 1.0, 1.0),
        ([0, 0, 10, 10], [5, 0, 15, 10], 50 / 150, 50 / 150),  # hull == union
        ([0, 0, 10, 10], [20, 0, 30, 10], 0.0, 0 - (300 - 200) / 300),  # disjoint: GIoU < 0
        ([0, 0, 10, 10], [2, 2, 4, 4], 4 / 100, 4 / 100),
        ([0, 0, 0, 10], [0, 0, 10, 10], 0.0, 0.0),  # zero-area box
    ],
)
def test_iou_giou(a, b, expected_iou, expected_giou):
    assert boxes.iou(a, b) == pytest.approx(expected_iou)
    assert boxes.giou(a, b) == pytest.approx(expected_giou)


@pytest.mark.parametrize("box, has", [
    ([0, 0, 10, 10], True), ([0.5, 2, 0.6, 2.1], True),
    ([40, 5, 10, 30], False),  # corners turned round: not a box, whatever sorting them would give
    ([0, 30, 10, 5], False), ([0, 0, 0, 10], False), ([0, 0, 0, 0], False),
])
def test_has_area(box, has):
    assert boxes.has_area(box) is has
    assert (boxes.box_area(box) > 0) is has  # the rule box_area and IoU already follow


def test_original_resized_mapping_both_ways():
    box = [103.9, 92.5, 231.2, 410.0]
    resized = boxes.original_to_resized(box, (640, 427), (644, 420))
    assert resized[0] == pytest.approx(103.9 * 644 / 640)
    assert resized[3] == pytest.approx(410.0 * 420 / 427)
    assert boxes.resized_to_original(resized, (644, 420), (640, 427)) == pytest.approx(box)


# ---------------------------------------------------------------------------- targets
def test_target_qwen25_is_absolute_pixels_of_the_resized_image():
    text = format_target([[103.9, 92.5, 231.2, 410.0]], "the lady", "qwen2.5-vl", (640, 427), (644, 420))
    # 103.9*644/640=104.55 -> 105; 92.5*420/427=90.98 -> 91; 231.2*644/640=232.6 -> 233; 410*420/427=403.3 -> 403
    assert json.loads(text) == [{"bbox_2d": [105, 91, 233, 403], "label": "the lady"}]


def test_target_qwen2_is_special_tokens_in_0_1000():
    text = format_target([[64, 42.7, 320, 427]], "cat", "qwen2-vl", (640, 427), (644, 420))
    assert text == "<|object_ref_start|>cat<|object_ref_end|><|box_start|>(100,100),(500,1000)<|box_end|>"


def test_target_qwen3_is_json_in_0_1000():
    text = format_target([[64, 42.7, 320, 427]], "cat", "qwen3-vl", (640, 427), (640, 416))
    assert json.loads(text) == [{"bbox_2d": [100, 100, 500, 1000], "label": "cat"}]


@pytest.mark.parametrize("family", boxes.FAMILIES)
def test_every_answer_starts_with_the_answer_opening(family):
    opening = boxes.answer_opening(family)
    assert opening == {"qwen2-vl": "<|box_start|>("}.get(family, '[{"bbox_2d": [')
    for box, size in (([5, 7, 9, 11], (20, 30)), ([64, 42.7, 320, 427], (640, 427)), ([0, 0, 1, 1], (1, 1))):
        answer = format_target([box], None, family, size, size)
        assert answer.startswith(opening) and answer[len(opening)].isdigit()


def test_target_box_smaller_than_the_grid_stays_a_box():
    # 1 px tall in a 1474 px image is 0.68 units of 0-1000: both corners round to 851
    text = format_target([[0, 1254, 1, 1255]], "dot", "qwen2-vl", (20, 1474), (28, 1484))
    assert text.endswith("<|box_start|>(0,851),(50,852)<|box_end|>")
    assert parse_answer(text, "qwen2-vl", (20, 1474), (28, 1484)).ok
    # at the image edge the unit is taken inwards
    assert boxes.to_model_coords([99.9, 0, 100, 10], "qwen2.5-vl", (100, 100), (100, 100)) == [99, 0, 100, 10]


def test_target_rounds_half_up():
    assert boxes.to_model_coords([0.5, 1.5, 2.5, 3.5], "qwen2.5-vl", (10, 10), (10, 10)) == [1, 2, 3, 4]


def test_target_without_label():
    assert format_target([[0, 0, 10, 10]], None, "qwen2.5-vl", (100, 100), (100, 100)) == '[{"bbox_2d": [0, 0, 10, 10]}]'
    text = format_target([[0, 0, 10, 10]], None, "qwen2-vl", (100, 100), (100, 100))
    assert text == "<|box_start|>(0,0),(100,100)<|box_end|>"
    assert parse_answer(text, "qwen2-vl", (100, 100), (100, 100)).boxes == [pytest.approx([0, 0, 10, 10])]


def test_target_several_boxes():
    text = format_target([[0, 0, 10, 10], [20, 20, 30, 30]], "dots", "qwen2.5-vl", (100, 100), (100, 100))
    assert [d["bbox_2d"] for d in json.loads(text)] == [[0, 0, 10, 10], [20, 20, 30, 30]]


@pytest.mark.parametrize("family", boxes.FAMILIES)
def test_several_boxes_are_written_in_reading_order_whatever_order_they_came_in(family):
    """Top to bottom, then left to right, by centre: one target string for one set of boxes."""
    lower_left, top_right, top_left, middle = [5, 60, 25, 80], [70, 5, 90, 25], [5, 5, 25, 25], [40, 30, 60, 50]
    orders = [[lower_left, top_right, top_left, middle], [middle, top_left, lower_left, top_right]]
    texts = {format_target(order, "dots", family, (100, 100), (100, 100)) for order in orders}
    assert len(texts) == 1
    parsed = parse_answer(texts.pop(), family, (100, 100), (100, 100))
    assert parsed.boxes == [pytest.approx(b, abs=0.5) for b in (top_left, top_right, middle, lower_left)]
    assert boxes.reading_order([lower_left, top_right, top_left]) == [top_left, top_right, lower_left]


@pytest.mark.parametrize("family", boxes.FAMILIES)
def test_no_target_is_the_empty_list_and_is_read_as_no_target_not_as_a_failure(family):
    text = format_target([], "the dog", family, (100, 100), (100, 100))
    assert text == boxes.NO_TARGET == "[]"
    for answer in (text, "```json\n[]\n```", "There is none: []", " [ ] "):
        parsed = parse_answer(answer, family, (100, 100), (100, 100))
        assert parsed.no_target and parsed.ok and parsed.boxes == [] and parsed.error is None, answer
    for not_an_answer in ("", "none", "[[]]", "[{}]", "[] and [1, 2]"):  # nothing read: a failure
        parsed = parse_answer(not_an_answer, family, (100, 100), (100, 100))
        assert not parsed.no_target and not parsed.ok and parsed.error, not_an_answer
    boxed = parse_answer('[{"bbox_2d": [10, 10, 20, 20]}, []]', family, (100, 100), (100, 100))
    assert boxed.boxes and not boxed.no_target  # a box anywhere is an answer with a box


# ---------------------------------------------------------------------------- parsing
# All cases: Qwen2.5-VL, original 200x100 shown to the model at 400x200 (so model coords / 2).
ORIG, RES = (200, 100), (400, 200)


@pytest.mark.parametrize(
    "text, expected",
    [
        ('[{"bbox_2d": [40, 20, 120, 60], "label": "x"}]', [[20, 10, 60, 30]]),
        # the trap: the key holds a digit; a parser reading "the first four numbers" gets x1=2
        ('{"bbox_2d": [40, 20, 120, 60]}', [[20, 10, 60, 30]]),
        ('```json\n[{"bbox_2d": [40, 20, 120, 60], "label": "x"}]\n```', [[20, 10, 60, 30]]),
        ('Sure! The box is [{"bbox_2d":[40,20,120,60]}]. Hope it helps.', [[20, 10, 60, 30]]),
        ("[40, 20, 120, 60]", [[20, 10, 60, 30]]),
        ("the answer: [40.0, 20.0, 120.0, 60.0] done", [[20, 10, 60, 30]]),
        ('[{"bbox_2d": [40, 20, 120, 60]}, {"bbox_2d": [0, 0, 20, 20]}]', [[20, 10, 60, 30], [0, 0, 10, 10]]),
        ('[{"bbox_2d": [120, 60, 40, 20]}]', [[20, 10, 60, 30]]),  # corners swapped: put in order
        ('[{"bbox_2d": [-10, -10, 1000, 1000]}]', [[0, 0, 200, 100]]),  # clipped to the image
        ('[{"bbox_2d": [40, 20, 120, 60', [[20, 10, 60, 30]]),  # truncated generation
        ('{"bbox": [40, 20, 120, 60]}', [[20, 10, 60, 30]]),
        ("<|box_start|>(40,20),(120,60)<|box_end|>", [[20, 10, 60, 30]]),  # token form, family's coords
    ],
)
def test_parse_qwen25_table(text, expected):
    parsed = parse_answer(text, "qwen2.5-vl", ORIG, RES)
    assert parsed.ok, parsed.error
    assert parsed.boxes == [pytest.approx(b) for b in expected]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "I cannot find it.",
        '{"bbox_2d": "somewhere"}',
        '[{"bbox_2d": [1, 2, 3]}]',  # three numbers
        "bbox_2d 2 40 20 120 60",  # numbers outside brackets are never read as a box
        '[{"bbox_2d": [500, 500, 600, 600]}]',  # entirely outside the image
        '[{"bbox_2d": [10, 10, 10, 50]}]',  # zero width
    ],
)
def test_parse_failures_are_reported_not_guessed(text):
    parsed = parse_answer(text, "qwen2.5-vl", ORIG, RES)
    assert not parsed.ok and parsed.boxes == [] and parsed.error


@pytest.mark.parametrize(
    "value, expected",
    [([1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0]), ((1.5, 2, 3, 4), [1.5, 2.0, 3.0, 4.0]), ([1, 2, 3], None),
     ([1, 2, 3, True], None), ([1, 2, float("nan"), 4], None), ([1, 2, float("inf"), 4], None),
     ("1,2,3,4", None), ([1, 2, "3", 4], None), (None, None)],
)
def test_as_box(value, expected):
    assert boxes.as_box(value) == expected


def test_parse_ignores_nan_boxes():
    assert not parse_answer('[{"bbox_2d": [NaN, 1, 2, 3]}]', "qwen2.5-vl", ORIG, RES).ok


def test_parse_qwen2_special_tokens_with_labels():
    text = (
        "<|object_ref_start|>the cat<|object_ref_end|><|box_start|>(100,200),(500,1000)<|box_end|>"
        "<|box_start|>( 0 , 0 ),( 50 , 50 )<|box_end|>"
    )
    parsed = parse_answer(text, "qwen2-vl", (640, 480), (644, 476))
    assert parsed.boxes == [pytest.approx([64, 96, 320, 480]), pytest.approx([0, 0, 32, 24])]
    assert parsed.labels == ["the cat", "the cat"]


def test_parse_qwen3_json_is_0_1000():
    parsed = parse_answer('[{"bbox_2d": [100, 100, 500, 1000], "label": "cat"}]', "qwen3-vl", (640, 427), (640, 416))
    assert parsed.boxes == [pytest.approx([64, 42.7, 320, 427])]
    assert parsed.labels == ["cat"]


# ---------------------------------------------------------------------------- round trips
@st.composite
def image_and_box(draw, max_side=2000):
    w = draw(st.integers(20, max_side))
    h = draw(st.integers(20, max_side))
    if max(w, h) / min(w, h) > 200:
        h = w
    x1 = draw(st.floats(0, w - 3))
    y1 = draw(st.floats(0, h - 3))
    x2 = draw(st.floats(x1 + 2, w))
    y2 = draw(st.floats(y1 + 2, h))
    return (w, h), [x1, y1, x2, y2]


@settings(max_examples=300, deadline=None)
@given(
    data=image_and_box(),
    family=st.sampled_from(boxes.FAMILIES),
    max_pixels=st.sampled_from([1003520, 12845056, 256 * 28 * 28]),
)
def test_round_trip_original_text_parse_original(data, family, max_pixels):
    """original -> target text -> parse -> original, within 1 px while the model's coordinate
    grid is at least as fine as the original pixels (0-1000 for sides <= 2000 px, resized images
    at least half the original size); in general within half a grid step (one and a half for a
    box smaller than the grid)."""
    size, box = data
    spec = ResizeSpec(families.family(family).factor, 3136, max_pixels)
    resized = spec.resized_size(size)
    text = format_target([box], "thing", family, size, resized)
    parsed = parse_answer(text, family, size, resized)
    assert parsed.ok, (text, parsed.error)
    if families.family(family).coordinates == families.NORM_1000:
        step_x, step_y = size[0] / 1000, size[1] / 1000
    else:
        step_x, step_y = size[0] / resized[0], size[1] / resized[1]
    # a box side shorter than one grid step is widened to one step so it stays a box: the moved
    # corner lands one step past the other corner, which itself was rounded by up to half a step
    small = (box[2] - box[0]) < step_x or (box[3] - box[1]) < step_y
    grace = 1.5 if small else 0.5
    tol_x, tol_y = max(1.0, step_x * grace), max(1.0, step_y * grace)
    for got, want, tol in zip(parsed.boxes[0], box, (tol_x, tol_y, tol_x, tol_y)):
        assert abs(got - want) <= tol + 1e-6, (text, parsed.boxes[0], box)
    if max(step_x, step_y) <= 2:
        assert max(abs(g - w) for g, w in zip(parsed.boxes[0], box)) <= 1.0 + 1e-6
