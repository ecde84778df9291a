"""The sample grid: written, the right size, broken records drawn as red cells, and the model-side
box where boxes.original_to_resized puts it."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image, ImageDraw

from groundtune.boxes import ResizeSpec, original_to_resized

RESIZE = ResizeSpec(factor=28, min_pixels=3136, max_pixels=1003520)  # groundtune's presets' budget
from groundtune.data import show, synth


def _cell_origin(i: int, cells: int) -> tuple[int, int]:
    cols = show.grid_size(cells)[0] // show.CELL_W
    return (i % cols) * show.CELL_W, (i // cols) * show.CELL_H


def test_grid_with_broken_records_does_not_crash(tmp_path):
    path = synth.make_synthetic_set(tmp_path, n=5, seed=0, workers=1)
    (tmp_path / "images" / "garbage.png").write_bytes(b"not a png at all")
    good = json.loads(path.read_text().splitlines()[0])
    with open(path, "a") as f:
        f.write(json.dumps({**good, "id": "missing", "image": "images/nope.png"}) + "\n")
        f.write(json.dumps({**good, "id": "garbage", "image": "images/garbage.png"}) + "\n")
        f.write("{this is not json\n")
    out = show.show_grid(path, tmp_path / "grid.png", RESIZE, n=16)
    grid = Image.open(out)
    assert out == tmp_path / "grid.png"
    assert grid.size == show.grid_size(8) == (3 * show.CELL_W, 3 * show.CELL_H)
    pixels = grid.convert("RGB")
    for i in range(8):  # fewer records than n: all of them, in file order
        x, y = _cell_origin(i, 8)
        expected = show.ERROR_BG if i >= 5 else (255, 255, 255)
        assert pixels.getpixel((x + 1, y + 1)) == expected, i
    assert not list(tmp_path.glob(".grid.png.*"))  # the atomic write left no temporary file


def test_random_choice_is_reproducible(tmp_path):
    path = synth.make_synthetic_set(tmp_path, n=12, seed=1, workers=1)
    a = show.show_grid(path, tmp_path / "a.png", RESIZE, n=4, seed=7).read_bytes()
    b = show.show_grid(path, tmp_path / "b.png", RESIZE, n=4, seed=7).read_bytes()
    c = show.show_grid(path, tmp_path / "c.png", RESIZE, n=4, seed=8).read_bytes()
    assert Image.open(tmp_path / "a.png").size == show.grid_size(4) == (2 * show.CELL_W, 2 * show.CELL_H)
    assert a == b and a != c


def test_model_panel_box_is_the_resized_box(tmp_path):
    # 100x50 -> smart_resize (factor 28) -> 112x56: the right panel must show the box mapped there
    image = Image.new("RGB", (100, 50), "white")
    ImageDraw.Draw(image).rectangle([20, 10, 59, 29], fill=(0, 128, 0))
    image.save(tmp_path / "x.png")
    box = [20.0, 10.0, 60.0, 30.0]
    rec = {"id": "x", "image": "x.png", "width": 100, "height": 50, "phrase": "the green box", "bbox": box}
    (tmp_path / "d.jsonl").write_text(json.dumps(rec) + "\n")
    resize = ResizeSpec(factor=28, min_pixels=3136, max_pixels=1003520)
    assert resize.resized_size((100, 50)) == (112, 56)
    grid = np.asarray(Image.open(show.show_grid(tmp_path / "d.jsonl", tmp_path / "g.png", resize=resize)))

    right = 2 * show.PAD + show.THUMB  # the model panel: 112x56 fitted into THUMB (x2), centred
    panel = grid[show.PAD: show.PAD + show.THUMB, right: right + show.THUMB]
    ys, xs = np.nonzero(np.all(panel == show.BOX_COLOUR, axis=-1))
    s = show.THUMB / 112
    oy = (show.THUMB - round(56 * s)) // 2
    x1, y1, x2, y2 = (v * s for v in original_to_resized(box, (100, 50), (112, 56)))
    # the outline is drawn 2 px wide just outside the box edges
    assert (xs.min(), ys.min()) == (round(x1) - 2, oy + round(y1) - 2)
    assert (xs.max() + 1, ys.max() + 1) == (round(x2) + 2, oy + round(y2) + 2)


def test_a_no_target_record_is_drawn_without_a_box_and_says_so(tmp_path, monkeypatch):
    """A cell for "bboxes": [] shows its image with no outline and writes that nothing matches."""
    path = synth.make_synthetic_set(tmp_path, n=1, seed=0, workers=1)
    record = json.loads(path.read_text())
    del record["bbox"]
    path.write_text(json.dumps({**record, "bboxes": [], "phrase": "the purple star"}) + "\n")
    said = []
    real_text = ImageDraw.ImageDraw.text
    monkeypatch.setattr(ImageDraw.ImageDraw, "text", lambda self, xy, text, *a, **k: said.append(text) or
                        real_text(self, xy, text, *a, **k))
    out = show.show_grid(path, tmp_path / "grid.png", RESIZE, n=1)
    assert any("no target" in text for text in said)
    cell = np.asarray(Image.open(out).convert("RGB"))
    assert not (cell == np.array(show.BOX_COLOUR)).all(-1).any()  # no box outline anywhere
