"""Dataset sources -> canonical JSONL (design.md, "Canonical sample").

One function per source, each called by ``groundtune data convert --from SOURCE``:

================  ==========================================================================
convert_refcoco   the refer toolkit's ``refs(unc).p`` / ``refs(umd).p`` / ``refs(google).p`` +
                  its ``instances.json`` (RefCOCO, RefCOCO+, RefCOCOg)
convert_grefcoco  gRefCOCO's ``grefs(unc).json`` + its ``instances.json``: one sample per
                  sentence, naming a set of boxes (possibly none)
convert_parquet   lmms-lab/RefCOCO-style parquet with the images embedded (its rows converter,
                  ``parquet_samples``, also reads ``hf:REPO:SPLIT`` data: data/hub.py)
convert_coco      COCO ``instances_*.json``: one sample per (image, category) holding every box
                  of the category, phrase = category name; optionally no-target samples
convert_jsonl     canonical JSONL in, validated and normalised JSONL out
================  ==========================================================================

Every function writes through ``records.write_samples`` (a crash leaves no half-written file),
shows a progress bar, and returns the number of samples written. Every box written is xyxy in
pixels of the original image, converted from the source's xywh by ``boxes.xywh_to_xyxy``.

Image paths are written relative to the output file's folder when the image lies inside that
folder (the folder can then move as a whole), and absolute otherwise: a ``../`` path would break
as soon as the JSONL alone is moved or copied.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, NoReturn

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from groundtune.boxes import as_box, xywh_to_xyxy
from groundtune.errors import shown
from groundtune.files import not_utf8, regular_file
from groundtune.progress import track

from .images import header_size
from .records import (DataError, atomic_write, derived_from, first_record, image_path, iter_jsonl, jsonl_file,
                      missing_fields, record_problem, record_size, write_samples)

# The sources `data convert` names in what it writes (refer_source's, and each converter's own; --from
# jsonl keeps a record's own source, "jsonl" where it has none): how its output is told from a user's
SOURCES = ("refcoco", "refcoco+", "refcocog", "refclef", "grefcoco", "parquet", "coco", "jsonl")


def _sample(id, image, width, height, phrase, bbox, split, source, box_key="bbox", **extras) -> dict:
    """A canonical record with its keys in the documented order, extras last. ``box_key`` "bboxes"
    writes a list of boxes (a set; ``[]``: no target) in bbox's place."""
    return {
        "id": id,
        "image": image,
        "width": width,
        "height": height,
        "phrase": phrase,
        box_key: bbox,
        "split": split,
        "source": source,
        **extras,
    }


def image_ref(image: str | Path, out: str | Path) -> str:
    """How the output file names an image (see the module docstring for why not always relative)."""
    # abspath, not resolve: a symlinked dataset folder stays spelled the way the user spelled it.
    image = Path(os.path.abspath(image))
    folder = Path(os.path.abspath(out)).parent
    try:
        return image.relative_to(folder).as_posix()
    except ValueError:
        return str(image)


def load_instances(path: str | Path) -> tuple[dict, dict]:
    """COCO instances.json -> (the whole file, images by id). COCO json has no streaming reader
    in the standard library; pycocotools loads it whole too."""
    try:
        with open(regular_file(path, "instances.json"), encoding="utf-8-sig") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); is it COCO instances.json?") from None
    except UnicodeDecodeError:
        raise not_utf8(path) from None
    except RecursionError:  # Python's reader stops at ~1,000 levels; COCO's nest 4
        raise DataError(f"{path}: nested deeper than Python's JSON reader goes; is it COCO instances.json?") from None
    if not isinstance(data, dict) or "images" not in data or "annotations" not in data:
        raise DataError(f"{path}: not a COCO instances file (needs 'images' and 'annotations')")
    return data, {im["id"]: im for im in data["images"]}


def written_by_convert(out: Path, path: str | Path | None = None) -> bool:
    """Whether ``out`` holds what `data convert` wrote, which the next convert may replace: its
    first record's source is one of SOURCES, or (``path``: the --from jsonl input, whose records
    keep their own source) it is one of ``path``'s records."""
    first = first_record(out)
    return first is not None and (first.get("source") in SOURCES or (path is not None and derived_from(out, path)))


