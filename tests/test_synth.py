"""The synthetic set: reproducible to the byte, boxes exactly tight, every phrase naming one shape.

Phrases are checked with a resolver written here from the grammar, independent of the generator's
own check (synth.resolve), with strict geometry: "left of" means wholly to the left, "leftmost"
the unique smallest centre x.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from groundtune.data import synth
from groundtune.data.records import DataError, read_samples

PAL = synth.DEFAULT_PALETTE


# --------------------------------------------------------------------------------------------
# An independent resolver


def _grammar(palette: synth.Palette) -> dict[str, re.Pattern]:
    c = "|".join(palette.colours)
    k = "|".join(palette.shapes)
    head = rf"(?:(?P<c>{c}) )?(?P<k>{k}|shape)"
    return {
        "attribute": re.compile(rf"(?:the )?{head}"),  # the article is optional (synth.BARE_SHARE)
        "relation": re.compile(rf"(?:the )?{head} (?P<rel>left of|right of|above|below) the (?P<ac>{c}) (?P<ak>{k})"),
        "extreme_pre": re.compile(rf"(?:the )?(?P<ext>leftmost|rightmost|top|bottom) {head}"),
        "extreme_post": re.compile(rf"(?:the )?{head} (?P<ext>on the left|on the right|at the top|at the bottom)"),
    }


_EXT = {"leftmost": "left", "on the left": "left", "rightmost": "right", "on the right": "right",
        "top": "top", "at the top": "top", "bottom": "bottom", "at the bottom": "bottom"}


def _centre(box, axis):
    return (box[axis] + box[axis + 2]) / 2


def independent_resolve(phrase: str, shapes: list[synth.Shape], palette=PAL) -> list[int]:
    """Indices of the shapes the phrase names, by strict geometry."""
    for name, pattern in _grammar(palette).items():
        m = pattern.fullmatch(phrase)
        if m:
            break
    else:
        raise AssertionError(f"phrase outside the grammar: {phrase!r}")
    colour, kind = m.group("c"), m.group("k")
    group = [i for i, s in enumerate(shapes)
             if (colour is None or s.colour == colour) and (kind == "shape" or s.kind == kind)]
    if name == "attribute":
        return group
    if name == "relation":
        anchors = [i for i, s in enumerate(shapes) if s.colour == m.group("ac") and s.kind == m.group("ak")]
        assert len(anchors) == 1, phrase
        a = shapes[anchors[0]].box
        side = {
            "left of": lambda b: b[2] <= a[0],
            "right of": lambda b: b[0] >= a[2],
            "above": lambda b: b[3] <= a[1],
            "below": lambda b: b[1] >= a[3],
        }[m.group("rel")]
        return [i for i in group if i != anchors[0] and side(shapes[i].box)]
    ext = _EXT[m.group("ext")]
    key = {"left": lambda i: _centre(shapes[i].box, 0), "right": lambda i: -_centre(shapes[i].box, 0),
           "top": lambda i: _centre(shapes[i].box, 1), "bottom": lambda i: -_centre(shapes[i].box, 1)}[ext]
    # "the red circle on the left": that shape, which must be the leftmost of all shapes
    pool = list(range(len(shapes))) if (colour and kind != "shape") else group
    assert len(pool) >= 2, f"{phrase!r}: nothing to compare with"
    ranked = sorted(pool, key=key)
    assert key(ranked[0]) < key(ranked[1]), f"{phrase!r}: a tie"
    return [ranked[0]] if ranked[0] in group else []


# --------------------------------------------------------------------------------------------
# Determinism


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_same_seed_gives_identical_bytes_whatever_the_workers(tmp_path):
    a = synth.make_synthetic_set(tmp_path / "a", n=24, seed=3, workers=1)
    synth.make_synthetic_set(tmp_path / "a2", n=24, seed=3, workers=1)
    synth.make_synthetic_set(tmp_path / "b", n=24, seed=3, workers=2)
    fa, fa2, fb = _files(tmp_path / "a"), _files(tmp_path / "a2"), _files(tmp_path / "b")
    assert a == tmp_path / "a" / "train.jsonl"
    assert len(fa) == 25  # 24 PNGs + the JSONL, no temporary files left behind
    assert fa == fa2
    assert fa == fb


def test_different_seed_or_split_differs(tmp_path):
    synth.make_synthetic_set(tmp_path / "a", n=8, seed=3, workers=1)
    synth.make_synthetic_set(tmp_path / "c", n=8, seed=4, workers=1)
    synth.make_synthetic_set(tmp_path / "a", n=8, seed=3, split="val", workers=1)
    a = read_samples(tmp_path / "a" / "train.jsonl")
    c = read_samples(tmp_path / "c" / "train.jsonl")
    v = read_samples(tmp_path / "a" / "val.jsonl")
    assert [r["bbox"] for r in a] != [r["bbox"] for r in c]
    # the same seed for val must not copy the training images
    assert [r["bbox"] for r in a] != [r["bbox"] for r in v]
    for i in range(8):
        assert (tmp_path / "a" / "images" / f"train-{i:07d}.png").read_bytes() != (
            tmp_path / "a" / "images" / f"val-{i:07d}.png"
        ).read_bytes()


def test_records_are_canonical_and_match_iter_samples(tmp_path):
    path = synth.make_synthetic_set(tmp_path, n=6, seed=5, workers=1, task="full")
    lines = path.read_text().splitlines()
    assert len(lines) == 6
    first = json.loads(lines[0])
    assert list(first) == ["id", "image", "width", "height", "phrase", "bbox", "split", "source", "task"]
    assert first["id"] == "synth-train-0" and first["image"] == "images/train-0000000.png"
    assert (first["width"], first["height"], first["split"], first["source"]) == (112, 112, "train", "synth")

    records = read_samples(path)
    for (image, rec), disk in zip(synth.iter_samples(5, 0, 6), records):
        assert rec == {k: v for k, v in disk.items() if k != "image"}
        on_disk = np.asarray(Image.open(tmp_path / disk["image"]))
        assert on_disk.shape == (112, 112, 3)
        assert np.array_equal(on_disk, np.asarray(image))
    # iter_samples can start anywhere: sample 4 alone is sample 4
    image, rec = next(synth.iter_samples(5, start=4, count=1))
    assert rec["id"] == "synth-train-4" and rec["bbox"] == records[4]["bbox"]


def test_png_encoder_round_trips():
    image, _ = synth.make_sample(0, 11, width=70, height=45)
    data = synth.encode_png(image)
    decoded = Image.open(io.BytesIO(data))
    assert decoded.size == (70, 45) and decoded.mode == "RGB"
    assert np.array_equal(np.asarray(decoded), np.asarray(image))


# --------------------------------------------------------------------------------------------
# Geometry


def _check_tight(image: np.ndarray, shape: synth.Shape, rgb) -> None:
    """The shape's colour touches all four box edges and no pixel of it lies in a 1 px ring
    around the box (shapes are >= 2 px apart, so the ring belongs to this shape alone)."""
    x1, y1, x2, y2 = shape.box
    mask = np.all(image == np.array(rgb, np.uint8), axis=-1)
    inside = mask[y1:y2, x1:x2]
    assert inside[0].any() and inside[-1].any() and inside[:, 0].any() and inside[:, -1].any(), shape
    h, w = mask.shape
    ring = mask[max(0, y1 - 1): min(h, y2 + 1), max(0, x1 - 1): min(w, x2 + 1)].sum() - inside.sum()
    assert ring == 0, shape


@pytest.mark.parametrize("size", [(112, 112), (160, 96)])
def test_layout_bounds_sizes_overlap_and_tight_boxes(size):
    w, h = size
    lo, hi = (14, 40) if size == (112, 112) else synth._size_range(w, h)
    counts = set()
    for i in range(150):
        scene = synth.make_scene(1, i, width=w, height=h)
        image, record = synth.make_sample(1, i, width=w, height=h)
        pixels = np.asarray(image)
        shapes = scene.shapes
        counts.add(len(shapes))
        assert [record["bbox"]] == scene.boxes == [[float(v) for v in shapes[t].box] for t in scene.targets]
        assert record["phrase"] == scene.phrase
        assert len({(s.colour, s.kind) for s in shapes}) == len(shapes), "a (colour, shape) pair repeats"
        for s in shapes:
            x1, y1, x2, y2 = s.box
            assert 0 <= x1 < x2 <= w and 0 <= y1 < y2 <= h
            assert lo <= max(x2 - x1, y2 - y1) <= hi
            _check_tight(pixels, s, PAL.colours[s.colour])
        for a in range(len(shapes)):
            for b in range(a + 1, len(shapes)):
                p, q = shapes[a].box, shapes[b].box
                assert p[2] <= q[0] or q[2] <= p[0] or p[3] <= q[1] or q[3] <= p[1], (p, q)
    assert counts == {1, 2, 3}


def test_every_phrase_names_exactly_its_target():
    forms = {}
    for i in range(600):
        scene = synth.make_scene(2, i)
        assert independent_resolve(scene.phrase, scene.shapes) == scene.targets, (i, scene.phrase, scene.shapes)
        forms[scene.query.form] = forms.get(scene.query.form, 0) + 1
    # relational forms are really used, not only the plain "the red circle"
    assert set(forms) == {"attribute", "relation", "extreme", "attribute+position"}
    assert forms["relation"] >= 60 and forms["extreme"] >= 60


def test_one_object_phrases_are_said_with_and_without_their_article():
    """A share of one-object phrases drop their leading "the" ("red circle", "circle left of the
    blue square"); a set's phrase never does."""
    bare = {task: sum(not synth.make_scene(4, i, task=task).phrase.startswith("the ") for i in range(600))
            for task in ("full", "single", "colour")}
    for task, count in bare.items():
        assert abs(count / 600 - synth.BARE_SHARE) < 0.06, (task, count)
    sets = [synth.make_scene(4, i, task="every").phrase for i in range(300)]
    assert all(p.split()[0] in ("every", "all", "the") for p in sets)


def test_single_task_is_one_shape_named_by_colour_and_shape():
    for i in range(200):
        scene = synth.make_scene(0, i, task="single")
        assert len(scene.shapes) == 1 and scene.targets == [0]
        s = scene.shapes[0]
        assert scene.phrase in (f"the {s.colour} {s.kind}", f"{s.colour} {s.kind}")
    _, record = synth.make_sample(0, 0, task="single")
    assert record["task"] == "single"


@pytest.mark.parametrize("task", ["attribute", "multi"])
def test_curriculum_tasks_always_leave_a_choice(task):
    forms = set()
    for i in range(300):
        scene = synth.make_scene(3, i, task=task)
        assert len(scene.shapes) in (2, 3)  # never a lone shape: position alone is not the answer
        assert independent_resolve(scene.phrase, scene.shapes) == scene.targets, (i, scene.phrase)
        forms.add(scene.query.form)
    if task == "attribute":  # named by colour and/or kind, never by where it is
        assert forms == {"attribute"}
    else:
        assert forms == {"attribute", "relation", "extreme", "attribute+position"}


def test_colour_task_leaves_the_colour_word_the_only_cue():
    """2-3 shapes of one kind in distinct colours: the kind word (if any) fits them all, so a model
    that ignores the colour word can only guess."""
    for i in range(300):
        scene = synth.make_scene(5, i, task="colour", canvas=(112, 224))
        kinds, colours = {s.kind for s in scene.shapes}, [s.colour for s in scene.shapes]
        assert len(scene.shapes) in (2, 3) and len(kinds) == 1 and len(set(colours)) == len(colours)
        assert independent_resolve(scene.phrase, scene.shapes) == scene.targets, (i, scene.phrase)
        # without its colour word the phrase ("the circle", "the shape") names every shape alike
        without_colour = f" {scene.phrase}".replace(f" {colours[scene.targets[0]]} ", " ").strip()
        assert independent_resolve(without_colour, scene.shapes) == list(range(len(scene.shapes))), scene.phrase


def test_palette_variant_is_one_argument():
    pal = synth.Palette(colours={"purple": (120, 30, 160), "orange": (240, 120, 0)}, shapes=("diamond", "cross"))
    for i in range(80):
        scene = synth.make_scene(0, i, palette=pal)
        image, record = synth.make_sample(0, i, palette=pal)
        assert len(scene.shapes) <= 3
        for s in scene.shapes:
            assert s.colour in pal.colours and s.kind in pal.shapes
            _check_tight(np.asarray(image), s, pal.colours[s.colour])
        assert independent_resolve(scene.phrase, scene.shapes, pal) == scene.targets


def test_the_unseen_palette_is_a_flag_and_shares_no_colour_or_shape_with_the_default(tmp_path):
    from cli_in_process import groundtune

    unseen, default = synth.PALETTES["unseen"], synth.DEFAULT_PALETTE
    assert not set(unseen.colours) & set(default.colours) and not set(unseen.shapes) & set(default.shapes)
    assert groundtune("data", "synth", "--out", str(tmp_path), "--n", "40", "--palette", "unseen").returncode == 0
    words = {w.rstrip("s") for r in read_samples(tmp_path / "train.jsonl") for w in r["phrase"].split()}
    assert words & {*unseen.colours, *unseen.shapes} and not words & {*default.colours, *default.shapes}


def test_the_dark_palette_changes_the_background_alone(tmp_path):
    """`--palette dark` (the quickstart's variant): the default scene, sample for sample, on a dark
    grey; each shape's pixels are its colour, as on the light background."""
    from cli_in_process import groundtune

    dark = synth.PALETTES["dark"]
    assert (dark.colours, dark.shapes) == (synth.DEFAULT_PALETTE.colours, synth.DEFAULT_PALETTE.shapes)
    for i in range(20):
        image, record = synth.make_sample(4, i, task="full", palette=dark)
        light_image, light = synth.make_sample(4, i, task="full")
        assert record == light
        pixels = np.asarray(image)
        background = np.ones(pixels.shape[:2], bool)
        for s in synth.make_scene(4, i, task="full", palette=dark).shapes:
            _check_tight(pixels, s, dark.colours[s.colour])
            x1, y1, x2, y2 = s.box
            background[y1:y2, x1:x2] = False
        assert 30 <= pixels[background].min() and pixels[background].max() <= 70
        assert np.asarray(light_image)[background].min() >= 200
    assert groundtune("data", "synth", "--out", str(tmp_path), "--n", "8", "--palette", "dark").returncode == 0
    with pytest.raises(ValueError, match="too close to the background"):
        synth.Palette(colours={"charcoal": (60, 60, 60)}, background=45)
    with pytest.raises(ValueError, match="background 5"):
        synth.Palette(background=5)


def test_varied_canvases_are_drawn_per_sample_and_reproducible(tmp_path):
    """canvas=(MIN, MAX): each sample's sides drawn from the range (non-square too), the same
    files whatever the workers, and a sample's layout on a drawn canvas is its layout on that
    canvas given as width x height."""
    sides = [synth.canvas_size(3, i, "train", (112, 224)) for i in range(300)]
    assert all(112 <= w <= 224 and 112 <= h <= 224 for w, h in sides)
    assert sum(w != h for w, h in sides) > 250 and len({w for w, _ in sides}) > 60
    assert sides != [synth.canvas_size(3, i, "val", (112, 224)) for i in range(300)]  # the split is in the key
    a = synth.make_synthetic_set(tmp_path / "a", n=16, seed=3, task="every", canvas=(112, 224), workers=1)
    b = synth.make_synthetic_set(tmp_path / "b", n=16, seed=3, task="every", canvas=(112, 224), workers=2)
    assert a.read_bytes() == b.read_bytes()
    for i, record in enumerate(read_samples(a)):
        width, height = synth.canvas_size(3, i, "train", (112, 224))
        with Image.open(tmp_path / "a" / record["image"]) as image:
            assert image.size == (record["width"], record["height"]) == (width, height)
        assert all(0 <= x1 < x2 <= width and 0 <= y1 < y2 <= height for x1, y1, x2, y2 in record["bboxes"])
    drawn_image, drawn = synth.make_sample(3, 5, task="full", canvas=(112, 224))
    given_image, given = synth.make_sample(3, 5, *synth.canvas_size(3, 5, "train", (112, 224)), task="full")
    assert drawn == given and drawn_image.tobytes() == given_image.tobytes()
    assert synth.parse_canvas("112-224") == (112, 224) and synth.parse_canvas("168") == (168, 168)
    with pytest.raises(ValueError, match="MIN-MAX"):
        synth.parse_canvas("big")
    with pytest.raises(ValueError, match="MIN <= MAX"):
        synth.parse_canvas("224-112")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="cannot draw"):
        synth.Palette(shapes=("hexagon",))
    with pytest.raises(ValueError, match="background"):
        synth.Palette(colours={"white": (250, 250, 250)})
    with pytest.raises(ValueError, match="task"):
        synth.make_sample(0, 0, task="double")


