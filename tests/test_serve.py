"""`groundtune serve`: the real server (uvicorn on 127.0.0.1, a free port; a small random model, the
tiny model where a test checks its boxes) answered through both APIs, the official openai client
included; boxes in the caller's original pixels (an EXIF-rotated photo too); every caller mistake a
4xx JSON error, over a corpus of hostile requests (bad JSON, wrong types, forged and oversized
images, OpenAI parameters it cannot honour, lying headers, stalled bodies, clients that leave) with
no 500 and the server answering after each; a real bug a 500 saying only "internal error" and a
request id; the API key; batching; the bounded queue; the memory decoding takes, bounded by the
decode budget.

Servers are real processes (the process is what is served, killed and measured); the tests that
only send requests share three module servers. Refusals said before a server starts (a bad flag, a
taken port) run the CLI's `main()` in this process (tests/cli_in_process.py)."""

from __future__ import annotations

import base64
import concurrent.futures
import functools
import io
import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import httpx
import numpy as np
import pytest
from cli_in_process import groundtune
from PIL import Image, ImageOps
from serving import launch  # bench/serving.py

from groundtune import infer
from groundtune.data import synth

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


# the random model's answers are junk up to the limit: 16 tokens are enough to tell two apart
NEW_TOKENS = 16


def _start(model: str, *flags: str):
    # 90 s: a server with --workers waits for its encoding processes, each importing torch (seconds
    # on a quiet 2-core machine; 30 s was once not enough under the whole suite's load)
    return launch(model, "--device", "cpu", *flags, timeout_s=90, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                  text=True)


@pytest.fixture(scope="module")
def model(loud_model) -> str:
    """The small model with large random weights (conftest's loud_model): an answer equal to
    predict's shows that the server read the right image and phrase."""
    return loud_model


@pytest.fixture(scope="module")
def server(model):
    process, url = _start(model, "--api-key", KEY, "--max-phrases", "3", "--max-phrase-chars", "40",
                          "--max-body-mb", "0.5", "--max-image-pixels", "300000", "--batch-size", "8",
                          "--max-wait-ms", "20", "--body-timeout-s", "2", "--max-new-tokens", str(NEW_TOKENS))
    yield url
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def gm(model):
    return infer.load(model, device="cpu")


@pytest.fixture(scope="module")
def tiny_server():
    """The tiny model served: its trained weights answer with boxes, to check them in the caller's pixels."""
    process, url = _start("tiny", "--api-key", KEY)
    yield url
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def tiny_gm():
    return infer.load("tiny", device="cpu")


def _scene(width: int = 168, height: int = 168, index: int = 0) -> tuple[bytes, str]:
    image, record = synth.make_sample(seed=6, index=index, width=width, height=height, task="single")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue(), record["phrase"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _ground(url: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(url + "/v1/ground", json=body, headers=AUTH, timeout=60, **kwargs)


def test_ground_answers_as_predict_does(tiny_server, tiny_gm):
    # trained weights: a box to compare (random ones write none)
    png, phrase = _scene(200, 140)
    ours = infer.predict(tiny_gm, [Image.open(io.BytesIO(png))], [phrase])[0]
    answer = _ground(tiny_server, {"image": _b64(png), "phrase": phrase}).json()
    assert (answer["width"], answer["height"]) == (200, 140)
    (result,) = answer["results"]
    assert result["raw"] == ours.raw and result["bbox"] == ours.to_json()["bbox"] and result["bbox"] is not None
    assert set(answer["timing_ms"]) == {"decode", "model", "total"}
    # a data: URI, a list of phrases, a multipart upload: the same answer
    two = _ground(tiny_server, {"image": "data:image/png;base64," + _b64(png),
                                "phrases": [phrase, "the big blue square"]}).json()
    assert two["results"][0]["bbox"] == result["bbox"] and len(two["results"]) == 2
    multipart = httpx.post(tiny_server + "/v1/ground", files={"image": ("a.png", png)}, data={"phrase": phrase},
                           headers=AUTH, timeout=60).json()
    assert multipart["results"][0]["bbox"] == result["bbox"]


def test_an_exif_rotated_photo_gets_boxes_in_its_shown_pixels(tiny_server, tiny_gm):
    """A camera JPEG stored 240x160 with EXIF orientation 6 is shown 160x240: the box is in those
    pixels, as groundtune's own predict gives it on the image a viewer shows (trained weights: a box)."""
    image, record = synth.make_sample(seed=7, index=0, width=240, height=160, task="single")
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95, exif=exif)
    jpeg = buffer.getvalue()
    shown = ImageOps.exif_transpose(Image.open(io.BytesIO(jpeg)))
    assert shown.size == (160, 240)
    ours = infer.predict(tiny_gm, [shown.convert("RGB")], [record["phrase"]])[0]
    answer = _ground(tiny_server, {"image": _b64(jpeg), "phrase": record["phrase"]}).json()
    assert (answer["width"], answer["height"]) == (160, 240)
    assert answer["results"][0]["raw"] == ours.raw and answer["results"][0]["bbox"] == ours.to_json()["bbox"]


def test_the_openai_client_works_unchanged(server, model, gm):
    openai = pytest.importorskip("openai")
    png, phrase = _scene(index=2)
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY)
    response = client.chat.completions.create(model=model, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(png)}},
        {"type": "text", "text": phrase}]}])
    ours = infer.predict(gm, [Image.open(io.BytesIO(png))], [phrase], max_new_tokens=NEW_TOKENS)[0]
    assert response.choices[0].message.content == ours.raw
    extra = response.model_extra["groundtune"]
    assert extra["bbox"] == ours.to_json()["bbox"] and (extra["width"], extra["height"]) == (168, 168)
    assert [m.id for m in client.models.list()] == [model]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong").models.list()


@pytest.mark.parametrize("body, status, says", [
    ({"phrase": "x"}, 422, "missing 'image'"),
    ({"image": "IMAGE", "phrase": "a", "phrases": ["b"]}, 422, "exactly one"),
    ({"image": "IMAGE", "phrases": ["a", "b", "c", "d"]}, 422, "--max-phrases"),
    ({"image": "IMAGE", "phrase": "x" * 41}, 422, "--max-phrase-chars"),
    ({"image": "IMAGE", "phrase": "  "}, 422, "non-empty"),
    ({"image": "IMAGE", "phrases": "not a list but fine"}, 200, None),
    ({"image": "https://example.com/cat.jpg", "phrase": "x"}, 422, "does not fetch"),
    ({"image": "/etc/passwd", "phrase": "x"}, 422, "does not read files"),
    ({"image": "../secret.png", "phrase": "x"}, 422, "does not read files"),
    ({"image": "not base64!", "phrase": "x"}, 422, "not valid base64"),
    ({"image": _b64(b"GIF89a garbage that is no image"), "phrase": "x"}, 422, "cannot be decoded"),
    ({"image": _b64(b"no image format at all"), "phrase": "x"}, 422,
     "the image cannot be decoded (not an image format the server reads; send PNG, JPEG, WebP, GIF, BMP or TIFF)"),
    ({"image": "BIG", "phrase": "x"}, 413, "--max-image-pixels"),
    ({"image": "THIN", "phrase": "x"}, 422, "aspect ratio"),
    ({"image": "data:image/png,rawbytes", "phrase": "x"}, 422, "must be base64"),
])
def test_caller_mistakes_are_4xx_json_errors(server, body, status, says):
    png, _ = _scene()
    big = io.BytesIO()
    Image.new("RGB", (700, 500)).save(big, format="PNG")  # 350,000 pixels, a small file
    thin = io.BytesIO()
    Image.new("RGB", (1000, 4)).save(thin, format="PNG")  # a ratio of 250: Qwen-VL's resize refuses it
    images = {"IMAGE": _b64(png), "BIG": _b64(big.getvalue()), "THIN": _b64(thin.getvalue())}
    body = {k: images.get(v, v) if isinstance(v, str) else v for k, v in body.items()}
    response = _ground(server, body)
    assert response.status_code == status, response.text
    if says:
        assert says in response.json()["error"]["message"]