def instance_images(instances: str | Path, images: str | Path) -> Iterator[tuple[str, Path]]:
    """("an image of --instances", path) for every image a COCO instances file names under the
    folder ``images``: what no output of a command reading them may be (``files.output_file``)."""
    for im in load_instances(instances)[0]["images"]:
        yield "an image of --instances", Path(images) / str(im.get("file_name"))


# --------------------------------------------------------------------------------------------
# RefCOCO / RefCOCO+ / RefCOCOg (the refer toolkit's files)


class _PlainUnpickler(pickle.Unpickler):
    # The refer pickles hold only lists, dicts, strings and numbers, so refusing every class
    # costs nothing and means a tampered pickle cannot run code while being read.
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it asks for {module}.{name}; a refs pickle holds only plain lists and dicts")


def _load_refs(path: str | Path) -> list[dict]:
    with open(regular_file(path, "refs pickle"), "rb") as f:
        try:
            # The pickles were written by Python 2; its byte strings are decoded as UTF-8.
            refs = _PlainUnpickler(f, encoding="utf-8").load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError) as e:
            raise DataError(f"{path}: cannot read the refs pickle ({e}); expected refs(unc).p, refs(umd).p "
                            "or refs(google).p from the refer toolkit") from None
    if not isinstance(refs, list) or not all(isinstance(r, dict) for r in refs):
        raise DataError(f"{path}: expected a list of refs (dicts), got {type(refs).__name__}")
    for i, ref in enumerate(refs):
        missing = [k for k in ("ref_id", "ann_id", "image_id", "split", "sentences") if k not in ref]
        if missing:
            raise DataError(f"{path}: ref #{i} has no {', '.join(missing)}; is this a refer toolkit pickle?")
    return refs


def refer_source(refs_path: str | Path) -> str:
    """Which dataset a refs pickle belongs to. The refer toolkit keeps each in a folder named after
    it (refcoco/, refcoco+/, refcocog/, refclef/) with overlapping file names (refcoco and refcocog
    both have refs(google).p), so the folder decides. Failing that, only RefCOCOg has a umd split;
    anything else is taken as RefCOCO."""
    path = Path(refs_path)
    folder = path.parent.name.lower()
    if folder in ("refcoco", "refcoco+", "refcocog", "refclef"):
        return folder
    return "refcocog" if "umd" in path.name.lower() else "refcoco"


def convert_refcoco(
    refs: str | Path,
    instances: str | Path,
    images: str | Path,
    out: str | Path,
    split: str | None = None,
) -> int:
    """Refer toolkit files -> canonical JSONL, one line per sentence. Returns the lines written.

    The image comes from instances.json's ``file_name``, never from the ref's ``file_name``, which
    carries an ``_<ann_id>`` suffix that names no file on disk. ``split`` keeps only that split.
    """
    if not Path(images).is_dir():
        raise DataError(f"{images}: images folder not found; pass the folder holding the COCO train2014 images")
    ref_list = _load_refs(refs)
    data, image_by_id = load_instances(instances)
    ann_by_id = {a["id"]: a for a in data["annotations"]}
    source = refer_source(refs)
    if split is not None:
        splits = sorted({r["split"] for r in ref_list})
        if split not in splits:
            raise DataError(f"{refs}: no ref has split {split!r}; its splits are {', '.join(splits)}")
        ref_list = [r for r in ref_list if r["split"] == split]

    def samples() -> Iterator[dict]:
        for ref in track(ref_list, f"{source} refs"):
            ann = ann_by_id.get(ref["ann_id"])
            im = image_by_id.get(ref["image_id"])
            if ann is None or im is None:
                what = f"ann_id {ref['ann_id']}" if ann is None else f"image_id {ref['image_id']}"
                raise DataError(f"{instances}: ref_id {ref['ref_id']} of {refs} names {what}, which is not in "
                                "this file; pass the instances.json that came with the refs pickle")
            bbox = xywh_to_xyxy(ann["bbox"])
            image = image_ref(Path(images) / im["file_name"], out)
            for sent in ref["sentences"]:
                yield _sample(
                    f"{source}-{ref['split']}-{sent['sent_id']}", image, im["width"], im["height"],
                    (sent.get("raw") or sent["sent"]).strip(), bbox, ref["split"], source,
                    ref_id=ref["ref_id"], ann_id=ref["ann_id"], image_id=ref["image_id"], sent_id=sent["sent_id"],
                )

    return write_samples(out, samples())


