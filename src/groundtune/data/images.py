"""Opening images the one way every stage opens them.

Boxes are annotated on the pixels as the dataset recorded them (COCO's width/height are those of
the stored pixels, EXIF ignored). So we keep the stored orientation and only apply the EXIF
rotation when that is what makes the decoded size agree with the recorded one: pixels are never
rotated away from their annotation.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageOps

from .records import DataError


def header_size(path: str | Path) -> tuple[int, int]:
    """An image file's stored (width, height), read from its header alone (no pixels decoded): what
    a record without width/height is given. DataError naming the file when it cannot be read."""
    try:
        with Image.open(path) as im:
            return im.size
    except (OSError, SyntaxError, ValueError) as e:
        raise DataError(f"cannot read image {path} ({e})") from None


def load_image(path: str | Path, expected_size: tuple[int, int] | None = None) -> Image.Image:
    """Decode an image fully as RGB. ``expected_size`` is the recorded (width, height).

    Raises DataError naming the file when it is missing, unreadable or truncated, or when its
    size disagrees with the recorded one in a way EXIF transposition does not explain.
    """
    try:
        with Image.open(path) as im:
            im.load()  # decode now: a truncated file fails here, not later in a worker
            image = im.copy()
    except FileNotFoundError:
        raise DataError(f"{path}: image file not found") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        # DecompressionBombError is no OSError: a corrupt header claiming billions of pixels raises it.
        raise DataError(f"{path}: cannot decode image ({e})") from None
    if expected_size is not None and image.size != tuple(expected_size):
        transposed = ImageOps.exif_transpose(image)
        if transposed.size == tuple(expected_size):
            image = transposed
        else:
            raise DataError(
                f"{path}: decoded size {image.size[0]}x{image.size[1]} disagrees with the recorded "
                f"{expected_size[0]}x{expected_size[1]}; fix the record's width/height or the image"
            )
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """Grayscale, palette, CMYK, 16-bit and RGBA images become 8-bit RGB (alpha over white)."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.split()[3])
        return background
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit grayscale: scale to 8 bits instead of clipping everything above 255 to white.
        import numpy as np

        a = np.asarray(image, dtype=np.float64)
        peak = a.max() if a.size else 1.0
        a = (a / (peak if peak > 0 else 1.0) * 255.0).round().astype("uint8")
        return Image.fromarray(a, mode="L").convert("RGB")
    return image.convert("RGB")