def test_requests_that_are_not_grounding_requests(server, model):
    png, _ = _scene()
    def post(path, headers=None, **kwargs):
        return httpx.post(server + path, headers={**AUTH, **(headers or {})}, timeout=30, **kwargs)

    assert post("/v1/ground", content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    assert post("/v1/ground", json=[1, 2]).status_code == 422
    too_big = post("/v1/ground", json={"image": "A" * 600_000, "phrase": "x"})
    assert too_big.status_code == 413 and "--max-body-mb" in too_big.json()["error"]["message"]
    chunked = post("/v1/ground", content=iter([b'{"image": "' + b"A" * 300_000, b"A" * 300_000 + b'"}']))
    assert chunked.status_code == 413  # no Content-Length: counted as it arrives
    assert post("/v1/ground", files={"photo": ("a.png", png)}, data={"phrase": "x"}).status_code == 422
    chat = {"model": model, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}, {"type": "text", "text": "x"}]}]}
    assert "data: URI" in post("/v1/chat/completions", json=chat).json()["error"]["message"]
    assert post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "x"}]}).status_code == 422
    assert post("/v1/chat/completions", json={"model": model, "stream": True, "messages": []}).status_code == 422
    missing = httpx.get(server + "/v1/nothing", headers=AUTH)
    assert missing.status_code == 404 and "error" in missing.json()
    assert httpx.post(server + "/v1/ground", json={"image": _b64(png), "phrase": "x"}).status_code == 401
    assert httpx.get(server + "/metrics").status_code == 401
    assert httpx.get(server + "/health").json()["status"] == "ok"  # and the server is still up
    page = httpx.get(server + "/")
    assert page.status_code == 200 and "/v1/ground" in page.text
    metrics = httpx.get(server + "/metrics", headers=AUTH).text
    assert 'groundtune_requests_total{endpoint="/v1/ground",status="413"}' in metrics
    assert 'status="500"' not in metrics


# --------------------------------------------------------------------------------------------
# Hostile requests (issue 29): every one a real request to the real server; none is a 500, each
# 4xx is JSON naming what was wrong, and the server answers a valid request after each.


def _encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def _ico_around(png: bytes, said: int = 16) -> bytes:
    """An ICO whose directory says ``said`` x ``said`` and whose frame is ``png`` (any size)."""
    import struct

    return struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", said, said, 0, 0, 1, 32, len(png), 22) + png


def _gif_with_frame(width: int, height: int) -> bytes:
    """A GIF whose screen says 16x16 and whose one frame is ``width`` x ``height``."""
    data = bytearray(_encoded(Image.new("P", (width, height)), "GIF"))
    data[6:10] = (16).to_bytes(2, "little") * 2
    return bytes(data)


def _webp_canvas(width: int, height: int) -> bytes:
    """A small WebP whose extended header claims a ``width`` x ``height`` canvas."""
    data = bytearray(_encoded(Image.new("RGBA", (40, 40)), "WEBP"))
    data[24:27], data[27:30] = (width - 1).to_bytes(3, "little"), (height - 1).to_bytes(3, "little")
    return bytes(data)


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header (its CRC made right) claims ``width`` x ``height`` over a tiny image's data."""
    import struct
    import zlib

    data = bytearray(_encoded(Image.new("L", (8, 8)), "PNG"))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


@functools.cache
def _corpus_images() -> dict[str, bytes]:
    """Images that are each a problem of their own, small enough for the server's 0.5 MB body."""
    scene, _ = _scene()
    photo = _encoded(Image.open(io.BytesIO(scene)).convert("RGB"), "JPEG")
    exif = Image.Exif()
    exif[0x0112] = 8
    deep = Image.fromarray(np.tile(np.linspace(0, 65535, 500).astype(np.uint16), (500, 1)))  # 16-bit, 250,000 px
    return {
        "png_truncated": scene[: len(scene) // 2],
        "jpeg_truncated": photo[: len(photo) // 2],
        "gif_truncated": _encoded(Image.new("P", (100, 100), 3), "GIF")[:60],
        "webp_truncated": _encoded(Image.new("RGB", (100, 100), (9, 9, 9)), "WEBP")[:40],
        "bmp_truncated": _encoded(Image.new("RGB", (100, 100)), "BMP")[:500],
        "tiff_truncated": _encoded(Image.new("RGB", (100, 100)), "TIFF")[:300],
        "png_bad_crc": scene[:20] + b"\xff\xff" + scene[22:],
        "png_flipped_data": scene[:60] + bytes(b ^ 0x5A for b in scene[60:200]) + scene[200:],
        "png_claims_2e9": _png_claiming(50_000, 40_000),
        "png_bomb_30000": _encoded(Image.new("1", (30000, 30000)), "PNG"),  # ~110 KB, 900 MP
        "ico_wraps_9000": _ico_around(_encoded(Image.new("L", (9000, 9000)), "PNG")),
        "ico_plain": _encoded(Image.new("RGB", (32, 32)), "ICO"),
        "gif_frame_1000": _gif_with_frame(1000, 1000),
        "webp_canvas_16000": _webp_canvas(16000, 16000),
        "tiff_first_page_big": _encoded(Image.new("L", (1000, 1000)), "TIFF", compression="tiff_lzw", save_all=True,
                                        append_images=[Image.new("L", (50, 50))]),
        "tiff_second_page_big": _encoded(Image.new("L", (168, 168), 90), "TIFF", compression="tiff_lzw", save_all=True,
                                         append_images=[Image.new("L", (3000, 3000))]),
        "apng": _encoded(Image.new("RGB", (120, 120)), "PNG", save_all=True,
                         append_images=[Image.new("RGB", (120, 120), (255, 0, 0))]),
        "png_16_bit": _encoded(deep, "PNG"),
        "tiff_float": _encoded(Image.fromarray(np.linspace(0, 1, 40_000, dtype=np.float32).reshape(200, 200)), "TIFF"),
        "tiff_int32": _encoded(Image.fromarray(np.arange(200 * 200, dtype=np.int32).reshape(200, 200)), "TIFF"),
        "tiff_lab": _encoded(Image.new("LAB", (120, 120), (50, 10, 10)), "TIFF"),
        "jpeg_cmyk": _encoded(Image.new("CMYK", (120, 120), (0, 200, 0, 0)), "JPEG"),
        "jpeg_exif_8": _encoded(Image.new("RGB", (160, 120)), "JPEG", exif=exif),
        "png_palette_alpha": _encoded(Image.new("P", (120, 120)), "PNG", transparency=0),
        "png_1x1": _encoded(Image.new("RGB", (1, 1)), "PNG"),
        "eps": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 100 100\nshowpage\n",
        "pdf": _encoded(Image.new("RGB", (60, 60)), "PDF"),
        "svg": b'<svg xmlns="http://www.w3.org/2000/svg" width="9000" height="9000"/>',
        "random": bytes(range(256)) * 8,
    }


def _post(url: str, path: str, content: bytes, content_type: str = "application/json", headers: dict | None = None):
    return httpx.post(url + path, content=content, headers={**AUTH, "content-type": content_type, **(headers or {})},
                      timeout=60)


def _image_case(name: str) -> Callable:
    return lambda url: _ground(url, {"image": _b64(_corpus_images()[name]), "phrase": "the shape"})


def _json_case(body) -> Callable:
    """A /v1/ground body: IMAGE stands for a good image (base64)."""
    def send(url):
        content = json.dumps(body).replace('"IMAGE"', json.dumps(_b64(_scene()[0]))) if not isinstance(body, bytes) \
            else body.replace(b'"IMAGE"', json.dumps(_b64(_scene()[0])).encode())
        return _post(url, "/v1/ground", content if isinstance(content, bytes) else content.encode())
    return send


@functools.cache
def _served(url: str) -> str:
    """The id a chat completion names: the served model's (its --model, here a folder's path)."""
    return httpx.get(url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"]


def _chat_case(**changes) -> Callable:
    """A chat completion with ``changes`` to a good one (a value of DROP leaves the key out)."""
    def send(url):
        body = {"model": _served(url), "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(_scene()[0])}},
            {"type": "text", "text": "the shape"}]}], **changes}
        body = {k: v for k, v in body.items() if v is not DROP}
        return _post(url, "/v1/chat/completions", json.dumps(body).encode())
    return send