# --------------------------------------------------------------------------------------------
# gRefCOCO (GRES, Liu et al. 2023): an expression names any number of objects, or none

# What every ref of grefs(unc).json holds (beside category_id, file_name, sent_ids, no_target).
GREF_KEYS = ("ref_id", "image_id", "ann_id", "split", "sentences")


def _gref_ann_ids(ref: dict, where: str) -> list[int]:
    """The ref's annotation ids; [] for a no-target ref. gRefCOCO lists them (``[-1]``: no
    target, with ``no_target: true``); a single id is read as a list of one, as grefer.py does."""
    value = ref["ann_id"]
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(a, int) and not isinstance(a, bool) for a in ids) or (-1 in ids and len(ids) > 1):
        raise DataError(f"{where}: ann_id {shown(value)} is not a list of annotation ids ([-1] for no target)")
    no_target = ids == [-1]
    flag = ref.get("no_target")
    if flag is not None and flag is not no_target:
        raise DataError(f"{where}: no_target is {shown(flag)} but ann_id is {shown(value)}; they disagree")
    return [] if no_target else ids


def _load_grefs(path: str | Path) -> list[dict]:
    """grefs(unc).json as a list of refs, each checked for the keys and types the converter reads;
    anything else is a DataError naming the file (and the ref's index)."""
    path = regular_file(path, "grefs file")
    with open(path, "rb") as f:
        if f.read(1) == b"\x80":  # how every pickle of protocol 2 or later begins
            raise DataError(f"{path}: a pickle (the refer toolkit's refs(unc).p?), not gRefCOCO's grefs(unc).json; "
                            "pass grefs(unc).json, or convert RefCOCO's pickles with --from refcoco")
    try:
        with open(path, encoding="utf-8-sig") as f:
            refs = json.load(f)
    except UnicodeDecodeError:
        raise not_utf8(path) from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise DataError(f"{path}: not valid JSON ({e}); expected gRefCOCO's grefs(unc).json, a list of refs") from None
    if not isinstance(refs, list):
        raise DataError(f"{path}: a JSON {type(refs).__name__}, not a list of refs; expected gRefCOCO's grefs(unc).json")
    for i, ref in enumerate(refs):
        where = f"{path}: ref #{i}"
        if not isinstance(ref, dict):
            raise DataError(f"{where} is a JSON {type(ref).__name__}, not a ref object")
        missing = [k for k in GREF_KEYS if k not in ref]
        if missing:
            raise DataError(f"{where} has no {', '.join(missing)}; is this gRefCOCO's grefs(unc).json?")
        _gref_ann_ids(ref, where)
        sentences = ref["sentences"]
        if not isinstance(sentences, list) or not all(
                isinstance(s, dict) and isinstance(s.get("sent_id"), int)
                and isinstance(s.get("raw") or s.get("sent"), str) for s in sentences):
            raise DataError(f"{where}: sentences must be a list of {{sent_id, raw, sent}} objects")
    return refs