def test_a_set_already_there_is_replaced_only_with_overwrite_and_its_stale_images_go(tmp_path):
    """`data synth --n 20` over a set of 10,000 cut it to 20 silently and left the rest of its
    images orphaned: now it needs overwrite, which also removes the images nothing names any more.
    A file of that name synth did not write is never replaced; a file beside the images stays."""
    synth.make_synthetic_set(tmp_path, n=5, seed=1, workers=1)
    (tmp_path / "images" / "mine.png").write_bytes(b"not synth's")
    before = sorted(p.name for p in (tmp_path / "images").iterdir())
    with pytest.raises(DataError, match=r"train\.jsonl holds a synthetic set already: give --overwrite to replace it"):
        synth.make_synthetic_set(tmp_path, n=2, seed=1, workers=1)
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == before
    assert len(read_samples(tmp_path / "train.jsonl")) == 5
    synth.make_synthetic_set(tmp_path, n=2, seed=1, workers=1, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == ["mine.png", "train-0000000.png",
                                                                       "train-0000001.png"]
    assert [r["image"] for r in read_samples(tmp_path / "train.jsonl")] == ["images/train-0000000.png",
                                                                            "images/train-0000001.png"]
    synth.make_synthetic_set(tmp_path, n=2, seed=1, split="val", workers=1)  # another split: another file
    (tmp_path / "val.jsonl").write_text('{"id": "mine"}\n')
    with pytest.raises(DataError, match="was not written by `groundtune data synth`"):
        synth.make_synthetic_set(tmp_path, n=2, seed=1, split="val", workers=1, overwrite=True)


# --------------------------------------------------------------------------------------------
# The every task: a phrase names a set, possibly empty


def independent_set(phrase: str, shapes: list[synth.Shape], palette=PAL) -> list[int]:
    """The shapes a set phrase names, read with a grammar of its own: "every red circle", "all the
    red circles", "all red circles", "the red circles", "every red shape", "all the squares" ..."""
    c, k = "|".join(palette.colours), "|".join(palette.shapes)
    m = (re.fullmatch(rf"every (?:(?P<c>{c}) )?(?P<k>{k}|shape)", phrase)
         or re.fullmatch(rf"(?:all the|all|the) (?:(?P<c>{c}) )?(?P<k>(?:{k})e?s|shapes)", phrase))
    assert m, f"not a set phrase: {phrase!r}"
    colour = m.group("c")
    kind = m.group("k")
    kind = None if kind.startswith("shape") else next(s for s in palette.shapes if kind in (s, s + "s", s + "es"))
    assert colour or kind, phrase
    return [i for i, s in enumerate(shapes) if (colour is None or s.colour == colour) and (kind is None or s.kind == kind)]


def test_every_task_names_sets_and_sometimes_nothing():
    sizes, repeated = [], 0
    for i in range(600):
        scene = synth.make_scene(seed=4, index=i, task="every")
        assert 1 <= len(scene.shapes) <= 6
        assert independent_set(scene.phrase, scene.shapes) == scene.targets, (i, scene.phrase)
        sizes.append(len(scene.targets))
        pairs = [(s.colour, s.kind) for s in scene.shapes]
        repeated += len(set(pairs)) < len(pairs)
    # a quarter name nothing in the image (20,000 scenes: 24.7% to 25.1%; these 600: 24.2%)
    assert sizes.count(0) / len(sizes) == pytest.approx(synth.NO_TARGET_SHARE, abs=0.03)
    assert sum(n >= 2 for n in sizes) / len(sizes) >= 0.10 and repeated >= 30  # real sets, repeated pairs
    image, record = synth.make_sample(seed=4, index=0, task="every")
    assert "bbox" not in record and isinstance(record["bboxes"], list)


def test_every_task_files_are_canonical_sets_and_reproducible(tmp_path):
    a = synth.make_synthetic_set(tmp_path / "a", n=40, seed=5, task="every", workers=1)
    b = synth.make_synthetic_set(tmp_path / "b", n=40, seed=5, task="every", workers=2)
    assert a.read_bytes() == b.read_bytes()
    records = read_samples(a)
    assert any(r["bboxes"] == [] for r in records) and any(len(r["bboxes"]) >= 2 for r in records)
    from groundtune.data import check

    report = check.check_file(a)
    assert report.trainable and report.no_target == sum(r["bboxes"] == [] for r in records)


def test_contrast_task_asks_one_image_twice_by_its_colour_word():
    """Samples 2j and 2j+1: the same pixels, phrases differing in the colour word alone, the first
    naming shapes in the image and the second another colour's shapes (or none): only a model that
    reads the colour word answers both."""
    second_empty = 0
    for j in range(150):
        (image_a, a), (image_b, b) = (synth.make_sample(seed=4, index=2 * j + m, task="contrast", canvas=(112, 224))
                                      for m in (0, 1))
        assert image_a.tobytes() == image_b.tobytes() and (a["width"], a["height"]) == (b["width"], b["height"])
        words_a, words_b = a["phrase"].split(), b["phrase"].split()
        differ = [i for i, (x, y) in enumerate(zip(words_a, words_b)) if x != y]
        assert len(words_a) == len(words_b) and len(differ) == 1, (a["phrase"], b["phrase"])
        assert {words_a[differ[0]], words_b[differ[0]]} <= set(PAL.colours)
        assert a["bboxes"] and a["bboxes"] != b["bboxes"], (a, b)
        scene = synth.make_scene(seed=4, index=2 * j + 1, task="contrast", canvas=(112, 224))
        assert independent_set(scene.phrase, scene.shapes) == scene.targets and scene.phrase == b["phrase"]
        second_empty += not b["bboxes"]
    assert 0.15 < second_empty / 150 < 0.85  # the other colour: sometimes in the image, sometimes not
    # a sequence of its own: pair 0 is not the every task's scene 0
    assert synth.make_sample(seed=4, index=0, task="every")[0].tobytes() != \
        synth.make_sample(seed=4, index=0, task="contrast")[0].tobytes()