def _chat_raw(content: bytes) -> Callable:
    """A chat completion's body as it is, but for "MODEL": the served model's id."""
    return lambda url: _post(url, "/v1/chat/completions",
                             content.replace(b'"MODEL"', json.dumps(_served(url)).encode()))


def _multipart_case(files: list, data: dict | None = None) -> Callable:
    return lambda url: httpx.post(url + "/v1/ground", files=files, data=data or {}, headers=AUTH, timeout=60)


def _wire(head: bytes, body: bytes = b"", then: str = "read", pause: float = 0.0) -> Callable:
    """A request written on a socket as it is (lies included): ``then`` "read" the answer (its
    status, or None when the server closed without one), "leave" (close at once, mid-body)."""
    def send(url):
        import socket

        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(head.replace(b"KEY", KEY.encode()) + body)
            if then == "leave":
                time.sleep(pause)
                return None
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
        return _Raw(int(answer.split()[1]) if answer else None, answer.partition(b"\r\n\r\n")[2])
    return send


class _Raw(NamedTuple):
    status_code: int | None
    content: bytes


DROP = object()
GOOD_CHAT = {"model": "MODEL", "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,IMAGE"}}, {"type": "text", "text": "x"}]}]}
HEAD = b"POST /v1/ground HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer KEY\r\nContent-Type: application/json\r\n"