def convert_grefcoco(
    grefs: str | Path,
    instances: str | Path,
    images: str | Path,
    out: str | Path,
    split: str | None = None,
    counts: Counter | None = None,
) -> int:
    """gRefCOCO's ``grefs(unc).json`` + ``instances.json`` -> canonical JSONL, one line per
    sentence. Returns the lines written.

    ``bboxes`` holds the boxes of every annotation the ref names (xyxy, original pixels), ``[]``
    for a no-target ref; the id is ``grefcoco-<split>-<ref_id>-<sent_id>``, with ``ref_id``,
    ``image_id``, ``ann_ids`` and ``sent_id`` kept. The image comes from instances.json's
    ``file_name`` under ``images``. A ref naming a crowd annotation is left out (its box covers an
    unknown number of objects, so no list of boxes is the set): ``counts["crowd"]`` counts its
    sentences, ``counts["no_target"]`` and ``counts["with_boxes"]`` the lines written.
    ``split`` keeps only that split.
    """
    if not Path(images).is_dir():
        raise DataError(f"{images}: images folder not found; pass the folder holding the COCO train2014 images")
    refs = _load_grefs(grefs)
    data, image_by_id = load_instances(instances)
    ann_by_id = {a["id"]: a for a in data["annotations"]}
    counts = counts if counts is not None else Counter()
    if split is not None:
        splits = sorted({str(r["split"]) for r in refs})
        if split not in splits:
            raise DataError(f"{grefs}: no ref has split {split!r}; its splits are {', '.join(splits)}")

    def samples() -> Iterator[dict]:
        ids = set()
        for i, ref in track(list(enumerate(refs)), "grefcoco refs"):
            if split is not None and ref["split"] != split:
                continue
            where = f"{grefs}: ref #{i} (ref_id {ref['ref_id']})"
            ann_ids = _gref_ann_ids(ref, where)
            im = image_by_id.get(ref["image_id"])
            anns = [ann_by_id.get(a) for a in ann_ids]
            if im is None or None in anns:
                what = f"image_id {ref['image_id']}" if im is None else f"ann_id {ann_ids[anns.index(None)]}"
                raise DataError(f"{where} names {what}, which {instances} does not hold; pass the "
                                "instances.json that came with grefs(unc).json")
            if any(a["image_id"] != ref["image_id"] or as_box(a.get("bbox")) is None for a in anns):
                raise DataError(f"{where}: an annotation of it lies in another image or has no 4-number bbox")
            if any(a.get("iscrowd") for a in anns):
                counts["crowd"] += len(ref["sentences"])
                continue
            boxes = [xywh_to_xyxy(a["bbox"]) for a in anns]
            image = image_ref(Path(images) / im["file_name"], out)
            for sent in ref["sentences"]:
                phrase = (sent.get("raw") or sent["sent"]).strip()
                if not phrase:
                    counts["empty_sentence"] += 1  # nothing to ground; its sent_id keeps the others' ids
                    continue
                id = f"grefcoco-{ref['split']}-{ref['ref_id']}-{sent['sent_id']}"
                if id in ids:
                    raise DataError(f"{where}: ref_id {ref['ref_id']} with sent_id {sent['sent_id']} appears twice")
                ids.add(id)
                counts["with_boxes" if boxes else "no_target"] += 1
                yield _sample(id, image, im["width"], im["height"], phrase, boxes, ref["split"], "grefcoco",
                              box_key="bboxes", ref_id=ref["ref_id"], image_id=ref["image_id"], ann_ids=ann_ids,
                              sent_id=sent["sent_id"])

    return write_samples(out, samples())


# --------------------------------------------------------------------------------------------
# Parquet with embedded images (lmms-lab/RefCOCO, RefCOCO+, RefCOCOg on the hub)

_PARQUET_REQUIRED = ("image", "bbox", "answer")
_PARQUET_OPTIONAL = ("question_id", "file_name", "split")
_EXTENSIONS = {"JPEG": "jpg", "MPO": "jpg", "TIFF": "tif"}  # otherwise the format's name, lower case


def _parquet_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.exists() and not path.is_dir():
        return [regular_file(path, "parquet file")]
    if not path.is_dir():
        raise DataError(f"{path}: no such parquet file or folder")
    files = [regular_file(f, "parquet file") for f in sorted(path.rglob("*.parquet"))]
    if not files:
        raise DataError(f"{path}: no .parquet files in this folder")
    return files


def _image_bytes(value, where: str) -> bytes:
    """HF datasets stores an Image feature as {"bytes", "path"}; plain binary columns hold bytes."""
    data = value.get("bytes") if isinstance(value, dict) else value
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise DataError(f"{where}: no embedded image bytes; convert a dataset saved with its images embedded")
    return bytes(data)


def _store_image(data: bytes, images_out: Path, seen: dict, where: str) -> tuple[Path, int, int]:
    """Write an embedded image once, named by its content hash; returns (file, width, height).
    RefCOCO has ~10 expressions per image, so hashing saves ~90% of the disk and the writes."""
    digest = hashlib.sha1(data).hexdigest()
    if digest not in seen:
        try:
            with Image.open(io.BytesIO(data)) as im:  # reads the header only
                (width, height), fmt = im.size, im.format
        except (OSError, SyntaxError, ValueError) as e:
            raise DataError(f"{where}: cannot read the embedded image ({e})") from None
        target = images_out / f"{digest[:16]}.{_EXTENSIONS.get(fmt, fmt.lower())}"
        if not target.exists():  # same name means same bytes: a re-run skips what is already there
            with atomic_write(target, "wb") as f:
                f.write(data)
        seen[digest] = (target, width, height)
    return seen[digest]


