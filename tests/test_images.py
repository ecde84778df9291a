"""data/images.py: deep (16-bit, 32-bit, float) images to 8-bit RGB as before, in a bounded
amount of memory (measured); images a stranger sends refused on their frame's own size before
anything is decoded; a path that is no regular file refused before it is opened. Peak memory
is measured in a fresh process (its own high-water mark), and a FIFO is opened in one that a
timeout can end if it ever waits."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

from groundtune.data import images
from groundtune.errors import DataError


def _encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def _whole_image_float64(image: Image.Image) -> np.ndarray:
    """to_rgb's 16-bit rule as it was written before (the whole image as float64)."""
    a = np.asarray(image, dtype=np.float64)
    peak = a.max() if a.size else 1.0
    return (a / (peak if peak > 0 else 1.0) * 255.0).round().astype("uint8")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
@pytest.mark.parametrize("shape", [(1, 1), (7, 1000), (1100, 700), (3, 300_000)])
def test_deep_images_become_the_same_8_bits_as_before(dtype, shape):
    values = np.random.default_rng(0).integers(0, np.iinfo(dtype).max, size=shape, dtype=dtype)
    image = Image.fromarray(values)
    rgb = images.to_rgb(image)
    assert rgb.mode == "RGB" and rgb.size == image.size
    assert np.array_equal(np.asarray(rgb)[..., 0], _whole_image_float64(image))


def test_float_images_are_scaled_by_their_peak_nan_and_negatives_as_0():
    values = np.array([[0.0, 0.25, np.nan], [-1.0, 0.5, np.inf]], dtype=np.float32)
    assert np.asarray(images.to_rgb(Image.fromarray(values)))[..., 0].tolist() == [[0, 128, 0], [0, 255, 0]]
    assert np.asarray(images.to_rgb(Image.new("I;16", (4, 4)))).max() == 0  # all black stays black


def test_a_16_bit_png_peaks_at_7_bytes_a_pixel():
    """Decoded (2 bytes a pixel), scaled to 8-bit grey (1) and made RGB (4): 7 bytes a pixel and a
    few MB (16-bit PNGs of 3 to 49 MP: 13.5), measured as the peak resident memory (Linux: VmHWM)
    of a process doing only that; decoding_bytes reserves at least as much. (Whole-image float64
    arrays took 8 bytes a pixel three times over.)"""
    png = _encoded(Image.fromarray(np.tile(np.linspace(0, 65535, 4000).astype(np.uint16), (3000, 1))), "PNG")
    code = textwrap.dedent("""
        import sys
        from pathlib import Path
        import numpy  # as the server has it
        from groundtune.data import images

        def kb(key):  # the process's resident memory now, or its peak (VmHWM)
            return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                        if line.startswith(key))

        data = sys.stdin.buffer.read()
        frame = images.untrusted_frame(data, 10**9)
        Path("/proc/self/clear_refs").write_text("5")  # the peak from here
        before = kb("VmRSS")
        image = images.open_untrusted(data, 10**9)
        image.load()
        rgb = images.to_rgb(image)
        print((kb("VmHWM") - before) * 1024, images.decoding_bytes(frame), rgb.size[0] * rgb.size[1])
    """)
    done = subprocess.run([sys.executable, "-c", code], input=png, capture_output=True, timeout=120)
    if done.returncode != 0 and "clear_refs" in done.stderr.decode():
        pytest.skip("cannot reset the peak memory (/proc/self/clear_refs)")
    peak, reserved, pixels = map(int, done.stdout.split())
    assert pixels == 12_000_000
    assert 6 * pixels < peak < 7 * pixels + 16 * 2**20, peak / pixels
    assert reserved >= peak, (reserved, peak)