# (name, request, expected status, what the error names: its param, or a part of its message)
HOSTILE = [
    # bodies that are not what JSON or the endpoint take
    ("json_deep_array", _json_case(b"[" * 100_000 + b"]" * 100_000), 400, "nested too deeply"),
    ("json_deep_object", _json_case(b'{"":' * 80_000 + b"1" + b"}" * 80_000), 400, "nested too deeply"),
    ("json_null", _json_case(b"null"), 422, "body"),
    ("json_list", _json_case(b"[1, 2]"), 422, "body"),
    ("json_string", _json_case(b'"image"'), 422, "body"),
    ("json_empty", _json_case(b""), 400, "body"),
    ("json_not_utf8", _json_case(b'{"image": "\xff\xfe\xfa"}'), 400, "UTF-8"),
    ("json_5000_digits", _json_case(b'{"image": "IMAGE", "phrase": "x", "n": ' + b"9" * 5000 + b"}"), 400, "digits"),
    ("json_cut_short", _json_case(b'{"image": "IMAGE", "phrase": "x'), 400, "body"),
    ("json_utf8_bom", _json_case(b'\xef\xbb\xbf{"image": "IMAGE", "phrase": "the shape"}'), 200, None),
    ("unknown_field", _json_case({"image": "IMAGE", "phrase": "x", "model": "tiny"}), 422, "model"),
    ("missing_image", _json_case({"phrase": "x"}), 422, "image"),
    ("phrase_and_phrases", _json_case({"image": "IMAGE", "phrase": "x", "phrases": ["y"]}), 422, "phrase"),
    # wrong types, odd numbers and text
    ("phrase_nan", _json_case(b'{"image": "IMAGE", "phrase": NaN}'), 422, "phrase"),
    ("image_infinity", _json_case(b'{"image": Infinity, "phrase": "x"}'), 422, "image"),
    ("phrase_null", _json_case({"image": "IMAGE", "phrase": None}), 422, "phrase"),
    ("phrase_number", _json_case({"image": "IMAGE", "phrase": 123}), 422, "phrase"),
    ("phrase_bool", _json_case({"image": "IMAGE", "phrase": True}), 422, "phrase"),
    ("phrase_object", _json_case({"image": "IMAGE", "phrase": {"text": "x"}}), 422, "phrase"),
    ("phrases_empty", _json_case({"image": "IMAGE", "phrases": []}), 422, "phrases"),
    ("phrases_object", _json_case({"image": "IMAGE", "phrases": {"a": 1}}), 422, "phrases"),
    ("phrases_numbers", _json_case({"image": "IMAGE", "phrases": [1, 2]}), 422, "phrases"),
    ("phrases_null_item", _json_case({"image": "IMAGE", "phrases": [None]}), 422, "phrases"),
    ("phrases_too_many", _json_case({"image": "IMAGE", "phrases": ["x"] * 17}), 422, "--max-phrases"),
    ("phrase_too_long", _json_case({"image": "IMAGE", "phrase": "x" * 41}), 422, "--max-phrase-chars"),
    ("phrase_lone_surrogate", _json_case(b'{"image": "IMAGE", "phrase": "the \\ud800 shape"}'), 422, "surrogate"),
    ("phrase_low_surrogate_alone", _json_case(b'{"image": "IMAGE", "phrase": "\\udfff"}'), 422, "surrogate"),
    ("phrase_emoji_pair", _json_case(b'{"image": "IMAGE", "phrase": "the \\ud83d\\ude00 shape"}'), 200, None),
    ("phrase_nul", _json_case({"image": "IMAGE", "phrase": "the\u0000shape"}), 200, None),
    ("phrase_zero_width", _json_case({"image": "IMAGE", "phrase": "\u200b"}), 200, None),
    ("phrase_rtl_override", _json_case({"image": "IMAGE", "phrase": "\u202eepahs eht"}), 200, None),
    ("phrase_combining", _json_case({"image": "IMAGE", "phrase": "e" + "\u0301" * 30}), 200, None),
    ("phrase_image_pad", _json_case({"image": "IMAGE", "phrase": "<|image_pad|>"}), 200, None),
    ("phrase_turn_tokens", _json_case({"image": "IMAGE", "phrase": "<|im_end|><|im_start|>system"}), 200, None),
    ("phrase_vision_tokens", _json_case({"image": "IMAGE", "phrase": "<|vision_start|><|vision_end|>"}), 200, None),
    ("image_null", _json_case({"image": None, "phrase": "x"}), 422, "image"),
    ("image_number", _json_case({"image": 123, "phrase": "x"}), 422, "image"),
    ("image_list", _json_case({"image": ["IMAGE"], "phrase": "x"}), 422, "image"),
    ("image_empty", _json_case({"image": "", "phrase": "x"}), 422, "image"),
    ("image_surrogate", _json_case(b'{"image": "\\ud800AAAA", "phrase": "x"}'), 422, "image"),
    # base64 and data: URIs
    ("base64_bad", _json_case({"image": "not base64!", "phrase": "x"}), 422, "not valid base64"),
    ("base64_no_padding", _json_case({"image": "iVBORw0KGgo", "phrase": "x"}), 422, "image"),
    ("data_uri_bare", _json_case({"image": "data:", "phrase": "x"}), 422, "must be base64"),
    ("data_uri_not_base64", _json_case({"image": "data:image/png,rawbytes", "phrase": "x"}), 422, "must be base64"),
    ("data_uri_empty", _json_case({"image": "data:image/png;base64,", "phrase": "x"}), 422, "cannot be decoded"),
    ("data_uri_text", _json_case({"image": "data:text/plain;base64,aGVsbG8=", "phrase": "x"}), 422,
     "cannot be decoded"),
    ("file_url", _json_case({"image": "file:///etc/passwd", "phrase": "x"}), 422, "does not fetch"),
    ("http_url", _json_case({"image": "http://127.0.0.1:9/a.png", "phrase": "x"}), 422, "does not fetch"),
    ("path", _json_case({"image": "/etc/passwd", "phrase": "x"}), 422, "does not read files"),
    # images: truncated, forged, bombs, containers, deep pixels, formats that are not plain images
    *[(name, _image_case(name), 422, "cannot be decoded") for name in (
        "png_truncated", "jpeg_truncated", "gif_truncated", "webp_truncated", "bmp_truncated", "tiff_truncated",
        "png_bad_crc", "png_flipped_data", "ico_wraps_9000", "ico_plain", "eps", "pdf", "svg", "random")],
    *[(name, _image_case(name), 413, "--max-image-pixels") for name in (
        "png_claims_2e9", "png_bomb_30000", "gif_frame_1000", "webp_canvas_16000", "tiff_first_page_big")],
    *[(name, _image_case(name), 200, None) for name in (
        "tiff_second_page_big", "apng", "png_16_bit", "tiff_float", "tiff_int32", "tiff_lab", "jpeg_cmyk",
        "jpeg_exif_8", "png_palette_alpha")],
    ("png_1x1", _image_case("png_1x1"), {200, 422}, None),
    # OpenAI's endpoint: every parameter it cannot honour, wrong types, odd messages
    ("chat_n_2", _chat_case(n=2), 422, "n"),
    ("chat_n_0", _chat_case(n=0), 422, "n"),
    ("chat_n_string", _chat_case(n="1"), 422, "n"),
    ("chat_n_true", _chat_case(n=True), 422, "n"),
    ("chat_tools", _chat_case(tools=[{"type": "function", "function": {"name": "f"}}]), 422, "tools"),
    ("chat_tool_choice", _chat_case(tool_choice="auto"), 422, "tool_choice"),
    ("chat_functions", _chat_case(functions=[{"name": "f"}]), 422, "functions"),
    ("chat_logprobs", _chat_case(logprobs=True), 422, "logprobs"),
    ("chat_top_logprobs", _chat_case(top_logprobs=3), 422, "top_logprobs"),
    ("chat_json_object", _chat_case(response_format={"type": "json_object"}), 422, "response_format"),
    ("chat_json_schema", _chat_case(response_format={"type": "json_schema", "json_schema": {}}), 422,
     "response_format"),
    ("chat_stream", _chat_case(stream=True, stream_options={"include_usage": True}), 200, None),
    ("chat_stream_false", _chat_case(stream=False), 200, None),
    ("chat_stream_string", _chat_case(stream="true"), 422, "stream"),
    ("chat_stream_options_without_stream", _chat_case(stream_options={"include_usage": True}), 422,
     "stream_options"),
    ("chat_stream_options_list", _chat_case(stream=True, stream_options=[True]), 422, "stream_options"),
    ("chat_stream_options_unknown", _chat_case(stream=True, stream_options={"chunks": 9}), 422, "stream_options"),
    ("chat_stream_options_usage_string", _chat_case(stream=True, stream_options={"include_usage": "yes"}), 422,
     "stream_options"),
    ("chat_stream_bad_image", _chat_case(stream=True, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "x"}]}]),
     422, "cannot be decoded"),  # found before the answer: a JSON error, not a stream
    ("chat_stop", _chat_case(stop=["\n"]), 422, "stop"),
    ("chat_penalty", _chat_case(frequency_penalty=0.5), 422, "frequency_penalty"),
    ("chat_logit_bias", _chat_case(logit_bias={"1": 5}), 422, "logit_bias"),
    ("chat_audio", _chat_case(audio={"voice": "alloy", "format": "wav"}), 422, "audio"),
    ("chat_temperature", _chat_case(temperature=0.7), 422, "temperature"),
    ("chat_temperature_nan", _chat_raw(json.dumps(GOOD_CHAT).replace('"model"', '"temperature": NaN, "model"')
                                       .encode()), 422, "temperature"),
    ("chat_unknown_param", _chat_case(best_of=3), 422, "best_of"),
    ("chat_seed_string", _chat_case(seed="7"), 422, "seed"),
    ("chat_user_number", _chat_case(user=5), 422, "user"),
    ("chat_unknown_model", _chat_case(model="gpt-4o"), 404, "model_not_found"),
    ("chat_model_missing", _chat_case(model=DROP), 422, "model"),
    ("chat_model_number", _chat_case(model=7), 422, "model"),
    ("chat_max_tokens_0", _chat_case(max_tokens=0), 422, "max_tokens"),
    ("chat_max_tokens_negative", _chat_case(max_tokens=-1), 422, "max_tokens"),
    ("chat_max_tokens_float", _chat_case(max_tokens=1e10), 422, "max_tokens"),
    ("chat_max_tokens_string", _chat_case(max_tokens="5"), 422, "max_tokens"),
    ("chat_max_completion_huge", _chat_case(max_completion_tokens=10**30), 422, "max_completion_tokens"),
    ("chat_max_tokens_big", _chat_case(max_tokens=10**6), 200, None),  # capped at --max-new-tokens
    ("chat_temperature_0_top_p", _chat_case(temperature=0, top_p=0.5, seed=3, user="u"), 200, None),
    ("chat_text_format", _chat_case(response_format={"type": "text"}, n=1, tools=None), 200, None),
    ("chat_messages_missing", _chat_case(messages=DROP), 422, "messages"),
    ("chat_messages_object", _chat_case(messages={"role": "user"}), 422, "messages"),
    ("chat_messages_empty", _chat_case(messages=[]), 422, "messages"),
    ("chat_message_number", _chat_case(messages=[1]), 422, "messages"),
    ("chat_message_role", _chat_case(messages=[{"role": "robot", "content": "x"}]), 422, "messages"),
    ("chat_no_user", _chat_case(messages=[{"role": "system", "content": "x"}]), 422, "no user message"),
    ("chat_content_null", _chat_case(messages=[{"role": "user", "content": None}]), 422, "messages"),
    ("chat_content_object", _chat_case(messages=[{"role": "user", "content": {"text": "x"}}]), 422, "messages"),
    ("chat_part_audio", _chat_case(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]), 422,
     "messages"),
    ("chat_part_text_number", _chat_case(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), 422,
     "messages"),
    ("chat_two_images", _chat_raw(json.dumps({**GOOD_CHAT, "messages": [{"role": "user", "content": [
        *GOOD_CHAT["messages"][0]["content"][:1] * 2, {"type": "text", "text": "x"}]}]}).encode()), 422,
     "exactly one image_url"),
    ("chat_image_http", _chat_case(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}, {"type": "text", "text": "x"}]}]),
     422, "data: URI"),
    ("chat_image_url_no_url", _chat_case(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {}}, {"type": "text", "text": "x"}]}]), 422, "data: URI"),
    ("chat_surrogate_text", _chat_raw(json.dumps(GOOD_CHAT).replace('"text": "x"', '"text": "\\ud800"').encode()),
     422, "surrogate"),
    # multipart
    ("multipart_two_images", _multipart_case([("image", ("a.png", b"A")), ("image", ("b.png", b"B"))],
                                             {"phrase": "x"}), 422, "one 'image'"),
    ("multipart_image_as_text", _multipart_case([("phrase", (None, b"x"))], {"image": "not a file"}), 422, "image"),
    ("multipart_unknown_field", _multipart_case([("photo", ("a.png", b"A"))], {"phrase": "x"}), 422, "photo"),
    ("multipart_phrase_file", lambda url: _multipart_case([("image", ("a.png", _scene()[0])),
                                                           ("phrase", ("p.txt", b"x"))])(url), 422, "phrase"),
    ("multipart_no_boundary", lambda url: _post(url, "/v1/ground", b"--x\r\n", "multipart/form-data"), 400, "boundary"),
    ("multipart_wrong_boundary", lambda url: _post(url, "/v1/ground", b"--x\r\n\r\n--x--\r\n",
                                                   "multipart/form-data; boundary=y"), 400, "multipart"),
    ("multipart_many_fields", _multipart_case([("image", ("a.png", b"A"))], {f"phrase{i}": "x" for i in range(30)}),
     400, "fields"),
    ("multipart_cut_short", lambda url: _post(url, "/v1/ground", b'--b\r\nContent-Disposition: form-data; name="ima',
                                              "multipart/form-data; boundary=b"), {400, 422}, None),
    # headers and the wire
    ("content_type_text", lambda url: _post(url, "/v1/ground", json.dumps({"image": _b64(_scene()[0]),
                                                                           "phrase": "x"}).encode(), "text/plain"),
     200, None),
    ("content_length_over_limit", _wire(HEAD + b"Content-Length: 999999999999\r\n\r\n"), 413, None),
    ("content_length_short", _wire(HEAD + b"Content-Length: 5\r\n\r\n", b'{"image": "AAAA", "phrase": "x"}'), 400,
     None),
    ("content_length_lie_stalls", _wire(HEAD + b"Content-Length: 1000\r\n\r\n", b'{"image": "'), 408, None),
    ("content_length_not_a_number", _wire(HEAD + b"Content-Length: ten\r\n\r\n", b"{}"), 400, None),
    ("content_length_and_chunked", _wire(HEAD + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n",
                                         b"2\r\n{}\r\n0\r\n\r\n"), {400, 422}, None),  # h11 reads it chunked
    ("chunked_over_limit", lambda url: _post(url, "/v1/ground", iter([b'{"image": "' + b"A" * 300_000,
                                                                      b"A" * 300_000 + b'"}'])), 413, "--max-body-mb"),
    ("slow_trickle", _wire(HEAD + b"Transfer-Encoding: chunked\r\n\r\n", b"1\r\n{\r\n"), 408, None),
    ("disconnect_mid_body", _wire(HEAD + b"Content-Length: 100000\r\n\r\n", b'{"image": "' + b"A" * 5000,
                                  then="leave", pause=0.3), None, None),
    ("header_too_large", _wire(b"GET /health HTTP/1.1\r\nHost: test\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"),
     {200, 400, 431, None}, None),
    ("get_on_post", lambda url: httpx.get(url + "/v1/ground", headers=AUTH), 405, None),
    ("unknown_path", lambda url: httpx.post(url + "/v1/%00/../x", headers=AUTH), 404, None),
    ("wrong_key", lambda url: httpx.post(url + "/v1/ground", headers={"Authorization": "Bearer nope"}), 401, None),
]


