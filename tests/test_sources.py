"""Dataset sources -> canonical JSONL, on tiny fixture files built here (no network, no real data)."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from groundtune.cli import main
from groundtune.data import sources
from groundtune.data.records import DataError, image_path

KEYS = ["id", "image", "width", "height", "phrase", "bbox", "split", "source"]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def make_image(path: Path, size: tuple[int, int], color=(200, 30, 30)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


def image_bytes(size: tuple[int, int], fmt: str, color=(0, 120, 200)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def no_leftovers(folder: Path) -> bool:
    """atomic_write leaves nothing behind when a conversion fails."""
    return not list(folder.glob(".*.tmp"))


# --------------------------------------------------------------------------------------------
# Fixtures: a COCO-style instances.json with two images, and a refer toolkit pickle over it


@pytest.fixture
def coco(tmp_path: Path) -> dict:
    images = tmp_path / "coco" / "train2014"
    make_image(images / "COCO_train2014_000000000001.jpg", (64, 48))
    make_image(images / "COCO_train2014_000000000002.jpg", (40, 30))
    instances = {
        "images": [
            {"id": 1, "file_name": "COCO_train2014_000000000001.jpg", "width": 64, "height": 48},
            {"id": 2, "file_name": "COCO_train2014_000000000002.jpg", "width": 40, "height": 30},
        ],
        "annotations": [
            {"id": 101, "image_id": 1, "bbox": [10, 5, 20, 15], "category_id": 1, "iscrowd": 0, "area": 300},
            {"id": 102, "image_id": 2, "bbox": [1.5, 2.5, 3.0, 4.0], "category_id": 2, "iscrowd": 0, "area": 12},
            {"id": 103, "image_id": 1, "bbox": [0, 0, 64, 48], "category_id": 1, "iscrowd": 1, "area": 3072},
        ],
        "categories": [{"id": 1, "name": "person"}, {"id": 2, "name": "dog"}],
    }
    path = tmp_path / "refcoco" / "instances.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(instances))
    return {"instances": path, "images": images, "data": instances}


def write_refs(path: Path, refs: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(refs, protocol=2))  # the refer toolkit's pickles are protocol 2
    return path


def ref(ref_id, ann_id, image_id, split, sentences) -> dict:
    return {
        "ref_id": ref_id, "ann_id": ann_id, "image_id": image_id, "split": split, "category_id": 1,
        # the toolkit's own file_name carries an _<ann_id> suffix that names no file on disk
        "file_name": f"COCO_train2014_{image_id:012d}_{ann_id}.jpg",
        "sentences": [{"raw": raw, "sent": raw.strip().lower(), "tokens": raw.split(), "sent_id": sid}
                      for sid, raw in sentences],
    }


REFS = [
    ref(0, 101, 1, "train", [(7, " The man on the LEFT "), (8, "left guy")]),
    ref(1, 102, 2, "val", [(9, "small dog")]),
]


@pytest.fixture
def refs(tmp_path: Path) -> Path:
    return write_refs(tmp_path / "refcoco" / "refs(unc).p", REFS)


# --------------------------------------------------------------------------------------------
# RefCOCO


def test_refcoco_one_line_per_sentence(tmp_path, coco, refs):
    out = tmp_path / "out" / "all.jsonl"
    n = sources.convert_refcoco(refs, coco["instances"], coco["images"], out)
    rows = read(out)
    assert n == len(rows) == 3
    first = rows[0]
    assert list(first)[: len(KEYS)] == KEYS
    assert first["id"] == "refcoco-train-7"
    assert first["phrase"] == "The man on the LEFT"  # the raw sentence, stripped
    assert first["bbox"] == [10.0, 5.0, 30.0, 20.0]  # xywh [10, 5, 20, 15] -> xyxy
    assert (first["width"], first["height"]) == (64, 48)
    assert (first["split"], first["source"]) == ("train", "refcoco")
    assert {k: first[k] for k in ("ref_id", "ann_id", "image_id", "sent_id")} == {
        "ref_id": 0, "ann_id": 101, "image_id": 1, "sent_id": 7}
    assert rows[1]["phrase"] == "left guy" and rows[1]["bbox"] == first["bbox"]
    assert rows[2]["bbox"] == [1.5, 2.5, 4.5, 6.5]
    for row in rows:
        # the image is the instances.json file, not the ref's suffixed name, and it resolves from the output
        assert "_101" not in row["image"] and "_102" not in row["image"]
        resolved = image_path(row, out)
        assert resolved.is_file()
        assert resolved.name == f"COCO_train2014_{row['image_id']:012d}.jpg"


def test_refcoco_image_inside_output_folder_is_relative(tmp_path, coco, refs):
    out = tmp_path / "all.jsonl"  # the images lie under tmp_path/coco
    sources.convert_refcoco(refs, coco["instances"], coco["images"], out)
    row = read(out)[0]
    assert row["image"] == "coco/train2014/COCO_train2014_000000000001.jpg"


def test_refcoco_split_filter(tmp_path, coco, refs):
    out = tmp_path / "val.jsonl"
    assert sources.convert_refcoco(refs, coco["instances"], coco["images"], out, split="val") == 1
    (row,) = read(out)
    assert (row["id"], row["split"], row["phrase"]) == ("refcoco-val-9", "val", "small dog")


def test_refcoco_unknown_split_names_the_splits(tmp_path, coco, refs):
    out = tmp_path / "x.jsonl"
    with pytest.raises(DataError, match=r"'testA'.*train, val"):
        sources.convert_refcoco(refs, coco["instances"], coco["images"], out, split="testA")
    assert not out.exists()


@pytest.mark.parametrize(
    "folder, name, source",
    [("refcoco+", "refs(unc).p", "refcoco+"), ("refcocog", "refs(google).p", "refcocog"),
     ("refcoco", "refs(google).p", "refcoco"), ("data", "refs(umd).p", "refcocog"), ("data", "refs(unc).p", "refcoco")],
)
def test_refcoco_source_from_file_names(tmp_path, coco, folder, name, source):
    refs = write_refs(tmp_path / folder / name, REFS)
    out = tmp_path / "out.jsonl"
    sources.convert_refcoco(refs, coco["instances"], coco["images"], out)
    row = read(out)[0]
    assert row["source"] == source and row["id"] == f"{source}-train-7"


@pytest.mark.parametrize("bad, missing", [(ref(5, 999, 1, "val", [(1, "x")]), "ann_id 999"),
                                          (ref(5, 101, 77, "val", [(1, "x")]), "image_id 77")])
def test_refcoco_ref_missing_from_instances(tmp_path, coco, bad, missing):
    refs = write_refs(tmp_path / "refcoco" / "refs(unc).p", REFS + [bad])
    out = tmp_path / "out.jsonl"
    with pytest.raises(DataError) as e:
        sources.convert_refcoco(refs, coco["instances"], coco["images"], out)
    message = str(e.value)
    assert str(coco["instances"]) in message and "ref_id 5" in message and missing in message
    assert not out.exists() and no_leftovers(tmp_path)


def test_refcoco_unreadable_pickle(tmp_path, coco):
    refs = tmp_path / "refcoco" / "refs(unc).p"
    refs.write_bytes(b"this is not a pickle")
    with pytest.raises(DataError, match=r"refs\(unc\)\.p: cannot read the refs pickle"):
        sources.convert_refcoco(refs, coco["instances"], coco["images"], tmp_path / "out.jsonl")


def test_refcoco_pickle_cannot_import_anything(tmp_path, coco):
    # A pickle naming any class (here a harmless one) is refused instead of being executed.
    from collections import OrderedDict

    refs = write_refs(tmp_path / "refcoco" / "refs(unc).p", [OrderedDict(REFS[0])])
    with pytest.raises(DataError, match="collections.OrderedDict"):
        sources.convert_refcoco(refs, coco["instances"], coco["images"], tmp_path / "out.jsonl")


# --------------------------------------------------------------------------------------------
# Parquet with embedded images


HF_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # datasets' Image feature


def parquet_table(rows: list[dict], image_type=HF_IMAGE, answer_type=pa.list_(pa.string())) -> pa.Table:
    schema = pa.schema([
        ("question_id", pa.string()), ("image", image_type), ("question", pa.string()),
        ("answer", answer_type), ("bbox", pa.list_(pa.float64())), ("file_name", pa.string()),
    ])
    return pa.Table.from_pylist(rows, schema=schema)


JPEG = image_bytes((50, 40), "JPEG")
PNG = image_bytes((30, 20), "PNG")


def hf_image(data: bytes) -> dict:
    return {"bytes": data, "path": None}


PARQUET_ROWS = [
    {"question_id": "q1", "image": hf_image(JPEG), "question": "?", "answer": ["red thing", " the left one "],
     "bbox": [2.0, 3.0, 10.0, 20.0], "file_name": "COCO_train2014_000000000001.jpg"},
    {"question_id": "q2", "image": hf_image(JPEG), "question": "?", "answer": ["same picture"],  # same bytes
     "bbox": [0.0, 0.0, 5.0, 5.0], "file_name": "COCO_train2014_000000000001.jpg"},
    {"question_id": "q3", "image": hf_image(PNG), "question": "?", "answer": ["blue square"],
     "bbox": [1.0, 1.0, 2.0, 2.0], "file_name": "COCO_train2014_000000000002.jpg"},
]


def test_parquet_one_line_per_phrase_and_images_once(tmp_path):
    data = tmp_path / "RefCOCO" / "data"
    data.mkdir(parents=True)
    # one row per row group, so the conversion really walks several batches
    pq.write_table(parquet_table(PARQUET_ROWS), data / "val-00000-of-00001.parquet", row_group_size=1)
    out, images_out = tmp_path / "val.jsonl", tmp_path / "images"
    n = sources.convert_parquet(data, images_out, out)
    rows = read(out)
    assert n == len(rows) == 4
    assert [r["id"] for r in rows] == ["q1-0", "q1-1", "q2-0", "q3-0"]
    assert [r["phrase"] for r in rows] == ["red thing", "the left one", "same picture", "blue square"]
    assert list(rows[0])[: len(KEYS)] == KEYS
    assert rows[0]["bbox"] == [2.0, 3.0, 12.0, 23.0]
    assert all(r["split"] == "val" and r["source"] == "parquet" for r in rows)  # split from the file name
    assert rows[0]["question_id"] == "q1" and rows[0]["file_name"] == "COCO_train2014_000000000001.jpg"
    # two distinct images written, once each, named by content hash
    written = sorted(p.name for p in images_out.iterdir())
    names = [hashlib.sha1(JPEG).hexdigest()[:16] + ".jpg", hashlib.sha1(PNG).hexdigest()[:16] + ".png"]
    assert written == sorted(names)
    assert rows[0]["image"] == rows[2]["image"] != rows[3]["image"]
    assert image_path(rows[0], out).read_bytes() == JPEG
    assert image_path(rows[3], out).read_bytes() == PNG
    assert (rows[0]["width"], rows[0]["height"]) == (50, 40) and (rows[3]["width"], rows[3]["height"]) == (30, 20)


def test_parquet_folder_of_files_raw_bytes_and_string_answer(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    raw = [dict(r, image=r["image"]["bytes"], answer=r["answer"][0]) for r in PARQUET_ROWS]
    pq.write_table(parquet_table(raw[2:], pa.binary(), pa.string()), data / "testB-00000-of-00001.parquet")
    pq.write_table(parquet_table(raw[:2], pa.binary(), pa.string()), data / "testA-00000-of-00001.parquet")
    out = tmp_path / "out.jsonl"
    assert sources.convert_parquet(data, tmp_path / "images", out) == 3
    rows = read(out)
    assert [(r["id"], r["split"]) for r in rows] == [("q1-0", "testA"), ("q2-0", "testA"), ("q3-0", "testB")]
    assert rows[0]["phrase"] == "red thing"
    assert len(list((tmp_path / "images").iterdir())) == 2
    # the split argument wins over the file name
    sources.convert_parquet(data, tmp_path / "images", out, split="mine")
    assert {r["split"] for r in read(out)} == {"mine"}


def test_parquet_split_column(tmp_path):
    table = parquet_table(PARQUET_ROWS[2:]).append_column("split", pa.array(["testA"]))
    pq.write_table(table, tmp_path / "train-00000-of-00001.parquet")
    out = tmp_path / "out.jsonl"
    sources.convert_parquet(tmp_path / "train-00000-of-00001.parquet", tmp_path / "images", out)
    assert read(out)[0]["split"] == "testA"


def test_parquet_corrupt_image_names_file_and_row(tmp_path):
    rows = PARQUET_ROWS[:1] + [dict(PARQUET_ROWS[2], image=hf_image(b"not an image"))]
    path = tmp_path / "val.parquet"
    pq.write_table(parquet_table(rows), path)
    out = tmp_path / "out.jsonl"
    with pytest.raises(DataError, match=r"val\.parquet: row 1: cannot read the embedded image"):
        sources.convert_parquet(path, tmp_path / "images", out)
    assert not out.exists() and no_leftovers(tmp_path)


# --------------------------------------------------------------------------------------------
# COCO


def test_coco_skips_crowd(tmp_path, coco):
    out = tmp_path / "coco.jsonl"
    n = sources.convert_coco(coco["instances"], coco["images"], out, split="train2014")
    rows = read(out)
    assert n == len(rows) == 2  # annotation 103 is a crowd box
    assert [r["ann_id"] for r in rows] == [101, 102]
    assert rows[0]["phrase"] == "person" and rows[1]["phrase"] == "dog"
    assert rows[0]["bbox"] == [10.0, 5.0, 30.0, 20.0]
    assert (rows[1]["width"], rows[1]["height"]) == (40, 30)
    assert rows[0]["id"] == "coco-train2014-101" and rows[0]["source"] == "coco"
    assert {k: rows[1][k] for k in ("image_id", "category_id")} == {"image_id": 2, "category_id": 2}
    assert image_path(rows[1], out) == coco["images"] / "COCO_train2014_000000000002.jpg"


def test_coco_split_from_file_name(tmp_path, coco):
    instances = tmp_path / "instances_val2017.json"
    instances.write_text(coco["instances"].read_text())
    out = tmp_path / "coco.jsonl"
    sources.convert_coco(instances, coco["images"], out)
    assert {r["split"] for r in read(out)} == {"val2017"}


# --------------------------------------------------------------------------------------------
# JSONL


def test_jsonl_normalises(tmp_path):
    src = tmp_path / "in" / "mine.jsonl"
    make_image(src.parent / "imgs" / "a.png", (33, 21))
    lines = [
        {"image": "imgs/a.png", "phrase": " the cat ", "bbox": [1, 2, 3, 4], "note": "kept"},
        {"id": "x", "image": "imgs/a.png", "width": 33, "height": 21, "phrase": "two cats",
         "bboxes": [[0, 0, 1, 1], [2, 2, 3, 3]], "split": "val", "source": "mine"},
    ]
    src.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    out = tmp_path / "out" / "clean.jsonl"
    assert sources.convert_jsonl(src, out) == 2
    first, second = read(out)
    assert list(first) == KEYS + ["note"]
    assert first["id"] == "mine-1" and first["note"] == "kept"
    assert (first["width"], first["height"]) == (33, 21)  # filled in from the image
    assert first["bbox"] == [1.0, 2.0, 3.0, 4.0] and all(isinstance(v, float) for v in first["bbox"])
    assert first["phrase"] == "the cat"
    assert (first["split"], first["source"]) == ("mine", "jsonl")
    assert image_path(first, out) == src.parent / "imgs" / "a.png"  # re-based on the output's folder
    assert list(second) == ["id", "image", "width", "height", "phrase", "bboxes", "split", "source"]
    assert second["bboxes"] == [[0.0, 0.0, 1.0, 1.0], [2.0, 2.0, 3.0, 3.0]]
    assert (second["id"], second["split"], second["source"]) == ("x", "val", "mine")


GOOD = {"image": "a.png", "phrase": "p", "bbox": [1, 2, 3, 4]}


@pytest.mark.parametrize(
    "bad, problem",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"image": "a.png", "bbox": [1, 2, 3, 4]}), "no phrase"),
        (json.dumps({"image": "a.png", "phrase": "p"}), "bbox"),
        (json.dumps(dict(GOOD, bbox=[1, 2, 3])), "is not 4 numbers"),
        (json.dumps(dict(GOOD, bbox=[1, 2, 3, "4"])), "is not 4 numbers"),
        (json.dumps({"phrase": "p", "bbox": [1, 2, 3, 4]}), "no image"),
        (json.dumps(dict(GOOD, image="gone.png")), "gone.png not found"),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad, problem):
    make_image(tmp_path / "a.png", (8, 8))
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(GOOD) + "\n" + bad + "\n")
    out = tmp_path / "out.jsonl"
    with pytest.raises(DataError) as e:
        sources.convert_jsonl(src, out)
    message = str(e.value)
    assert f"{src}:2:" in message and problem in message and "groundtune data check" in message
    assert not out.exists() and no_leftovers(tmp_path)


# --------------------------------------------------------------------------------------------
# Through the CLI


def test_cli_convert_coco(tmp_path, coco, capsys):
    out = tmp_path / "cli.jsonl"
    argv = ["data", "convert", "--from", "coco", "--instances", str(coco["instances"]),
            "--images", str(coco["images"]), "--out", str(out)]
    assert main(argv) == 0
    assert len(read(out)) == 2
    assert "wrote 2 samples" in capsys.readouterr().out


def test_cli_missing_flag_is_named(tmp_path, coco, capsys):
    assert main(["data", "convert", "--from", "coco", "--images", str(coco["images"]),
                 "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "error: groundtune data convert --from coco: missing --instances" in capsys.readouterr().err
    assert main(["data", "convert", "--from", "parquet", "--out", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "--path" in err and "--images-out" in err


def test_cli_bad_input_exits_2_with_message(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("{broken\n")
    assert main(["data", "convert", "--from", "jsonl", "--path", str(src), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert f"{src}:1:" in capsys.readouterr().err