class RowBatches(NamedTuple):
    """The rows of one parquet file, or of one split of a ``datasets`` Dataset (data/hub.py), as
    pyarrow record batches for ``parquet_samples``."""

    name: str  # what a message names: the file, or hf:REPO:SPLIT
    stem: str  # the split when none is given ("val-00000-of-00002" -> "val"); the id of a row without question_id
    batches: Iterable[pa.RecordBatch]


def parquet_columns(names: Iterable[str], where) -> list[str]:
    """The columns the parquet converter reads of a table with ``names``; a DataError naming
    ``where`` (a file, or hf:REPO) when a required one is missing."""
    names = list(names)
    missing = [c for c in _PARQUET_REQUIRED if c not in names]
    if missing:
        raise DataError(f"{where}: no column {', '.join(missing)}; expected columns {', '.join(_PARQUET_REQUIRED)}")
    return [c for c in _PARQUET_REQUIRED + _PARQUET_OPTIONAL if c in names]


def parquet_samples(tables: Iterable[RowBatches], images_out: str | Path, out: str | Path | None,
                    split: str | None = None, total: int | None = None) -> Iterator[dict]:
    """THE row converter of ``convert_parquet`` and of ``hf:REPO:SPLIT`` data (data/hub.py): rows
    (image, bbox as xywh, answer = phrase or list of phrases) -> canonical records, one per phrase.

    Each distinct image is written once to ``images_out``. Image paths are written for the JSONL
    file ``out`` (module docstring); ``out=None`` writes them absolute. The split is ``split`` if
    given, else the row's ``split`` column, else the table's stem before the first '-'. The id is
    ``<question_id>-<phrase index>``; the source is "parquet". ``total`` rows, for the progress bar.
    """
    images_out = Path(images_out)
    seen: dict = {}

    def rows() -> Iterator[tuple[RowBatches, int, dict]]:
        for table in tables:
            row = 0
            for batch in table.batches:
                for record in batch.to_pylist():
                    yield table, row, record
                    row += 1

    for table, row, record in track(rows(), "parquet rows", total=total):
        where = f"{table.name}: row {row}"
        bbox = record["bbox"]
        if not isinstance(bbox, list) or len(bbox) != 4 or any(v is None for v in bbox):
            raise DataError(f"{where}: bbox {shown(bbox)} is not 4 numbers (x, y, width, height)")
        file, width, height = _store_image(_image_bytes(record["image"], where), images_out, seen, where)
        image = image_ref(file, out) if out is not None else os.path.abspath(file)
        answer = record["answer"]
        phrases = [answer] if isinstance(answer, str) else list(answer or [])
        qid = record.get("question_id")
        if qid is None:
            qid = f"{table.stem}-{row}"
        extras = {k: record[k] for k in ("question_id", "file_name") if record.get(k) is not None}
        for i, phrase in enumerate(phrases):
            if not phrase or not phrase.strip():
                continue  # an empty expression cannot be grounded; the index keeps later ids stable
            yield _sample(
                f"{qid}-{i}", image, width, height, phrase.strip(), xywh_to_xyxy(bbox),
                split or record.get("split") or table.stem.split("-")[0], "parquet", **extras,
            )


def convert_parquet(path: str | Path, images_out: str | Path, out: str | Path, split: str | None = None) -> int:
    """Parquet rows -> canonical JSONL by ``parquet_samples``, one line per phrase. Returns the
    lines written.

    ``path`` is one .parquet file or a folder searched for them (sorted). Row batches are streamed,
    so memory holds one batch, not the dataset. The split, when not given, comes from the row's
    ``split`` column or the file name ("val-00000-of-00002.parquet" -> "val").
    """
    files = {f: pq.ParquetFile(f) for f in _parquet_files(path)}
    columns = {f: parquet_columns(pf.schema_arrow.names, f) for f, pf in files.items()}
    # Small batches: a row carries a whole image, so 64 rows is already several MB.
    tables = (RowBatches(str(f), f.stem, pf.iter_batches(batch_size=64, columns=columns[f])) for f, pf in files.items())
    total = sum(pf.metadata.num_rows for pf in files.values())  # from the footers, no data read
    return write_samples(out, parquet_samples(tables, images_out, out, split, total))


# --------------------------------------------------------------------------------------------
# COCO detection annotations