@pytest.fixture(scope="module")
def hostile_process(model):
    """The limits of ``server``, answers of 4 tokens (a valid request after each hostile one is quick)."""
    process, url = _start(model, "--api-key", KEY, "--max-phrases", "3", "--max-phrase-chars", "40",
                          "--max-body-mb", "0.5", "--max-image-pixels", "300000", "--max-wait-ms", "0",
                          "--body-timeout-s", "2", "--max-new-tokens", "4")
    yield process, url
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def hostile_server(hostile_process):
    return hostile_process[1]


@pytest.mark.parametrize("name, send, status, names", HOSTILE, ids=[case[0] for case in HOSTILE])
def test_hostile_requests_get_4xx_json_naming_what_is_wrong(hostile_server, name, send, status, names):
    """Each a real request (a few written on a socket as they are); never a 500; an error answer
    is JSON ``{"error": {"message", "type", "param", "code"}}`` naming the param or the flag; and
    the server still answers a valid request after it."""
    answer = send(hostile_server)
    got = answer.status_code if answer is not None else None
    assert got in (status if isinstance(status, set) else {status}), (name, got, answer and answer.content[:300])
    if got is not None and 400 <= got < 500 and not isinstance(answer, _Raw):
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        if names is not None:
            assert names in (error["param"] or "") or names in error["message"] or names == error["code"], error
    png, phrase = _scene(index=3)
    valid = _ground(hostile_server, {"image": _b64(png), "phrase": phrase})
    assert valid.status_code == 200, valid.text


def test_after_the_hostile_corpus_no_500_and_no_traceback(hostile_process):
    """The corpus's server (after the corpus; alone too), sent a client that leaves mid-body and a
    made-up path: /metrics has no status="500" series, the client that left is counted (499), all
    made-up paths share one series; stopped, its log says each client that left in one line, and
    nothing printed a traceback."""
    process, url = hostile_process
    _wire(HEAD + b"Content-Length: 100000\r\n\r\n", b'{"image": "', then="leave", pause=0.3)(url)
    assert httpx.post(url + "/v1/made/up", headers=AUTH).status_code == 404
    time.sleep(0.3)
    metrics = httpx.get(url + "/metrics", headers=AUTH).text
    assert 'status="500"' not in metrics
    assert 'groundtune_requests_total{endpoint="/v1/ground",status="499"}' in metrics
    assert 'groundtune_requests_total{endpoint="other",status="404"}' in metrics and "made" not in metrics
    process.terminate()
    process.wait(timeout=10)
    log = process.stdout.read()
    lines = log.splitlines() + [""]
    left = [i for i, line in enumerate(lines) if "the client left before its body arrived" in line]
    assert left and all(lines[i].startswith("WARNING:  request ") and "POST '/v1/ground'" in lines[i]
                        and not lines[i + 1].startswith((" ", "Traceback")) for i in left), log
    assert "Traceback" not in log, log


def test_concurrent_requests_are_answered_in_batches(server):
    requests = [_scene(index=i) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda r: _ground(server, {"image": _b64(r[0]), "phrase": r[1]}), requests))
    assert [a.status_code for a in answers] == [200] * 16
    metrics = httpx.get(server + "/metrics", headers=AUTH).text
    count = float(next(line.split()[-1] for line in metrics.splitlines() if line.startswith("groundtune_batch_size_count")))
    total = float(next(line.split()[-1] for line in metrics.splitlines() if line.startswith("groundtune_batch_size_sum")))
    assert total / count > 1.5  # phrases per model call, over every request this server answered


def test_served_with_no_flags_as_the_readme_says(model):
    """`groundtune serve --model M` alone: the device and the encoding workers chosen for the machine."""
    process, url = launch(model, timeout_s=30, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        png, phrase = _scene()
        answer = httpx.post(url + "/v1/ground", json={"image": _b64(png), "phrase": phrase}, timeout=60)
        assert answer.status_code == 200 and answer.json()["results"][0]["raw"]
        assert httpx.get(url + "/health").json()["family"] == "qwen2.5-vl"
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_encoding_processes_answer_as_the_server_does_alone(gm, model):
    """--workers N (a GPU machine's default): images decoded and prompts encoded in processes of
    their own; the same answers, and a caller's mistake found there is still its 4xx."""
    process, url = _start(model, "--workers", "2", "--max-image-pixels", "300000", "--max-new-tokens", str(NEW_TOKENS))
    try:
        png, phrase = _scene(200, 140)
        ours = infer.predict(gm, [Image.open(io.BytesIO(png))], [phrase], max_new_tokens=NEW_TOKENS)[0]
        answer = httpx.post(url + "/v1/ground", json={"image": _b64(png), "phrases": [phrase, phrase]}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert [(r["raw"], r["bbox"]) for r in answer.json()["results"]] == [(ours.raw, ours.to_json()["bbox"])] * 2
        big, thin = io.BytesIO(), io.BytesIO()
        Image.new("RGB", (700, 500)).save(big, format="PNG")
        Image.new("RGB", (1000, 4)).save(thin, format="PNG")
        for image, status, says in [(b"GIF89a no image", 422, "cannot be decoded"),
                                    (big.getvalue(), 413, "--max-image-pixels"), (thin.getvalue(), 422, "aspect ratio")]:
            refused = httpx.post(url + "/v1/ground", json={"image": _b64(image), "phrase": "x"}, timeout=60)
            assert refused.status_code == status and says in refused.json()["error"]["message"], refused.text
        chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={"model": model, "messages": [{
            "role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(png)}},
                                        {"type": "text", "text": phrase}]}]})
        assert chat.json()["choices"][0]["message"]["content"] == ours.raw
        assert chat.json()["groundtune"]["bbox"] == ours.to_json()["bbox"]
        workers = _children(process.pid)
        assert len(workers) >= 3  # the model's process and two encoding workers
    finally:
        process.terminate()
        process.wait(timeout=20)
    # stopped by SIGTERM as systemd stops it: a normal exit, nothing said, nothing left behind
    output = process.stdout.read()
    assert process.returncode == 0 and "Traceback" not in output and "leaked" not in output, output
    deadline = time.monotonic() + 10
    while [pid for pid in workers if Path(f"/proc/{pid}").exists()] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]  # the workers ended with the server


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux: /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def test_a_full_queue_answers_503_with_retry_after(model):
    process, url = _start(model, "--queue-size", "2", "--batch-size", "1", "--max-wait-ms", "0")
    try:
        png, phrase = _scene()
        body = {"image": _b64(png), "phrase": phrase}
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            answers = list(pool.map(lambda _: httpx.post(url + "/v1/ground", json=body, timeout=60), range(24)))
        statuses = [a.status_code for a in answers]
        assert set(statuses) == {200, 503} and statuses.count(200) >= 2
        busy = next(a for a in answers if a.status_code == 503)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "server_busy"
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_taken_port_is_one_line_and_exit_2():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = groundtune("serve", "--model", "tiny", "--port", port)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in "
                                   "use); choose another --port (or --host)")
    assert "serving" not in done.stdout  # said before the model loads, not after


