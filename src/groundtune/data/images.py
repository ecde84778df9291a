"""Opening images the one way every stage opens them.

Boxes are annotated on the pixels as the dataset recorded them (COCO's width/height are those of
the stored pixels, EXIF ignored). So we keep the stored orientation and only apply the EXIF
rotation when that is what makes the decoded size agree with the recorded one: pixels are never
rotated away from their annotation.

Images a stranger sends (the server's) are opened with ``open_untrusted``: a few plain formats
only, their frame's size checked before a pixel is decoded, and ``decoding_bytes`` says what
decoding one will hold in memory, before it is decoded.

A file on disk is opened with the bytes read bounded (``opened``): its header must end within
HEADER_BYTES, and decoding may read what its frame can take and no more. Pillow's JPEG reader skips
bytes that are no marker one at a time, so a JPEG header followed by 10 GB of zeros (or a sparse
file) read for ten minutes; bounded, it is refused in about a second. A JPEG whose header promises
a frame its file is too small to hold is refused before a pixel is decoded (``_jpeg_too_short``).
"""

from __future__ import annotations

import contextlib
import io
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from PIL import Image, ImageOps

from groundtune.files import path_problem, regular_file

from .records import DataError

# The most bytes an image's header may take. A camera JPEG's is under 100 KB (EXIF, a thumbnail, an
# ICC profile, XMP); Pillow skips junk a byte at a time, ~0.15 s a MB: a second at most.
HEADER_BYTES = 8 * 2**20


class ReadTooMuch(OSError):
    """An image file read past what its header, or its frame, can take: damaged, or no image."""


class TooShort(OSError):
    """An image file smaller than the least its header's frame can be stored in: damaged, or no image."""


class _Bounded(io.RawIOBase):
    """A file that raises ReadTooMuch once more than ``limit`` bytes have been read from it. No
    ``fileno``: a decoder handed the descriptor (libtiff) would read past the count."""

    def __init__(self, raw: io.FileIO, limit: int):
        self.raw, self.limit, self.taken = raw, limit, 0
        self.what = "the end of the image's header"  # what reading up to ``limit`` should have found

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.raw.readinto(buffer) or 0
        self.taken += n
        if self.taken > self.limit:
            size = os.fstat(self.raw.fileno()).st_size
            raise ReadTooMuch(f"read {self.taken:,} bytes of a {size:,}-byte file without finding {self.what}")
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()


@contextlib.contextmanager
def opened(path: str | Path) -> Iterator[Image.Image]:
    """``path`` opened by Pillow (its header read, nothing decoded), the bytes it may read bounded:
    HEADER_BYTES to open it, then as much again as its frame can take (twice its pixels' bytes) to
    decode it; past either, a ReadTooMuch (an OSError, as any file that does not decode). A path no
    file can have, or no regular file (a FIFO would block the open forever), is a DataError."""
    problem = path_problem(path)
    if problem:
        raise DataError(f"image {problem}")
    regular_file(path, "image")
    with open(path, "rb", buffering=0) as raw:
        bounded = _Bounded(raw, HEADER_BYTES)
        try:
            image = Image.open(io.BufferedReader(bounded, 2**16))
        except Image.UnidentifiedImageError:  # said as Pillow says it for a path
            raise Image.UnidentifiedImageError(f"cannot identify image file {str(path)!r}") from None
        with image:
            width, height = image.size
            short = _jpeg_too_short(image, raw.fileno()) if image.format in ("JPEG", "MPO") else None
            if short:
                raise TooShort(short)
            bounded.limit = bounded.taken + 2 * width * height * _bytes_per_pixel(image.mode) + HEADER_BYTES
            bounded.what = f"the end of a {width}x{height} image"
            yield image


