"""Dataset sources -> canonical JSONL, on tiny fixture files built here (no network, no real data)."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
import shlex
from collections import Counter
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
# Fixtures: a COCO-style instances.json with two images, and a refer toolkit pickle over it. Image 1
# holds a person and a crowd of people; image 2 two dogs and a cat; the file names a bird too.


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
            {"id": 104, "image_id": 2, "bbox": [20, 10, 8, 6], "category_id": 2, "iscrowd": 0, "area": 48},
            {"id": 105, "image_id": 2, "bbox": [30, 20, 5, 5], "category_id": 3, "iscrowd": 0, "area": 25},
        ],
        "categories": [{"id": 1, "name": "person"}, {"id": 2, "name": "dog"}, {"id": 3, "name": "cat"},
                       {"id": 4, "name": "bird"}],
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
ANSWERS = pa.list_(pa.string())


def parquet_table(rows: list[dict], image_type=HF_IMAGE, answer_type=ANSWERS) -> pa.Table:
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


def test_coco_one_line_per_category_with_all_its_boxes(tmp_path, coco):
    out = tmp_path / "coco.jsonl"
    counts = Counter()
    n = sources.convert_coco(coco["instances"], coco["images"], out, split="train2014", counts=counts)
    rows = read(out)
    # image 1: the person beside a crowd of people is left out (how many people is unknown);
    # image 2: both dogs in one line, the cat in another
    assert n == len(rows) == 2 and counts == {"with_boxes": 2, "crowd": 1}
    dogs, cat = rows
    assert list(dogs)[: len(KEYS)] == KEYS[:5] + ["bboxes"] + KEYS[6:]
    assert (dogs["phrase"], dogs["bboxes"]) == ("dog", [[1.5, 2.5, 4.5, 6.5], [20.0, 10.0, 28.0, 16.0]])
    assert (cat["phrase"], cat["bboxes"]) == ("cat", [[30.0, 20.0, 35.0, 25.0]])
    assert [r["id"] for r in rows] == ["coco-train2014-2-2", "coco-train2014-2-3"]  # image id, category id
    assert {k: dogs[k] for k in ("image_id", "category_id", "ann_ids", "split", "source")} == {
        "image_id": 2, "category_id": 2, "ann_ids": [102, 104], "split": "train2014", "source": "coco"}
    assert (dogs["width"], dogs["height"]) == (40, 30)
    assert image_path(dogs, out) == coco["images"] / "COCO_train2014_000000000002.jpg"


def test_coco_negatives_are_absent_categories_drawn_by_seed(tmp_path, coco, capsys):
    def convert(out: str, *flags: str) -> list[dict]:
        assert main(["data", "convert", "--from", "coco", "--instances", str(coco["instances"]), "--images",
                     str(coco["images"]), "--out", str(tmp_path / out), *flags]) == 0
        return read(tmp_path / out)

    rows = convert("neg.jsonl", "--negatives", "2")
    assert "2 with boxes, 4 with no target; left out: 1 (image, category) pairs with a crowd box" in capsys.readouterr().out
    present = {(a["image_id"], a["category_id"]) for a in coco["data"]["annotations"]}  # crowd boxes too
    negatives = [r for r in rows if r["bboxes"] == []]
    # image 1 has 3 absent categories (dog, cat, bird: never the person, whose crowd is there), image 2 two
    assert sorted(r["image_id"] for r in negatives) == [1, 1, 2, 2]
    names = {c["id"]: c["name"] for c in coco["data"]["categories"]}
    for r in negatives:
        assert (r["image_id"], r["category_id"]) not in present and r["phrase"] == names[r["category_id"]]
        assert r["id"] == f"coco-{r['split']}-{r['image_id']}-{r['category_id']}" and r["ann_ids"] == []
    assert len({r["id"] for r in rows}) == len(rows)
    # the same seed writes the same bytes; other seeds draw other categories for image 1
    convert("again.jsonl", "--negatives", "2")
    assert (tmp_path / "again.jsonl").read_bytes() == (tmp_path / "neg.jsonl").read_bytes()
    drawn = {tuple(r["category_id"] for r in convert(f"s{seed}.jsonl", "--negatives", "2", "--seed", str(seed))
                   if r["image_id"] == 1) for seed in range(8)}
    assert len(drawn) > 1 and all(len(d) == 2 for d in drawn)
    assert len([r for r in convert("all.jsonl", "--negatives", "9") if r["bboxes"] == []]) == 5
    # what the check makes of them: usable records with no target
    capsys.readouterr()
    assert main(["data", "check", str(tmp_path / "neg.jsonl"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["no_target"] == 4 and not report["errors"]


def test_coco_one_per_box_keeps_the_old_form_and_warns(tmp_path, coco, capsys):
    out = tmp_path / "coco.jsonl"
    assert main(["data", "convert", "--from", "coco", "--instances", str(coco["instances"]), "--images",
                 str(coco["images"]), "--split", "train2014", "--one-per-box", "--out", str(out)]) == 0
    rows = read(out)
    assert [r["ann_id"] for r in rows] == [101, 102, 104, 105]  # annotation 103 is a crowd box
    assert [r["phrase"] for r in rows] == ["person", "dog", "dog", "cat"]
    assert rows[0]["bbox"] == [10.0, 5.0, 30.0, 20.0] and list(rows[0])[: len(KEYS)] == KEYS
    assert rows[0]["id"] == "coco-train2014-101" and rows[0]["source"] == "coco"
    assert {k: rows[1][k] for k in ("image_id", "category_id")} == {"image_id": 2, "category_id": 2}
    # the person (beside a crowd of people) and the two dogs: their category repeats in the image
    err = capsys.readouterr().err
    assert err.startswith("warning: --one-per-box: 3 of 4 lines name a category that repeats in their image")


def test_coco_split_from_file_name(tmp_path, coco):
    instances = tmp_path / "instances_val2017.json"
    instances.write_text(coco["instances"].read_text())
    out = tmp_path / "coco.jsonl"
    sources.convert_coco(instances, coco["images"], out)
    assert {r["split"] for r in read(out)} == {"val2017"}


# --------------------------------------------------------------------------------------------
# gRefCOCO: tests/fixtures/grefcoco holds grefs(unc).json and instances.json in their real layout
# (refs with ann_id lists, [-1] and no_target for no target; COCO-style instances with segmentation)

GREFCOCO = Path(__file__).parent / "fixtures" / "grefcoco"
GREFS = GREFCOCO / "grefs(unc).json"


@pytest.fixture
def grefcoco(tmp_path: Path) -> dict:
    """The fixture's files, and the COCO images its instances.json names, written here."""
    instances = json.loads((GREFCOCO / "instances.json").read_text())
    images = tmp_path / "coco" / "train2014"
    for im in instances["images"]:
        make_image(images / im["file_name"], (im["width"], im["height"]))
    return {"refs": GREFS, "instances": GREFCOCO / "instances.json", "images": images, "data": instances}