def coco_annotations(data: dict, image_by_id: dict, names: dict, instances) -> dict:
    """Annotations by image id, in the file's order; one naming no image or category, or whose box
    is not 4 numbers, raises naming it (``instances``: the file, for the message). Also what
    ``refgen.from_coco`` reads detections with."""
    by_image: dict = defaultdict(list)
    for ann in data["annotations"]:
        where = f"{instances}: annotation {ann.get('id')}"
        if ann.get("image_id") not in image_by_id or ann.get("category_id") not in names:
            what = "image_id" if ann.get("image_id") not in image_by_id else "category_id"
            raise DataError(f"{where} names {what} {shown(ann.get(what))}, which this file does not define")
        if as_box(ann.get("bbox")) is None:
            raise DataError(f"{where}: bbox {shown(ann.get('bbox'))} is not 4 numbers (x, y, width, height)")
        by_image[ann["image_id"]].append(ann)
    return by_image


def convert_coco(instances: str | Path, images: str | Path, out: str | Path, split: str | None = None,
                 negatives: int = 0, seed: int = 0, one_per_box: bool = False,
                 counts: Counter | None = None) -> int:
    """COCO instances.json -> canonical JSONL, the category name as the phrase. Returns the lines
    written; ``counts`` (when given) receives how many lines have boxes (``with_boxes``) or none
    (``no_target``), how many (image, category) pairs were left out for a crowd box (``crowd``;
    with ``one_per_box``, crowd boxes skipped) and, with ``one_per_box``, how many lines name a
    category that repeats in their image (``repeated``).

    A phrase names a SET (design.md): "cup" means every cup of the image. So each (image,
    category) is one line with every box of the category in ``bboxes``, id
    ``coco-<split>-<image_id>-<category_id>``. A category with a crowd box (iscrowd=1) in the image
    is left out: the crowd holds an unknown number of them, so no list of boxes is the set.

    ``negatives`` adds up to that many lines per image with ``"bboxes": []`` for categories with
    no annotation in the image (same id form), drawn by a random stream of ``seed`` and the image
    id (the same seed writes the same bytes). It assumes the file labels every one of its
    categories in every image, as COCO does; for a data set that does not, "no box" is not
    "absent" and these lines are false.

    ``one_per_box`` writes the old form instead: one line per non-crowd box, id
    ``coco-<split>-<ann_id>``, ``bbox`` its box. It is ambiguous wherever a category repeats in an
    image (the phrase "cup" names both cups, the line one).

    ``split`` is recorded on every line; without it, the instances file name decides
    ("instances_val2017.json" -> "val2017"). Images come in the file's order, categories in its
    category list's order.
    """
    data, image_by_id = load_instances(instances)
    names = {c["id"]: c["name"] for c in data.get("categories", [])}
    split = split or Path(instances).stem.removeprefix("instances_")
    by_image = coco_annotations(data, image_by_id, names, instances)
    counts = counts if counts is not None else Counter()

    def samples() -> Iterator[dict]:
        for im in track(data["images"], "coco images"):
            anns = by_image.get(im["id"], [])
            image = image_ref(Path(images) / im["file_name"], out)
            common = (im["width"], im["height"])
            by_category: dict = {}
            for ann in anns:
                by_category.setdefault(ann["category_id"], []).append(ann)
            if one_per_box:
                for ann in anns:
                    if ann.get("iscrowd"):
                        counts["crowd"] += 1
                        continue
                    counts["repeated"] += len(by_category[ann["category_id"]]) > 1
                    counts["with_boxes"] += 1
                    yield _sample(
                        f"coco-{split}-{ann['id']}", image, *common, names[ann["category_id"]],
                        xywh_to_xyxy(ann["bbox"]), split, "coco",
                        ann_id=ann["id"], image_id=im["id"], category_id=ann["category_id"])
            else:
                for cid in (c for c in names if c in by_category):
                    group = by_category[cid]
                    if any(a.get("iscrowd") for a in group):
                        counts["crowd"] += 1
                        continue
                    counts["with_boxes"] += 1
                    yield _sample(
                        f"coco-{split}-{im['id']}-{cid}", image, *common, names[cid],
                        [xywh_to_xyxy(a["bbox"]) for a in group], split, "coco", box_key="bboxes",
                        image_id=im["id"], category_id=cid, ann_ids=[a["id"] for a in group])
            if negatives:
                absent = [c for c in names if c not in by_category]
                # a str seed is hashed with SHA-512: the same stream in every process and run
                rng = random.Random(f"{seed}:{im['id']}")
                chosen = set(rng.sample(absent, min(negatives, len(absent))))
                for cid in (c for c in absent if c in chosen):
                    counts["no_target"] += 1
                    yield _sample(f"coco-{split}-{im['id']}-{cid}", image, *common, names[cid], [], split, "coco",
                                  box_key="bboxes", image_id=im["id"], category_id=cid, ann_ids=[])

    return write_samples(out, samples())


