"""Reading what a caller of `groundtune serve` sends: the body (within its size and time limits),
its JSON, the image (base64, MIME's line breaks allowed, or a data: URI, or a multipart file;
decoded as a viewer shows it, refused on its frame's header before a pixel is decoded) and the
phrases. A caller's mistake is a ``RequestError``, which the app (serve.py) answers as a 4xx JSON
error naming what was wrong. ``Encoder`` decodes and encodes a request in the encoding workers
(batching.py)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re

from PIL import Image, ImageOps

from groundtune.data import images
from groundtune.deploy.limits import Limits
from groundtune.errors import DataError


class RequestError(Exception):
    """A caller's mistake: answered with ``status`` and a JSON error naming ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def __reduce__(self):  # raised in an encoding process, said by the server
        return RequestError, (self.status, self.message, self.param, self.kind, self.code)


def decode_image(data: bytes, limits: Limits, param: str = "image") -> Image.Image:
    """Image bytes -> RGB as a viewer shows it (EXIF orientation applied). Only the plain formats
    (``images.PLAIN_FORMATS``: PNG, JPEG, WebP, GIF, BMP, TIFF), refused before decoding when the
    frame's own header says more than ``limits.max_image_pixels``; what Pillow cannot decode is a
    422. The memory it holds at most is ``image_frame``'s ``images.decoding_bytes``."""
    image = _opened(images.open_untrusted, data, limits, param)
    try:
        image.load()
        ImageOps.exif_transpose(image, in_place=True)  # in place: one copy less than a new image
        return images.to_rgb(image)
    except MemoryError:
        raise  # the machine's, not the caller's
    except Exception as e:  # noqa: BLE001 - what Pillow's decoders raise on bytes made up to break them
        raise RequestError(422, f"the image cannot be decoded ({_pillow_said(e)})", param) from None


def image_frame(data: bytes, limits: Limits, param: str = "image") -> images.Frame:
    """What decoding ``data`` will give, from its header alone (``decode_image``'s refusals,
    raised before anything is decoded)."""
    return _opened(images.untrusted_frame, data, limits, param)


def _opened(open_, data: bytes, limits: Limits, param: str):
    try:
        return open_(data, limits.max_image_pixels)
    except images.TooManyPixels as e:
        raise RequestError(413, f"{e} (--max-image-pixels)", param) from None
    except images.NotAnImage as e:
        raise RequestError(422, f"the image cannot be decoded ({e})", param) from None
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a header made up to break a plugin's parser
        raise RequestError(422, f"the image cannot be decoded ({_pillow_said(e)})", param) from None


def _pillow_said(error: Exception) -> str:
    """Pillow's message without the buffer it read from ("<_io.BytesIO object at 0x...>"), which
    is nothing the caller sent; the exception's name where it said nothing."""
    said = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(error)).strip()
    return said or type(error).__name__


def image_bytes(value: str, param: str) -> bytes:
    """A base64 string or a data: URI -> the image file's bytes. Anything else (a URL, a file path)
    is refused: the server reads nothing from its disk or network on a caller's behalf. Base64 may
    be MIME's, broken into lines (LF or CRLF, as ``base64`` and e-mail write it at 76
    columns); any other character outside base64's alphabet is refused, not skipped."""
    if not isinstance(value, str) or not value:
        raise RequestError(422, "expected an image as base64 or a data: URI", param)
    if value.startswith("data:"):
        header, _, value = value.partition(",")
        if ";base64" not in header:
            raise RequestError(422, "a data: URI image must be base64 (data:image/png;base64,...)", param)
    elif value.startswith(("http://", "https://", "file:", "ftp://")):
        raise RequestError(422, "images are accepted as base64 or data: URIs only: the server does not fetch "
                                "URLs on a caller's behalf", param)
    if "\n" in value or "\r" in value:  # copied only when it has line breaks
        value = value.replace("\r", "").replace("\n", "")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        looks_like_a_path = value.startswith(("/", "./", "~")) or "." in value[-6:]
        raise RequestError(422, "the server does not read files on a caller's behalf: send the image itself, "
                                "as base64 or a data: URI" if looks_like_a_path else "the image is not valid base64",
                           param) from None


def check_phrases(phrases, limits: Limits, param: str = "phrases") -> list[str]:
    if isinstance(phrases, str):
        phrases = [phrases]
    if not isinstance(phrases, list) or not phrases:
        raise RequestError(422, "give a phrase (a string) or phrases (a list of strings)", param)
    if len(phrases) > limits.max_phrases:
        raise RequestError(422, f"{len(phrases)} phrases; the limit is {limits.max_phrases} a request "
                                "(--max-phrases)", param)
    for phrase in phrases:
        if not isinstance(phrase, str) or not phrase.strip():
            raise RequestError(422, "every phrase must be a non-empty string", param)
        if not _unicode(phrase):
            raise RequestError(422, "a phrase holds a lone surrogate (a \\ud800-\\udfff escape that is half of a "
                                    "character): not Unicode text", param)
        if len(phrase) > limits.max_phrase_chars:
            raise RequestError(422, f"a phrase of {len(phrase)} characters; the limit is {limits.max_phrase_chars} "
                                    "(--max-phrase-chars)", param)
    return phrases


