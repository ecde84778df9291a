"""Referring expressions from detection boxes: ``groundtune data refgen``.

Most data sets have detections (a box and a category per object), not referring expressions.
``data convert --from coco`` names each category's boxes together ("cup": every cup). This
module writes phrases that pick exactly one box of their image:

==========  ============================================================  ==============================
kind        phrases                                                       emitted when
==========  ============================================================  ==============================
category    "the laptop"                                                  the only box of its category
attribute   "the red cup"                                                 the only box of its category
                                                                          with that word, and every
                                                                          other one's words are known
extreme     "the leftmost cup", "the cup on the right", "the top cup"     it is clearly beyond every
                                                                          other cup towards that side
                                                                          (below), and it and one other
                                                                          are counted
ordinal     "the second cup from the left"                                3+ counted cups (it one), each
                                                                          clearly before or after it,
                                                                          uncounted ones clearly after
size        "the biggest cup"; among two: "the small cup",               its area is SIZE_RATIO x (or
            "the bigger of the two cups"                                  1 / SIZE_RATIO x) every other's
relation    "the cup left of the laptop", "the cup above the table",      the anchor is the only box of
            "the cup next to the laptop"                                  its category (or of its
                                                                          attribute); see below
==========  ============================================================  ==============================

... phrases that name exactly a set of 2+ boxes of one category (SET_KINDS; a record with
``bboxes`` and ``targets``), each of its boxes at least ``min_size``, no crowd box of the category:

=============  =========================================  ===========================================
kind           phrases                                    emitted when
=============  =========================================  ===========================================
set            "every cup", "all the cups"                2+ cups
set_attribute  "every red cup", "all the red cups"        2+ cups with the word, every cup's words
                                                          known
set_relation   "the cups left of the laptop",             2+ cups each clearly so (as a one-box
               "all the cups beside the laptop"           relation's target must be), every other
                                                          cup clearly not (the relation rules below)
=============  =========================================  ===========================================

... and phrases that name nothing (kind ``none``, ``"bboxes": []``, ``"targets": []``): "the dog"
for a category of the label set (the COCO file's category list, which COCO labels in every image)
with no box at all in the image, none of whose names shares a word with a name of anything there
(no "the dog" beside a hot dog). At most NONE_PER_IMAGE per image. Without a label set (``--from
jsonl``) there are none: a category with no box may just be unlabelled there.

Each box gets up to ``per_box`` phrases, each category's set up to ``per_box``; a kind's weight
chooses among the kinds that one box (or one set) can have, so the set kinds never crowd out a
box's phrases, and their amount is bounded by the categories that repeat.

A cup is "clearly beyond" another towards a side when both of its edges on that axis lie at least
``margin`` further that way than the other's (so a box holding another is never beyond it, at the
top or on the left, and a shift only of centres is not enough) and the boxes' overlap covers at most
MAX_COVERED of the smaller one (more, and a reader sees one heap, not two things side by side).
``margin`` is MARGIN_FRAC of the image's shorter side (at least 1 px).

A box under ``min_size`` (sqrt of its area, MIN_SIZE_PX by default) is never a target or an anchor.
One under ``min_size`` or MIN_SIZE_PX, whichever is larger, is "uncounted" for extremes and
ordinals: a reader may overlook it, or may count it. It never makes a position phrase possible
(an ordinal needs 3 counted cups, an extreme one counted other cup) nor gets one, and a position
phrase is written only when it is true either way: an uncounted cup that is not clearly beyond the
target the other way (it could be first, or shift the rank) means no phrase, rather than one true
only for the reader who did not see it. For every other kind an uncounted cup is another cup like
any other (a reader who sees it must not be misled).

Relations hold by a clear distance and no other box of the category nearly satisfies them:
"left of" needs the target wholly left of the anchor (x2 <= anchor x1) with its centre at least
``margin`` left of the anchor's, while every other cup's centre lies at least ``margin`` right of
the anchor's centre ("above"/"below" the same on y). "next to" needs the boxes side by side: apart
horizontally by a gap of at most NEAR_FRAC of the image's shorter side (touching counts,
overlapping does not), sharing at least BAND_SHARE of the shorter box's height (so a laptop standing
on a table is not "beside" it), and every other cup's gap (on either axis) above FAR_FRAC of that
side. A box whose category also has a crowd box in the image gets no phrase (the crowd holds an
unknown number of them).

An attribute word that would make a phrase read two ways is dropped from that image's boxes: a
position or size word of the templates ("top", "small": RESERVED_WORDS), or a word that with one
category's name spells another's ("teddy" on a bear beside a teddy bear).

Left/right words are exactly those ``augment.hflip`` swaps (left, right, leftmost, rightmost), so
a flipped sample's phrase stays true. Those words, the templates, the category names and the
numbers of "clearly" are the language, ``refexp.py``, which ``refcheck.py`` reads too; it
re-derives, with its own parser and geometry, whether each written phrase picks exactly its box (a
reading of "clearly" of its own whose bounds this module's rules stay inside); the records keep
every box of the image (``objects``, and ``target``: the index of the phrase's box, or
``targets``: the indices of its set) for it.

    groundtune data refgen --from coco --instances instances_val2017.json --images val2017 --out refs.jsonl
    groundtune data refgen --from jsonl --path shelves.jsonl --out refs.jsonl --kinds relation=2,extreme,size
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Iterator

from groundtune.boxes import as_box, box_area, box_centre, xywh_to_xyxy
from groundtune.errors import ConfigError, shown
from groundtune.files import path_problem
from groundtune.progress import track

from .images import header_size
from .records import MAX_PHRASE_CHARS, DataError, first_record, image_path, iter_jsonl, jsonl_file, record_size
from .refexp import (
    EXTREME_TEXTS,
    FAR_FRAC,
    MARGIN_FRAC,
    MIN_SIZE_PX,
    NEAR_FRAC,
    ORDINAL_WORDS,
    RELATION_TEXTS,
    RESERVED_WORDS,
    SET_ATTRIBUTE_TEXTS,
    SET_RELATION_TEXTS,
    SET_TEXTS,
    SIZE_RATIO,
    SYNONYMS,
    plural,
)
from .sources import coco_annotations, image_ref, load_instances

# Kinds of a phrase naming one box (a record with "bbox" and "target") ...
BOX_KINDS = ("category", "attribute", "extreme", "ordinal", "size", "relation")
# ... naming every box of a category (all of it, all with a word, all on one side of an anchor) ...
SET_KINDS = ("set", "set_attribute", "set_relation")
# ... and naming nothing in the image (a record with "bboxes": [] and "targets": [])
KINDS = BOX_KINDS + SET_KINDS + ("none",)
# An image gets at most this many no-target phrases. With the boxes' and sets' phrases that is about
# a tenth of what refgen writes (9% on the synthetic scenes of bench/refgen_proof.py --check), near
# gRefCOCO's own share (32k no-target expressions of 278k): enough to teach "[]", too few to teach
# a model that "[]" is a safe answer.
NONE_PER_IMAGE = 1

ATTRIBUTE_FIELD = "attributes"  # the annotation's field of a box's attribute words, unless the caller names another
# The longest label or attribute word taken: a phrase holds at most two of each and a few words
# around them, so every phrase stays within the limit every record's has (records.MAX_PHRASE_CHARS)
MAX_WORDS_CHARS = MAX_PHRASE_CHARS // 5

# What "clearly" means (MARGIN_FRAC, SIZE_RATIO, NEAR_FRAC, FAR_FRAC) and MIN_SIZE_PX belong to the
# language, refexp.py, which refcheck.py reads too. The two below are this generator's own rules,
# kept inside the checker's own reading of "clearly" (its MAX_IOU, EDGE_SHARE).

# Two boxes sharing more than half of the smaller one read as one heap (a cup mostly behind or in
# another): no "leftmost"/"second from the left" between them, however their edges lie. Half still
# allows two cups each half hidden by the other, which a reader tells apart.
MAX_COVERED = 0.5
# "next to"/"beside": side by side means in one horizontal band; sharing at least half of the
# shorter box's height excludes one box standing on the other (a laptop on a table shares none).
BAND_SHARE = 0.5
MODEL_FILTER_IOU = 0.5  # --filter-model: a phrase the model boxes back at this IoU or more is kept
SOURCE = "refgen"  # every record's source: what tells a file refgen wrote (``written_by_refgen``)


# --------------------------------------------------------------------------------------------
# Settings and input


@dataclass(frozen=True)
class RefgenSettings:
    """What ``generate`` emits; the ``data refgen`` flags of the same names."""

    kinds: dict[str, float] = field(default_factory=lambda: {k: 1.0 for k in KINDS})  # kind -> weight in the mix
    per_box: int = 3  # at most this many expressions per box
    min_size: float = MIN_SIZE_PX  # boxes with sqrt(area) below this (px) are never targets or anchors
    seed: int = 0  # same seed, same bytes

    def __post_init__(self) -> None:
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown or not self.kinds:
            raise ConfigError(f"--kinds: unknown kind(s) {', '.join(unknown) or '(none given)'}; "
                            f"choose from {', '.join(KINDS)}")
        bad = [k for k, w in self.kinds.items() if not (math.isfinite(w) and w > 0)]
        if bad:
            raise ConfigError(f"--kinds: the weight of {', '.join(bad)} must be a positive number")
        if self.per_box < 1:
            raise ConfigError(f"--per-box must be at least 1, got {self.per_box}")
        if not (math.isfinite(self.min_size) and self.min_size >= 0):
            raise ConfigError(f"--min-size must be a number of pixels >= 0, got {self.min_size}")


def parse_kinds(text: str) -> dict[str, float]:
    """``--kinds``: "relation=2,extreme,size" -> {"relation": 2.0, "extreme": 1.0, "size": 1.0}."""
    kinds = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition("=")
        try:
            kinds[name.strip()] = float(weight) if weight else 1.0
        except ValueError:
            raise ConfigError(f"--kinds: {shown(part)}: the weight after '=' must be a number") from None
    return kinds


@dataclass(frozen=True)
class Obj:
    """One detection: an xyxy box in original pixels, its category, its attribute words (None:
    not recorded, so any word may be true of it), whether it is a crowd box, and its source id."""

    box: tuple[float, float, float, float]
    label: str
    attributes: tuple[str, ...] | None = None
    crowd: bool = False
    ann_id: object = None

    @property
    def cx(self) -> float:
        return box_centre(self.box)[0]

    @property
    def cy(self) -> float:
        return box_centre(self.box)[1]

    @property
    def area(self) -> float:
        return box_area(self.box)

    def to_json(self) -> dict:
        out = {"bbox": list(self.box), "label": self.label}
        if self.attributes is not None:
            out["attributes"] = list(self.attributes)
        if self.crowd:
            out["crowd"] = True
        return out


@dataclass
class Detections:
    """Every box of one image, as written records name it (``image`` relative to the output)."""

    key: str  # the image's id in ids and in its random stream
    image: str
    width: int
    height: int
    split: str
    objects: list[Obj]
    extras: dict = field(default_factory=dict)  # passed into every record (image_id, ...)
    # The categories the source labels in EVERY image (a COCO file's category list): one of them with
    # no box here is absent, which a none phrase says. None: not known, so no none phrases.
    label_set: tuple[str, ...] | None = None


def _attributes(value, where: str) -> tuple[str, ...] | None:
    """A user's attribute field: a word, a list of words, or absent/null (not recorded)."""
    if value is None:
        return None
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise DataError(f"{where}: attributes {shown(value)} must be a string or a list of strings")
    if any(len(w) > MAX_WORDS_CHARS for w in words):
        raise DataError(f"{where}: attributes {shown(value, 40)} hold one longer than {MAX_WORDS_CHARS} characters; "
                        "an attribute is a word or two")
    # one lower-case spelling, so "Red" and "red " are the same word to every check
    return tuple(dict.fromkeys(" ".join(w.lower().split()) for w in words if w.strip()))


