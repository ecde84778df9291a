"""The built-in synthetic grounding set: 1-3 coloured shapes on a light noisy background and a
phrase that names exactly one of them; or, task ``every``, 1-6 shapes whose colour and kind may
repeat and a phrase that names a SET of them ("every red circle", "all the squares"), or nothing
in the image (a quarter of the samples: "every green cross" where there is none).

It is the embedded default data (quickstart, tests, CI) and the pre-training stream of the tiny
model, so it is made to be fast and reproducible:

- sample ``index`` is a pure function of ``(seed, split, index)``: any number of worker processes,
  in any order, gives byte-identical JSONL and PNG files;
- every box is read back from the drawn pixel mask, so it is exactly tight (xyxy pixel edges:
  a shape covering columns 10..29 has x1=10, x2=30);
- every phrase is built from the layout and checked by :func:`resolve` to pick out exactly one
  shape; a form that would be ambiguous for this layout is never emitted.

    groundtune data synth --out data/synth --n 20000 --seed 0
    groundtune data synth --out data/synth --n 1000 --seed 1 --split val
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import re
import struct
import zlib
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image, ImageDraw

from groundtune.boxes import box_centre
from groundtune.cores import cores
from groundtune.data.records import DataError, iter_jsonl, write_samples
from groundtune.errors import shown
from groundtune.files import regular_file
from groundtune.progress import progress_bar

# What a sample asks, from easiest to the full task (curriculum stages of the tiny model's pre-training):
#   single     one shape, "the {colour} {shape}"
#   attribute  2-3 shapes, the target named by colour and/or kind only ("the red circle", "the circle",
#              "the red shape"): position alone never tells which shape is meant
#   colour     2-3 shapes of one kind in distinct colours ("the red circle", "the red shape"): the
#              colour word is the only way to the target (in attribute scenes the kind word
#              usually is one, and a model can learn to ignore colour)
#   multi      2-3 shapes, every phrase form
#   full       1-3 shapes, every phrase form
#   every      1-6 shapes, colour and kind may repeat; the phrase names every shape of a colour and/or
#              kind ("every red circle", "all the squares", "the blue shapes"), possibly none
#   contrast   the every task's scenes in pairs: samples 2j and 2j+1 are one image asked about twice,
#              by phrases differing only in their colour word ("every red circle", "every blue
#              circle"), the first naming shapes in the image, the second another colour's (or none).
#              A model that ignores the colour word answers one of the two wrongly, always.
SHAPE_COUNTS = {"full": (1, 3), "single": (1, 1), "attribute": (2, 3), "colour": (2, 3), "multi": (2, 3),
                "every": (1, 6), "contrast": (1, 6)}  # task -> (fewest, most)
TASKS = tuple(SHAPE_COUNTS)
# A set's defaults (make_synthetic_set's and its helpers', and `groundtune data synth`'s flags): the
# canvas the built-in tiny model was pre-trained on, and relational phrases about 1-3 shapes
CANVAS_SIDE = 112
TASK = "full"
SPLIT = "train"
# Shapes _shape_mask can draw. A Palette may use any of them: a variant with new shapes is a
# different Palette, not new code.
SHAPE_KINDS = ("circle", "square", "triangle", "diamond", "cross")


@dataclass(frozen=True)
class Palette:
    """What a scene is made of: colour name -> RGB, shape names (from SHAPE_KINDS), and the
    background's brightness: each channel of a scene's tint is drawn from background to
    background + 25, minus per-pixel grey noise of 0-15 (the default: a light grey, 200-240)."""

    colours: dict[str, tuple[int, int, int]] = field(
        default_factory=lambda: {
            "red": (220, 40, 40),
            "green": (40, 160, 60),
            "blue": (40, 80, 220),
            "yellow": (230, 190, 20),
        }
    )
    shapes: tuple[str, ...] = ("circle", "square", "triangle")
    background: int = 215

    def __post_init__(self) -> None:
        if not self.colours or not self.shapes:
            raise ValueError("a Palette needs at least one colour and one shape")
        unknown = [s for s in self.shapes if s not in SHAPE_KINDS]
        if unknown:
            raise ValueError(f"cannot draw shape(s) {unknown}; known shapes: {', '.join(SHAPE_KINDS)}")
        if len(set(self.shapes)) != len(self.shapes):
            raise ValueError(f"shape names repeat: {self.shapes}")
        if not 15 <= self.background <= 230:
            raise ValueError(f"background {self.background}: expected 15-230 (channels background-15 to background+25)")
        darkest, lightest = self.background - 15, self.background + 25
        for name, rgb in self.colours.items():
            if not name or " " in name or name in self.shapes or name == "shape":
                raise ValueError(f"colour name {name!r} must be one word and not a shape name")
            if len(rgb) != 3 or not all(isinstance(v, int) and 0 <= v <= 255 for v in rgb):
                raise ValueError(f"colour {name!r}: need three ints 0-255, got {rgb}")
            # A colour must differ clearly from the background in some channel, or the shape is
            # invisible and its box a lie.
            if all(darkest - 30 < v < lightest + 30 for v in rgb):
                raise ValueError(f"colour {name!r} {rgb} is too close to the background "
                                 f"(channels {darkest}-{lightest})")


DEFAULT_PALETTE = Palette()
# Colours and shapes no built-in model was pre-trained on (new words, hues and outlines), a variant
# for LoRA to teach. Each colour differs from the default colours and the background by at least ~60
# in some channel.
UNSEEN_PALETTE = Palette(colours={"purple": (130, 50, 180), "orange": (240, 120, 10), "pink": (240, 100, 180),
                                  "brown": (120, 70, 30)}, shapes=("diamond", "cross"))
# The default shapes and colours on a dark grey (channels 30-70): no built-in model has seen a dark
# background; the quickstart's variant
DARK_PALETTE = Palette(background=45)
PALETTES = {"default": DEFAULT_PALETTE, "unseen": UNSEEN_PALETTE, "dark": DARK_PALETTE}

SET_TASK = "every"
CONTRAST_TASK = "contrast"
COLOUR_TASK = "colour"
SET_TASKS = (SET_TASK, CONTRAST_TASK)  # tasks whose answer is a set: "bboxes", any number
# of the every task's samples: a phrase naming nothing in the image (measured: 24.7% to 25.1% of
# 20,000 scenes, for each of seeds 0 and 1, split val, and canvases of 112-224 px)
NO_TARGET_SHARE = 0.25
# "every red circle", "all the red circles", "all red circles", "the red circles": the ways a set is asked for
SET_TEMPLATES = ("every {one}", "all the {many}", "all {many}", "the {many}")
# of the one-object tasks' phrases: said without their leading article ("red circle", "circle left
# of the blue square"), as short referring expressions often are (RefCOCO's mostly are). A model
# that only ever read "the ..." misses a third of bare phrases (the first tiny 2: held-out one-object
# Acc@0.5 0.99 with the article, 0.67 without; docs/benchmarks-history.md)
BARE_SHARE = 1 / 3

REL_WORDS = ("left of", "right of", "above", "below")
EXTREMES = ("left", "right", "top", "bottom")
FORMS = ("attribute", "relation", "extreme", "attribute+position")


@dataclass(frozen=True)
class Shape:
    colour: str
    kind: str
    box: tuple[int, int, int, int]  # tight xyxy pixel edges, read from the drawn mask

    @property
    def cx(self) -> float:
        return box_centre(self.box)[0]

    @property
    def cy(self) -> float:
        return box_centre(self.box)[1]


@dataclass(frozen=True)
class Query:
    """A phrase as structure, so it can be checked against the layout before it is written.

    ``colour``/``kind`` select a group (None: any). Then at most one of: ``relation`` to the shape
    ``anchor`` (an index into the scene's shapes), or ``extreme`` within the group (within all
    shapes when colour and kind are both given: "the red circle on the left")."""

    form: str  # "attribute" | "relation" | "extreme" | "attribute+position"
    text: str
    colour: str | None = None
    kind: str | None = None
    relation: str | None = None
    anchor: int | None = None
    extreme: str | None = None


@dataclass
class Scene:
    width: int
    height: int
    shapes: list[Shape]
    targets: list[int]  # the shapes the phrase names: one, or for the every task any number
    query: Query
    # where each shape's mask is pasted: (x0, y0) and the mask's side
    placements: list[tuple[int, int, int]]

    @property
    def phrase(self) -> str:
        return self.query.text

    @property
    def boxes(self) -> list[list[float]]:
        return [[float(v) for v in self.shapes[i].box] for i in self.targets]


# --------------------------------------------------------------------------------------------
# Drawing


@lru_cache(maxsize=1024)
def _shape_mask(kind: str, size: int) -> tuple[Image.Image, tuple[int, int, int, int]]:
    """The 0/255 mask of a shape drawn in a size x size square and its tight box in it.
    Cached: there are only a few hundred (kind, size) pairs and masks are never modified."""
    m = Image.new("L", (size, size), 0)
    d = ImageDraw.Draw(m)
    s = size - 1  # PIL's coordinates are inclusive
    if kind == "circle":
        d.ellipse([0, 0, s, s], fill=255)
    elif kind == "square":
        d.rectangle([0, 0, s, s], fill=255)
    elif kind == "triangle":
        d.polygon([(0, s), (s, s), (s / 2, 0)], fill=255)
    elif kind == "diamond":
        d.polygon([(s / 2, 0), (s, s / 2), (s / 2, s), (0, s / 2)], fill=255)
    elif kind == "cross":
        t = max(1, size // 3)
        a = (size - t) // 2
        d.rectangle([a, 0, a + t - 1, s], fill=255)
        d.rectangle([0, a, s, a + t - 1], fill=255)
    else:
        raise ValueError(f"unknown shape {kind!r}")
    box = m.getbbox()  # (left, upper, right, lower), right/lower exclusive: our xyxy edges
    assert box is not None, (kind, size)
    return m, box


def _size_range(width: int, height: int) -> tuple[int, int]:
    """14-40 px on the 112 px default canvas, scaled with the shorter side otherwise."""
    s = min(width, height) / 112
    lo = max(4, round(14 * s))
    hi = max(lo, min(round(40 * s), min(width, height)))
    return lo, hi


def _margin(width: int, height: int) -> float:
    """How much further one shape must be than another for 'leftmost' etc. to be clear."""
    return max(1.0, 5 * min(width, height) / 112)


def _place(rng: np.random.Generator, k: int, width: int, height: int) -> list[tuple[int, int, int]]:
    """Up to k non-overlapping squares (x0, y0, side), at least `gap` px apart."""
    lo, hi = _size_range(width, height)
    gap = max(2, round(2 * min(width, height) / 112))
    placed: list[tuple[int, int, int]] = []
    for _ in range(k):
        size = int(rng.integers(lo, hi + 1))
        for _attempt in range(100):
            x0 = int(rng.integers(0, width - size + 1))
            y0 = int(rng.integers(0, height - size + 1))
            if all(
                x0 + size + gap <= px or px + ps + gap <= x0 or y0 + size + gap <= py or py + ps + gap <= y0
                for px, py, ps in placed
            ):
                placed.append((x0, y0, size))
                break
        # a shape that finds no room after 100 tries is dropped: rare, and still deterministic
    return placed


# --------------------------------------------------------------------------------------------
# Phrases


def _head_text(colour: str | None, kind: str | None) -> str:
    if colour and kind:
        return f"{colour} {kind}"
    if kind:
        return kind
    if colour:
        return f"{colour} shape"
    return "shape"


def _extreme_texts(head: str, extreme: str) -> list[str]:
    return {
        "left": [f"the leftmost {head}", f"the {head} on the left"],
        "right": [f"the rightmost {head}", f"the {head} on the right"],
        "top": [f"the top {head}", f"the {head} at the top"],
        "bottom": [f"the bottom {head}", f"the {head} at the bottom"],
    }[extreme]


def _rank(s: Shape, extreme: str) -> float:
    """Smaller is further towards `extreme` (centres: what a reader compares)."""
    return {"left": s.cx, "right": -s.cx, "top": s.cy, "bottom": -s.cy}[extreme]


def _relation(rel: str, s: Shape, a: Shape) -> bool | None:
    """Is s `rel` a? True: wholly on that side (no overlap along the axis). False: clearly not
    (its centre is not on that side of a's centre). None: in between, too close to call."""
    x1, y1, x2, y2 = s.box
    ax1, ay1, ax2, ay2 = a.box
    if rel == "left of":
        return True if x2 <= ax1 else False if s.cx >= a.cx else None
    if rel == "right of":
        return True if x1 >= ax2 else False if s.cx <= a.cx else None
    if rel == "above":
        return True if y2 <= ay1 else False if s.cy >= a.cy else None
    if rel == "below":
        return True if y1 >= ay2 else False if s.cy <= a.cy else None
    raise ValueError(f"unknown relation {rel!r}")


def resolve(query: Query, shapes: list[Shape], margin: float) -> tuple[set[int], set[int]]:
    """Which shapes the query selects: (surely, unclear). A phrase is only used when surely is
    exactly the target and nothing is unclear, so a reader never has to guess."""
    group = [
        i
        for i, s in enumerate(shapes)
        if (query.colour is None or s.colour == query.colour) and (query.kind is None or s.kind == query.kind)
    ]
    if query.relation is not None:
        anchor = shapes[query.anchor]
        sure, unclear = set(), set()
        for i in group:
            if i == query.anchor:
                continue
            r = _relation(query.relation, shapes[i], anchor)
            if r is True:
                sure.add(i)
            elif r is None:
                unclear.add(i)
        return sure, unclear
    if query.extreme is not None:
        # "the red circle on the left" compares the red circle with all shapes; "the leftmost
        # circle" compares circles. Needs someone to compare with, and a clear winner.
        if query.colour is not None and query.kind is not None:
            if len(group) != 1:
                return set(), set(group)
            pool = range(len(shapes))
        else:
            pool = group
        if len(pool) < 2:
            return set(), set(group)
        pos = {i: _rank(shapes[i], query.extreme) for i in pool}
        best = min(pos, key=pos.get)
        if all(pos[best] + margin <= pos[j] for j in pool if j != best) and best in group:
            return {best}, set()
        return set(), set(group)
    return set(group), set()


def _candidates(form: str, shapes: list[Shape], target: int) -> list[Query]:
    """Every phrase of one form that could name the target; resolve() decides which are true and
    unique."""
    t = shapes[target]
    loose_heads = [(None, t.kind), (t.colour, None), (None, None)]  # "circle", "red shape", "shape"
    out = []
    if form == "attribute":
        for colour, kind in [(t.colour, t.kind), *loose_heads[:2]]:
            out.append(Query(form, f"the {_head_text(colour, kind)}", colour, kind))
    elif form == "relation":
        for colour, kind in loose_heads:
            for a, anchor in enumerate(shapes):
                if a != target:
                    for rel in REL_WORDS:
                        text = f"the {_head_text(colour, kind)} {rel} the {anchor.colour} {anchor.kind}"
                        out.append(Query(form, text, colour, kind, relation=rel, anchor=a))
    elif form == "extreme":
        for colour, kind in loose_heads:
            for ext in EXTREMES:
                for text in _extreme_texts(_head_text(colour, kind), ext):
                    out.append(Query(form, text, colour, kind, extreme=ext))
    elif form == "attribute+position":
        for ext in EXTREMES:
            text = _extreme_texts(_head_text(t.colour, t.kind), ext)[1]  # "the red circle on the left"
            out.append(Query(form, text, t.colour, t.kind, extreme=ext))
    return out


def _choose_query(rng: np.random.Generator, shapes: list[Shape], target: int, task: str, margin: float) -> Query:
    t = shapes[target]
    if task == "single":
        return Query("attribute", f"the {t.colour} {t.kind}", t.colour, t.kind)
    # The first form, in a random order, that can name the target: a form uniformly among those
    # that can, so relational forms get used even where "the red circle" would do and the model
    # has to read them. "attribute" always can, so the loop always returns.
    forms = ("attribute",) if task in ("attribute", COLOUR_TASK) else FORMS
    for f in rng.permutation(len(forms)):
        valid = []
        for q in _candidates(forms[f], shapes, target):
            sure, unclear = resolve(q, shapes, margin)
            if sure == {target} and not unclear:
                valid.append(q)
        if valid:
            return valid[int(rng.integers(len(valid)))]
    raise AssertionError("unreachable: 'the {colour} {shape}' always names one shape")


# --------------------------------------------------------------------------------------------
# Samples


def plural(kind: str) -> str:
    return kind + ("es" if kind.endswith(("s", "x")) else "s")


def _set_query(rng: np.random.Generator, shapes: list[Shape], palette: Palette) -> Query:
    """A phrase naming every shape of a colour, a kind or both; NO_TARGET_SHARE of the time one
    that names none of them (a colour/kind pairing, or a colour or kind, absent from the scene).
    The set is read back from the phrase by ``resolve``, as every phrase is."""
    present = [(s.colour, s.kind) for s in shapes]
    if rng.random() < NO_TARGET_SHARE:
        absent = [(c, k) for c in palette.colours for k in palette.shapes if (c, k) not in present]
        absent += [(c, None) for c in palette.colours if all(c != pc for pc, _ in present)]
        absent += [(None, k) for k in palette.shapes if all(k != pk for _, pk in present)]
        colour, kind = absent[int(rng.integers(len(absent)))]
    else:
        colour, kind = present[int(rng.integers(len(present)))]
        colour, kind = [(colour, kind), (colour, None), (None, kind)][int(rng.integers(3))]
    one = _head_text(colour, kind)
    many = plural(kind) if kind else f"{colour} shapes"
    many = f"{colour} {many}" if colour and kind else many
    template = SET_TEMPLATES[int(rng.integers(len(SET_TEMPLATES)))]
    return Query("set", template.format(one=one, many=many), colour, kind)


def _contrast_queries(rng: np.random.Generator, shapes: list[Shape], palette: Palette) -> tuple[Query, Query]:
    """Two phrases of one template differing only in their colour word: the first names a colour
    present in the image (with a present shape's kind, or alone: "the red shapes"), the second any
    other colour of the palette, present (another set) or not (none)."""
    shape = shapes[int(rng.integers(len(shapes)))]
    kind = shape.kind if rng.random() < 0.5 else None
    others = [c for c in palette.colours if c != shape.colour]
    other = others[int(rng.integers(len(others)))] if others else shape.colour  # one colour: asked twice alike
    template = SET_TEMPLATES[int(rng.integers(len(SET_TEMPLATES)))]

    def query(colour: str) -> Query:
        many = f"{colour} {plural(kind)}" if kind else f"{colour} shapes"
        return Query("set", template.format(one=_head_text(colour, kind), many=many), colour, kind)

    return query(shape.colour), query(other)


def _rng(seed: int, index: int, split: str) -> np.random.Generator:
    # The split is part of the key so that `--split val` with the default seed is not a copy of
    # the training set. crc32, not hash(): Python salts str hashes per process.
    return np.random.default_rng([seed, zlib.crc32(split.encode()), index])


def _scene(rng: np.random.Generator, width: int, height: int, task: str, palette: Palette,
           member: int = 0) -> Scene:
    """``member``: for the contrast task, which of the pair's two phrases (0 or 1); the scene and
    the random draws after it are the same for both, so both are one image."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    n_pairs = len(palette.colours) * len(palette.shapes)
    lo, hi = SHAPE_COUNTS[task]
    k = lo if lo == hi else int(rng.integers(lo, hi + 1))
    if task in SET_TASKS:  # pairs may repeat: a set of several red circles
        pairs = rng.integers(n_pairs, size=k)
    elif task == COLOUR_TASK:  # one kind, distinct colours: only the colour tells them apart
        k = min(k, len(palette.colours))
        kind = int(rng.integers(len(palette.shapes)))
        pairs = rng.choice(len(palette.colours), size=k, replace=False) * len(palette.shapes) + kind
    else:  # distinct (colour, shape) pairs, so "the {colour} {shape}" always names one shape
        k = min(k, n_pairs)
        pairs = rng.choice(n_pairs, size=k, replace=False)
    placements = _place(rng, k, width, height)
    for _attempt in range(100):  # a dropped shape would leave no choice to make: lay out again
        if len(placements) >= min(lo, k):
            break
        placements = _place(rng, k, width, height)
    else:
        raise ValueError(f"a {width}x{height} canvas has no room for {lo} shapes (task {task!r})")
    colours = list(palette.colours)
    shapes = []
    for pair, (x0, y0, size) in zip(pairs, placements):
        colour, kind = colours[pair // len(palette.shapes)], palette.shapes[pair % len(palette.shapes)]
        _, (bx1, by1, bx2, by2) = _shape_mask(kind, size)
        shapes.append(Shape(colour, kind, (x0 + bx1, y0 + by1, x0 + bx2, y0 + by2)))
    if not shapes:
        raise ValueError(f"a {width}x{height} canvas is too small for a {_size_range(width, height)[0]} px shape")
    if task in SET_TASKS:
        query = (_set_query(rng, shapes, palette) if task == SET_TASK
                 else _contrast_queries(rng, shapes, palette)[member])
        targets = sorted(resolve(query, shapes, _margin(width, height))[0])
    else:
        target = int(rng.integers(len(shapes)))
        query, targets = _choose_query(rng, shapes, target, task, _margin(width, height)), [target]
        if rng.random() < BARE_SHARE:
            query = replace(query, text=query.text.removeprefix("the "))
    return Scene(width, height, shapes, targets, query, placements[: len(shapes)])


def _render(rng: np.random.Generator, scene: Scene, palette: Palette) -> Image.Image:
    # The background: a random grey-ish tint minus per-pixel grey noise (light: channels 200-240).
    tint = rng.integers(palette.background, palette.background + 26, size=3, dtype=np.uint8)
    noise = rng.integers(0, 16, size=(scene.height, scene.width), dtype=np.uint8)
    pixels = np.empty((scene.height, scene.width, 3), np.uint8)
    for c in range(3):  # one plane at a time: ~6x faster than broadcasting (H, W, 1) against (3,)
        np.subtract(tint[c], noise, out=pixels[..., c])  # no underflow: background >= 15
    image = Image.fromarray(pixels, "RGB")
    for shape, (x0, y0, size) in zip(scene.shapes, scene.placements):
        mask, _ = _shape_mask(shape.kind, size)
        image.paste(palette.colours[shape.colour], (x0, y0), mask)
    return image


def parse_canvas(text: str) -> tuple[int, int]:
    """``"112-224"`` -> (112, 224): the range each side of a canvas is drawn from (``"168"``: one
    size). Raises ValueError with the accepted form."""
    low, _, high = text.partition("-")
    try:
        sides = (int(low), int(high or low))
    except ValueError:
        raise ValueError(f"canvas {shown(text)}: expected MIN-MAX pixels, e.g. 112-224") from None
    if not 8 <= sides[0] <= sides[1]:
        raise ValueError(f"canvas {shown(text)}: need 8 <= MIN <= MAX")
    return sides


def canvas_size(seed: int, index: int, split: str, sides: tuple[int, int]) -> tuple[int, int]:
    """Sample ``index``'s (width, height) when canvases vary: each side uniform in ``sides``,
    drawn independently (so non-square too), from a generator of its own: a sample's layout is
    the same function of its canvas whether the canvas was drawn or given."""
    rng = np.random.default_rng([seed, zlib.crc32(f"{split}/canvas".encode()), index])
    width, height = (int(v) for v in rng.integers(sides[0], sides[1] + 1, size=2))
    return width, height


def make_scene(
    seed: int,
    index: int,
    width: int = CANVAS_SIDE,
    height: int = CANVAS_SIDE,
    task: str = TASK,
    palette: Palette = DEFAULT_PALETTE,
    split: str = SPLIT,
    canvas: tuple[int, int] | None = None,
) -> Scene:
    """The layout and phrase of a sample (every shape, the target, the query), without drawing it.
    ``canvas``: (MIN, MAX) side range, drawn per sample (``canvas_size``) in place of width x height."""
    return _drawn_scene(seed, index, width, height, task, palette, split, canvas)[0]


def _drawn_scene(seed: int, index: int, width: int, height: int, task: str, palette: Palette, split: str,
                 canvas: tuple[int, int] | None) -> tuple[Scene, np.random.Generator]:
    """Sample ``index``'s scene and the generator its drawing goes on with."""
    member = 0
    if task == CONTRAST_TASK:  # samples 2j and 2j+1: scene j of the task's own sequence, asked twice
        index, member = index // 2, index % 2
        split = f"{split}/{CONTRAST_TASK}"  # not the every task's scene j
    if canvas is not None:
        width, height = canvas_size(seed, index, split, canvas)
    rng = _rng(seed, index, split)
    return _scene(rng, width, height, task, palette, member), rng


def make_sample(
    seed: int,
    index: int,
    width: int = CANVAS_SIDE,
    height: int = CANVAS_SIDE,
    task: str = TASK,
    palette: Palette = DEFAULT_PALETTE,
    split: str = SPLIT,
    canvas: tuple[int, int] | None = None,
) -> tuple[Image.Image, dict]:
    """Sample ``index`` of the set ``(seed, split)``: an RGB image and its record without the
    id/image/split fields (make_synthetic_set and iter_samples add those). ``canvas``: as
    make_scene's."""
    scene, rng = _drawn_scene(seed, index, width, height, task, palette, split, canvas)
    image = _render(rng, scene, palette)
    record = {
        "width": scene.width,
        "height": scene.height,
        "phrase": scene.phrase,
        # a set (possibly empty) for the every and contrast tasks, else the one box
        **({"bboxes": scene.boxes} if task in SET_TASKS else {"bbox": scene.boxes[0]}),
        "source": "synth",
        "task": task,
    }
    return image, record


def _record(index: int, split: str, sample: dict, image: str | None) -> dict:
    """The canonical record, fields in the canonical order."""
    rec = {"id": f"synth-{split}-{index}"}
    if image is not None:
        rec["image"] = image
    rec.update(width=sample["width"], height=sample["height"], phrase=sample["phrase"],
               **{key: sample[key] for key in ("bbox", "bboxes") if key in sample})
    rec.update(split=split, source=sample["source"], task=sample["task"])
    return rec


def iter_samples(
    seed: int,
    start: int = 0,
    count: int | None = None,
    width: int = CANVAS_SIDE,
    height: int = CANVAS_SIDE,
    split: str = SPLIT,
    task: str = TASK,
    palette: Palette = DEFAULT_PALETTE,
) -> Iterator[tuple[Image.Image, dict]]:
    """Samples start, start+1, ... (forever when count is None) as (image, record) without touching
    disk: the same pixels and record (less "image") that make_synthetic_set writes."""
    index = start
    while count is None or index < start + count:
        image, sample = make_sample(seed, index, width, height, task, palette, split)
        yield image, _record(index, split, sample, None)
        index += 1


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def encode_png(image: Image.Image) -> bytes:
    """An 8-bit RGB PNG of the image, the bytes a function of the pixels alone (no timestamp, no
    metadata). Written here rather than by Pillow because Pillow's per-row adaptive filtering
    costs ~1 ms on a noisy 112x112 image; filter "none" + zlib level 1 takes half that and, on
    this noise, gives a file ~15% smaller. Any PNG reader decodes it."""
    pixels = np.asarray(image.convert("RGB"))
    height, width, _ = pixels.shape
    rows = np.zeros((height, 1 + 3 * width), np.uint8)  # each row: filter byte 0, then RGB RGB ...
    rows[:, 1:] = pixels.reshape(height, -1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bit, truecolour, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(rows.tobytes(), 1))
        + _png_chunk(b"IEND", b"")
    )