def _unicode(text: str) -> bool:
    """False for a string JSON's escapes made of a lone surrogate, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Encoder:
    """A request's image bytes and phrases -> (width, height, [(encoded prompt, sizes)]): the image
    decoded as a viewer shows it, each phrase encoded as eval encodes it (``infer.PromptEncoder``).
    Made by the model's process, used by the encoding workers (or threads): batching.Model's
    ``make_encoder``."""

    def __init__(self, gm, limits: Limits):
        from groundtune import infer

        self.encode, self.limits = infer.PromptEncoder(gm), limits

    def __call__(self, data: bytes, phrases: list[str], param: str) -> tuple[int, int, list[tuple[dict, tuple]]]:
        image = decode_image(data, self.limits, param)
        try:
            prompts = self.encode.many(image, phrases, "the image")
        except DataError as e:  # refused here, not in the batch: it would fail there for every caller in it
            raise RequestError(422, f"{e}: the model cannot take it", param) from None
        return image.width, image.height, prompts

    def decoding_bytes(self, data: bytes, param: str) -> int:
        """The memory decoding ``data`` will hold, from its header alone (``image_frame``'s
        refusals raised before anything is decoded)."""
        return images.decoding_bytes(image_frame(data, self.limits, param))


async def read_body(request, limits: Limits) -> bytes:
    """The whole body, refused past the size limit (a body sent without a Content-Length included)
    or when it has not all arrived within --body-timeout-s (a stalled or trickling client)."""
    from starlette.requests import ClientDisconnect

    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.body_timeout_s
    chunks, size, more = [], 0, True
    while more:
        try:
            message = await asyncio.wait_for(request.receive(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            raise RequestError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s "
                                    "(--body-timeout-s)", "body") from None
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
        if size > limits.max_body_bytes:
            raise RequestError(413, f"the request body is over the limit of {limits.max_body_bytes:,} bytes "
                                    "(--max-body-mb)", "body")
    request._body = b"".join(chunks)  # what request.form() parses (Starlette's cache of the body)
    return request._body


async def json_body(request, limits: Limits) -> dict:
    raw = await read_body(request, limits)
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError(400, "the body's JSON is nested too deeply", "body") from None
    except json.JSONDecodeError as e:
        raise RequestError(400, f"the body is not JSON ({e})", "body") from None
    except UnicodeDecodeError:
        raise RequestError(400, "the body is not JSON: it is not UTF-8 text", "body") from None
    except ValueError:  # Python reads no integer of over 4,300 digits
        raise RequestError(400, "the body's JSON holds a number of over 4,300 digits", "body") from None
    if not isinstance(body, dict):
        raise RequestError(422, "the body must be a JSON object", "body")
    return body


def shown(value, chars: int = 40) -> str:
    """A caller's value in an error message: its repr, cut short (reprlib's: a few levels and items
    of a nested one, which plain repr would walk whole), lone surrogates escaped."""
    import reprlib

    text = reprlib.repr(value)
    return text if len(text) <= chars else text[:chars] + "..."


async def ground_inputs(request, limits: Limits) -> tuple[bytes, list[str]]:
    """JSON {"image", "phrase" | "phrases"} or multipart (an ``image`` file, ``phrase`` fields) ->
    the image file's bytes (decoded with the prompts' encoding, off the event loop) and phrases.
    A field the endpoint does not take is refused, not ignored."""
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        await read_body(request, limits)
        form = await request.form(max_files=2, max_fields=limits.max_phrases + 2)
        unknown = [name for name in form if name not in ("image", "phrase", "phrases")]
        if unknown:
            raise RequestError(422, f"unknown field {shown(unknown[0])}: a multipart request takes an 'image' file "
                                    "and 'phrase' fields", unknown[0])
        uploads = form.getlist("image")
        if len(uploads) != 1 or isinstance(uploads[0], str):
            raise RequestError(422, "multipart requests need one 'image' file field" +
                               (f", got {len(uploads)}" if len(uploads) > 1 else ""), "image")
        phrases = form.getlist("phrase") + form.getlist("phrases")
        return await uploads[0].read(), check_phrases(phrases, limits, "phrase")
    body = await json_body(request, limits)
    unknown = [name for name in body if name not in ("image", "phrase", "phrases")]
    if unknown:
        raise RequestError(422, f"unknown field {shown(unknown[0])}: /v1/ground takes 'image' and 'phrase' or "
                                "'phrases'", unknown[0][:100])
    if "image" not in body:
        raise RequestError(422, "missing 'image' (base64 or a data: URI)", "image")
    if ("phrase" in body) == ("phrases" in body):
        raise RequestError(422, "give exactly one of 'phrase' (a string) and 'phrases' (a list)", "phrase")
    param = "phrase" if "phrase" in body else "phrases"
    phrases = check_phrases(body[param], limits, param)
    return image_bytes(body["image"], "image"), phrases
