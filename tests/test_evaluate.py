"""Scoring on hand-made predictions with known IoUs, the set metrics against a brute-force count,
AP against pycocotools' COCOeval run directly, the gallery, and `groundtune eval` end to end on a
small random model (the report, the files, the refusals: whatever the weights) and on the trained
tiny model (an answer cut short)."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
from PIL import Image

from groundtune import evaluate
from groundtune.cli import main
from groundtune.infer import Prediction

# Hand-made rows: the predicted box is always [0, 0, 10, 10] (or nothing); the true box sets the IoU.
#   id  true box(es)                         IoU      split  source
#   a   [0, 0, 10, 10]                       1        val    s1
#   b   [0, 0, 10, 12]                       100/120  val    s2
#   c   [0, 0, 10, 16]                       100/160  test   s1
#   d   [5, 0, 15, 10]                       50/150   test   s1
#   e   [0, 0, 10, 10], no prediction        0        test   s2
#   f   [50, 50, 60, 60] and [0, 0, 10, 12]  100/120  val    s2   (best of two true boxes)
PRED = [0.0, 0.0, 10.0, 10.0]
CASES = [
    ("a", [[0, 0, 10, 10]], PRED, "val", "s1"),
    ("b", [[0, 0, 10, 12]], PRED, "val", "s2"),
    ("c", [[0, 0, 10, 16]], PRED, "test", "s1"),
    ("d", [[5, 0, 15, 10]], PRED, "test", "s1"),
    ("e", [[0, 0, 10, 10]], None, "test", "s2"),
    ("f", [[50, 50, 60, 60], [0, 0, 10, 12]], PRED, "val", "s2"),
]
IOUS = {"a": 1.0, "b": 5 / 6, "c": 0.625, "d": 1 / 3, "e": 0.0, "f": 5 / 6}


def _prediction(pred_boxes: list | None, scores: list[float] | None = None) -> Prediction:
    """An answer as infer makes it: its boxes, [] for "no target", None for one that was not read."""
    if pred_boxes is None:
        return Prediction(bbox=None, boxes=[], label=None, raw="no box <here>", error="no box found in the answer")
    return Prediction(bbox=pred_boxes[0] if pred_boxes else None, boxes=pred_boxes, label=None,
                      raw=json.dumps([{"bbox_2d": b} for b in pred_boxes]), error=None,
                      no_target=not pred_boxes, scores=scores)


def _row(id_, true, pred_boxes, split="val", source="s", scores=None, size=(64, 64)) -> dict:
    pred = _prediction(pred_boxes, scores)
    return {"id": id_, "phrase": f"<b>thing</b> & {id_}", "image": "img.png", "width": size[0], "height": size[1],
            "true_boxes": true, **evaluate.score_answer(pred, true), "raw": pred.raw, "error": pred.error,
            "split": split, "source": source}


def _rows() -> list[dict]:
    return [_row(id_, true, [pred] if pred else None, split, source) for id_, true, pred, split, source in CASES]


SINGLE_TARGET_KEYS = ["n", "acc@0.5", "acc@0.75", "acc@0.5:0.95", "miou", "parse_fail_rate"]


def _single(metrics: dict) -> dict:
    return {k: metrics[k] for k in SINGLE_TARGET_KEYS}


def test_score_known_boxes():
    assert evaluate.score([0, 0, 10, 10], [[0, 0, 10, 10]]) == {"iou": 1.0, "hit@0.5": True, "hit@0.75": True}
    half = evaluate.score([0, 0, 10, 10], [[0, 0, 20, 10]])  # covers half of the true box
    assert half == {"iou": 0.5, "hit@0.5": True, "hit@0.75": False}
    assert evaluate.score([0, 0, 10, 10], [[5, 0, 15, 10]])["iou"] == pytest.approx(1 / 3)
    assert evaluate.score(None, [[0, 0, 10, 10]]) == {"iou": 0.0, "hit@0.5": False, "hit@0.75": False}
    assert evaluate.score([0, 0, 10, 10], [[50, 50, 60, 60], [0, 0, 10, 12]])["iou"] == pytest.approx(5 / 6)


def test_rows_have_the_known_ious():
    for row in _rows():
        assert row["iou"] == pytest.approx(IOUS[row["id"]])


def test_summary_numbers():
    s = evaluate.summarise(_rows())
    # IoUs 1, .833, .625, .333, 0, .833 -> hits per threshold 0.5 ... 0.95:
    #   0.5 0.55 0.6: 4 | 0.65 0.7 0.75 0.8: 3 | 0.85 0.9 0.95: 1  -> 27 of 60
    assert s["n"] == 6
    assert s["acc@0.5"] == pytest.approx(4 / 6)
    assert s["acc@0.75"] == pytest.approx(3 / 6)
    assert s["acc@0.5:0.95"] == pytest.approx(27 / 60)
    assert s["miou"] == pytest.approx((1 + 5 / 6 + 0.625 + 1 / 3 + 0 + 5 / 6) / 6)
    assert s["parse_fail_rate"] == pytest.approx(1 / 6)

    val, test = s["by_split"]["val"], s["by_split"]["test"]
    assert set(s["by_split"]) == {"val", "test"}
    # val: 1, .833, .833 -> 3 hits at 0.5 ... 0.8 (7 thresholds), 1 at 0.85 ... 0.95 -> 24 of 30
    assert _single(val) == pytest.approx({"n": 3, "acc@0.5": 1.0, "acc@0.75": 1.0, "acc@0.5:0.95": 24 / 30,
                                 "miou": (1 + 5 / 6 + 5 / 6) / 3, "parse_fail_rate": 0.0})
    # test: .625, .333, 0 -> 1 hit at 0.5, 0.55, 0.6 -> 3 of 30
    assert _single(test) == pytest.approx({"n": 3, "acc@0.5": 1 / 3, "acc@0.75": 0.0, "acc@0.5:0.95": 3 / 30,
                                  "miou": (0.625 + 1 / 3) / 3, "parse_fail_rate": 1 / 3})
    # s1: 1, .625, .333 ; s2: .833, 0, .833
    assert _single(s["by_source"]["s1"]) == pytest.approx({"n": 3, "acc@0.5": 2 / 3, "acc@0.75": 1 / 3,
                                                  "acc@0.5:0.95": (3 * 2 + 7 * 1) / 30,
                                                  "miou": (1 + 0.625 + 1 / 3) / 3, "parse_fail_rate": 0.0})
    assert _single(s["by_source"]["s2"]) == pytest.approx({"n": 3, "acc@0.5": 2 / 3, "acc@0.75": 2 / 3,
                                                  "acc@0.5:0.95": (7 * 2 + 3 * 0) / 30,
                                                  "miou": (5 / 6 + 5 / 6) / 3, "parse_fail_rate": 1 / 3})


def test_summary_of_nothing():
    s = evaluate.summarise([])
    assert s["n"] == 0 and s["acc@0.5"] is None and s["by_split"] == {}


def test_set_metrics_of_the_single_target_cases():
    # a, b, c, f: the box matches (f: one of its two true boxes); d misses at IoU 1/3; e was not read.
    # 5 boxes predicted, 7 true, 4 matched; answered exactly: a, b, c (f misses a true box).
    s = evaluate.summarise(_rows())
    assert (s["n_target"], s["n_no_target"]) == (6, 0)
    assert (s["matched@0.5"], s["missed@0.5"], s["extra@0.5"]) == (4, 3, 1)
    assert s["precision@0.5"] == pytest.approx(4 / 5) and s["recall@0.5"] == pytest.approx(4 / 7)
    assert s["f1@0.5"] == pytest.approx(2 * (4 / 5) * (4 / 7) / (4 / 5 + 4 / 7))
    assert s["set_acc@0.5"] == pytest.approx(3 / 6) and s["t_acc"] == pytest.approx(5 / 6)
    assert s["n_acc"] is None  # no no-target sample to score
    assert "ap@0.5" not in s and "ap@0.5:0.95" not in s  # a text model's boxes carry no scores


def test_no_target_answers_are_read_and_counted_right():
    base = evaluate.summarise(_rows())
    no_target = [_row("n1", [], []),  # no target, answered none: right
                 _row("n2", [], [[0, 0, 10, 10]]),  # no target, a box: wrong, one extra box
                 _row("n3", [], None)]  # no target, not read: wrong (it did not say "none"), a parse failure
    s = evaluate.summarise(_rows() + no_target)
    assert (s["n"], s["n_target"], s["n_no_target"]) == (9, 6, 3)
    # Acc@0.5, Acc@0.75, Acc@0.5:0.95 and mIoU are over the samples with a target: unchanged
    assert {k: s[k] for k in ("acc@0.5", "acc@0.75", "acc@0.5:0.95", "miou")} == \
        {k: base[k] for k in ("acc@0.5", "acc@0.75", "acc@0.5:0.95", "miou")}
    assert s["parse_fail_rate"] == pytest.approx(2 / 9)  # e and n3; n1's [] was read
    assert s["n_acc"] == pytest.approx(1 / 3) and s["t_acc"] == pytest.approx(5 / 6)
    assert s["set_acc@0.5"] == pytest.approx(4 / 9)  # a, b, c and n1
    assert s["precision@0.5"] == pytest.approx(4 / 6) and s["recall@0.5"] == pytest.approx(4 / 7)
    assert s["by_split"]["val"]["n_acc"] == pytest.approx(1 / 3)

    answered_none = _row("t", [[0, 0, 10, 10]], [])  # a target answered "none": read, wrong, one box missed
    assert answered_none["read"] and not answered_none["set_hit"] and answered_none["missed"] == [0]
    one = evaluate.summarise([answered_none])
    assert one["parse_fail_rate"] == 0 and one["t_acc"] == 0 and one["acc@0.5"] == 0 and one["recall@0.5"] == 0
    assert one["precision@0.5"] is None and one["f1@0.5"] == 0  # nothing predicted: no precision to speak of
    only_none = evaluate.summarise([_row("n1", [], [])])
    assert only_none["set_acc@0.5"] == 1 and only_none["n_acc"] == 1 and only_none["acc@0.5"] is None
    assert only_none["f1@0.5"] is None and only_none["t_acc"] is None


def test_headline_is_acc_on_one_object_phrases_and_f1_on_sets():
    """The number a run keeps its best model by: Acc@0.5 where every phrase names one object; F1@0.5
    where the eval set asks for sets (several true boxes, or none), which Acc@0.5 (the first box
    of one-target samples) cannot judge; on a set of no-target samples only, set_acc@0.5 (F1 there
    is 0 or undefined whatever the answers)."""
    one_object = [r for r in _rows() if len(r["true_boxes"]) == 1]  # a to e
    assert evaluate.headline(evaluate.summarise(one_object)) == ("acc@0.5", pytest.approx(3 / 5))
    assert evaluate.headline(evaluate.summarise(_rows()))[0] == "f1@0.5"  # f names two
    with_none = one_object + [_row("n1", [], []), _row("n2", [], [[0, 0, 10, 10]])]
    assert evaluate.headline(evaluate.summarise(with_none)) == ("f1@0.5", evaluate.summarise(with_none)["f1@0.5"])
    # several true boxes, the first found: Acc@0.5 1.0 whatever else the answer misses; F1 sees it
    first_only = [_row("s1", [[0, 0, 10, 10], [20, 20, 30, 30]], [[0, 0, 10, 10]])]
    both = [_row("s1", [[0, 0, 10, 10], [20, 20, 30, 30]], [[0, 0, 10, 10], [20, 20, 30, 30]])]
    assert evaluate.summarise(first_only)["acc@0.5"] == evaluate.summarise(both)["acc@0.5"] == 1.0
    assert evaluate.headline(evaluate.summarise(first_only)) == ("f1@0.5", pytest.approx(2 / 3))
    assert evaluate.headline(evaluate.summarise(both)) == ("f1@0.5", 1.0)
    all_right = evaluate.summarise([_row("n1", [], []), _row("n2", [], [])])
    half = evaluate.summarise([_row("n1", [], []), _row("n2", [], [[0, 0, 10, 10]])])
    assert (all_right["acc@0.5"], all_right["f1@0.5"], half["f1@0.5"]) == (None, None, 0)
    assert evaluate.headline(all_right) == ("set_acc@0.5", 1.0) and evaluate.headline(half) == ("set_acc@0.5", 0.5)
    # a report whose Acc@0.5 counts nothing while true boxes exist is judged by F1@0.5
    assert evaluate.headline({"acc@0.5": None, "recall@0.5": 0.5, "f1@0.5": 0.4, "set_acc@0.5": 0.1}) == ("f1@0.5", 0.4)
    assert evaluate.headline(evaluate.summarise([])) == ("set_acc@0.5", None)
    assert set(evaluate.HEADLINE_REASONS) == {"f1@0.5", "set_acc@0.5"}  # a reason for each measure not Acc@0.5


def _iou(a, b) -> float:
    """IoU written out again, not boxes.iou: the check below must not share eval's code."""
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
    return w * h / union


