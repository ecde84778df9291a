"""Does each written phrase pick exactly its box? The check of ``data refgen``'s output that does
not trust the generator: ``groundtune data check --refs FILE`` and the tests.

It reads the phrase TEXT back with its own grammar (category, attribute, extreme, ordinal, size,
relation and anchor) and evaluates that reading against every box of the image the record keeps
(``objects``, ``target`` = the index of the phrase's box) with its own geometry. It shares with
data/refgen.py only the definition of the language, and reads it from data/refexp.py, never from
refgen.py: the category names (SYNONYMS, PLURALS), the four numbers that say what "clearly" means
(MARGIN_FRAC, SIZE_RATIO, NEAR_FRAC, FAR_FRAC) and the size under which a reader may overlook a box
(MIN_SIZE_PX); no function of the generator is called.
What makes two boxes clearly apart it measures its own way (MAX_IOU, EDGE_SHARE below, the band of
"next to"), on other quantities than the generator's, so a slip in either rule shows as a
disagreement; the generator's bounds lie inside these, so its phrases never sit on their edge.

A reading gives the boxes the phrase surely names and those it may name (a reader could take it
so). The phrase is right when both are exactly its set: the record's ``target`` (one box), or its
``targets`` (a set, written with ``bboxes``; ``[]`` for a phrase naming nothing). With m = max(1 px, MARGIN_FRAC x the
shorter image side), s = the shorter side, a cup's "group" = every box its name can mean (a crowd
box of that category may always be meant: it holds an unknown number of them), and cup A "clearly
left of" cup B = A's centre >= m left of B's, A's left edge >= EDGE_SHARE x m left of B's left edge
and B's right edge the same right of A's (neither holds the other across), and IoU(A, B) <= MAX_IOU
(not one heap); right/top/bottom alike:

===================================  ===================================  ===========================
phrase                               surely                               may mean
===================================  ===================================  ===========================
the cup                              every cup                            every cup
the red cup                          cups whose words include red         ... and cups without words
the leftmost cup / cup on the left   a cup clearly left of every other    a cup no other counted cup
  (right/top/bottom alike)                                                is clearly left of
the second cup from the left         exactly 1 counted cup clearly left   it could be second if the
                                     of it, the other counted cups        unclear ones fall either
                                     clearly right of it, and every cup   way and the small ones are
                                     under MIN_SIZE_PX clearly right      counted or not
the biggest / smallest cup           area >= SIZE_RATIO x every other's   no other clearly bigger
the big / small cup, the bigger of   as biggest/smallest, and only when   (smaller)
  the two cups                       the image holds exactly two cups
the cup left of the laptop           wholly left (x2 <= laptop x1) and    centre < laptop centre + m
  (right of / above / below,         centre >= m left of the laptop's
  to the left of, under)
the cup next to / beside the laptop  a horizontal gap of 0..NEAR_FRAC x   edge gap <= FAR_FRAC x s
                                     s, and the shorter box's middle
                                     (y) within the taller's height
every cup / all (the) cups           as "the cup"                         as "the cup"
every red cup / all (the) red cups   as "the red cup"                     as "the red cup"
(all) the cups left of the laptop    as "the cup left of the laptop"      as "the cup left of ..."
the dog, with no dog in the image    nothing                              a box whose name shares a
                                                                          word ("the hot dog")
===================================  ===================================  ===========================

The forms of the first part ("the cup ...") are said of one box: a record whose set has two or
more boxes is refused for them, whatever they name (``wrong_box``).

A "counted" cup is one of at least MIN_SIZE_PX (sqrt of its area): a smaller one a reader may or may
not count, so an extreme or an ordinal names its box surely only when it is the same either way.

The anchor ("the laptop", "the red laptop") must itself be surely and only one box. The
vocabulary is the categories of the image's boxes and the record's ``label`` (a none record's
category has no box). Verdicts: ``ok``; ``wrong_box`` (the phrase does not clearly name every box
of its set, or surely names a box where the record says none); ``second_box`` (it names its set
and, possibly or surely, another box); ``unparsed`` (outside the grammar); ``bad_record`` (no
usable ``objects`` and ``target``/``targets``, or ``bbox``/``bboxes`` not those objects' boxes).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from groundtune.boxes import as_box
from groundtune.errors import shown
from groundtune.progress import track

from .records import iter_jsonl, write_samples
from .refexp import (
    FAR_FRAC,
    MARGIN_FRAC,
    MIN_SIZE_PX,
    NEAR_FRAC,
    PLURALS,
    SIZE_RATIO,
    SYNONYMS,
)

VERDICTS = ("ok", "wrong_box", "second_box", "unparsed", "bad_record")

# The checker's own reading of "clearly apart" for extremes and ordinals (refgen measures the
# share of the smaller box covered instead). Two equal cups overlapping 80% (IoU 0.67) read as one
# heap; two each half hidden by the other (IoU 1/3, refgen's bound) a reader still tells apart.
MAX_IOU = 0.4
# Besides the centres m apart, the matching ends of the two boxes at least this share of m apart: a
# small cup inside a big one, or out of it by a few px, is never "at the top" or "on the left" of it.
EDGE_SHARE = 0.5


@dataclass(frozen=True)
class _Box:
    x1: float
    y1: float
    x2: float
    y2: float
    label: str
    words: frozenset | None  # attribute words; None: not recorded
    crowd: bool

    @property
    def cx(self) -> float:
        return (self.x1 + self.x2) / 2

    @property
    def cy(self) -> float:
        return (self.y1 + self.y2) / 2

    @property
    def area(self) -> float:
        return max(0.0, self.x2 - self.x1) * max(0.0, self.y2 - self.y1)


@dataclass(frozen=True)
class Verdict:
    verdict: str
    reason: str = ""
    sure: tuple[int, ...] = ()  # the boxes the phrase surely names
    maybe: tuple[int, ...] = ()  # ... and those it may name

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"


# --------------------------------------------------------------------------------------------
# Reading the text


def _spoken(label: str) -> set[str]:
    return {label, *SYNONYMS.get(label, ())}


def _plurals(name: str) -> set[str]:
    if name in PLURALS:
        return {PLURALS[name]}
    # any regular spelling reads back; which one is English is the writer's business
    return {name + "s", name + "es", name[:-1] + "ies"}


def _alternation(words) -> str:
    # longest first, so "teddy bear" is tried before "bear"
    return "|".join(re.escape(w) for w in sorted(words, key=lambda w: (-len(w), w)))


_SIDE = {"leftmost": "left", "rightmost": "right", "top": "top", "bottom": "bottom",
         "on the left": "left", "on the right": "right", "at the top": "top", "at the bottom": "bottom"}
_ORDINAL = {"second": 2, "third": 3, "fourth": 4, "fifth": 5}
_REL = {"left of": "left of", "to the left of": "left of", "right of": "right of",
        "to the right of": "right of", "above": "above", "below": "below", "under": "below",
        "next to": "next to", "beside": "next to"}


def _grammar(names: set[str], plurals: set[str], words: set[str]) -> list[tuple[str, bool, re.Pattern]]:
    """(form, said of one box?, pattern). The set forms ("every cup", "all the red cups", "the cups
    left of the laptop") are read as the category, attribute and relation forms are, but of any
    number of boxes; the others name one box."""
    n = f"(?P<n>{_alternation(names)})"
    ns = f"(?P<ns>{_alternation(plurals)})"
    anchor = (f"(?:(?P<aa>{_alternation(words)}) )?" if words else "") + f"(?P<an>{_alternation(names)})"
    rel = rf"(?P<rel>{_alternation(_REL)}) the {anchor}"
    forms = [
        ("category", True, rf"the {n}"),
        ("extreme", True, rf"the (?P<side>leftmost|rightmost|top|bottom) {n}"),
        ("extreme", True, rf"the {n} (?P<side>on the left|on the right|at the top|at the bottom)"),
        ("ordinal", True, rf"the (?P<ord>second|third|fourth|fifth) {n} from the (?P<from>left|right|top|bottom)"),
        ("size", True, rf"the (?P<size>biggest|largest|smallest) {n}"),
        ("size_of_two", True, rf"the (?P<size>big|large|small) {n}"),
        ("size_of_two", True, rf"the (?P<size>bigger|smaller) of the two {ns}"),
        ("relation", True, rf"the {n} {rel}"),
        ("category", False, rf"every {n}"),
        ("category", False, rf"all (?:the )?{ns}"),
        ("relation", False, rf"(?:all )?the {ns} {rel}"),
        ("relation", False, rf"every {n} {rel}"),
    ]
    if words:
        a = f"(?P<a>{_alternation(words)})"
        forms += [("attribute", True, rf"the {a} {n}"), ("attribute", False, rf"every {a} {n}"),
                  ("attribute", False, rf"all (?:the )?{a} {ns}")]
    return [(form, one, re.compile(pattern)) for form, one, pattern in forms]


def parse(phrase: str, boxes: list[_Box], also: str | None = None) -> list[dict]:
    """Every reading of the phrase in this image's vocabulary (its boxes' categories, and ``also``:
    the category a no-target record says it names): [{"form", "one", "labels", ...}], ``one`` when
    the form is said of one box. More than one reading when the words allow it ("top" is also an
    attribute word here)."""
    text = " ".join(phrase.lower().split())
    meaning: dict[str, set[str]] = {}  # a spoken name -> the categories it can mean
    plural_of: dict[str, set[str]] = {}
    for label in {b.label for b in boxes} | ({also} if also else set()):
        for name in _spoken(label):
            meaning.setdefault(name, set()).add(label)
            for p in _plurals(name):
                plural_of.setdefault(p, set()).add(label)
    words = {w for b in boxes if b.words for w in b.words}
    readings = []
    for form, one, pattern in _grammar(set(meaning), set(plural_of), words):
        m = pattern.fullmatch(text)
        if not m:
            continue
        g = m.groupdict()
        reading = {"form": form, "one": one, "labels": meaning[g["n"]] if g.get("n") else plural_of[g["ns"]]}
        if form == "attribute":
            reading["word"] = g["a"]
        elif form == "extreme":
            reading["side"] = _SIDE[g["side"]]
        elif form == "ordinal":
            reading.update(rank=_ORDINAL[g["ord"]], side=g["from"])
        elif form in ("size", "size_of_two"):
            reading["big"] = g["size"] in ("biggest", "largest", "big", "large", "bigger")
        elif form == "relation":
            reading.update(rel=_REL[g["rel"]], anchor_labels=meaning[g["an"]], anchor_word=g.get("aa"))
        readings.append(reading)
    return readings


# --------------------------------------------------------------------------------------------
# Evaluating a reading


def _position(side: str):
    """Smaller is further towards ``side``."""
    return {"left": lambda b: b.cx, "right": lambda b: -b.cx, "top": lambda b: b.cy, "bottom": lambda b: -b.cy}[side]


def _iou(a: _Box, b: _Box) -> float:
    inter = max(0.0, min(a.x2, b.x2) - max(a.x1, b.x1)) * max(0.0, min(a.y2, b.y2) - max(a.y1, b.y1))
    union = a.area + b.area - inter
    return inter / union if union > 0 else 1.0


def _ends(b: _Box, side: str) -> tuple[float, float]:
    """(b's end towards ``side``, its end away from it), signed so that smaller is further that way."""
    return {"left": (b.x1, b.x2), "right": (-b.x2, -b.x1), "top": (b.y1, b.y2), "bottom": (-b.y2, -b.y1)}[side]


def _clearly_toward(b: _Box, o: _Box, side: str, m: float) -> bool:
    """b is clearly further towards ``side`` than o: its centre m past o's, each of its ends at least
    EDGE_SHARE x m past o's matching end (b sticks out of o on that side, o out of b on the other),
    and IoU at most MAX_IOU."""
    pos = _position(side)
    (b_near, b_far), (o_near, o_far) = _ends(b, side), _ends(o, side)
    ends_apart = b_near + EDGE_SHARE * m <= o_near and b_far + EDGE_SHARE * m <= o_far
    return pos(b) + m <= pos(o) and ends_apart and _iou(b, o) <= MAX_IOU


def _beside(b: _Box, a: _Box, s: float) -> bool:
    """b next to a: a horizontal gap of 0..NEAR_FRAC x s, and in one band: the shorter box's
    vertical middle within the taller's height (a laptop standing on a table has its middle above
    the table's top)."""
    gap_x = max(a.x1 - b.x2, b.x1 - a.x2)
    short, tall = sorted((b, a), key=lambda k: k.y2 - k.y1)
    return 0 <= gap_x <= NEAR_FRAC * s and tall.y1 <= short.cy <= tall.y2


def _edge_gap(a: _Box, b: _Box) -> float:
    dx = max(b.x1 - a.x2, a.x1 - b.x2)
    dy = max(b.y1 - a.y2, a.y1 - b.y2)
    return max(dx, dy)


def _named(boxes: list[_Box], labels: set[str], word: str | None) -> tuple[set[int], set[int]]:
    """(surely, maybe) for "the [word] name"."""
    group = [i for i, b in enumerate(boxes) if b.label in labels]
    if word is None:
        sure = {i for i in group if not boxes[i].crowd}
        return sure, set(group)
    sure = {i for i in group if not boxes[i].crowd and boxes[i].words is not None and word in boxes[i].words}
    maybe = sure | {i for i in group if boxes[i].crowd or boxes[i].words is None}
    return sure, maybe


def evaluate(reading: dict, boxes: list[_Box], width: float, height: float) -> tuple[set[int], set[int], str]:
    """(surely, maybe, why) of one reading against every box."""
    m = max(1.0, MARGIN_FRAC * min(width, height))
    s = min(width, height)
    form = reading["form"]
    group = [i for i, b in enumerate(boxes) if b.label in reading["labels"]]
    if not group:
        # Nothing of that name here: the phrase names nothing, though a reader looking for it may
        # settle on a thing whose name shares a word with it ("the dog": the hot dog).
        words = {w for label in reading["labels"] for name in _spoken(label) for w in name.split()}
        similar = {i for i, b in enumerate(boxes) if words & {w for name in _spoken(b.label) for w in name.split()}}
        return set(), similar, "nothing of that name here, but something named alike" if similar else ""
    crowds = {i for i in group if boxes[i].crowd}
    people = [i for i in group if not boxes[i].crowd]
    if form in ("category", "attribute"):
        sure, maybe = _named(boxes, reading["labels"], reading.get("word"))
        return sure, maybe, ""
    if form == "relation":
        a_sure, a_maybe = _named(boxes, reading["anchor_labels"], reading["anchor_word"])
        if len(a_sure) != 1 or a_maybe != a_sure:
            return set(), set(group), "the anchor is not one box"
        (k,) = a_sure
        a = boxes[k]
        cands = [i for i in people if i != k]
        rel = reading["rel"]
        if rel == "next to":
            sure = {i for i in cands if _beside(boxes[i], a, s)}
            maybe = {i for i in cands if _edge_gap(boxes[i], a) <= FAR_FRAC * s}
        else:
            # (clearly on that side, may be read as on that side), each written out: the same
            # comparisons in the same arithmetic as the rules state them, no sign tricks
            tests = {
                "left of": (lambda b: b.x2 <= a.x1 and b.cx + m <= a.cx, lambda b: not a.cx + m <= b.cx),
                "right of": (lambda b: b.x1 >= a.x2 and a.cx + m <= b.cx, lambda b: not b.cx + m <= a.cx),
                "above": (lambda b: b.y2 <= a.y1 and b.cy + m <= a.cy, lambda b: not a.cy + m <= b.cy),
                "below": (lambda b: b.y1 >= a.y2 and a.cy + m <= b.cy, lambda b: not b.cy + m <= a.cy),
            }
            clearly, possibly = tests[rel]
            sure = {i for i in cands if clearly(boxes[i])}
            maybe = {i for i in cands if possibly(boxes[i])}
        return sure, maybe | crowds, ""
    counted = {i for i in people if boxes[i].area >= MIN_SIZE_PX ** 2}
    if form == "extreme":
        side = reading["side"]

        def beats(i: int, j: int) -> bool:
            return _clearly_toward(boxes[i], boxes[j], side, m)

        sure = {i for i in people if all(beats(i, j) for j in people if j != i)}
        # beaten only by small cups: the extreme for a reader who overlooks them
        maybe = {i for i in people if not any(beats(j, i) for j in counted if j != i)}
        return sure, maybe | crowds, ""
    if form == "ordinal":
        side, rank = reading["side"], reading["rank"]
        sure, maybe = set(), set()
        for i in people:
            rest = [j for j in people if j != i]
            before = sum(_clearly_toward(boxes[j], boxes[i], side, m) for j in rest if j in counted)
            after = sum(_clearly_toward(boxes[i], boxes[j], side, m) for j in rest if j in counted)
            unclear = sum(j in counted for j in rest) - before - after
            # a small cup not clearly after it: one reader counts it before it, another not at all
            small_before = sum(not _clearly_toward(boxes[i], boxes[j], side, m) for j in rest if j not in counted)
            lowest, highest = before + 1, before + unclear + small_before + 1
            if lowest == highest == rank:
                sure.add(i)
            if lowest <= rank <= highest:
                maybe.add(i)
        return sure, maybe | crowds, ""
    # size, size_of_two
    if form == "size_of_two" and len(group) != 2:
        return set(), set(group), f"'{'big' if reading['big'] else 'small'}' among {len(group)}, not two"
    sign = 1 if reading["big"] else -1

    def clearly_larger(i: int, j: int) -> bool:  # i clearly bigger than j (smaller, for "small")
        big, small = (boxes[i], boxes[j]) if sign > 0 else (boxes[j], boxes[i])
        return big.area >= SIZE_RATIO * small.area

    sure = {i for i in people if all(clearly_larger(i, j) for j in people if j != i)}
    maybe = {i for i in people if not any(clearly_larger(j, i) for j in people if j != i)}
    return sure, maybe | crowds, ""


# --------------------------------------------------------------------------------------------
# Records and files


def _boxes(record: dict) -> list[_Box] | None:
    objects = record.get("objects")
    if not isinstance(objects, list) or not objects:
        return None
    out = []
    for o in objects:
        box = as_box(o.get("bbox")) if isinstance(o, dict) else None
        if box is None or not isinstance(o.get("label"), str):
            return None
        words = o.get("attributes")
        out.append(_Box(*box, label=o["label"], crowd=bool(o.get("crowd")),
                        words=None if words is None else frozenset(" ".join(w.lower().split()) for w in words)))
    return out


def _targets(record: dict, boxes: list[_Box]) -> list[int] | str:
    """The record's set as indices into its objects (``targets`` with ``bboxes``, or ``target``
    with ``bbox``), or why the record gives none."""
    def box(i: int) -> list[float]:
        b = boxes[i]
        return [b.x1, b.y1, b.x2, b.y2]

    def index(i) -> bool:
        return isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(boxes)

    if "targets" in record:
        targets, bboxes = record["targets"], record.get("bboxes")
        if not isinstance(targets, list) or not all(map(index, targets)) or len(set(targets)) != len(targets):
            return "targets is not a list of distinct indices into objects"
        if not isinstance(bboxes, list) or [as_box(b) for b in bboxes] != [box(i) for i in targets]:
            return "bboxes are not objects[targets]'s boxes"
        return targets
    if not index(record.get("target")):
        return "no objects list with a target (or targets) index into it: not written by `data refgen`?"
    if as_box(record.get("bbox")) != box(record["target"]):
        return "bbox is not objects[target]'s box"
    return [record["target"]]


def check_record(record: dict) -> Verdict:
    """The verdict on one record of ``data refgen``'s output."""
    boxes = _boxes(record)
    if boxes is None:
        return Verdict("bad_record", "no objects list with a target (or targets) index into it: not written by "
                       "`data refgen`?")
    targets = _targets(record, boxes)
    if isinstance(targets, str):
        return Verdict("bad_record", targets)
    label = record.get("label")
    readings = parse(str(record.get("phrase", "")), boxes, " ".join(label.lower().split()) if isinstance(label, str)
                     else None)
    if not readings:
        return Verdict("unparsed", "outside the grammar of refgen's phrases")
    sure, maybe, why = set(), set(), []
    for reading in readings:  # several readings: what any of them names may be meant
        s, m, w = evaluate(reading, boxes, record.get("width", 0), record.get("height", 0))
        sure |= s
        maybe |= m | s
        why += [w] if w else []
    found = dict(sure=tuple(sorted(sure)), maybe=tuple(sorted(maybe)))
    want = set(targets)
    if len(want) > 1 and any(r["one"] for r in readings):
        return Verdict("wrong_box", f"a phrase said of one box, for a set of {len(want)}", **found)
    if sure == want and maybe == want:
        return Verdict("ok", **found)
    if not want <= sure or (not want and sure):
        return Verdict("wrong_box", "; ".join(why) or "it does not clearly name its set", **found)
    return Verdict("second_box", "; ".join(why) or "another box may be meant too", **found)


@dataclass
class RefsReport:
    path: str
    counts: Counter = field(default_factory=Counter)  # verdict -> records
    by_kind: dict = field(default_factory=dict)  # kind -> Counter of verdicts
    problems: list[dict] = field(default_factory=list)  # {"line", "id", "phrase", "verdict", "reason"}

    @property
    def failed(self) -> int:
        return sum(n for v, n in self.counts.items() if v != "ok")

    def to_dict(self) -> dict:
        return {"file": self.path, "checked": sum(self.counts.values()), "failed": self.failed,
                "counts": {v: self.counts.get(v, 0) for v in VERDICTS},
                "by_kind": {k: dict(c) for k, c in sorted(self.by_kind.items())}, "problems": self.problems}

    def summary(self, show: int = 20) -> str:
        total = sum(self.counts.values())
        lines = [f"{self.path}: {total} phrases checked, {self.counts.get('ok', 0)} pick exactly their box, "
                 f"{self.failed} do not"]
        lines += [f"  {v:<11} {self.counts.get(v, 0):>8}" for v in VERDICTS]
        for p in self.problems[:show]:
            lines.append(f"  line {p['line']}: {p['verdict']}: {shown(p['phrase'], 100)} ({p['reason']})")
        if len(self.problems) > show:
            lines.append(f"  ... and {len(self.problems) - show} more (--json lists them all)")
        return "\n".join(lines)


def check_refs(path: str | Path, fix_out: str | Path | None = None) -> RefsReport:
    """Check every line of a refgen file; ``fix_out`` receives the lines that pass."""
    report, good = RefsReport(str(path)), []
    for line in track(iter_jsonl(path), "check --refs"):
        verdict = Verdict("bad_record", line.error) if line.error else check_record(line.record)
        report.counts[verdict.verdict] += 1
        kind = str((line.record or {}).get("kind", "-"))
        report.by_kind.setdefault(kind, Counter())[verdict.verdict] += 1
        if verdict.ok:
            good.append(line.record)
        else:
            report.problems.append({"line": line.number, "id": (line.record or {}).get("id"),
                                    "phrase": (line.record or {}).get("phrase"), "verdict": verdict.verdict,
                                    "reason": verdict.reason})
    if fix_out is not None:
        write_samples(fix_out, good)
    return report