# Every 8x8 block of every component of a Huffman-coded JPEG (baseline, extended, progressive,
# lossless: SOF0-3, 5-7) takes at least one bit of scan data, its DC coefficient's code (a
# progressive file's first DC scan included); a flat image, the most compressible, takes 2 (grey,
# optimised tables) to 32 bits (4:2:0 colour, standard tables) a block of its smallest component
# (measured with Pillow, 4000x4000, every quality). libjpeg fills a scan cut short by a marker with
# grey and says nothing: a 633-byte file whose header says 13000x13000 decoded to a grey image in
# 1.8 s, at 1.3 GB (1.6 GB progressive). So a frame whose smallest component has more blocks than
# the file has bits after its header is refused, unread (one component only: a file may leave the
# others out, which libjpeg decodes as grey). Arithmetic coding (SOF9-15, rare) can take far less
# than a bit a block: not judged. PNG, GIF, TIFF and BMP need no such rule: Pillow refuses their
# short data itself ("truncated") before the frame it allocated is touched (12000x12000: 24 MB,
# 0.01 s). A frame the file CAN hold is decoded, however large (Pillow's own limit aside): a scan of
# zeros is no sign of damage (a grey 4000x4000 JPEG with optimised tables: 62,504 of its scan's
# 62,512 bytes are zeros), and only the read budget bounds it.
_HUFFMAN_FRAMES = (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7)


def _jpeg_too_short(image: Image.Image, fd: int) -> str | None:
    """Why the JPEG ``image`` (open on ``fd``) cannot hold the frame its header says, or None."""
    found = _jpeg_scan_start(fd)
    if found is None or found[0] not in _HUFFMAN_FRAMES or not image.layer:
        return None
    width, height = image.size
    h_max, v_max = max(c[1] for c in image.layer), max(c[2] for c in image.layer)
    share = min(c[1] * c[2] for c in image.layer) / (h_max * v_max)  # the smallest component's
    least = int(width * height * share / 64) // 8  # a bit a block, edge blocks not counted
    held = os.fstat(fd).st_size - found[1]
    if held >= least:
        return None
    return (f"its header says {width}x{height}, whose scan takes at least {least:,} bytes (a bit for each 8x8 "
            f"block); the file holds {held:,} after its header")


def _jpeg_scan_start(fd: int) -> tuple[int, int] | None:
    """(the frame's SOF marker, where the first scan's data begins) of the JPEG file ``fd``, its
    segments walked with ``os.pread`` (Pillow's position in the file stays where it is); None where
    the walk meets anything but a segment within HEADER_BYTES (Pillow skips such junk)."""
    at, frame = 2, None
    while at < HEADER_BYTES:
        head = os.pread(fd, 4, at)
        if len(head) < 4 or head[0] != 0xFF:
            return None
        if head[1] == 0xFF:  # a fill byte before the marker
            at += 1
            continue
        if 0xC0 <= head[1] <= 0xCF and head[1] not in (0xC4, 0xC8, 0xCC):  # not DHT, JPG, DAC
            frame = frame or head[1]
        length = struct.unpack(">H", head[2:])[0]
        if head[1] == 0xDA:  # SOS: the scan's data follows its header
            return (frame, at + 2 + length) if frame else None
        at += 2 + length
    return None


def png_info(software: str):
    """What a PNG groundtune draws carries to say which command drew it (its "Software" text), so
    that the next run of that command may replace it (``drawn_by``)."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("Software", software)
    return info


def drawn_by(path: str | Path, software: str) -> bool:
    """Whether ``path`` is a PNG that ``software`` drew (``png_info``); anything unreadable is not."""
    try:
        with opened(path) as image:
            return image.format == "PNG" and image.info.get("Software") == software
    except Exception:  # a file that does not open is no drawing of ours
        return False


def header_size(path: str | Path) -> tuple[int, int]:
    """An image file's stored (width, height), read from its header alone (no pixels decoded): what
    a record without width/height is given. DataError naming the file when it cannot be read, or
    is not a regular file (a FIFO would block the open forever)."""
    try:
        with opened(path) as im:
            return im.size
    except DataError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"cannot read image {path} ({e})") from None


def load_image(path: str | Path, expected_size: tuple[int, int] | None = None) -> Image.Image:
    """Decode an image fully as RGB. ``expected_size`` is the recorded (width, height).

    Raises DataError naming the file when it is missing, not a regular file (a FIFO, a socket, a
    device: refused before it is opened), unreadable or truncated, or when its size disagrees
    with the recorded one in a way EXIF transposition does not explain.
    """
    try:
        with opened(path) as im:
            im.load()  # decode now: a truncated file fails here, not later in a worker
            image = im.copy()
    except FileNotFoundError:
        raise DataError(f"{path}: image file not found") from None
    except DataError:
        raise
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


# Scaled to 8 bits by their largest value, a band of this many pixels at a time: 2 MB of float64
# (the whole image at once was 8 bytes a pixel, three times over)
_DEEP_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")
_BAND_PIXELS = 2**18


def to_rgb(image: Image.Image) -> Image.Image:
    """Grayscale, palette, CMYK, 16-bit, 32-bit, float and RGBA images become 8-bit RGB (alpha
    over white); an RGB image is returned as it is.

    16-bit, 32-bit and float grayscale is scaled to 8 bits by its largest value (not clipped at
    255, which made a 16-bit image white), a band of rows at a time: beside the image it holds
    one byte a pixel of grey and the RGB result (Pillow keeps RGB in 4 bytes a pixel), so a 50 MP
    16-bit PNG (100 MB decoded) peaks at 100 + 50 + 200 = 350 MB (``decoding_bytes``; whole-image
    float64 arrays took 1.2 GB more). Negative values and NaN count as 0."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))  # one band, not split()'s four
        return background
    if image.mode in _DEEP_MODES:
        return _to_8_bits(image).convert("RGB")
    return image.convert("RGB")