def test_a_model_that_cannot_load_is_said_with_exit_2(tmp_path):
    import socket
    import sys

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "groundtune", "serve", "--model", str(tmp_path / "nothing"),
                           "--port", str(port)], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and str(tmp_path / "nothing") in done.stderr and "Traceback" not in done.stderr


def test_the_server_stops_when_its_model_process_dies(model):
    """The model answers in a process of its own; killed (out of memory, say), the waiting request
    gets a 500 and the server exits 1 saying why, for a supervisor to restart it."""
    import signal

    process, url = _start(model)
    try:
        (answering,) = [pid for pid in _children(process.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        png, phrase = _scene()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, url + "/v1/ground", json={"image": _b64(png), "phrase": phrase},
                                  timeout=60)
            os.kill(answering, signal.SIGKILL)
            answer = waiting.result()
        assert answer.status_code in (200, 500)  # answered before the kill, or failed by it
        assert process.wait(timeout=30) == 1
        assert "the model's process exited with -9; the server stops" in process.stdout.read()
    finally:
        process.kill()


def test_openai_max_tokens_usage_and_refusals(server, model):
    """max_tokens cuts the answer at its first k tokens (greedy: what a limit of k gives) and says
    "length"; usage counts the prompt's and the answer's tokens; what the server cannot honour is
    the openai client's own 422 and 404 errors."""
    openai = pytest.importorskip("openai")
    png, phrase = _scene(index=4)
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(png)}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": phrase}]}]
    whole = client.chat.completions.create(model=model, messages=messages)
    cut = client.chat.completions.create(model=model, messages=messages, max_tokens=3)
    newer = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=3, temperature=0)
    assert whole.usage.completion_tokens > 3 and cut.usage.completion_tokens == 3
    assert whole.usage.prompt_tokens == cut.usage.prompt_tokens > 0
    assert cut.usage.total_tokens == cut.usage.prompt_tokens + 3
    assert cut.choices[0].finish_reason == "length" and whole.choices[0].finish_reason in ("stop", "length")
    first_3 = cut.choices[0].message.content
    assert first_3 and whole.choices[0].message.content.startswith(first_3)
    assert newer.choices[0].message.content == first_3
    with pytest.raises(openai.UnprocessableEntityError, match="'n' must be 1"):
        client.chat.completions.create(model=model, messages=messages, n=2)
    with pytest.raises(openai.UnprocessableEntityError, match="'tools'"):
        client.chat.completions.create(model=model, messages=messages, tools=[
            {"type": "function", "function": {"name": "box", "parameters": {"type": "object"}}}])
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=messages)
    assert missing.value.code == "model_not_found" and missing.value.param == "model"


def test_the_openai_client_streams(server, model):
    """stream=True is OpenAI's server-sent events: a role chunk, the text, a chunk with the
    finish_reason and the boxes (``groundtune``), with include_usage a last chunk of usage and no
    choices; the text and boxes are the unstreamed answer's. A mistake found before the answer is
    the client's ordinary error, not a stream."""
    openai = pytest.importorskip("openai")
    png, phrase = _scene(index=5)
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(png)}},
        {"type": "text", "text": phrase}]}]
    whole = client.chat.completions.create(model=model, messages=messages)
    chunks = list(client.chat.completions.create(model=model, messages=messages, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + [whole.choices[0].finish_reason]
    assert chunks[-1].model_extra["groundtune"] == whole.model_extra["groundtune"]
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in chunks)
    assert not any("groundtune" in c.model_extra for c in chunks[:-1])

    counted = list(client.chat.completions.create(model=model, messages=messages, stream=True, max_tokens=3,
                                                  stream_options={"include_usage": True}))
    *answer, usage = counted
    assert usage.choices == [] and usage.usage.completion_tokens == 3
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.usage.total_tokens == 3 + whole.usage.prompt_tokens
    assert all(c.usage is None for c in answer) and answer[-1].choices[0].finish_reason == "length"
    assert "groundtune" in answer[-1].model_extra
    assert whole.choices[0].message.content.startswith("".join(c.choices[0].delta.content or "" for c in answer))

    with pytest.raises(openai.UnprocessableEntityError, match="'n' must be 1"):
        client.chat.completions.create(model=model, messages=messages, stream=True, n=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=messages, stream=True)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong").chat.completions.create(
            model=model, messages=messages, stream=True)


def test_a_stream_on_the_wire(server, model):
    """What a client without the openai package reads: text/event-stream, one JSON a "data:" line,
    a blank line after each, "data: [DONE]" last."""
    png, phrase = _scene(index=6)
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(png)}},
        {"type": "text", "text": phrase}]}]}
    answer = httpx.post(server + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
    assert answer.headers["cache-control"] == "no-cache"
    events = answer.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length") and "usage" not in chunks[-1]
    assert set(chunks[-1]["groundtune"]) >= {"bbox", "boxes", "width", "height"}


def test_the_api_key_is_one_bearer_header_of_any_case(server):
    """`Authorization: Bearer KEY` is the one way to give the key (the scheme in any case); a bare
    key, X-Api-Key, another scheme or a wrong key is 401 with WWW-Authenticate. The API's
    description (/openapi.json) is behind the key; the UI and /health are not."""
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        assert httpx.get(server + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    for headers in ({"Authorization": KEY}, {"X-Api-Key": KEY}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer"}, {}):
        refused = httpx.get(server + "/v1/models", headers=headers)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer", headers
        assert "Authorization: Bearer KEY" in refused.json()["error"]["message"]
    assert httpx.get(server + "/openapi.json").status_code == 401
    described = httpx.get(server + "/openapi.json", headers={"Authorization": f"bearer {KEY}"})
    assert described.status_code == 200 and "/v1/ground" in described.json()["paths"]
    assert httpx.get(server + "/docs").status_code == 401  # off; and said to no one without the key
    assert httpx.get(server + "/health").status_code == 200 and httpx.get(server + "/").status_code == 200


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/", "/metrics"])
def test_head_is_answered_wherever_get_is(server, path):
    got, head = httpx.get(server + path, headers=AUTH), httpx.head(server + path, headers=AUTH)
    assert head.status_code == got.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    if path in ("/", "/v1/models"):  # the same body every time: the same length
        assert head.headers["content-length"] == got.headers["content-length"]
    assert httpx.head(server + "/v1/models").status_code == 401  # the key still asked


def test_mime_base64_with_line_breaks_is_taken(server, model):
    """Base64 as MIME writes it (76 columns, LF or CRLF line breaks), in the JSON image and in
    data: URIs on both endpoints, is the same image; other characters are still refused."""
    png, phrase = _scene(index=7)
    plain = _ground(server, {"image": _b64(png), "phrase": phrase}).json()["results"][0]
    wrapped = base64.encodebytes(png).decode()  # a line break every 76 characters
    assert "\n" in wrapped[:80]
    for image in (wrapped, wrapped.replace("\n", "\r\n"), "data:image/png;base64," + wrapped.replace("\n", "\r\n")):
        answer = _ground(server, {"image": image, "phrase": phrase})
        assert answer.status_code == 200 and answer.json()["results"][0] == plain, answer.text
    chat = {"model": model, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + wrapped}},
        {"type": "text", "text": phrase}]}]}
    answered = httpx.post(server + "/v1/chat/completions", json=chat, headers=AUTH, timeout=60)
    assert answered.status_code == 200 and answered.json()["choices"][0]["message"]["content"] == plain["raw"]
    assert answered.json()["groundtune"]["bbox"] == plain["bbox"]
    spaced = _ground(server, {"image": wrapped.replace("\n", " "), "phrase": phrase})
    assert spaced.status_code == 422 and "not valid base64" in spaced.json()["error"]["message"]