def _label(value, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: label {shown(value)} must be a non-empty string")
    if len(value) > MAX_WORDS_CHARS:  # every phrase holds it: it would be longer than a phrase may be
        raise DataError(f"{where}: label {shown(value, 40)} is longer than {MAX_WORDS_CHARS} characters; a label is "
                        "a category's name")
    return " ".join(value.lower().split())


def from_coco(instances: str | Path, images: str | Path, out: str | Path, split: str | None = None,
              attribute_field: str = ATTRIBUTE_FIELD) -> list[Detections]:
    """COCO instances.json -> one Detections per image that has annotations, in the file's image
    order. An annotation may carry ``attribute_field`` (a word or a list of words). The file's
    category list is the label set (COCO labels all its categories in every image): a category of
    it with no box in an image is absent there."""
    data, image_by_id = load_instances(instances)
    names = {c["id"]: c["name"] for c in data.get("categories", [])}
    split = split or Path(instances).stem.removeprefix("instances_")
    def detection(ann: dict) -> Obj:
        where = f"{instances}: annotation {ann.get('id')}"
        return Obj(tuple(xywh_to_xyxy(as_box(ann["bbox"]))), _label(names[ann["category_id"]], where),
                   _attributes(ann.get(attribute_field), where), bool(ann.get("iscrowd")), ann.get("id"))

    by_image = {image_id: [detection(ann) for ann in anns]
                for image_id, anns in coco_annotations(data, image_by_id, names, instances).items()}
    label_set = tuple(dict.fromkeys(_label(name, f"{instances}: categories") for name in names.values()))
    return [
        Detections(str(im["id"]), image_ref(Path(images) / im["file_name"], out), im["width"], im["height"],
                   split, by_image[im["id"]], {"image_id": im["id"]}, label_set)
        for im in data["images"] if by_image.get(im["id"])
    ]


def from_jsonl(path: str | Path, out: str | Path, attribute_field: str = ATTRIBUTE_FIELD) -> list[Detections]:
    """Canonical-style JSONL -> one Detections per image. Either form, per line:

    - every box of an image: ``bboxes`` with a ``labels`` list beside it (and, optionally, a list
      of attributes in ``attribute_field`` and ``crowd``: a list of booleans);
    - one box: ``bbox`` + ``label`` (+ ``attribute_field``, ``crowd``); lines naming the same
      ``image`` are one image.

    ``width``/``height`` are read from the image header when missing. The first bad line raises,
    naming file and line."""
    path = jsonl_file(path)
    images: dict[str, Detections] = {}
    for line in iter_jsonl(path):
        where = f"{path}:{line.number}"
        if line.error:
            raise DataError(f"{where}: {line.error}")
        r = line.record
        if not isinstance(r.get("image"), str) or not r["image"]:
            raise DataError(f"{where}: no image")
        problem = path_problem(r["image"])
        if problem:
            raise DataError(f"{where}: image {problem}")
        objects = _line_objects(r, where, attribute_field)
        key = r["image"]
        if key not in images:
            width, height = _size(r, image_path(r, path), where)
            # the image's id in record ids: its image_id, else its place in the file and its name
            name = str(r["image_id"]) if "image_id" in r else f"{len(images)}-{Path(key).stem}"
            extras = {"image_id": r["image_id"]} if "image_id" in r else {}
            images[key] = Detections(name, image_ref(image_path(r, path), out), width, height,
                                     str(r.get("split", path.stem)), [], extras)
        elif record_size(r) not in (None, (images[key].width, images[key].height)):
            raise DataError(f"{where}: width/height {r['width']}x{r.get('height')} differ from an earlier line "
                            f"of the same image ({images[key].width}x{images[key].height})")
        images[key].objects += objects
    return list(images.values())


def _line_objects(r: dict, where: str, attribute_field: str) -> list[Obj]:
    if "bboxes" in r:
        boxes, labels = r["bboxes"], r.get("labels")
        if not isinstance(boxes, list) or not isinstance(labels, list) or len(labels) != len(boxes):
            raise DataError(f"{where}: bboxes needs a labels list of the same length (one category per box)")
        attrs = r.get(attribute_field, [None] * len(boxes))
        crowd = r.get("crowd", [False] * len(boxes))
        if not isinstance(attrs, list) or len(attrs) != len(boxes):
            raise DataError(f"{where}: {attribute_field} must be a list with one entry per box (null: unknown)")
        if not isinstance(crowd, list) or len(crowd) != len(boxes):
            raise DataError(f"{where}: crowd must be a list with one boolean per box")
        rows = list(zip(boxes, labels, attrs, crowd))
    elif "bbox" in r:
        rows = [(r["bbox"], r.get("label"), r.get(attribute_field), r.get("crowd", r.get("iscrowd", False)))]
    else:
        raise DataError(f"{where}: needs bboxes + labels (every box of the image) or bbox + label (one box)")
    objects = []
    for box, label, attrs, crowd in rows:
        xyxy = as_box(box)
        if xyxy is None or xyxy[2] <= xyxy[0] or xyxy[3] <= xyxy[1]:
            raise DataError(f"{where}: box {shown(box)} is not [x1, y1, x2, y2] with x2 > x1 and y2 > y1")
        objects.append(Obj(tuple(xyxy), _label(label, where), _attributes(attrs, where), bool(crowd)))
    return objects


def _size(r: dict, image: Path, where: str) -> tuple[int, int]:
    size = record_size(r)
    if size is not None:
        return size
    try:
        return header_size(image)
    except DataError as e:
        raise DataError(f"{where}: no width/height, and {e}") from None


# --------------------------------------------------------------------------------------------
# Expressions


@dataclass(frozen=True)
class Candidate:
    """One way to name the target: ``meaning`` identifies it (two templates of one meaning are one
    candidate, its text chosen once), ``texts`` are its templates, "{n}" the target's name."""

    kind: str
    meaning: tuple
    texts: tuple[str, ...]
    targets: tuple[int, ...] = ()  # a set phrase's boxes (indices into the image's objects)


@dataclass
class Stats:
    """What ``generate`` did: per kind, per reason a box got nothing."""

    images: int = 0
    boxes: int = 0
    expressions: Counter = field(default_factory=Counter)  # kind -> written
    skipped: Counter = field(default_factory=Counter)  # reason -> boxes
    targets: int = 0  # boxes with at least one expression
    dropped_words: Counter = field(default_factory=Counter)  # attribute words that would read two ways

    def total(self) -> int:
        return sum(self.expressions.values())

    def to_dict(self) -> dict:
        return {"images": self.images, "boxes": self.boxes, "targets": self.targets,
                "expressions": dict(sorted(self.expressions.items())), "skipped": dict(sorted(self.skipped.items())),
                "attribute_words_dropped": dict(sorted(self.dropped_words.items()))}


SKIP_REASONS = {
    "crowd": "a crowd box (covers a group, not one object)",
    "too_small": "smaller than --min-size",
    "crowd_category": "its category has a crowd box in the image: how many there are is unknown",
    "no_unique_phrase": "no phrase of the chosen kinds picks it alone with a margin",
}


def _margin(d: Detections) -> float:
    return max(1.0, MARGIN_FRAC * min(d.width, d.height))


def _gap(a: Obj, b: Obj) -> float:
    """Distance between two boxes' edges along the axis they are most apart on; <= 0 when they
    overlap on both axes (then the larger overlap's negative)."""
    return max(b.box[0] - a.box[2], a.box[0] - b.box[2], b.box[1] - a.box[3], a.box[1] - b.box[3])


def _too_small(o: Obj, settings: RefgenSettings) -> bool:
    """Under --min-size: never a target or an anchor."""
    return math.sqrt(o.area) < settings.min_size


def _uncounted(o: Obj, settings: RefgenSettings) -> bool:
    """A box a reader may overlook when counting for an extreme or an ordinal: under --min-size, or
    under MIN_SIZE_PX even when --min-size is lower (a 5 px cup may be a target then, but a rank
    counted over it is true only for the reader who spotted it)."""
    return math.sqrt(o.area) < max(settings.min_size, MIN_SIZE_PX)


def _edges(o: Obj, side: str) -> tuple[float, float]:
    """The box's near and far edge on ``side``'s axis, as positions where smaller is further
    towards ``side``."""
    x1, y1, x2, y2 = o.box
    return {"left": (x1, x2), "right": (-x2, -x1), "top": (y1, y2), "bottom": (-y2, -y1)}[side]


def _covered(a: Obj, b: Obj) -> float:
    """The share of the smaller box that the two boxes' intersection covers (1: one holds the other)."""
    w = min(a.box[2], b.box[2]) - max(a.box[0], b.box[0])
    h = min(a.box[3], b.box[3]) - max(a.box[1], b.box[1])
    smaller = min(a.area, b.area)
    return max(0.0, w) * max(0.0, h) / smaller if smaller > 0 else 1.0


def _clearly_beyond(t: Obj, p: Obj, side: str, m: float) -> bool:
    """t reads as clearly further towards ``side`` than p: both its edges on that axis at least m
    further (centres alone would put a small cup inside a big one "at the top" of it) and the two
    not one heap (MAX_COVERED)."""
    (t_near, t_far), (p_near, p_far) = _edges(t, side), _edges(p, side)
    return t_near + m <= p_near and t_far + m <= p_far and _covered(t, p) <= MAX_COVERED


def _clearly_extreme(t: Obj, others: list[Obj], side: str, m: float, settings: RefgenSettings) -> bool:
    """"the leftmost cup": clearly beyond every other cup, counted or not (a reader who sees a tiny
    one further left would pick it), itself counted (a reader who overlooks it would pick the
    next), and at least one other counted (a tiny one alone would make "the leftmost" of a single
    visible cup)."""
    return (not _uncounted(t, settings) and any(not _uncounted(p, settings) for p in others)
            and all(_clearly_beyond(t, p, side, m) for p in others))


def _ordinal_rank(t: Obj, others: list[Obj], side: str, m: float, settings: RefgenSettings) -> int | None:
    """The rank of t from ``side`` among the counted cups, when every reader counts the same: t
    itself counted, each counted cup clearly before or after it, 3+ counted cups in all, and every
    uncounted cup clearly after it. An uncounted cup before it (or unclear) would make the rank
    depend on whether the reader saw it, so there is no rank rather than one true only for a
    reader who missed it."""
    counted = [p for p in others if not _uncounted(p, settings)]
    uncounted = [p for p in others if _uncounted(p, settings)]
    before = [p for p in counted if _clearly_beyond(p, t, side, m)]
    after = [p for p in counted if _clearly_beyond(t, p, side, m)]
    if (_uncounted(t, settings) or len(counted) + 1 < 3 or len(before) + len(after) < len(counted)
            or not all(_clearly_beyond(t, p, side, m) for p in uncounted)):
        return None
    return len(before) + 1


def _side_by_side(t: Obj, a: Obj, scale: float) -> bool:
    """"next to"/"beside": apart horizontally by a small gap (touching counts, overlapping does
    not) and in one horizontal band: sharing BAND_SHARE of the shorter box's height, so neither
    stands on the other nor sits inside it."""
    gap_x = max(a.box[0] - t.box[2], t.box[0] - a.box[2])
    shared_y = min(t.box[3], a.box[3]) - max(t.box[1], a.box[1])
    shorter = min(t.box[3] - t.box[1], a.box[3] - a.box[1])
    return 0 <= gap_x <= NEAR_FRAC * scale and shared_y >= BAND_SHARE * shorter


def _names(label: str, present: set[str]) -> tuple[str, ...]:
    """How to say ``label`` in an image holding ``present`` categories: never by a name that one of
    them is also called (a user's "table" beside COCO's "dining table"). None left: it cannot be
    named alone, and gets no phrase."""
    others = {n for other in present - {label} for n in (other, *SYNONYMS.get(other, ()))}
    return tuple(n for n in SYNONYMS.get(label, (label,)) if n not in others)


def _describe_unique(i: int, d: Detections) -> list[tuple]:
    """How to name box i alone by category or attribute: [("category",), ("attribute", word), ...]."""
    o = d.objects[i]
    others = [p for j, p in enumerate(d.objects) if j != i and p.label == o.label]
    out = [] if others else [("category",)]
    if o.attributes and all(p.attributes is not None for p in others):
        out += [("attribute", a) for a in o.attributes if all(a not in p.attributes for p in others)]
    return out


def candidates(i: int, d: Detections, settings: RefgenSettings) -> list[Candidate]:
    """Every phrase that picks box i of ``d`` alone, by the rules of the module docstring."""
    t, m = d.objects[i], _margin(d)
    if not _names(t.label, {o.label for o in d.objects}):
        return []
    others = [p for j, p in enumerate(d.objects) if j != i and p.label == t.label]
    group = [t] + others
    out = [Candidate(k[0], k, ("the {n}",) if k[0] == "category" else (f"the {k[1]} {{n}}",))
           for k in _describe_unique(i, d)]
    for side in EXTREME_TEXTS:
        if _clearly_extreme(t, others, side, m, settings):
            out.append(Candidate("extreme", ("extreme", side), EXTREME_TEXTS[side]))
    for side in EXTREME_TEXTS:
        rank = _ordinal_rank(t, others, side, m, settings)
        if rank in ORDINAL_WORDS:
            out.append(Candidate("ordinal", ("ordinal", side, rank),
                                 (f"the {ORDINAL_WORDS[rank]} {{n}} from the {side}",)))
    if others and all(t.area >= SIZE_RATIO * p.area for p in others):
        two = len(group) == 2
        texts = ("the big {n}", "the bigger of the two {ns}") if two else ("the biggest {n}", "the largest {n}")
        out.append(Candidate("size", ("size", "big"), texts))
    if others and all(p.area >= SIZE_RATIO * t.area for p in others):
        texts = ("the small {n}", "the smaller of the two {ns}") if len(group) == 2 else ("the smallest {n}",)
        out.append(Candidate("size", ("size", "small"), texts))
    out += _relations(i, d, settings, m)
    return out


def _relation_rules(d: Detections, m: float) -> tuple[dict, dict]:
    """(holds, clearly_not): per relation, whether a box o is clearly so of the anchor a, and
    whether it is clearly not so, not even nearly (every box of the category the phrase leaves out
    must be)."""
    scale = min(d.width, d.height)
    holds = {
        "left of": lambda o, a: o.box[2] <= a.box[0] and o.cx + m <= a.cx,
        "right of": lambda o, a: o.box[0] >= a.box[2] and a.cx + m <= o.cx,
        "above": lambda o, a: o.box[3] <= a.box[1] and o.cy + m <= a.cy,
        "below": lambda o, a: o.box[1] >= a.box[3] and a.cy + m <= o.cy,
        "next to": lambda o, a: _side_by_side(o, a, scale),
    }
    clearly_not = {
        "left of": lambda o, a: a.cx + m <= o.cx,
        "right of": lambda o, a: o.cx + m <= a.cx,
        "above": lambda o, a: a.cy + m <= o.cy,
        "below": lambda o, a: o.cy + m <= a.cy,
        "next to": lambda o, a: _gap(o, a) > FAR_FRAC * scale,
    }
    return holds, clearly_not


def _anchors(label: str, d: Detections, settings: RefgenSettings) -> Iterator[tuple[int, tuple]]:
    """(j, how) for each box j that can anchor a relation of a ``label`` box, and each way to name
    it alone: another category's box, no crowd box nor of a crowded category, not under --min-size."""
    crowded = {o.label for o in d.objects if o.crowd}
    present = {o.label for o in d.objects}
    for j, a in enumerate(d.objects):
        if (a.label == label or a.crowd or a.label in crowded or _too_small(a, settings)
                or not _names(a.label, present)):
            continue
        for how in _describe_unique(j, d):
            yield j, how


def _relations(i: int, d: Detections, settings: RefgenSettings, m: float) -> list[Candidate]:
    t = d.objects[i]
    others = [p for j, p in enumerate(d.objects) if j != i and p.label == t.label]
    holds, clearly_not = _relation_rules(d, m)
    out = []
    for j, how in _anchors(t.label, d, settings):
        a = d.objects[j]
        for rel, ok in holds.items():
            if ok(t, a) and all(clearly_not[rel](p, a) for p in others):
                out.append(Candidate("relation", ("relation", rel, j, *how), RELATION_TEXTS[rel]))
    return out


def set_candidates(label: str, d: Detections, settings: RefgenSettings) -> list[Candidate]:
    """Every phrase that names exactly a set of 2+ boxes of ``label``, each of them at least
    --min-size: every one ("every cup"), every one with a word ("all the red cups": every box's
    words known), every one clearly on one side of an anchor with every other clearly not ("the
    cups left of the laptop", by the relation rules). None when the category has a crowd box (how
    many it holds is unknown) or cannot be named in this image."""
    group = [i for i, o in enumerate(d.objects) if o.label == label]
    if any(d.objects[i].crowd for i in group) or not _names(label, {o.label for o in d.objects}):
        return []

    def nameable(members) -> bool:
        return len(members) >= 2 and not any(_too_small(d.objects[i], settings) for i in members)

    out = [Candidate("set", ("set",), SET_TEXTS, tuple(group))] if nameable(group) else []
    if all(d.objects[i].attributes is not None for i in group):
        for word in dict.fromkeys(w for i in group for w in d.objects[i].attributes):
            members = tuple(i for i in group if word in d.objects[i].attributes)
            if nameable(members):
                texts = tuple(t.format(w=word) for t in SET_ATTRIBUTE_TEXTS)
                out.append(Candidate("set_attribute", ("set_attribute", word), texts, members))
    holds, clearly_not = _relation_rules(d, _margin(d))
    for j, how in _anchors(label, d, settings):
        a = d.objects[j]
        for rel in holds:
            members = tuple(i for i in group if holds[rel](d.objects[i], a))
            if nameable(members) and all(clearly_not[rel](d.objects[i], a) for i in group if i not in members):
                out.append(Candidate("set_relation", ("set_relation", rel, j, *how), SET_RELATION_TEXTS[rel],
                                     members))
    return out


def _words(label: str) -> set[str]:
    return {w for name in (label, *SYNONYMS.get(label, ())) for w in name.split()}


def none_candidates(d: Detections) -> list[Candidate]:
    """"the dog" where there is surely none: a category of the label set with no box in the image
    (not even a crowd or a tiny one), none of whose names shares a word with a name of anything in
    the image (no "the dog" beside a hot dog, no "the bear" beside a teddy bear). None without a
    label set: a category with no box may then just be unlabelled."""
    if d.label_set is None:
        return []
    present = {o.label for o in d.objects}
    words = {w for label in present for w in _words(label)}
    return [Candidate("none", ("none", label), ("the {n}",)) for label in d.label_set
            if label not in present and not _words(label) & words]


def _say(c: Candidate, label: str, d: Detections, rng: random.Random) -> str:
    """The phrase of candidate ``c`` for a box (or the boxes) of ``label``."""
    present = {o.label for o in d.objects}
    name = rng.choice(_names(label, present))
    texts = c.texts
    if plural(name) == name:  # "the sheep left of the laptop" would also read as one sheep
        texts = tuple(t for t in texts if not t.startswith("the {ns}")) or texts
    text = rng.choice(texts)
    anchor = ""
    if c.kind in ("relation", "set_relation"):
        j, how = c.meaning[2], c.meaning[3:]
        anchor_name = rng.choice(_names(d.objects[j].label, present))
        anchor = f"the {anchor_name}" if how[0] == "category" else f"the {how[1]} {anchor_name}"
    return text.format(n=name, ns=plural(name), a=anchor)


def _choose(cands: list[Candidate], settings: RefgenSettings, rng: random.Random, limit: int) -> list[Candidate]:
    """Up to ``limit`` candidates: a kind drawn by its weight among the kinds that have one left,
    then one of that kind's candidates; never the same meaning twice."""
    by_kind: dict[str, list[Candidate]] = defaultdict(list)
    for c in cands:
        if c.kind in settings.kinds:
            by_kind[c.kind].append(c)
    chosen = []
    while by_kind and len(chosen) < limit:
        kinds = sorted(by_kind)  # sorted: the draw must not depend on the order candidates came in
        kind = rng.choices(kinds, weights=[settings.kinds[k] for k in kinds])[0]
        pool = by_kind[kind]
        chosen.append(pool.pop(rng.randrange(len(pool))))
        if not pool:
            del by_kind[kind]
    return chosen


def _skip_reason(o: Obj, d: Detections, settings: RefgenSettings) -> str | None:
    if o.crowd:
        return "crowd"
    if _too_small(o, settings):
        return "too_small"
    if any(p.crowd and p.label == o.label for p in d.objects):
        return "crowd_category"
    return None


def _without_ambiguous_words(d: Detections, stats: Stats) -> Detections:
    """``d`` without the attribute words that would make a phrase read two ways: RESERVED_WORDS
    ("the top cup"), and a word that with one category's name spells another's ("teddy" on a bear
    beside a teddy bear). The records keep the rest, so the checker sees what the phrases used."""
    names = {n for o in d.objects for n in (o.label, *SYNONYMS.get(o.label, ()))}
    spelled = {n.split(" ", 1)[0] for n in names if " " in n and n.split(" ", 1)[1] in names}
    objects = []
    for o in d.objects:
        dropped = [w for w in o.attributes or () if w in RESERVED_WORDS or w in spelled]
        if dropped:
            stats.dropped_words.update(dropped)
            o = replace(o, attributes=tuple(w for w in o.attributes if w not in dropped))
        objects.append(o)
    return replace(d, objects=objects)


def generate(images: Iterable[Detections], settings: RefgenSettings = RefgenSettings(),
             stats: Stats | None = None, progress: bool = True) -> Iterator[dict]:
    """Canonical records (``source: refgen``), image by image: each box's phrases (up to
    ``per_box``, a ``bbox`` and its ``target`` index), then each category's set phrases (up to
    ``per_box`` per category, ``bboxes`` and their ``targets`` indices), then up to NONE_PER_IMAGE
    none phrases (``"bboxes": []``, ``"targets": []``). Each image draws from its own random stream
    (the seed and the image's key), so the output is a function of the seed and the input alone."""
    stats = stats if stats is not None else Stats()
    images = list(images)
    for d in track(images, "refgen images") if progress else images:
        stats.images += 1
        d = _without_ambiguous_words(d, stats)
        rng = random.Random(f"{settings.seed}:{d.key}")  # a str seed is hashed with SHA-512: the same in every process
        objects = [o.to_json() for o in d.objects]
        base = {"image": d.image, "width": d.width, "height": d.height}

        def box_id(i: int):
            return d.objects[i].ann_id if d.objects[i].ann_id is not None else i

        def set_record(id: str, c: Candidate, label: str) -> dict:
            stats.expressions[c.kind] += 1
            ann_ids = [d.objects[i].ann_id for i in c.targets]
            return {"id": id, **base, "phrase": _say(c, label, d, rng), "bboxes": [list(d.objects[i].box) for i in c.targets],
                    "split": d.split, "source": SOURCE, "kind": c.kind, "label": label, **d.extras,
                    **({"ann_ids": ann_ids} if c.targets and None not in ann_ids else {}),
                    "targets": list(c.targets), "objects": objects}

        for i, o in enumerate(d.objects):
            stats.boxes += 1
            reason = _skip_reason(o, d, settings)
            chosen = [] if reason else _choose(candidates(i, d, settings), settings, rng, settings.per_box)
            if not chosen:
                stats.skipped[reason or "no_unique_phrase"] += 1
                continue
            stats.targets += 1
            for k, c in enumerate(chosen):
                stats.expressions[c.kind] += 1
                yield {
                    "id": f"refgen-{d.split}-{d.key}-{box_id(i)}-{k}", **base,
                    "phrase": _say(c, o.label, d, rng), "bbox": list(o.box),
                    "split": d.split, "source": SOURCE, "kind": c.kind, "label": o.label,
                    **d.extras, **({"ann_id": o.ann_id} if o.ann_id is not None else {}),
                    "target": i, "objects": objects,
                }
        if any(k in settings.kinds for k in SET_KINDS):
            for label in dict.fromkeys(o.label for o in d.objects):  # categories in the order of their first box
                first = next(i for i, o in enumerate(d.objects) if o.label == label)
                for k, c in enumerate(_choose(set_candidates(label, d, settings), settings, rng, settings.per_box)):
                    yield set_record(f"refgen-{d.split}-{d.key}-set-{box_id(first)}-{k}", c, label)
        for k, c in enumerate(_choose(none_candidates(d), settings, rng, NONE_PER_IMAGE)):
            yield set_record(f"refgen-{d.split}-{d.key}-none-{k}", c, c.meaning[1])


def written_by_refgen(path: Path) -> bool:
    """Whether ``path`` holds what `data refgen` wrote (its first record's source is SOURCE): the
    next refgen may replace it without --overwrite."""
    first = first_record(path)
    return first is not None and first.get("source") == SOURCE


def format_stats(stats: Stats) -> str:
    """The ``--stats`` table: expressions per kind, boxes skipped per reason."""
    lines = [f"{stats.images} images, {stats.boxes} boxes, {stats.targets} with an expression, "
             f"{stats.total()} expressions"]
    lines += [f"  {kind:<13} {stats.expressions.get(kind, 0):>8}" for kind in KINDS]
    if stats.skipped:
        lines.append("boxes skipped:")
        lines += [f"  {reason:<17} {n:>8}  {SKIP_REASONS.get(reason, '')}" for reason, n in sorted(stats.skipped.items())]
    if stats.dropped_words:
        words = ", ".join(f"{w} ({n})" for w, n in sorted(stats.dropped_words.items()))
        lines.append(f"attribute words dropped (a phrase with them would read two ways): {words}")
    return "\n".join(lines)