def test_a_strangers_image_is_refused_on_its_frames_own_size_before_decoding():
    # an ICO saying 16x16 around a 3000x3000 PNG: not a format taken (Pillow decodes it to open it)
    inner = _encoded(Image.new("L", (3000, 3000)), "PNG")
    import struct

    ico = struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 16, 16, 0, 0, 1, 32, len(inner), 22) + inner
    with pytest.raises(images.NotAnImage, match="PNG, JPEG, WebP, GIF, BMP or TIFF"):
        images.open_untrusted(ico, 1_000_000)
    # a GIF whose screen says 16x16 and whose frame is 2000x2000
    gif = bytearray(_encoded(Image.new("P", (2000, 2000)), "GIF"))
    gif[6:10] = struct.pack("<HH", 16, 16)
    with pytest.raises(images.TooManyPixels, match="2000x2000 = 4,000,000 pixels; the limit is 1,000,000"):
        images.open_untrusted(bytes(gif), 1_000_000)
    # a WebP claiming a 16000x16000 canvas: refused before Pillow's decoder (which allocates it) exists
    webp = bytearray(_encoded(Image.new("RGBA", (40, 40)), "WEBP"))
    webp[24:27], webp[27:30] = (15999).to_bytes(3, "little"), (15999).to_bytes(3, "little")
    for read in (images.open_untrusted, images.untrusted_frame):
        with pytest.raises(images.TooManyPixels, match="16000x16000"):
            read(bytes(webp), 1_000_000)
    # a header over Pillow's own bomb limit, where that limit is on: our error, its pixel count
    bomb = _encoded(Image.new("1", (30000, 30000)), "PNG")
    assert Image.MAX_IMAGE_PIXELS is not None
    with pytest.raises(images.TooManyPixels, match="the image is 900,000,000 pixels; the limit is 1,000,000"):
        images.open_untrusted(bomb, 1_000_000)
    # the first page of a TIFF is what is decoded and measured
    tiff = _encoded(Image.new("L", (100, 100)), "TIFF", save_all=True, append_images=[Image.new("L", (3000, 3000))])
    assert images.untrusted_frame(tiff, 1_000_000).size == (100, 100)


@pytest.mark.parametrize("mode, fmt, per_pixel", [
    ("I;16", "PNG", 2 + 1 + 4), ("RGB", "JPEG", 4), ("RGB", "PNG", 4 + 4), ("RGBA", "PNG", 4 + 5),
    ("L", "PNG", 1 + 4), ("F", "TIFF", 4 + 1 + 4), ("RGBA", "WEBP", 4 + 5 + 12),
])
def test_decoding_bytes_from_the_header(mode, fmt, per_pixel):
    """What a server reserves for an image: its decoded frame and the larger of turning it (EXIF;
    a PNG's may follow its pixels) and making it RGB, a WebP's decoder's buffers, the file's
    bytes, and 16 MB."""
    data = _encoded(Image.new(mode, (100, 50)), fmt)
    frame = images.untrusted_frame(data, 10**6)
    assert (frame.size, frame.mode) == ((100, 50), mode)
    assert images.decoding_bytes(frame) == 5000 * per_pixel + len(data) + 16 * 2**20