def _best_pairs(pred: list, true: list) -> tuple[int, float]:
    """Brute force over every one-to-one assignment (each predicted box to a free true box or to
    none): the most pairs at IoU >= 0.5, and the largest summed IoU among those."""
    best = (0, 0.0)
    for chosen in itertools.permutations(list(range(len(true))) + [None] * len(pred), len(pred)):
        ious = [_iou(pred[i], true[j]) for i, j in enumerate(chosen) if j is not None]
        if all(v >= 0.5 for v in ious):
            best = max(best, (len(ious), sum(ious)))
    return best


def _random_rows(seed: int, n: int = 120, scored: bool = False) -> list[dict]:
    """Samples of 0-4 true boxes crowded together (shifted copies of one box, so predicted boxes
    compete for them), answered by jittered copies, strays, [] or an unread answer."""
    rng = random.Random(seed)
    rows = []
    for k in range(n):
        x, y, w, h = rng.uniform(0, 40), rng.uniform(0, 40), rng.uniform(10, 40), rng.uniform(10, 40)
        true = [[x + dx, y, x + dx + w, y + h] for dx in (rng.uniform(0, w) for _ in range(rng.choice([0, 1, 1, 2, 3, 4])))]
        pred = [[b[0] + rng.gauss(0, w / 4), b[1] + rng.gauss(0, h / 4), b[2] + rng.gauss(0, w / 4),
                 b[3] + rng.gauss(0, h / 4)] for b in true if rng.random() < 0.8]
        pred += [[x + rng.uniform(0, w), y, x + rng.uniform(w, 2 * w), y + h] for _ in range(rng.choice([0, 0, 1, 2]))]
        pred = [[min(b[0], b[2]), min(b[1], b[3]), max(b[0], b[2]) + 0.5, max(b[1], b[3]) + 0.5] for b in pred]
        rng.shuffle(pred)
        answer = None if rng.random() < 0.08 else pred  # an unread answer now and then; [] says "none"
        scores = [rng.random() for _ in pred] if scored and answer is not None else None
        rows.append(_row(f"r{k}", true, answer, split=rng.choice(["val", "test"]), scores=scores, size=(120, 120)))
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_set_metrics_equal_a_brute_force_count(seed):
    rows = _random_rows(seed)
    matched = predicted = true = exact = 0
    no_target = no_target_right = target = target_answered = 0
    for r in rows:
        m, iou_sum = _best_pairs(r["pred_boxes"], r["true_boxes"])
        # the row's matching is one to one, at IoU >= 0.5, and as good as the best of every assignment
        assert len({i for i, _, _ in r["matched"]}) == len({j for _, j, _ in r["matched"]}) == len(r["matched"]) == m
        assert all(_iou(r["pred_boxes"][i], r["true_boxes"][j]) >= 0.5 for i, j, _ in r["matched"])
        assert sum(v for _, _, v in r["matched"]) == pytest.approx(iou_sum)
        read = r["raw"] != "no box <here>"
        matched, predicted, true = matched + m, predicted + len(r["pred_boxes"]), true + len(r["true_boxes"])
        exact += read and m == len(r["true_boxes"]) == len(r["pred_boxes"])
        if r["true_boxes"]:
            target, target_answered = target + 1, target_answered + bool(r["pred_boxes"])
        else:
            no_target, no_target_right = no_target + 1, no_target_right + (read and not r["pred_boxes"])
    s = evaluate.summarise(rows)
    assert no_target and target and 0 < matched < min(predicted, true)  # every case is there
    assert s["precision@0.5"] == pytest.approx(matched / predicted)
    assert s["recall@0.5"] == pytest.approx(matched / true)
    assert s["f1@0.5"] == pytest.approx(2 * (matched / predicted) * (matched / true)
                                        / (matched / predicted + matched / true))
    assert s["set_acc@0.5"] == pytest.approx(exact / len(rows))
    assert s["n_acc"] == pytest.approx(no_target_right / no_target)
    assert s["t_acc"] == pytest.approx(target_answered / target)
    assert (s["matched@0.5"], s["missed@0.5"], s["extra@0.5"]) == (matched, true - matched, predicted - matched)