# --------------------------------------------------------------------------------------------
# Connections (issue 48): a request's headers within --header-timeout-s, at most --max-connections
# open, failed accepts said once in a while. bench/serve_connections.py measures 20,000 of them.


def _connect(url: str):
    import socket

    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _rest(sock) -> bytes:
    """What the server says until it closes (or 10 s pass)."""
    said = b""
    try:
        while chunk := sock.recv(65536):
            said += chunk
    except OSError:  # reset, or the 10 s timeout
        pass
    return said


def _trickle(sock, data: bytes, every: float) -> tuple[bytes, float]:
    """``data`` sent a byte every ``every`` seconds until the server answers or closes; returns what
    it said and the seconds it took."""
    import select

    start = time.monotonic()
    for i in range(10_000):
        if i < len(data):
            try:
                sock.sendall(data[i:i + 1])
            except OSError:
                break
        if select.select([sock], [], [], every)[0]:
            break
    return _rest(sock), time.monotonic() - start


def _answer_on(sock) -> bytes:
    """One whole answer read off a kept-alive connection (its Content-Length)."""
    said = b""
    while b"\r\n\r\n" not in said:
        said += sock.recv(65536)
    head, _, body = said.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head


def test_a_request_s_headers_must_arrive_within_the_header_timeout(model):
    """--header-timeout-s 1: connections trickling a header byte every 0.2 s get a 408 after ~1 s
    (one deadline, not restarted by each byte); one that sends nothing is closed silently; headers
    that arrive in time, however slowly, are answered; after an answer the next request has a
    deadline of its own; no log line for any of it."""
    process, url = _start(model, "--header-timeout-s", "1")
    try:
        slow = b"GET /health HTTP/1.1\r\nHost: test\r\nX-Slow: " + b"a" * 100
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            trickled = list(pool.map(lambda sock: _trickle(sock, slow, 0.2), [_connect(url) for _ in range(3)]))
            silent = _trickle(_connect(url), b"", 0.2)
        for said, seconds in trickled:
            assert said.startswith(b"HTTP/1.1 408 ") and b"(--header-timeout-s)" in said, said
            assert 0.9 < seconds < 3, seconds
        assert silent[0] == b"" and 0.9 < silent[1] < 3, silent
        kept = _connect(url)
        for byte in b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n":  # 0.7 s: in time
            kept.sendall(bytes([byte]))
            time.sleep(0.02)
        assert _answer_on(kept).startswith(b"HTTP/1.1 200 ")
        said, seconds = _trickle(kept, slow, 0.2)  # kept alive: the next request's headers have 1 s again
        assert said.startswith(b"HTTP/1.1 408 ") and 0.8 < seconds < 3, (said, seconds)
        metrics = httpx.get(url + "/metrics").text
        assert 'groundtune_connections_shed_total{reason="header_timeout"} 5.0' in metrics
    finally:
        process.terminate()
        process.wait(timeout=10)
    log = process.stdout.read()
    assert "Traceback" not in log and "WARNING" not in log and "ERROR" not in log, log


def test_a_connection_cap_refuses_cleanly_and_makes_room(model):
    """--max-connections 2: with two connections busy with requests (bodies on their way), a third
    is answered 503 with Retry-After at once and closed; one waiting for its headers gives its
    place to a new connection (a real request is answered): closed silently when it had sent
    nothing, with a 503 when it had sent part of a request. Counted in /metrics, no traceback."""
    process, url = _start(model, "--max-connections", "2", "--body-timeout-s", "30")
    try:
        busy = [_connect(url) for _ in range(2)]
        for sock in busy:
            sock.sendall(HEAD.replace(b"Authorization: Bearer KEY\r\n", b"") + b'Content-Length: 1000\r\n\r\n{"image": "')
        time.sleep(0.5)  # their headers read: each is busy with its request
        start = time.monotonic()
        said = _rest(_connect(url))
        assert time.monotonic() - start < 2
        head, _, body = said.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower(), said
        error = json.loads(body)["error"]
        assert error["type"] == "server_busy" and "--max-connections" in error["message"]

        busy[0].close()  # the server sees it leave (a 499): one place free
        time.sleep(0.5)
        idle = _connect(url)
        time.sleep(0.2)
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # in the place of the idle one
        assert _rest(idle) == b""
        partial = _connect(url)
        partial.sendall(b"GET /hea")
        time.sleep(0.2)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        said = _rest(partial)
        assert said.startswith(b"HTTP/1.1 503 ") and b"--max-connections" in said, said
        busy[1].close()
        time.sleep(0.5)
        metrics = httpx.get(url + "/metrics").text
        assert 'groundtune_connections_shed_total{reason="refused"} 1.0' in metrics
        evicted = float(re.search(r'groundtune_connections_shed_total\{reason="evicted"\} (\S+)', metrics).group(1))
        assert evicted >= 2 and "groundtune_connections 1.0" in metrics  # /metrics's own connection
    finally:
        process.terminate()
        process.wait(timeout=10)
    log = process.stdout.read()
    assert "Traceback" not in log and "ERROR" not in log, log


def test_the_connection_cap_fits_under_the_open_file_limit(monkeypatch):
    """The soft open-file limit is raised as far as the hard one allows; the default cap is 4096 or
    what the limit leaves room for (the cap, twice the backlog, the server's own 256); a cap given
    that cannot fit is an error naming --max-connections."""
    import resource

    from groundtune.deploy import connections
    from groundtune.errors import ConfigError

    limit = {"soft": 1024, "hard": 1024}
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limit["soft"], limit["hard"]))
    monkeypatch.setattr(resource, "setrlimit", lambda which, pair: limit.update(soft=pair[0]))
    assert connections.budget(None) == (1024 - 2 * 256 - 256, 256)
    limit.update(hard=1_048_576)
    assert connections.budget(None) == (4096, 2048) and limit["soft"] == 4096 + 2 * 2048 + 256
    assert connections.budget(10_000) == (10_000, 2048) and limit["soft"] == 10_000 + 2 * 2048 + 256
    limit.update(soft=1024, hard=1024)
    with pytest.raises(ConfigError, match=r"--max-connections 5000: the open-file limit \(ulimit -n\) is 1024 "
                                          r"\(hard 1024\), which leaves room for 256 connections"):
        connections.budget(5000)