def _write_chunk(job: tuple) -> list[dict]:
    """Worker: draw and save samples [start, start+count), return their records in order."""
    out_dir, split, start, count, seed, width, height, task, palette, canvas = job
    records = []
    for i in range(start, start + count):
        image, sample = make_sample(seed, i, width, height, task, palette, split, canvas)
        rel = f"images/{split}-{i:07d}.png"
        path = Path(out_dir) / rel
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(encode_png(image))
        os.replace(tmp, path)  # never a half-written PNG under the final name
        records.append(_record(i, split, sample, rel))
    return records


def _previous_images(jsonl: Path, split: str, overwrite: bool) -> set[str]:
    """The images a synthetic set already at ``jsonl`` names (relative to its folder), which a new
    set written there replaces. A user's own data of that split name is refused whatever
    ``overwrite`` says (a command never writes over what it did not write); a previous synthetic set
    only with ``overwrite`` (a set of 20 written over one of 10,000 cut it silently)."""
    if not jsonl.exists():
        return set()
    try:
        with open(regular_file(jsonl, "JSONL file"), encoding="utf-8-sig") as f:
            first = json.loads(f.readline(2**20) or "null")
    except (OSError, ValueError, RecursionError):
        first = None
    if not jsonl.stat().st_size:
        return set()
    if not (isinstance(first, dict) and first.get("source") == "synth"):
        raise DataError(f"{jsonl} exists and was not written by `groundtune data synth`: it would be replaced; "
                        "choose another --out (or --split)")
    if not overwrite:
        raise DataError(f"{jsonl} holds a synthetic set already: give --overwrite to replace it (its images too), or "
                        "choose another --out (or --split)")
    ours = re.compile(rf"images/{re.escape(split)}-\d{{7}}\.png")  # only what synth names: nothing else is removed
    try:
        return {line.record["image"] for line in iter_jsonl(jsonl)
                if line.record is not None and isinstance(line.record.get("image"), str)
                and ours.fullmatch(line.record["image"])}
    except DataError:  # not UTF-8 any more: its images stay where they are
        return set()