def test_matching_is_optimal_where_greedy_is_not():
    # p1 overlaps both true boxes, best with t1; p2 only t1. Taking the best pair first (p1-t1)
    # leaves p2 with nothing; the optimal matching pairs p1-t2 and p2-t1.
    t1, t2 = [5, 0, 15, 10], [8, 0, 18, 10]
    p1, p2 = [6, 0, 16, 10], [2, 0, 12, 10]
    assert _iou(p1, t1) > _iou(p1, t2) >= 0.5 and _iou(p2, t1) >= 0.5 > _iou(p2, t2)
    greedy, used = 0, set()
    for v, i, j in sorted(((_iou(p, t), i, j) for i, p in enumerate([p1, p2]) for j, t in enumerate([t1, t2])),
                          reverse=True):
        if v >= 0.5 and i not in used and j not in used:
            greedy, used = greedy + 1, used | {i, j}
    assert greedy == 1
    row = _row("g", [t1, t2], [p1, p2])
    assert sorted((i, j) for i, j, _ in row["matched"]) == [(0, 1), (1, 0)] and row["set_hit"]
    s = evaluate.summarise([row])
    assert s["precision@0.5"] == s["recall@0.5"] == s["set_acc@0.5"] == 1.0


def _cocoeval_direct(tmp_path, rows: list[dict]) -> tuple[float, float]:
    """COCOeval run as pycocotools' own demo runs it: ground truth and results as JSON files."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    def xywh(b):
        return [b[0], b[1], b[2] - b[0], b[3] - b[1]]

    truth = {"images": [{"id": 10 + k, "width": r["width"], "height": r["height"]} for k, r in enumerate(rows)],
             "categories": [{"id": 3, "name": "thing"}], "annotations": []}
    results = []
    for k, r in enumerate(rows):
        for b in r["true_boxes"]:
            truth["annotations"].append({"id": 100 + len(truth["annotations"]), "image_id": 10 + k, "category_id": 3,
                                         "bbox": xywh(b), "area": xywh(b)[2] * xywh(b)[3], "iscrowd": 0})
        results += [{"image_id": 10 + k, "category_id": 3, "bbox": xywh(b), "score": sc}
                    for b, sc in zip(r["pred_boxes"], r["scores"] or [])]
    (tmp_path / "truth.json").write_text(json.dumps(truth))
    (tmp_path / "results.json").write_text(json.dumps(results))
    coco = COCO(str(tmp_path / "truth.json"))
    run = COCOeval(coco, coco.loadRes(str(tmp_path / "results.json")), "bbox")
    run.evaluate()
    run.accumulate()
    run.summarize()
    return run.stats[0], run.stats[1]


@pytest.mark.parametrize("seed", [0, 1])
def test_ap_equals_cocoeval_run_directly(tmp_path, seed):
    rows = _random_rows(seed, n=80, scored=True)
    s = evaluate.summarise(rows)
    ap, ap50 = _cocoeval_direct(tmp_path, rows)
    assert 0 < ap < ap50 < 1
    assert s["ap@0.5:0.95"] == pytest.approx(ap) and s["ap@0.5"] == pytest.approx(ap50)
    val = [r for r in rows if r["split"] == "val"]
    assert s["by_split"]["val"]["ap@0.5:0.95"] == pytest.approx(_cocoeval_direct(tmp_path, val)[0])


def test_ap_of_exact_boxes_and_of_a_confident_stray():
    exact = [_row("a", [[0, 0, 10, 10], [20, 20, 40, 30]], [[20, 20, 40, 30], [0, 0, 10, 10]], scores=[0.9, 0.8])]
    assert evaluate.summarise(exact)["ap@0.5:0.95"] == pytest.approx(1.0)
    # A box on a no-target sample, scored above the true one, is a false positive ranked first.
    stray = exact + [_row("n", [], [[0, 0, 10, 10]], scores=[0.95]), _row("m", [], [], scores=[])]
    assert evaluate.summarise(stray)["ap@0.5"] < 1.0
    assert evaluate.summarise([_row("n", [], [], scores=[])])["ap@0.5"] is None  # no true box: no AP
    unscored = exact + [_row("b", [[0, 0, 10, 10]], [[0, 0, 10, 10]])]  # one answer without scores: no AP
    assert "ap@0.5" not in evaluate.summarise(unscored)


def test_gallery_worst_first_escaped(tmp_path):
    Image.new("RGB", (64, 64), "white").save(tmp_path / "img.png")
    index = evaluate.write_gallery(_rows(), tmp_path / "data.jsonl", tmp_path / "gallery", n_worst=2, n_best=2)
    page = index.read_text()
    # Worst: the parse failure, then the lowest IoU; best: two of the hits a, b, c, f.
    order = [page.index(x) for x in ("worst_000.png", "&amp; e</b>", "worst_001.png", "&amp; d</b>", "best_000.png")]
    assert order == sorted(order)
    assert "parse failure: no box found in the answer" in page
    assert "IoU 0.333" in page
    assert "<b>thing" not in page and "&lt;b&gt;thing&lt;/b&gt;" in page
    assert "no box &lt;here&gt;" in page
    pngs = sorted(p.name for p in (tmp_path / "gallery").glob("*.png"))
    assert pngs == ["best_000.png", "best_001.png", "worst_000.png", "worst_001.png"]
    assert all(f'src="{p}"' in page for p in pngs)
    assert not list((tmp_path / "gallery").glob(".*"))  # no temporary files left behind
    # what eval checks before it starts names every file written, and each is known as the gallery's
    written = sorted((tmp_path / "gallery").iterdir())
    assert set(written) <= set(evaluate.gallery_files(tmp_path / "gallery"))
    assert all(evaluate.written_by_gallery(p) for p in written)
    (tmp_path / "mine.html").write_text("<html><title>my page</title></html>\n")
    assert not evaluate.written_by_gallery(tmp_path / "mine.html")
    assert not evaluate.written_by_gallery(tmp_path / "img.png")


def test_draw_boxes_colours():
    image = Image.new("RGB", (64, 32), "white")
    drawn = evaluate.draw_boxes(image, [[4, 4, 20, 20]], [30, 4, 60, 28])
    s = drawn.width // 64
    assert drawn.size == (64 * s, 32 * s)
    assert drawn.getpixel((4 * s, 10 * s)) == evaluate.TRUE_COLOUR
    assert drawn.getpixel((30 * s, 10 * s)) == evaluate.PRED_COLOUR


def test_gallery_says_missed_extra_and_no_target(tmp_path):
    Image.new("RGB", (64, 64), "white").save(tmp_path / "img.png")
    rows = [_row("set", [[0, 0, 10, 10], [30, 30, 50, 50]], [[0, 0, 10, 11], [40, 2, 60, 20]]),
            _row("right", [], []), _row("stray", [], [[5, 5, 20, 20]]), _row("said none", [[0, 0, 10, 10]], []),
            _row("exact", [[0, 0, 10, 10]], [[0, 0, 10, 10]])]
    page = evaluate.write_gallery(rows, tmp_path / "data.jsonl", tmp_path / "gallery", n_worst=4, n_best=2).read_text()
    assert "IoU 0.909, 1 of 2 true box(es) found, 1 extra" in page
    assert "no target, answered no target" in page and "no target, 1 extra box(es)" in page
    assert "answered no target, 1 missed" in page
    # worst first: nothing right (the lower IoU first: "said none" has no box), then half right ("set"),
    # then the exact answers in their order; the best are drawn from the exact ones left
    order = [page.index(f"&amp; {x}</b>") for x in ("said none", "stray", "set", "right")]
    assert order == sorted(order) and order[-1] < page.index("Best") < page.index("&amp; exact</b>")


def test_draw_answer_colours_found_missed_matched_extra():
    image = Image.new("RGB", (64, 64), "white")
    true, pred = [[4, 4, 20, 20], [40, 40, 60, 60]], [[4, 4, 20, 21], [30, 2, 50, 14]]
    row = _row("x", true, pred)
    drawn = evaluate.draw_answer(image, true, pred, row["matched"])
    s = drawn.width // 64
    assert drawn.getpixel((4 * s + 1, 10 * s)) == evaluate.PRED_COLOUR  # drawn over the true box it found
    assert drawn.getpixel((12 * s, 4 * s + 1)) == evaluate.PRED_COLOUR
    assert drawn.getpixel((12 * s, 21 * s)) == evaluate.PRED_COLOUR  # its bottom edge, below the true one's
    assert drawn.getpixel((12 * s, 20 * s)) == evaluate.TRUE_COLOUR
    assert drawn.getpixel((40 * s, 50 * s)) == evaluate.MISSED_COLOUR
    assert drawn.getpixel((30 * s, 8 * s)) == evaluate.EXTRA_COLOUR


def test_an_answer_with_no_area_is_drawn_and_listed_as_invalid(tmp_path):
    """x1 > x2 (a harness's reading of an answer, say) is no box: the gallery dashes the corners' span
    in the invalid colour and lists it as invalid, never draws the box the sorted corners make."""
    image = Image.new("RGB", (64, 64), "white")
    image.save(tmp_path / "img.png")
    turned, point = [40.0, 5.0, 10.0, 30.0], [0.0, 0.0, 0.0, 0.0]
    row = _row("turned", [[4, 4, 20, 20]], [turned, point])
    assert row["extra"] == [0, 1] and row["iou"] == 0.0  # scored as it was: no area, IoU 0
    drawn = evaluate.draw_answer(image, row["true_boxes"], row["pred_boxes"], row["matched"])
    s = drawn.width // 64
    colours = {colour for _, colour in drawn.getcolors(drawn.width * drawn.height)}
    assert evaluate.INVALID_COLOUR in colours and evaluate.EXTRA_COLOUR not in colours
    assert drawn.getpixel((10 * s + 1, 5 * s)) == evaluate.INVALID_COLOUR  # a dash of its top edge
    page = evaluate.write_gallery([row], tmp_path / "data.jsonl", tmp_path / "gallery", n_worst=1).read_text()
    assert "invalid box(es), no area: [40, 5, 10, 30], [0, 0, 0, 0]" in page


# --------------------------------------------------------------------------------------------
# The eval command on a model


@pytest.fixture
def dataset(tmp_path):
    """Three coloured rectangles on white, one of them on a non-square image, as canonical JSONL."""
    (tmp_path / "images").mkdir()
    samples = []
    for i, (size, colour, split) in enumerate([((112, 112), "red", "val"), ((200, 100), "blue", "val"),
                                               ((84, 168), "green", "test")]):
        w, h = size
        box = [w // 4, h // 4, w // 2, h // 2]
        image = Image.new("RGB", size, "white")
        image.paste(Image.new("RGB", (box[2] - box[0], box[3] - box[1]), colour), (box[0], box[1]))
        image.save(tmp_path / "images" / f"{i}.png")
        samples.append({"id": f"s{i}", "image": f"images/{i}.png", "width": w, "height": h,
                        "phrase": f'the "{colour}" <square> & more', "bbox": [float(v) for v in box],
                        "split": split, "source": "synth"})
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return path


REPORT_KEYS = {"model", "data", "family", "resize", "prompt", "decoding", "n", "acc@0.5", "acc@0.75", "acc@0.5:0.95",
               "miou", "parse_fail_rate", "by_split", "by_source", "n_target", "n_no_target", "precision@0.5",
               "recall@0.5", "f1@0.5", "set_acc@0.5", "n_acc", "t_acc", "definitions"}


def test_eval_cli_writes_report_and_gallery(small_model, dataset, tmp_path, capsys, monkeypatch):
    out, gallery = tmp_path / "report.json", tmp_path / "gallery"
    monkeypatch.setenv("GROUNDTUNE_PROGRESS_EVERY", "1e-9")  # a plain progress line every batch
    assert main(["eval", "--model", small_model, "--data", str(dataset), "--out", str(out), "--gallery", str(gallery),
                 "--batch-size", "2", "--device", "cpu"]) == 0
    report = json.loads(out.read_text())
    assert REPORT_KEYS <= set(report)
    assert report["model"] == small_model and report["family"] == "qwen2.5-vl" and report["n"] == 3
    assert report["resize"] == {"factor": 28, "min_pixels": 3136, "max_pixels": 50176}  # its groundtune.json's
    assert report["decoding"] == {"max_new_tokens": 64, "do_sample": False, "repetition_penalty": 1.0}
    assert set(report["by_split"]) == {"val", "test"} and report["by_split"]["val"]["n"] == 2
    assert set(report["by_source"]) == {"synth"}
    for key in ("acc@0.5", "acc@0.75", "acc@0.5:0.95", "miou", "parse_fail_rate"):
        assert 0.0 <= report[key] <= 1.0
    page = (gallery / "index.html").read_text()
    pngs = list(gallery.glob("*.png"))
    assert len(pngs) == 3 and all(p.name in page for p in pngs)
    assert "&lt;square&gt;" in page and "<square>" not in page
    captured = capsys.readouterr()
    printed = captured.out
    assert "Acc@.5" in printed and "split=test" in printed
    # stderr is no terminal here: plain progress lines, not a bar
    assert "eval (2/batch) 1/2 (50%)" in captured.err and "eval (2/batch) 2/2 (100%)" in captured.err
    assert all(h in printed for h in ("F1@.5", "set acc", "missed", "extra", "no target"))
    assert "ap@0.5" not in report and set(report["definitions"]) == set(evaluate.METRICS + evaluate.SET_METRICS)
    # again into the same report and gallery: each is this command's, replaced without --overwrite
    assert main(["eval", "--model", small_model, "--data", str(dataset), "--out", str(out), "--gallery", str(gallery),
                 "--batch-size", "2", "--device", "cpu", "--limit", "1"]) == 0
    assert json.loads(out.read_text())["n"] == 1


def test_eval_compare_and_pixel_override(small_model, dataset, tmp_path):
    with pytest.warns(UserWarning, match=f"eval: {re.escape(small_model)} has its pixel budget in groundtune.json .* "
                                         "but runs with"):
        result = evaluate.run_eval(small_model, dataset, limit=2, compare=small_model, max_pixels=28 * 28 * 16,
                                   device="cpu", out=tmp_path / "both.json")
    assert json.loads((tmp_path / "both.json").read_text()) == result
    first, second = result["models"]
    assert first["n"] == second["n"] == 2
    assert first["resize"]["max_pixels"] == 28 * 28 * 16 and first["resize"]["min_pixels"] == 3136
    assert second["resize"] == first["resize"]  # the override holds for both (random weights: equal scores say little)
    assert {k: first[k] for k in evaluate.METRICS} == {k: second[k] for k in evaluate.METRICS}


def test_eval_cli_names_a_bad_image(small_model, dataset, tmp_path, capsys):
    (tmp_path / "images" / "1.png").write_bytes(b"not a png")
    assert main(["eval", "--model", small_model, "--data", str(dataset), "--device", "cpu"]) == 2
    assert "1.png: cannot decode image" in capsys.readouterr().err


def test_max_new_tokens_cuts_answers_and_is_reported(dataset, tmp_path, capsys):
    """Three tokens cannot hold a box (`[{"` alone is three): every answer is cut and reported as a
    parse failure, never read as a guessed box; predict takes the same flag. Trained weights: the
    tiny model answers a box when not cut (a random model's answers never parse, cut or not)."""
    out = tmp_path / "short.json"
    assert main(["eval", "--model", "tiny", "--data", str(dataset), "--out", str(out), "--max-new-tokens", "3",
                 "--device", "cpu"]) == 0
    report = json.loads(out.read_text())
    assert report["decoding"]["max_new_tokens"] == 3 and report["parse_fail_rate"] == 1.0 and report["miou"] == 0
    capsys.readouterr()
    image = next((tmp_path / "images").glob("*.png"))
    assert main(["predict", "--model", "tiny", "--image", str(image), "--phrase", "the square",
                 "--max-new-tokens", "3", "--device", "cpu"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["bbox"] is None and answer["error"] == "no box found in the answer"