def test_a_path_that_is_no_regular_file_is_refused_before_it_is_opened(tmp_path):
    with pytest.raises(DataError, match="a device, not a regular file; give the image itself"):
        images.load_image("/dev/zero")
    with pytest.raises(DataError, match="a device, not a regular file"):
        images.header_size("/dev/zero")
    # a FIFO would block open() forever: in a process of its own, so that a regression times out
    fifo = tmp_path / "image.png"
    os.mkfifo(fifo)
    code = textwrap.dedent(f"""
        from groundtune.data import images
        from groundtune.errors import DataError
        for read in (images.load_image, images.header_size):
            try:
                read({str(fifo)!r})
            except DataError as e:
                print(e)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == [f"{fifo}: a FIFO (named pipe), not a regular file; give the image itself"] * 2
    # what was said before stays: a missing file, a broken one
    with pytest.raises(DataError, match="image file not found"):
        images.load_image(tmp_path / "missing.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    with pytest.raises(DataError, match="cannot decode image"):
        images.load_image(tmp_path / "broken.png")
    with pytest.raises(DataError, match="cannot read image"):
        images.header_size(tmp_path / "broken.png")


def test_the_bytes_read_from_an_image_file_are_bounded(tmp_path):
    """Pillow's JPEG reader skips what is no marker a byte at a time: a JPEG's first bytes and 10 GB
    of zeros (a sparse file, nothing on disk) read for ten minutes. Bounded: the header must end
    within HEADER_BYTES; decoding may read twice what the frame's pixels take, past the header."""
    sparse = tmp_path / "sparse.jpg"
    sparse.write_bytes(b"\xff\xd8\xff\xe0")
    os.truncate(sparse, 10 * 2**30)
    header = "read 8,454,144 bytes of a 10,737,418,240-byte file without finding the end of the image's header"
    for read, said in ((images.load_image, "cannot decode image"), (images.header_size, "cannot read image")):
        with pytest.raises(DataError, match=rf"{said} .*\({re.escape(header)}\)$"):
            read(sparse)
    # a progressive JPEG whose scans are zeros: its header reads, its decoding stops at the frame's budget
    progressive = io.BytesIO()
    Image.new("RGB", (64, 48), "red").save(progressive, format="JPEG", progressive=True)
    data = progressive.getvalue()
    zeros = tmp_path / "zeros.jpg"
    zeros.write_bytes(data[:data.index(b"\xff\xda") + 40])
    os.truncate(zeros, 10 * 2**30)
    assert images.header_size(zeros) == (64, 48)
    with pytest.raises(DataError, match=r"without finding the end of a 64x48 image\)$"):
        images.load_image(zeros)
    # a real image, and trailing bytes after it, read as ever
    Image.new("RGB", (64, 48), "red").save(tmp_path / "ok.png")
    (tmp_path / "trailing.png").write_bytes((tmp_path / "ok.png").read_bytes() + b"\0" * 2**20)
    assert images.load_image(tmp_path / "ok.png").size == images.load_image(tmp_path / "trailing.png").size == (64, 48)


def _jpeg_saying(width: int, height: int, **save) -> bytes:
    """A 16x16 JPEG, whole (its end marker too), whose frame header says ``width`` x ``height``."""
    data = bytearray(_encoded(Image.new("RGB", (16, 16), "red"), "JPEG", **save))
    frame = data.index(b"\xff\xc2" if save.get("progressive") else b"\xff\xc0")
    data[frame + 5:frame + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


def test_a_jpeg_too_short_for_its_frame_is_refused_before_decoding(tmp_path):
    """libjpeg fills a scan cut short by a marker with grey: a 633-byte JPEG saying 13000x13000
    decoded in 2 s to 1.3 GB (progressive 4:4:4: 1.6 GB). A Huffman-coded frame takes a bit for
    each 8x8 block at least; a file with fewer bits after its header is refused, unread: in a
    process doing only that, a few MB and well under a second."""
    path = tmp_path / "short.jpg"
    path.write_bytes(_jpeg_saying(13000, 13000, progressive=True, subsampling=0))
    code = textwrap.dedent("""
        import sys, time
        from pathlib import Path
        from groundtune.data import images

        def kb(key):
            return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                        if line.startswith(key))

        Path("/proc/self/clear_refs").write_text("5")  # the peak from here
        before, started = kb("VmRSS"), time.monotonic()
        try:
            images.load_image(sys.argv[1])
        except images.DataError as e:
            print(e, file=sys.stderr)
        print((kb("VmHWM") - before) * 1024, time.monotonic() - started)
    """)
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0 and "clear_refs" in done.stderr:
        pytest.skip("cannot reset the peak memory (/proc/self/clear_refs)")
    peak, seconds = map(float, done.stdout.split())
    # the last line: Pillow's DecompressionBombWarning (over 89 MP) comes first
    held = path.stat().st_size - _scan_start(path.read_bytes())
    assert done.stderr.strip().splitlines()[-1] == (
        f"{path}: cannot decode image (its header says 13000x13000, whose scan takes at least 330,078 bytes (a bit "
        f"for each 8x8 block); the file holds {held} after its header)")
    assert peak < 32 * 2**20 and seconds < 1, (peak, seconds)
    for read, said in ((images.header_size, "cannot read image"), (images.load_image, "cannot decode image")):
        path.write_bytes(_jpeg_saying(4000, 3000))  # baseline 4:2:0: 4000 x 3000 / 4 / 64 bits
        with pytest.raises(DataError, match=rf"{said} .*at least 5,859 bytes \(a bit for each 8x8 block\)"):
            read(path)


def _scan_start(data: bytes) -> int:
    """Where a JPEG's first scan's data begins: after its SOS marker and the segment it opens."""
    sos = data.index(b"\xff\xda")
    return sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big")


@pytest.mark.parametrize("mode, save", [("L", {"optimize": True}), ("L", {"progressive": True}),
                                        ("RGB", {"optimize": True, "subsampling": 0}),
                                        ("RGB", {"progressive": True, "subsampling": 2})])
def test_the_most_compressible_real_jpegs_are_read(tmp_path, mode, save):
    """A flat image is the least a frame is stored in: 2 bits a block (grey, optimised tables) and
    up, every one at least twice the bound."""
    Image.new(mode, (2000, 1500), 128 if mode == "L" else (200, 30, 30)).save(tmp_path / "flat.jpg", **save)
    assert images.load_image(tmp_path / "flat.jpg").size == images.header_size(tmp_path / "flat.jpg") == (2000, 1500)


def test_an_image_path_no_file_can_have_is_said_as_such():
    with pytest.raises(DataError, match=r"^image 'a\\x00\.png' holds a NUL byte, which no file name can$"):
        images.load_image("a\0.png")
    with pytest.raises(DataError, match="holds a NUL byte"):
        images.header_size("a\0.png")
