"""`groundtune data check` on a deliberately broken file: one line per kind, real broken images."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from groundtune.cli import main
from groundtune.data import check
from groundtune.data.images import load_image
from groundtune.data.records import image_path, read_samples, sample_boxes

W, H = 64, 48  # size of every ordinary fixture image


def _images(folder: Path) -> None:
    folder.mkdir()
    rng = np.random.default_rng(0)
    Image.new("RGB", (W, H), (200, 30, 30)).save(folder / "good.png")
    # Truncated JPEG: noise compresses badly, so half the file cuts well into the scan data.
    Image.fromarray(rng.integers(0, 255, (H, W, 3), dtype=np.uint8)).save(folder / "full.jpg", quality=95)
    data = (folder / "full.jpg").read_bytes()
    (folder / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (folder / "garbage.jpg").write_bytes(rng.integers(0, 255, 500, dtype=np.uint8).tobytes())
    Image.new("L", (W, H), 128).save(folder / "gray.png")
    Image.new("CMYK", (W, H), (0, 100, 100, 0)).save(folder / "cmyk.jpg")
    Image.new("RGBA", (W, H), (0, 0, 255, 128)).save(folder / "rgba.png")
    Image.fromarray(np.full((H, W), 40000, dtype=np.uint16)).save(folder / "deep.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display": stored WxH, shown HxW
    Image.new("RGB", (W, H), "green").save(folder / "exif.jpg", exif=exif)
    Image.new("RGB", (80, 60), "blue").save(folder / "wrong.png")
    Image.new("RGB", (1, 300), "white").save(folder / "thin.png")


def _rec(id_, image="images/good.png", phrase="the red square", bbox=(10, 10, 40, 30), size=(W, H), **extra):
    r = {"id": id_, "image": image, "width": size[0], "height": size[1], "phrase": phrase,
         "bbox": list(bbox) if isinstance(bbox, tuple) else bbox}
    r.update(extra)
    return r


# Physical line -> what is on it. Blank lines are skipped by the checker but still counted in
# the numbering, as an editor counts them.
def _lines() -> list[str | dict | None]:
    no_size = _rec("no-size")
    del no_size["width"], no_size["height"]
    no_box = _rec("no-box")
    del no_box["bbox"]
    return [
        _rec("good-1"),  # 1
        _rec("good-2", bbox=None, bboxes=[[0, 0, 10, 10], [20, 20, 64, 48]]),  # 2
        None,  # 3: blank
        '{"id": "broken", "image": ',  # 4: invalid_json
        no_box,  # 5: missing_field
        no_size,  # 6: missing_size
        _rec("missing", image="images/nope.jpg"),  # 7: image_missing
        _rec("truncated", image="images/truncated.jpg"),  # 8: image_unreadable
        _rec("garbage", image="images/garbage.jpg"),  # 9: image_unreadable
        _rec("wrong", image="images/wrong.png"),  # 10: size_mismatch
        _rec("exif", image="images/exif.jpg", size=(H, W), bbox=(5, 5, 40, 60)),  # 11: exif_transposed
        '{"id": "nan", "image": "images/good.png", "width": 64, "height": 48, '
        '"phrase": "the red square", "bbox": [NaN, 1, 20, 20]}',  # 12: bbox_nan
        _rec("empty-box", bbox=(40, 20, 40, 40)),  # 13: bbox_empty (zero width; as xywh it leaves the image)
        _rec("xywh", bbox=(40, 10, 20, 30)),  # 14: bbox_looks_xywh ([40, 10, 60, 40] as xywh)
        _rec("outside", bbox=(10, 10, 114, 40)),  # 15: bbox_outside (50 px)
        _rec("clipped", bbox=(-1, 0, 65, 48)),  # 16: bbox_clipped (1 px)
        _rec("no-phrase", phrase="   "),  # 17: phrase_empty
        _rec("html", phrase="<b>red</b> square"),  # 18: phrase_html
        _rec("control", phrase="the\x07 square"),  # 19: phrase_control_chars
        _rec("thin", image="images/thin.png", size=(1, 300), bbox=(0, 10, 1, 100)),  # 20: aspect_ratio
        _rec("gray", image="images/gray.png"),  # 21: image_mode
        _rec("cmyk", image="images/cmyk.jpg"),  # 22: image_mode
        _rec("rgba", image="images/rgba.png"),  # 23: image_mode
        _rec("deep", image="images/deep.png"),  # 24: image_mode (I;16)
        _rec("multi-clip", bbox=None, bboxes=[[0, 0, 10, 10], [30, 30, 65, 49]]),  # 25: bbox_clipped
        _rec("multi-xywh", bbox=None, bboxes=[[0, 0, 10, 10], [30, 30, 10, 10]]),  # 26: bbox_looks_xywh
        _rec("clip-and-empty", phrase="", bbox=(0, 0, 66, 48)),  # 27: bbox_clipped + phrase_empty
        _rec("good-3", phrase="the red square on the left", split="val", source="mine"),  # 28
        _rec("folder", image="images"),  # 29: image_not_a_file (a folder: never opened)
        _rec("no-target", phrase="the green triangle", bbox=None, bboxes=[]),  # 30: no target: usable as it is
        _rec("long", phrase="the red square " * 40),  # 31: phrase_too_long (600 characters)
        _rec("nul", image="images/good\x00.png"),  # 32: image_not_a_file (no file can have the name)
        None,  # 33: blank
    ]


EXPECTED = {
    "lines": 31,
    "no_target": 1,
    "errors": {
        "invalid_json": [4],
        "missing_field": [5],
        "image_missing": [7],
        "image_unreadable": [8, 9],
        "image_not_a_file": [29, 32],
        "size_mismatch": [10],
        "bbox_nan": [12],
        "bbox_empty": [13],
        "bbox_outside": [15],
        "bbox_looks_xywh": [14, 26],
        "phrase_empty": [17, 27],
        "phrase_too_long": [31],
        "aspect_ratio": [20],
    },
    "warnings": {
        "missing_size": [6],
        "exif_transposed": [11],
        "bbox_clipped": [16, 25, 27],
        "phrase_html": [18],
        "phrase_control_chars": [19],
        "image_mode": [21, 22, 23, 24],
    },
    "fixed": {  # line 27 has a warning but also an error: dropped, so not fixed
        "missing_size": [6],
        "exif_transposed": [11],
        "bbox_clipped": [16, 25],
        "phrase_html": [18],
        "phrase_control_chars": [19],
        "image_mode": [21, 22, 23, 24],
    },
}
GOOD_IDS = ["good-1", "good-2", "good-3", "no-target"]
WARNING_IDS = ["no-size", "exif", "clipped", "html", "control", "gray", "cmyk", "rgba", "deep", "multi-clip"]


def _write(path: Path, lines: list) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for item in lines:
            if item is None:
                f.write("\n")
            elif isinstance(item, str):
                f.write(item + "\n")
            else:
                # None stands for "no such field" (a "bboxes" record has no "bbox").
                f.write(json.dumps({k: v for k, v in item.items() if v is not None}) + "\n")
    return path


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    _images(tmp_path / "images")
    return _write(tmp_path / "data.jsonl", _lines())


def test_every_kind_on_its_exact_lines(broken: Path):
    report = check.check_file(broken)
    assert report.to_dict() == EXPECTED
    assert list(report.to_dict()) == ["lines", "no_target", "errors", "warnings", "fixed"]
    assert list(report.to_dict()["errors"]) == [k for k in check.KINDS if k in EXPECTED["errors"]]
    json.dumps(report.to_dict(), allow_nan=False)  # plain JSON, whatever the input held
    # Every kind of the table is exercised by this fixture.
    assert set(EXPECTED["errors"]) | set(EXPECTED["warnings"]) == set(check.KINDS)


def test_good_lines_appear_nowhere(broken: Path):
    d = check.check_file(broken).to_dict()
    flagged = {n for group in ("errors", "warnings", "fixed") for lines in d[group].values() for n in lines}
    assert flagged.isdisjoint({1, 2, 28, 30})


def test_fix_out_holds_good_and_fixed_warning_records_only(broken: Path):
    out = broken.parent / "clean.jsonl"
    report = check.check_file(broken, fix_out=out)
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    by_id = {r["id"]: r for r in records}
    assert [r["id"] for r in records] == ["good-1", "good-2", "no-size", "exif", "clipped", "html", "control",
                                          "gray", "cmyk", "rgba", "deep", "multi-clip", "good-3", "no-target"]
    assert by_id["no-target"]["bboxes"] == [] and "bbox" not in by_id["no-target"]  # kept as it is
    assert sorted(by_id) == sorted(GOOD_IDS + WARNING_IDS) and report.kept == len(records)

    # The fixes are applied ...
    assert by_id["clipped"]["bbox"] == [0.0, 0.0, 64.0, 48.0]
    assert by_id["multi-clip"]["bboxes"] == [[0, 0, 10, 10], [30.0, 30.0, 64.0, 48.0]]
    assert by_id["html"]["phrase"] == "red square"
    assert by_id["control"]["phrase"] == "the square"
    assert list(by_id["no-size"])[:4] == ["id", "image", "width", "height"]
    assert (by_id["no-size"]["width"], by_id["no-size"]["height"]) == (W, H)
    # ... and nothing else changes: the same dicts as the input lines, extra fields kept.
    assert by_id["good-3"] == _rec("good-3", phrase="the red square on the left", split="val", source="mine")
    assert by_id["exif"] == _rec("exif", image="images/exif.jpg", size=(H, W), bbox=(5, 5, 40, 60))
    assert by_id["gray"] == _rec("gray", image="images/gray.png")

    # What the checker passes, the loader loads at the recorded size, boxes inside with area.
    for r in read_samples(out):
        image = load_image(image_path(r, out), (r["width"], r["height"]))
        assert image.size == (r["width"], r["height"]) and image.mode == "RGB"
        for x1, y1, x2, y2 in sample_boxes(r):
            assert 0 <= x1 < x2 <= r["width"] and 0 <= y1 < y2 <= r["height"]
    # The checked file of fixed records is clean.
    assert check.check_file(out).errors == {}


def test_fix_out_elsewhere_keeps_image_paths_working(broken: Path):
    out = broken.parent / "sub" / "dir" / "clean.jsonl"
    check.check_file(broken, fix_out=out)
    records = read_samples(out)
    assert records[0]["image"] == "../../images/good.png"
    assert check.check_file(out).to_dict()["errors"] == {}


def test_each_image_is_decoded_once(broken: Path, monkeypatch):
    seen = []
    probe = check._probe_image
    monkeypatch.setattr(check, "_probe_image", lambda p: seen.append(p) or probe(p))
    check.check_file(broken)
    assert len(seen) == len(set(seen)) == 10  # the 10 files there (good.png serves 16 lines); the missing one is not opened
    # checked again: every image comes from the cache; one changed since is decoded again
    seen.clear()
    check.check_file(broken)
    assert seen == []
    good = broken.parent / "images" / "good.png"
    before = good.stat().st_mtime_ns
    Image.new("RGB", (W, H), "blue").save(good)
    os.utime(good, ns=(before + 10**9, before + 10**9))  # a second later (file times are coarse)
    report = check.check_file(broken)
    assert seen == [good] and report.to_dict() == EXPECTED


def test_cli_json_is_one_object_and_exit_code(broken: Path, tmp_path: Path, capsys):
    assert main(["data", "check", str(broken), "--json"]) == 1
    out = capsys.readouterr().out
    assert json.loads(out) == EXPECTED  # json.loads: one object, nothing else

    clean = _write(tmp_path / "clean.jsonl", [_rec("a"), None, _rec("b", bbox=(0, 0, W, H))])
    assert main(["data", "check", str(clean), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"lines": 2, "no_target": 0, "errors": {}, "warnings": {}, "fixed": {}}


def test_cli_fix_out_and_summary(broken: Path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the table fits the terminal; wide enough to read whole here
    out = broken.parent / "fixed.jsonl"
    assert main(["data", "check", str(broken), "--fix-out", str(out)]) == 1
    text = capsys.readouterr().out
    for kind in check.KINDS:
        assert kind in text
    assert "8, 9" in text  # the image_unreadable lines
    assert "[x1, y1, x2, y2]" in text  # not eaten as rich markup
    assert "what to do" in text and "left out of --fix-out" in text
    assert len(read_samples(out)) == len(GOOD_IDS + WARNING_IDS)
    # The fixed file passes with warnings only (image modes and EXIF stay: fixed at load).
    assert main(["data", "check", str(out)]) == 0
    assert "No errors" in capsys.readouterr().out
    # a previous --fix-out of the file (its records) is replaced; a file of other records only with --overwrite
    assert main(["data", "check", str(broken), "--fix-out", str(out)]) == 1
    other = broken.parent / "other.jsonl"
    other.write_text(json.dumps(_rec("someone-elses")) + "\n")
    capsys.readouterr()
    assert main(["data", "check", str(broken), "--fix-out", str(other)]) == 2
    assert f"--fix-out {other} exists and was not written by `groundtune data check`" in capsys.readouterr().err
    assert read_samples(other)[0]["id"] == "someone-elses"
    assert main(["data", "check", str(broken), "--fix-out", str(other), "--overwrite"]) == 1
    assert read_samples(other) == read_samples(out)


def test_summary_of_a_clean_file(tmp_path: Path):
    _images(tmp_path / "images")
    report = check.check_file(_write(tmp_path / "ok.jsonl", [_rec("a")]))
    assert "No problems found" in report.summary()


@pytest.mark.parametrize(
    "record, kinds",
    [
        ({"id": 1, "image": 5, "phrase": "x", "bbox": [0, 0, 1, 1]}, {"missing_field"}),
        (_rec("s", phrase=["a"]), {"phrase_empty"}),
        (_rec("s", phrase="<br>"), {"phrase_html", "phrase_empty"}),
        (_rec("s", phrase="a &amp; b"), {"phrase_html"}),
        (_rec("s", phrase="tab\there"), {"phrase_control_chars"}),
        (_rec("s", bbox="10 10 20 20"), {"bbox_nan"}),
        (_rec("s", bbox=[1, 2, 3]), {"bbox_nan"}),
        (_rec("s", bbox=[True, 0, 10, 10]), {"bbox_nan"}),
        (_rec("s", bbox=[[0, 0, 1, 1]]), {"bbox_nan"}),
        (_rec("s", bbox=[0, 0, 1e400, 10]), {"bbox_nan"}),  # inf
        (_rec("s", bbox=None, bboxes="nope"), {"bbox_nan"}),
        (_rec("s", bbox=None, bboxes=[]), set()),  # no target: usable as it is
        (_rec("s", bbox=None), {"missing_field"}),  # neither bbox nor bboxes
        (_rec("s", bbox=(-2, -2, 10, 10)), {"bbox_clipped"}),
        (_rec("s", bbox=(-3, 0, 10, 10)), {"bbox_outside"}),
        (_rec("s", bbox=(-2, 0, -1, 10)), {"bbox_outside"}),  # a sliver wholly outside
        (_rec("s", size=("64", 48)), {"missing_size"}),
        (_rec("s", size=(0, 48)), {"missing_size"}),
        (_rec("s", image="images"), {"image_not_a_file"}),  # a folder
        (_rec("s", image="images/a\x00.png"), {"image_not_a_file"}),  # no file can have the name
        (_rec("s", image="images/\ud800.png"), {"image_not_a_file"}),  # nor this one (a lone surrogate)
        (_rec("s", image="x" * 300 + ".png"), {"image_not_a_file"}),  # a name over 255 bytes
        (_rec("s", phrase="x" * 501), {"phrase_too_long"}),
        (_rec("s", phrase="x" * 500), set()),
        (_rec("s", image="images/nope.png", size=(None, None)), {"image_missing"}),  # no size known at all
    ],
)
def test_odd_records_never_crash(tmp_path: Path, record: dict, kinds: set):
    _images(tmp_path / "images")
    path = _write(tmp_path / "odd.jsonl", [record])
    d = check.check_file(path, fix_out=tmp_path / "out.jsonl").to_dict()
    found = {k for group in ("errors", "warnings") for k in d[group]}
    assert found == kinds
    kept = read_samples(tmp_path / "out.jsonl") if not d["errors"] else []
    for r in kept:  # whatever is kept is trainable
        assert all(math.isfinite(v) for b in sample_boxes(r) for v in b)


def test_non_utf8_file_is_a_clear_error(tmp_path: Path, capsys):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"id": "a"}\n{"phrase": "caf\xe9"}\n'.encode("latin-1"))
    assert main(["data", "check", str(path)]) == 2
    assert capsys.readouterr().err == (f"error: {path}:2: not UTF-8 text (byte 0xE9 at byte offset 27); save the file "
                                       "as UTF-8\n")


def test_docstring_table_lists_every_kind_with_its_level():
    rows = {}
    for line in check.__doc__.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[1] in ("error", "warning"):
            rows[parts[0]] = parts[1]
    assert rows == {kind: level for kind, (level, _) in check.KINDS.items()}


def test_loader_refuses_what_check_calls_unreadable(tmp_path: Path):
    """A run must stop with a DataError naming the file, never another exception, on these images."""
    from groundtune.data.records import DataError

    _images(tmp_path / "images")
    # A BMP whose header claims 100,000 x 100,000 pixels: Pillow raises DecompressionBombError,
    # which is not an OSError.
    Image.new("RGB", (4, 4)).save(tmp_path / "images" / "bomb.bmp")
    data = bytearray((tmp_path / "images" / "bomb.bmp").read_bytes())
    data[18:26] = (100_000).to_bytes(4, "little") * 2
    (tmp_path / "images" / "bomb.bmp").write_bytes(bytes(data))
    names = ["truncated.jpg", "garbage.jpg", "nope.jpg", "bomb.bmp"]
    path = _write(tmp_path / "d.jsonl", [_rec(n, image=f"images/{n}") for n in names])
    d = check.check_file(path).to_dict()
    assert d["errors"] == {"image_missing": [3], "image_unreadable": [1, 2, 4]}
    for n in names:
        with pytest.raises(DataError, match=n):
            load_image(tmp_path / "images" / n, (W, H))