def _to_8_bits(image: Image.Image) -> Image.Image:
    """A 16-bit, 32-bit or float grayscale image -> "L", ``value / peak * 255`` rounded (as numpy
    rounds: what the whole-image version gave), a band of rows at a time."""
    import numpy as np

    width, height = image.size
    rows = max(1, _BAND_PIXELS // max(1, width))
    bands = [(0, top, width, min(top + rows, height)) for top in range(0, height, rows)]

    def band(box) -> np.ndarray:  # one array a band, worked on in place
        values = np.array(image.crop(box), dtype=np.float64)
        np.nan_to_num(values, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
        return np.maximum(values, 0.0, out=values)

    peak = max((float(band(box).max(initial=0.0)) for box in bands), default=0.0)
    peak = peak if peak > 0 else 1.0
    grey = np.empty((height, width), dtype=np.uint8)
    for box in bands:
        values = band(box)
        values /= peak
        values *= 255.0
        grey[box[1]:box[3]] = np.round(values, out=values)
    return Image.fromarray(grey)


# --------------------------------------------------------------------------------------------
# Images a stranger sends

# Formats whose header gives the size of the frame Pillow decodes (GIF's first frame widens the
# screen it is opened with; APNG, MPO and TIFF decode their first frame or page) and that Pillow
# decodes itself. Not ICO (its directory's size is not its frame's, and Pillow decodes the frame
# while opening it), nor EPS or PDF (Ghostscript), nor the rarer plugins.
PLAIN_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG's opener opens MPO too
FORMAT_NAMES = "PNG, JPEG, WebP, GIF, BMP or TIFF"


class TooManyPixels(DataError):
    """An image over a pixel limit, found before it was decoded."""

    def __init__(self, size: tuple[int, int] | None, limit: int, pixels: int | None = None):
        self.size, self.limit = size, limit
        self.pixels = size[0] * size[1] if size is not None else pixels
        shown = f"{size[0]}x{size[1]} = {self.pixels:,}" if size is not None else (
            f"{pixels:,}" if pixels is not None else "more than that")
        super().__init__(f"the image is {shown} pixels; the limit is {limit:,}")


class NotAnImage(DataError):
    """Bytes that are no image in an accepted format."""


@dataclass(frozen=True)
class Frame:
    """What an image's header says of the frame that decoding it gives, nothing decoded."""

    format: str
    size: tuple[int, int]
    mode: str
    may_turn: bool  # an EXIF orientation may transpose it: a second copy while it turns
    file_bytes: int  # a decoder may read the file's data whole (an uncompressed TIFF strip)


def untrusted_frame(data: bytes, max_image_pixels: int, formats: tuple[str, ...] = PLAIN_FORMATS) -> Frame:
    """The frame ``data`` decodes to, from its header: NotAnImage when it is none of ``formats``,
    TooManyPixels when it is over ``max_image_pixels``. Nothing of the image's size is allocated:
    WebP's size is read from its RIFF header here, because Pillow's WebP plugin creates its
    decoder, which allocates the whole canvas, while opening the file."""
    size = _webp_canvas(data) if "WEBP" in formats else None
    if size is not None:
        if size[0] * size[1] > max_image_pixels:
            raise TooManyPixels(size, max_image_pixels)
        return Frame("WEBP", size, "RGBA", True, len(data))  # its EXIF is read by the decoder
    image = open_untrusted(data, max_image_pixels, formats)
    # Pillow's PNG getexif decodes the image to look for an eXIf chunk after the pixels: assume one
    may_turn = image.format == "PNG" or image.getexif().get(0x0112, 1) in range(2, 9)
    return Frame(image.format, image.size, image.mode, may_turn, len(data))


def open_untrusted(data: bytes, max_image_pixels: int, formats: tuple[str, ...] = PLAIN_FORMATS) -> Image.Image:
    """``data`` opened (headers read, nothing decoded yet) when it is one of ``formats`` and its
    frame is at most ``max_image_pixels``; NotAnImage or TooManyPixels otherwise, before any pixel is
    decoded. Pillow's own decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``) is not the
    judge: where it is on, a header it refuses is a TooManyPixels too."""
    size = _webp_canvas(data) if "WEBP" in formats else None
    if size is not None and size[0] * size[1] > max_image_pixels:  # before Pillow's decoder allocates it
        raise TooManyPixels(size, max_image_pixels)
    try:
        image = Image.open(io.BytesIO(data), formats=list(formats))
    except Image.DecompressionBombError as e:  # "Image size (N pixels) exceeds limit of ...": its N
        pixels = next((int(word.strip("(")) for word in str(e).split() if word.strip("(").isdigit()), None)
        raise TooManyPixels(None, max_image_pixels, pixels) from None
    except Image.UnidentifiedImageError:
        raise NotAnImage(f"not an image format the server reads; send {FORMAT_NAMES}") from None
    if image.width * image.height > max_image_pixels:
        raise TooManyPixels(image.size, max_image_pixels)
    return image


def _webp_canvas(data: bytes) -> tuple[int, int] | None:
    """A WebP file's canvas (width, height) from its first chunk's header, or None when ``data``
    is no WebP file (the same reading as Pillow's WebP plugin, done before its decoder exists)."""
    if len(data) < 30 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    chunk = data[12:16]
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":  # lossy: a key frame's start code, then 14-bit sizes
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and data[20] == 0x2F:  # lossless: 14 bits each, minus one
        bits = struct.unpack("<I", data[21:25])[0]
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":  # extended (alpha, animation, EXIF): the canvas, 24 bits each, minus one
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    return None


def _bytes_per_pixel(mode: str) -> int:
    """What Pillow stores a pixel of ``mode`` in (RGB too takes 4 bytes)."""
    return 1 if mode in ("1", "L", "P") else 2 if mode.startswith("I;16") else 4


def decoding_bytes(frame: Frame) -> int:
    """The most memory decoding ``frame`` holds at once, its EXIF rotation applied and made RGB
    (``to_rgb``), from its header alone: what a server reserves before decoding it. A 50 MP
    16-bit PNG: 7 bytes a pixel, 350 MB, and 16 MB besides (measured: 357 MB at 49 MP); a 50 MP
    JPEG photo: 200 MB, 400 when its EXIF turns it (a PNG's EXIF may follow its pixels: counted
    as turning); a WebP adds its decoder's canvases and the frame it hands over (12 bytes a
    pixel). Conservative where the header cannot tell (a palette's transparency)."""
    pixels = frame.size[0] * frame.size[1]
    decoded = pixels * _bytes_per_pixel(frame.mode)
    turning = decoded if frame.may_turn else 0
    if frame.mode == "RGB":
        converting = 0
    elif frame.mode in _DEEP_MODES:
        converting = pixels * (1 + 4)  # the 8-bit grey, then RGB
    elif frame.mode == "RGBA":
        converting = pixels * (4 + 1)  # the white RGB, the alpha band
    elif frame.mode in ("LA", "PA", "P"):
        converting = pixels * (4 + 4 + 1)  # RGBA first
    else:
        converting = pixels * 4
    decoder = pixels * 12 if frame.format == "WEBP" else 0  # kept by the image until it is dropped
    return decoded + max(turning, converting) + decoder + frame.file_bytes + _WORKING_BYTES


# What decoding holds beside the image, whatever its size: to_rgb's bands (2 MB of float64 each),
# decoders' buffers (measured: 13.5 MB beside 16-bit PNGs of 3 to 49 MP, numpy's import included)
_WORKING_BYTES = 16 * 2**20