def make_synthetic_set(
    out_dir: str | Path,
    n: int,
    seed: int,
    width: int = CANVAS_SIDE,
    height: int = CANVAS_SIDE,
    split: str = SPLIT,
    task: str = TASK,
    workers: int = 0,
    palette: Palette = DEFAULT_PALETTE,
    canvas: tuple[int, int] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``out_dir/{split}.jsonl`` and ``out_dir/images/{split}-{index:07d}.png``; return the
    JSONL path. ``canvas``: (MIN, MAX), each sample's sides drawn from it instead of width x height.
    workers=0: one process per CPU core this process may use. The same arguments give byte-identical files
    whatever the number of workers. The JSONL is written last and atomically: it exists only when
    every image it names does. A set already there is replaced only with ``overwrite`` (its images
    the new one does not write are removed after the new JSONL is in place); a file of that name
    that synth did not write, never."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    if min(width, height, *(canvas or (8,))) < 8:
        raise ValueError(f"canvas {canvas or (width, height)} is too small; use at least 8x8")
    out_dir = Path(out_dir)
    previous = _previous_images(out_dir / f"{split}.jsonl", split, overwrite)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    workers = workers or cores()  # the cores this process may use, not the machine's
    workers = max(1, min(workers, n)) if n else 1
    # Chunks of a few hundred: large enough that pickling records is noise, small enough that
    # the progress bar moves and the last worker does not finish long after the others.
    chunk = max(1, min(256, math.ceil(n / (workers * 4))))
    jobs = [
        (str(out_dir), split, s, min(chunk, n - s), seed, width, height, task, palette, canvas)
        for s in range(0, n, chunk)
    ]

    def records(bar, task_id):
        if workers == 1:
            results: Iterator[list[dict]] = map(_write_chunk, jobs)
            pool = None
        else:
            pool = multiprocessing.get_context().Pool(workers)
            results = pool.imap(_write_chunk, jobs)  # imap keeps job order: records in index order
        try:
            for recs in results:
                yield from recs
                bar.advance(task_id, len(recs))
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()

    path = out_dir / f"{split}.jsonl"
    with progress_bar() as bar:
        task_id = bar.add_task(f"synth {split}", total=n, info=f"{workers} worker(s)")
        write_samples(path, records(bar, task_id))
    for stale in previous - {f"images/{split}-{i:07d}.png" for i in range(n)}:
        (out_dir / stale).unlink(missing_ok=True)  # the replaced set's, named by nothing now
    return path
