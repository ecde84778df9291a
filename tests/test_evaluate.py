"""Scoring on hand-made predictions with known IoUs, the gallery, and `groundtune eval` end to end
on the real tiny model."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from groundtune import evaluate
from groundtune.cli import main

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


def _rows() -> list[dict]:
    rows = []
    for id_, true, pred, split, source in CASES:
        rows.append({
            "id": id_, "phrase": f"<b>thing</b> & {id_}", "image": "img.png", "width": 64, "height": 64,
            "true_boxes": true, "pred_bbox": pred, **evaluate.score(pred, true),
            "raw": "no box <here>" if pred is None else json.dumps([{"bbox_2d": pred}]),
            "error": "no box found in the answer" if pred is None else None,
            "split": split, "source": source,
        })
    return rows


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
    assert val == pytest.approx({"n": 3, "acc@0.5": 1.0, "acc@0.75": 1.0, "acc@0.5:0.95": 24 / 30,
                                 "miou": (1 + 5 / 6 + 5 / 6) / 3, "parse_fail_rate": 0.0})
    # test: .625, .333, 0 -> 1 hit at 0.5, 0.55, 0.6 -> 3 of 30
    assert test == pytest.approx({"n": 3, "acc@0.5": 1 / 3, "acc@0.75": 0.0, "acc@0.5:0.95": 3 / 30,
                                  "miou": (0.625 + 1 / 3) / 3, "parse_fail_rate": 1 / 3})
    # s1: 1, .625, .333 ; s2: .833, 0, .833
    assert s["by_source"]["s1"] == pytest.approx({"n": 3, "acc@0.5": 2 / 3, "acc@0.75": 1 / 3,
                                                  "acc@0.5:0.95": (3 * 2 + 7 * 1) / 30,
                                                  "miou": (1 + 0.625 + 1 / 3) / 3, "parse_fail_rate": 0.0})
    assert s["by_source"]["s2"] == pytest.approx({"n": 3, "acc@0.5": 2 / 3, "acc@0.75": 2 / 3,
                                                  "acc@0.5:0.95": (7 * 2 + 3 * 0) / 30,
                                                  "miou": (5 / 6 + 5 / 6) / 3, "parse_fail_rate": 1 / 3})


def test_summary_of_nothing():
    s = evaluate.summarise([])
    assert s["n"] == 0 and s["acc@0.5"] is None and s["by_split"] == {}


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


def test_draw_boxes_colours():
    image = Image.new("RGB", (64, 32), "white")
    drawn = evaluate.draw_boxes(image, [[4, 4, 20, 20]], [30, 4, 60, 28])
    s = drawn.width // 64
    assert drawn.size == (64 * s, 32 * s)
    assert drawn.getpixel((4 * s, 10 * s)) == evaluate.TRUE_COLOUR
    assert drawn.getpixel((30 * s, 10 * s)) == evaluate.PRED_COLOUR


# --------------------------------------------------------------------------------------------
# The eval command on the real tiny model


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
               "miou", "parse_fail_rate", "by_split", "by_source"}


def test_eval_cli_writes_report_and_gallery(dataset, tmp_path, capsys):
    out, gallery = tmp_path / "report.json", tmp_path / "gallery"
    assert main(["eval", "--model", "tiny", "--data", str(dataset), "--out", str(out), "--gallery", str(gallery),
                 "--batch-size", "2", "--device", "cpu"]) == 0
    report = json.loads(out.read_text())
    assert REPORT_KEYS <= set(report)
    assert report["model"] == "tiny" and report["family"] == "qwen2.5-vl" and report["n"] == 3
    assert report["resize"] == {"factor": 28, "min_pixels": 3136, "max_pixels": 50176}  # the tiny run's own
    assert report["decoding"] == {"max_new_tokens": 64, "do_sample": False, "repetition_penalty": 1.0}
    assert set(report["by_split"]) == {"val", "test"} and report["by_split"]["val"]["n"] == 2
    assert set(report["by_source"]) == {"synth"}
    for key in ("acc@0.5", "acc@0.75", "acc@0.5:0.95", "miou", "parse_fail_rate"):
        assert 0.0 <= report[key] <= 1.0
    page = (gallery / "index.html").read_text()
    pngs = list(gallery.glob("*.png"))
    assert len(pngs) == 3 and all(p.name in page for p in pngs)
    assert "&lt;square&gt;" in page and "<square>" not in page
    printed = capsys.readouterr().out
    assert "Acc@.5" in printed and "split=test" in printed


def test_eval_compare_and_pixel_override(dataset, tmp_path):
    with pytest.warns(UserWarning, match="eval: tiny has its pixel budget in groundtune.json .* but runs with"):
        result = evaluate.run_eval("tiny", dataset, limit=2, compare="tiny", max_pixels=28 * 28 * 16,
                                   device="cpu", out=tmp_path / "both.json")
    assert json.loads((tmp_path / "both.json").read_text()) == result
    first, second = result["models"]
    assert first["n"] == second["n"] == 2
    assert first["resize"]["max_pixels"] == 28 * 28 * 16 and first["resize"]["min_pixels"] == 3136
    assert {k: first[k] for k in evaluate.METRICS} == {k: second[k] for k in evaluate.METRICS}


def test_eval_cli_names_a_bad_image(dataset, tmp_path, capsys):
    (tmp_path / "images" / "1.png").write_bytes(b"not a png")
    assert main(["eval", "--model", "tiny", "--data", str(dataset), "--device", "cpu"]) == 2
    assert "1.png: cannot decode image" in capsys.readouterr().err


def test_max_new_tokens_cuts_answers_and_is_reported(dataset, tmp_path, capsys):
    """Three tokens cannot hold a box (`[{"` alone is three): every answer is cut and reported as a
    parse failure, never read as a guessed box; predict takes the same flag."""
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