def test_failed_accepts_are_said_once_in_a_while():
    """Out of open files, asyncio would log a traceback per failed accept (thousands a second): here
    one line without a traceback, then nothing until a minute has passed; other errors as asyncio
    says them."""
    import asyncio
    import errno
    import logging

    from groundtune.deploy.connections import quiet_accept_errors

    said: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = said.append
    loggers = [logging.getLogger("uvicorn.error"), logging.getLogger("asyncio")]
    for logger in loggers:
        logger.addHandler(handler)
    loop = asyncio.new_event_loop()
    try:
        quiet_accept_errors(loop)
        for _ in range(2048):
            loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                         "exception": OSError(errno.EMFILE, "Too many open files")})
        loop.call_exception_handler({"message": "something else broke"})
    finally:
        loop.close()
        for logger in loggers:
            logger.removeHandler(handler)
    accepts = [r for r in said if "accept" in r.getMessage()]
    assert len(accepts) == 1 and not accepts[0].exc_info
    assert "cannot accept connections: Too many open files (1 failed accepts" in accepts[0].getMessage()
    assert any(r.getMessage() == "something else broke" for r in said)


def test_a_connection_cap_the_open_file_limit_cannot_hold_is_one_line():
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    done = groundtune("serve", "--model", "tiny", "--port", port, "--max-connections", "100000000")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (said,) = done.stderr.strip().splitlines()
    assert said.startswith("error: --max-connections 100000000: the open-file limit (ulimit -n) is "), said
    assert "serving" not in done.stdout  # said before the model loads


def _started_at(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def test_a_bug_is_a_500_saying_internal_error_and_its_request_id(model):
    """A real failure of the server's own (its encoding process killed, as the kernel's OOM killer
    would): the request gets 500 with "internal error" and a request id, nothing of the exception;
    the log prints that id with the traceback; /metrics counts the 500 and its latency; the next
    request is answered (a new worker)."""
    import signal

    process, url = _start(model, "--workers", "1", "--max-new-tokens", "4")
    try:
        spawned = [pid for pid in _children(process.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        worker = max(spawned, key=_started_at)  # the model's process starts first
        os.kill(worker, signal.SIGKILL)
        while Path(f"/proc/{worker}").exists() and "zombie" not in Path(f"/proc/{worker}/status").read_text():
            time.sleep(0.05)
        time.sleep(0.5)  # the pool sees its worker gone
        png, phrase = _scene()
        failed = httpx.post(url + "/v1/ground", json={"image": _b64(png), "phrase": phrase}, timeout=60)
        request_id = failed.headers["x-request-id"]
        assert failed.status_code == 500
        assert failed.json() == {"error": {"message": f"internal error (request id {request_id})",
                                           "type": "server_error", "param": None, "code": None}}
        again = httpx.post(url + "/v1/ground", json={"image": _b64(png), "phrase": phrase}, timeout=120)
        assert again.status_code == 200, again.text
        metrics = httpx.get(url + "/metrics").text
        assert 'groundtune_requests_total{endpoint="/v1/ground",status="500"} 1.0' in metrics
        assert 'groundtune_request_seconds_count{endpoint="/v1/ground"} 2.0' in metrics
    finally:
        process.terminate()
        process.wait(timeout=30)
    log = process.stdout.read()
    said = log[log.index(f"request {request_id}: POST '/v1/ground' failed"):]
    assert said.splitlines()[1] == "Traceback (most recent call last):" and "BrokenProcessPool" in said, log


@pytest.mark.slow
def test_decoding_memory_is_bounded_by_the_decode_budget(model):
    """Six 4 MP 16-bit PNGs at once (~28 MB each to decode, 36 reserved) on a server whose decode
    budget is 40 MB: they are decoded one at a time, so the server's peak stays within the budget
    (plus slack), where all six at once took ~170 MB (and the float64 conversion ~750); and the
    memory goes back (within 32 MB of idle)."""
    process, url = _start(model, "--max-image-pixels", "4000000", "--decode-budget-mb", "40", "--max-new-tokens", "4",
                          "--max-wait-ms", "0")
    status = Path(f"/proc/{process.pid}/status")

    def mb(key: str) -> float:
        return next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith(key)) / 1024

    try:
        png, phrase = _scene()
        assert _ground(url, {"image": _b64(png), "phrase": phrase}).status_code == 200  # a warm server
        row = np.linspace(0, 65535, 2000).astype(np.uint16)
        deep = _b64(_encoded(Image.fromarray(np.tile(row, (2000, 1))), "PNG"))
        time.sleep(0.5)
        try:
            Path(f"/proc/{process.pid}/clear_refs").write_text("5")  # the peak (VmHWM) from now on
        except OSError:
            pytest.skip("cannot reset the server's peak memory (/proc/PID/clear_refs)")
        idle = mb("VmRSS")
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: _ground(url, {"image": deep, "phrase": "x"}), range(6)))
        assert [a.status_code for a in answers] == [200] * 6
        time.sleep(0.5)
        peak, after = mb("VmHWM") - idle, mb("VmRSS") - idle
        assert peak < 40 + 32, (peak, after)
        assert after < 32, (peak, after)
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_serve_flags_say_their_defaults_and_a_bad_port_is_one_line():
    shown = groundtune("serve", "--help").stdout
    flags = ["--port", "--max-image-pixels", "--max-phrase-chars", "--body-timeout-s", "--decode-budget-mb",
             "--max-body-mb", "--max-phrases", "--batch-size", "--queue-size", "--max-wait-ms", "--max-new-tokens"]
    text = " ".join(shown.split())
    for flag in flags:
        said = text.split(f" {flag} {flag.lstrip('-').replace('-', '_').upper()} ", 1)[1].split(" --", 1)[0]
        assert "(default: " in said and len(said) > 30, (flag, said)
    for port in ("99999", "0", "http"):
        done = groundtune("serve", "--model", "tiny", "--port", port)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        (said,) = done.stderr.strip().splitlines()  # one line, as every other mistake
        assert said.startswith("error: groundtune serve: argument --port:"), done.stderr
    done = groundtune("serve", "--model", "tiny", "--body-timeout-s", "nan")
    assert done.returncode == 2 and "--body-timeout-s" in done.stderr.splitlines()[-1]


def test_listen_names_the_flags_for_a_port_the_system_refuses():
    from groundtune.deploy.serve import listen
    from groundtune.errors import ConfigError

    with pytest.raises(ConfigError, match="--host 127.0.0.1 --port 99999: cannot listen there"):
        listen("127.0.0.1", 99999)


def test_the_decode_budget_is_first_come_first_served():
    """A request waits for its share; a small one does not pass a large one waiting before it; one
    larger than the whole budget waits for all of it; one given up (the server stops) leaves its place."""
    import asyncio

    from groundtune.deploy.batching import DecodeBudget

    async def scenario() -> list[str]:
        budget, said = DecodeBudget(100), []

        async def decode(name: str, wanted: int, seconds: float) -> None:
            async with budget.hold(wanted):
                said.append(f"{name} in ({budget.free} free)")
                await asyncio.sleep(seconds)
            said.append(f"{name} out")

        first = asyncio.create_task(decode("a", 60, 0.05))
        await asyncio.sleep(0)
        large = asyncio.create_task(decode("huge", 500, 0.01))  # waits for the whole 100
        await asyncio.sleep(0)
        small = asyncio.create_task(decode("b", 10, 0.01))  # would fit now; waits its turn
        await asyncio.sleep(0)
        gone = asyncio.create_task(decode("gone", 50, 0.01))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.gather(first, large, small, return_exceptions=True)
        assert budget.free == 100 and not budget.waiting
        return said

    assert asyncio.run(scenario()) == ["a in (40 free)", "a out", "huge in (0 free)", "huge out", "b in (90 free)",
                                       "b out"]