def convert_grefcoco(tmp_path: Path, refs: Path, *flags: str, instances: Path = GREFCOCO / "instances.json") -> int:
    return main(["data", "convert", "--from", "grefcoco", "--refs", str(refs), "--instances", str(instances),
                 "--images", str(tmp_path / "coco" / "train2014"), "--out", str(tmp_path / "out.jsonl"), *flags])


def test_grefcoco_every_expression_names_its_refs_boxes(tmp_path, grefcoco, capsys):
    assert convert_grefcoco(tmp_path, GREFS) == 0
    out = capsys.readouterr().out
    rows = {r["sent_id"]: r for r in read(tmp_path / "out.jsonl")}
    # what each sentence must name, read from the source files here: the ref's annotations' boxes,
    # xywh -> xyxy, none for a no-target ref; the ref naming a crowd box is left out
    boxes = {a["id"]: a["bbox"] for a in grefcoco["data"]["annotations"]}
    crowd = {a["id"] for a in grefcoco["data"]["annotations"] if a["iscrowd"]}
    expected = {}
    for ref in json.loads(GREFS.read_text()):
        if crowd & set(ref["ann_id"]):
            continue
        for sent in ref["sentences"]:
            targets = [] if ref["no_target"] else [[x, y, x + w, y + h] for x, y, w, h in map(boxes.get, ref["ann_id"])]
            expected[sent["sent_id"]] = (sent["raw"].strip(), targets, ref["split"], ref["ref_id"])
    assert {k: (r["phrase"], r["bboxes"], r["split"], r["ref_id"]) for k, r in rows.items()} == expected
    # the same, by hand, for a few: two oranges, one, none, and the crowd's sentence gone
    assert rows[0]["bboxes"] == [[10.5, 10.0, 50.5, 50.0], [60.0, 12.0, 98.0, 48.25]]
    assert rows[1]["phrase"] == "The oranges in the bowl"  # the raw sentence, stripped
    assert rows[2]["bboxes"] == [[300.0, 200.0, 350.0, 245.0]] and rows[2]["ann_ids"] == [1003]
    assert rows[3]["bboxes"] == rows[4]["bboxes"] == [] and rows[3]["ann_ids"] == []
    assert 8 not in rows and len(rows) == 10  # sentence 8 names the crowd of people
    r = rows[5]
    assert r["id"] == "grefcoco-val-3-5" and r["source"] == "grefcoco" and (r["width"], r["height"]) == (500, 375)
    assert list(r)[:8] == ["id", "image", "width", "height", "phrase", "bboxes", "split", "source"]
    assert image_path(r, tmp_path / "out.jsonl") == grefcoco["images"] / "COCO_train2014_000000000025.jpg"
    assert "wrote 10 samples" in out and "7 with boxes, 3 with no target; left out: 1 sentences of refs naming a crowd box" in out
    # data check reads them as they are: usable, three with no target
    assert main(["data", "check", str(tmp_path / "out.jsonl"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["no_target"] == 3 and report["lines"] == 10 and not report["errors"]


def test_grefcoco_split(tmp_path, grefcoco):
    assert convert_grefcoco(tmp_path, GREFS, "--split", "val") == 0
    rows = read(tmp_path / "out.jsonl")
    assert [(r["phrase"], len(r["bboxes"])) for r in rows] == [("zebra on the left", 0), ("the zebra", 0),
                                                                ("both giraffes", 2)]
    assert convert_grefcoco(tmp_path, GREFS, "--split", "testC") == 2


def _broken_refs(tmp_path: Path, change) -> Path:
    refs = json.loads(GREFS.read_text())
    path = tmp_path / "grefcoco" / "grefs(unc).json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(change(refs)))
    return path


def _without(refs: list, i: int, key: str) -> list:
    del refs[i][key]
    return refs


def _with(refs: list, i: int, **values) -> list:
    refs[i].update(values)
    return refs


@pytest.mark.parametrize("change, problem", [
    (lambda refs: {"refs": refs}, "a JSON dict, not a list of refs"),
    (lambda refs: _without(refs, 3, "sentences"), "ref #3 has no sentences"),
    (lambda refs: _without(refs, 0, "ann_id"), "ref #0 has no ann_id"),
    (lambda refs: refs[:1] + ["not a ref"], "ref #1 is a JSON str"),
    (lambda refs: _with(refs, 1, no_target=True), "ref #1: no_target is True but ann_id is [1003]"),
    (lambda refs: _with(refs, 2, ann_id=[-1, 2001]), "ref #2: ann_id [-1, 2001] is not a list of annotation ids"),
    (lambda refs: _with(refs, 4, sentences=[{"raw": "the vase"}]), "ref #4: sentences must be a list"),
    (lambda refs: _with(refs, 4, ann_id=[999]), "ref #4 (ref_id 4) names ann_id 999"),
])
def test_grefcoco_wrong_layout_is_one_line_naming_file_and_ref(tmp_path, grefcoco, capsys, change, problem):
    refs = _broken_refs(tmp_path, change)
    assert convert_grefcoco(tmp_path, refs) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(refs) in err and problem in err, err
    assert not (tmp_path / "out.jsonl").exists() and no_leftovers(tmp_path)


def test_grefcoco_refuses_a_refcoco_pickle(tmp_path, grefcoco, capsys):
    refs = write_refs(tmp_path / "refcoco" / "refs(unc).p", REFS)
    assert convert_grefcoco(tmp_path, refs) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{refs}: a pickle" in err and "--from refcoco" in err


def test_grefcoco_command_of_the_docs_runs(tmp_path, monkeypatch, grefcoco):
    """docs/data.md's gRefCOCO command, as written, in a folder laid out as it names."""
    docs = (Path(__file__).resolve().parent.parent / "docs" / "data.md").read_text()
    (command,) = re.findall(r"`(groundtune data convert --from grefcoco[^`]*)`", docs)
    monkeypatch.chdir(tmp_path)
    Path("grefcoco").mkdir()
    for name in ("grefs(unc).json", "instances.json"):
        (tmp_path / "grefcoco" / name).write_bytes((GREFCOCO / name).read_bytes())
    assert main(shlex.split(command)[1:]) == 0
    out = shlex.split(command)[shlex.split(command).index("--out") + 1]
    assert {r["split"] for r in read(Path(out))} == {"val"}


# --------------------------------------------------------------------------------------------
# JSONL


def test_jsonl_normalises(tmp_path):
    src = tmp_path / "in" / "mine.jsonl"
    make_image(src.parent / "imgs" / "a.png", (33, 21))
    lines = [
        {"image": "imgs/a.png", "phrase": " the cat ", "bbox": [1, 2, 3, 4], "note": "kept"},
        {"id": "x", "image": "imgs/a.png", "width": 33, "height": 21, "phrase": "two cats",
         "bboxes": [[0, 0, 1, 1], [2, 2, 3, 3]], "split": "val", "source": "mine"},
        {"image": "imgs/a.png", "phrase": "the dog", "bboxes": []},  # no target: kept as it is
    ]
    src.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    out = tmp_path / "out" / "clean.jsonl"
    assert sources.convert_jsonl(src, out) == 3
    first, second, third = read(out)
    assert (third["phrase"], third["bboxes"], third["id"]) == ("the dog", [], "mine-3") and "bbox" not in third
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
        (json.dumps({"image": "a.png", "phrase": "p", "bboxes": "[]"}), "bboxes '[]' is not a list of boxes"),
        (json.dumps({"image": "a.png", "phrase": "p", "bboxes": None}), "bboxes None is not a list of boxes"),
        (json.dumps({"image": "a.png", "phrase": "p", "bboxes": [1, 2, 3, 4]}), "bboxes[0] 1 is not 4 numbers"),
        (json.dumps({"image": "a.png", "phrase": "p", "bboxes": [[1, 2, 3, 4], [1, 2, 3]]}),
         "bboxes[1] [1, 2, 3] is not 4 numbers"),
        (json.dumps({"image": "a.png", "phrase": "p", "bboxes": [[1, 2, 3, 4], [1, 2, 3, None]]}),
         "bboxes[1] [1, 2, 3, None] is not 4 numbers"),
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
    captured = capsys.readouterr()
    assert "wrote 2 samples" in captured.out and "left out: 1 (image, category) pairs with a crowd box" in captured.out
    assert not captured.err  # the warning is --one-per-box's
    # the flags of --from coco are refused elsewhere, by name
    for flag in (["--negatives", "1"], ["--one-per-box"]):
        assert main(["data", "convert", "--from", "jsonl", "--path", str(out), "--out", str(tmp_path / "x.jsonl"),
                     *flag]) == 2
        assert f"{flag[0]} is for --from coco" in capsys.readouterr().err


def test_cli_convert_replaces_its_own_output_and_no_one_elses(tmp_path, coco, capsys):
    """A previous convert's output is replaced (its source is convert's, or, from JSONL, it holds the
    input's records); a user's own labels only with --overwrite, the file as it was until then."""
    out = tmp_path / "cli.jsonl"
    coco_argv = ["data", "convert", "--from", "coco", "--instances", str(coco["instances"]), "--images",
                 str(coco["images"]), "--out", str(out)]
    assert main(coco_argv) == 0 and main(coco_argv) == 0
    mine = tmp_path / "mine.jsonl"  # source "my-labels": from --from jsonl, the output keeps it
    mine.write_text("".join(json.dumps({**r, "source": "my-labels"}) + "\n" for r in read(out)))
    jsonl_argv = ["data", "convert", "--from", "jsonl", "--path", str(mine), "--out", str(tmp_path / "again.jsonl")]
    assert main(jsonl_argv) == 0 and main(jsonl_argv) == 0
    capsys.readouterr()
    labels = mine.read_bytes()
    assert main([*coco_argv[:-1], str(mine)]) == 2  # the user's labels, written by no convert
    assert f"--out {mine} exists and was not written by `groundtune data convert`" in capsys.readouterr().err
    assert mine.read_bytes() == labels
    assert main([*coco_argv[:-1], str(mine), "--overwrite"]) == 0 and read(mine) == read(out)


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
    make_image(tmp_path / "a.png", (8, 8))
    src.write_text(json.dumps({"image": "a.png", "phrase": "the dog", "bboxes": []}) + "\n"
                   + json.dumps({"image": "a.png", "phrase": "two", "bboxes": [[0, 0, 2, 2], [1, "x", 2, 2]]}) + "\n")
    assert main(["data", "convert", "--from", "jsonl", "--path", str(src), "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{src}:2: bboxes[1] [1, 'x', 2, 2] is not 4 numbers" in err
    assert not (tmp_path / "o.jsonl").exists()