# --------------------------------------------------------------------------------------------
# Canonical JSONL -> validated, normalised canonical JSONL


def _box(value) -> list[float] | None:
    """A box as four finite floats, or None when it is not one (JSON lists only)."""
    return as_box(value) if isinstance(value, list) else None


def convert_jsonl(path: str | Path, out: str | Path) -> int:
    """Canonical JSONL -> the same records validated and normalised. Returns the lines written.

    Fills ``width``/``height`` from the image header when missing, makes boxes floats, fills a
    missing ``id`` with ``<file stem>-<line>``, a missing ``split`` with the file stem (synth writes
    SPLIT.jsonl) and a missing ``source`` with "jsonl". ``bboxes`` must be a list of 4-number
    boxes; ``[]`` (a phrase with no target) is kept as it is. Image paths are read relative to
    ``path`` and written for ``out``. The first bad line raises, naming file and line.
    """
    path = jsonl_file(path)
    with open(path, "rb") as f:  # one quick pass buys the progress bar an ETA (by blocks: a line may be huge)
        total = sum(block.count(b"\n") for block in iter(lambda: f.read(2**20), b""))

    def fail(number: int, problem: str) -> NoReturn:
        raise DataError(f"{path}:{number}: {problem}; run `groundtune data check {path}` to see every problem")

    def samples() -> Iterator[dict]:
        for line in track(iter_jsonl(path), "jsonl lines", total=total):
            n, r = line.number, line.record
            if line.error:
                fail(n, line.error)
            missing = missing_fields(r, ("image", "phrase"))  # id and width/height are filled in
            if missing or not isinstance(r["phrase"], str) or not r["phrase"].strip():
                fail(n, f"no {(missing or ['phrase'])[0]}")
            problem = record_problem(r)
            if problem:
                fail(n, problem)
            if ("bbox" in r) == ("bboxes" in r):
                fail(n, "needs exactly one of bbox or bboxes")
            key = "bbox" if "bbox" in r else "bboxes"
            if key == "bbox":
                value = _box(r["bbox"])
                if value is None:
                    fail(n, f"bbox {shown(r['bbox'])} is not 4 numbers (x1, y1, x2, y2 in pixels)")
            else:  # a list of boxes; [] is a phrase with no target in the image
                if not isinstance(r["bboxes"], list):
                    fail(n, f"bboxes {shown(r['bboxes'])} is not a list of boxes ([] for a phrase with no target)")
                value = [_box(b) for b in r["bboxes"]]
                if None in value:
                    k = value.index(None)
                    fail(n, f"bboxes[{k}] {shown(r['bboxes'][k])} is not 4 numbers (x1, y1, x2, y2 in pixels)")
            image = image_path(r, path)
            if not image.is_file():
                fail(n, f"image file {image} not found")
            size = record_size(r)
            if any(key in r and missing_fields(r, (key,)) for key in ("width", "height")):
                fail(n, f"width/height {shown(r.get('width'))}/{shown(r.get('height'))} are not positive integers")
            width, height = size or (None, None)
            if size is None:
                try:
                    width, height = header_size(image)
                except DataError as e:
                    fail(n, f"{e} to fill in width/height")
            # Written out here rather than with _sample: a multi-target sample has bboxes in bbox's place.
            sample = {
                "id": str(r["id"]) if "id" in r else f"{path.stem}-{n}",
                "image": image_ref(image, out),
                "width": width,
                "height": height,
                "phrase": r["phrase"].strip(),
                key: value,
                "split": r.get("split", path.stem),
                "source": r.get("source", "jsonl"),
            }
            sample.update((k, v) for k, v in r.items() if k not in sample)
            yield sample

    return write_samples(out, samples())
