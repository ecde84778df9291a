"""Draw samples with their boxes, as stored and as the model sees them.

Each cell of the grid shows the original image with its box(es) beside the image after
smart_resize with the box mapped by ``boxes.original_to_resized``, the very function training
uses to make targets. A box that is wrong after resizing is wrong in the right-hand picture.

    groundtune data show data/synth/train.jsonl --out grid.png --n 16
"""

from __future__ import annotations

import math
import random
import textwrap
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from groundtune.boxes import ResizeSpec, Size, original_to_resized, scale_box
from groundtune.data.images import load_image, png_info
from groundtune.data.records import DataError, Line, atomic_write, image_path, iter_jsonl, sample_boxes

THUMB = 224  # each picture is fitted into a THUMB x THUMB panel
PAD = 8
LINE_H = 16
TEXT_LINES = 4  # phrase (2 lines), sizes, model box
DRAWN_BY = "groundtune data show"  # in the PNG it writes: a later show may replace it (images.drawn_by)
CELL_W = 2 * THUMB + 3 * PAD
CELL_H = PAD + THUMB + PAD + TEXT_LINES * LINE_H + PAD
BOX_COLOUR = (255, 0, 255)  # magenta: unlike every synthetic colour and most photos
PANEL_BG = (235, 235, 235)
ERROR_BG = (255, 225, 225)
ERROR_FG = (200, 0, 0)


def grid_size(cells: int) -> Size:
    """(width, height) of the PNG for this many cells: a near-square grid of columns."""
    cols = max(1, math.ceil(math.sqrt(cells)))
    rows = max(1, math.ceil(cells / cols))
    return cols * CELL_W, rows * CELL_H


def _font(size: int = 13):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has only the fixed bitmap font
        return ImageFont.load_default()


def fit(image: Image.Image) -> tuple[Image.Image, Size]:
    """The image scaled to fit a THUMB panel. Upscaling uses nearest neighbour so single pixels
    stay visible: a tight box then visibly touches the shape."""
    w, h = image.size
    s = THUMB / max(w, h)
    size = (max(1, round(w * s)), max(1, round(h * s)))
    resample = Image.Resampling.NEAREST if s >= 1 else Image.Resampling.BILINEAR
    return image.resize(size, resample), size


def _panel(cell: Image.Image, x: int, y: int, image: Image.Image, boxes: list[list[float]]) -> None:
    """Paste image fitted into the panel at (x, y) and outline boxes (given in image pixels)."""
    draw = ImageDraw.Draw(cell)
    draw.rectangle([x, y, x + THUMB - 1, y + THUMB - 1], fill=PANEL_BG)
    thumb, size = fit(image)
    ox, oy = x + (THUMB - size[0]) // 2, y + (THUMB - size[1]) // 2
    cell.paste(thumb, (ox, oy))
    for box in boxes:
        x1, y1, x2, y2 = (round(v) for v in scale_box(box, image.size, size))  # PIL would truncate
        # Drawn just outside the box edges (PIL's rectangle includes its end pixels and draws
        # width inwards), so the outline never hides the object's border pixels.
        draw.rectangle([ox + x1 - 2, oy + y1 - 2, ox + x2 + 1, oy + y2 + 1], outline=BOX_COLOUR, width=2)


def _fmt(box: list[float]) -> str:
    return "[" + ", ".join(f"{v:.1f}" for v in box) + "]"


def _sample_cell(record: dict, jsonl_path: Path, resize: ResizeSpec, font) -> Image.Image:
    """Original with its boxes | resized with the mapped boxes, and text under them."""
    expected = (int(record["width"]), int(record["height"])) if "width" in record and "height" in record else None
    image = load_image(image_path(record, jsonl_path), expected)
    boxes = sample_boxes(record)
    original = image.size
    resized = resize.resized_size(original)
    model_image = image.resize(resized, Image.Resampling.BICUBIC)  # what the processor feeds the model
    model_boxes = [original_to_resized(b, original, resized) for b in boxes]

    cell = Image.new("RGB", (CELL_W, CELL_H), "white")
    _panel(cell, PAD, PAD, image, boxes)
    _panel(cell, 2 * PAD + THUMB, PAD, model_image, model_boxes)
    draw = ImageDraw.Draw(cell)
    lines = textwrap.wrap(str(record.get("phrase", ""))[:200], width=64)[:2]  # two lines of it: what fits
    lines += [""] * (2 - len(lines))
    lines.append(f"original {original[0]}x{original[1]}  ->  model {resized[0]}x{resized[1]}  ({record.get('id', '')})")
    lines.append(("model boxes: " + " ".join(_fmt(b) for b in model_boxes)) if model_boxes
                 else "no target: the phrase names nothing in this image")
    for i, text in enumerate(lines):
        draw.text((PAD, 2 * PAD + THUMB + i * LINE_H), text, fill="black", font=font)
    return cell


def _error_cell(message: str, font) -> Image.Image:
    cell = Image.new("RGB", (CELL_W, CELL_H), ERROR_BG)
    draw = ImageDraw.Draw(cell)
    for i, text in enumerate(textwrap.wrap("unreadable: " + message, width=64)[: (CELL_H - 2 * PAD) // LINE_H]):
        draw.text((PAD, PAD + i * LINE_H), text, fill=ERROR_FG, font=font)
    return cell


def cell(line: Line, jsonl_path: Path, resize: ResizeSpec, font=None) -> Image.Image:
    """One grid cell: the record of ``line`` beside its image resized with ``resize``, or the red
    "unreadable: ..." cell saying why it cannot be drawn (what the studio shows of one sample)."""
    font = font or _font()
    if line.error:
        return _error_cell(f"line {line.number}: {line.error}", font)
    try:
        return _sample_cell(line.record, jsonl_path, resize, font)
    except DataError as e:
        return _error_cell(f"line {line.number}: {e}", font)
    except KeyError as e:
        return _error_cell(f"line {line.number}: missing field {e}", font)
    except (TypeError, ValueError) as e:  # e.g. a box that is not four numbers
        return _error_cell(f"line {line.number}: {e}", font)


def show_grid(
    jsonl_path: str | Path,
    out_png: str | Path,
    resize: ResizeSpec,
    n: int = 16,
    seed: int = 0,
) -> Path:
    """Draw n records of a JSONL file (a random choice with ``seed``, in file order; all of them if
    fewer) into one PNG, each beside its image resized with ``resize`` (the model's pixel budget).
    A record that cannot be drawn becomes a red "unreadable: ..." cell."""
    jsonl_path = Path(jsonl_path)
    lines = list(iter_jsonl(jsonl_path))
    if not lines:
        raise DataError(f"{jsonl_path}: no records to show")
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if len(lines) > n:
        lines = [lines[i] for i in sorted(random.Random(seed).sample(range(len(lines)), n))]

    font = _font()
    grid = Image.new("RGB", grid_size(len(lines)), "white")
    cols = grid.width // CELL_W
    for i, line in enumerate(lines):
        grid.paste(cell(line, jsonl_path, resize, font), ((i % cols) * CELL_W, (i // cols) * CELL_H))

    out_png = Path(out_png)
    with atomic_write(out_png, "wb") as f:
        grid.save(f, format="PNG", pnginfo=png_info(DRAWN_BY))
    return out_png
