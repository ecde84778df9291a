"""The HTTP server: `groundtune serve --model M` (FastAPI on uvicorn; ``pip install "groundtune[serve]"``).

    groundtune serve --model runs/sft                                 # http://127.0.0.1:8000
    groundtune serve --model exports/sft --host 0.0.0.0 --api-key $KEY

Endpoints (the contract is in the README, "Serve"):
- ``POST /v1/ground``: an image (JSON ``image`` as base64 or a data: URI, or a multipart ``image``
  file) and ``phrase`` or ``phrases`` -> a box per phrase in pixels of the caller's ORIGINAL
  image (its EXIF orientation applied, as a viewer shows it), label, raw answer, timings;
- ``POST /v1/chat/completions``: OpenAI's chat API (the ``openai`` client works unchanged). The
  last user message's text is the phrase, asked with the model's own prompt; its image is an
  ``image_url`` data: URI. The answer is the model's text (cut at ``max_completion_tokens`` or
  ``max_tokens``), its ``usage``, plus ``groundtune`` with the boxes in the caller's pixels. A
  parameter the server cannot honour (n > 1, sampling, tools, logprobs, a response format, ...)
  is a 422 naming it, another model OpenAI's 404 ``model_not_found`` (``_chat_settings``);
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /`` (a one-page UI).

This module is the HTTP: reading what a caller sends, the app, its errors and metrics. Behind it
(batching.py), encoding workers turn each request into prompts as it arrives, and the model, in a
process of its own, answers the prompts waiting in batches of up to ``--batch-size``.

The queue is bounded (phrases sent to the model and not answered yet): a full one answers 503
with Retry-After, never an unbounded backlog. The server reads nothing from its own disk or
network on a caller's behalf (no file paths, no http(s) image URLs), listens on 127.0.0.1 unless
told otherwise, and answers every caller mistake with a 4xx JSON error that names what was wrong:
``{"error": {"message", "type", "param", "code"}}``. A 500 is a bug of ours: its answer says
"internal error" and a request id, which the server's log prints with the traceback.

What a stranger's request can make the server hold is bounded: a body (``--max-body-mb``) that
must arrive within ``--body-timeout-s``; an image of a few plain formats whose frame is at most
``--max-image-pixels``, checked on the frame's own header before a pixel is decoded; and the
memory all requests' images take while they are decoded together, ``--decode-budget-mb``: each
request reserves what its image's header says decoding it will hold (``images.decoding_bytes``)
before it is decoded, first come first served.
"""


import asyncio
import base64
import binascii
import contextlib
import json
import logging
import math
import re
import secrets
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path

from PIL import Image, ImageOps

from groundtune.config import InferSettings
from groundtune.data import images
from groundtune.deploy.batching import Answer, Model, QueueFull, prepare_decoding
from groundtune.errors import ConfigError, DataError, MissingPackageError

UI_FILE = Path(__file__).resolve().parent.parent / "assets" / "serve_ui.html"
HOST = "127.0.0.1"  # this machine only: another interface is the operator's choice (--host 0.0.0.0)
PORT = 8000
MB = 2**20  # a Limits field counted in bytes (*_bytes) is a flag in MB: max_body_bytes is --max-body-mb


def flag(name: str) -> str:
    """The `groundtune serve` flag of the Limits field ``name``."""
    return "--" + (name.removesuffix("_bytes") + "_mb" if name.endswith("_bytes") else name).replace("_", "-")


_SHARED = {f.name: f for f in fields(InferSettings)}  # the settings serve shares with eval and predict


def _limit(default, help: str, least: float | None = None):
    """A Limits field: its default, its flag's help, and the least value it takes (by default 1 for
    a count, 0.001 for a number)."""
    least = (1 if isinstance(default, int) else 0.001) if least is None else least
    return field(default=default, metadata={"help": help, "least": least})


@dataclass(frozen=True)
class Limits:
    """What one request may ask, and how requests are queued and batched. Each field is a flag of
    `groundtune serve` (``flag``), its default and help read from here (cli.py)."""

    # the batch size every command that answers shares: its default and help are config.InferSettings'
    batch_size: int = _limit(InferSettings.batch_size, _SHARED["batch_size"].metadata["help"])
    max_wait_ms: float = _limit(5.0, "how long a phrase waits for others to fill its batch", least=0)
    queue_size: int = _limit(256, "phrases that may wait; beyond, 503 with Retry-After")
    workers: int | None = _limit(None, "processes decoding and encoding request images, 0: threads of the server "
                                       "(default: some on a GPU machine, none on a CPU one, where the model needs "
                                       "the cores)", least=0)  # None: infer.default_workers
    max_body_bytes: int = _limit(20 * MB, "largest request body; larger: 413")  # a big phone photo in base64
    # 60 s: a body of 20 MB arriving at 2.7 Mbit/s
    body_timeout_s: float = _limit(60.0, "a request's whole body must arrive within this; a stalled or slower one: 408")
    max_image_pixels: int = _limit(50_000_000, "largest image, in pixels of the decoded frame (read from its own "
                                               "header before decoding); larger: 413")
    # 1 GB: two limit-sized 16-bit PNGs (367 MB each) or four 50 MP JPEG photos (~225 MB)
    decode_budget_bytes: int = _limit(2**30, "memory for decoding images, all requests together: each waits for "
                                             "what its image takes (a 50 MP 16-bit PNG: 367 MB; one larger than all "
                                             "of it is decoded alone)")
    max_phrases: int = _limit(16, "phrases per request")
    max_phrase_chars: int = _limit(500, "longest phrase, in characters")

    def __post_init__(self) -> None:
        for f in fields(self):
            value, least = getattr(self, f.name), f.metadata["least"]
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= least):
                raise ConfigError(f"{flag(f.name)} must be a number of at least {least:g}, got {value!r}")


log = logging.getLogger("uvicorn.error")  # uvicorn's own log: the server's stderr, in its format


class RequestError(Exception):
    """A caller's mistake: answered with ``status`` and a JSON error naming ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def __reduce__(self):  # raised in an encoding process, said by the server
        return RequestError, (self.status, self.message, self.param, self.kind, self.code)


# --------------------------------------------------------------------------------------------
# Reading what a caller sends


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
    is refused: the server reads nothing from its disk or network on a caller's behalf."""
    if not isinstance(value, str) or not value:
        raise RequestError(422, "expected an image as base64 or a data: URI", param)
    if value.startswith("data:"):
        header, _, value = value.partition(",")
        if ";base64" not in header:
            raise RequestError(422, "a data: URI image must be base64 (data:image/png;base64,...)", param)
    elif value.startswith(("http://", "https://", "file:", "ftp://")):
        raise RequestError(422, "images are accepted as base64 or data: URIs only: the server does not fetch "
                                "URLs on a caller's behalf", param)
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


class Metrics:
    """Prometheus metrics in a registry of the app's own (two apps in one process stay apart)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("groundtune_requests", "HTTP requests answered", ["endpoint", "status"],
                                registry=self.registry)
        self.latency = Histogram("groundtune_request_seconds", "time from request to answer", ["endpoint"],
                                 registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.batch_size = Histogram("groundtune_batch_size", "phrases answered per model call",
                                    registry=self.registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        # where a request's time goes: its image decoded and prompts encoded, waiting for a batch, the batch
        seconds = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
        self.encode_seconds = Histogram("groundtune_encode_seconds", "decoding and encoding a request "
                                        "(waiting for a worker and the decode budget included)",
                                        registry=self.registry, buckets=seconds)
        self.queue_seconds = Histogram("groundtune_queue_seconds", "a phrase's wait for its batch",
                                       registry=self.registry, buckets=seconds)
        self.batch_seconds = Histogram("groundtune_batch_seconds", "one model call (a batch)",
                                       registry=self.registry, buckets=seconds)


# --------------------------------------------------------------------------------------------
# The app


def create_app(model: Model, model_name: str, limits: Limits = Limits(), api_key: str | None = None):
    """The FastAPI app serving ``model`` (its process started)."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import HTMLResponse, Response
        from starlette.exceptions import HTTPException
    except ImportError:
        raise MissingPackageError('groundtune serve needs FastAPI and uvicorn: pip install "groundtune[serve]"') from None

    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await model.start(metrics)
        yield
        await model.stop()

    app = FastAPI(title="groundtune", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(_Guard, metrics=metrics, limits=limits, api_key=api_key)

    @app.exception_handler(RequestError)
    async def _request_error(request, e: RequestError):
        headers = {"Retry-After": "1"} if e.status == 503 else None
        if e.status in (408, 413):  # the rest of the body is not read: the connection cannot carry another request
            headers = {"Connection": "close"}
        return _error(e.status, e.message, e.param, e.kind, e.code, headers)

    @app.exception_handler(Exception)
    async def _server_error(request, e: Exception):  # what _Guard did not answer (a bug in it): still no details
        return _error(500, "internal error", kind="server_error")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(422, f"{first.get('msg', 'invalid request')}", where)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, str(e.detail), kind=kind, headers=e.headers)

    async def answer(data: bytes, phrases: list[str], param: str, max_tokens: int | None = None) -> Answer:
        try:
            return await model.answer(data, phrases, param, max_tokens)
        except QueueFull:
            raise RequestError(503, f"the server is busy ({limits.queue_size} phrases waiting); retry shortly",
                               kind="server_busy") from None

    @app.post("/v1/ground")
    async def ground(request: Request):
        start = time.perf_counter()
        data, phrases = await _ground_inputs(request, limits)
        answered = await answer(data, phrases, "image")
        done = time.perf_counter()
        return {
            "model": model_name,
            "width": answered.width,
            "height": answered.height,
            "results": [{"phrase": phrase, **p.to_json()}
                        for phrase, p in zip(phrases, answered.predictions)],
            # decode: the request read, its image decoded and prompts encoded; model: its batch's
            # wait and the batch
            "timing_ms": {"decode": round((answered.encoded_at - start) * 1000, 1),
                          "model": round((done - answered.encoded_at) * 1000, 1),
                          "total": round((done - start) * 1000, 1)},
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json_body(request, limits)
        max_tokens = _chat_settings(body, model_name, model.max_new_tokens)
        data, phrase = _chat_inputs(body, limits)
        answered = await answer(data, [phrase], "messages", max_tokens)
        (one,) = answered.answers
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": one.prediction.raw},
                         "finish_reason": "stop" if one.stopped else "length", "logprobs": None}],
            "usage": {"prompt_tokens": answered.prompt_tokens[0], "completion_tokens": one.tokens,
                      "total_tokens": answered.prompt_tokens[0] + one.tokens},
            # the answer's boxes in the caller's pixels (its raw text is the message above)
            "groundtune": {**{k: v for k, v in one.prediction.to_json().items() if k != "raw"},
                           "width": answered.width, "height": answered.height},
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "groundtune"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "family": model.family, "waiting": len(model.pending)}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def ui():
        return UI_FILE.read_text()

    return app


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None, headers: dict | None = None):
    """OpenAI's error shape. ASCII JSON: a lone surrogate a caller sent, said back, stays valid."""
    from starlette.responses import Response

    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return Response(json.dumps(body), status, headers, media_type="application/json")


# The endpoints metrics are kept for, each by name; any other path is counted as "other" (a
# client's made-up paths would each add a series that lives as long as the server)
_ENDPOINTS = ("/v1/ground", "/v1/chat/completions", "/v1/models")


class _Guard:
    """What every HTTP request passes first: the API key, the declared body size, a request id
    (the X-Request-Id header), the metrics, and the last word on a failure.

    A plain ASGI middleware, not ``@app.middleware("http")``: Starlette answers an exception no
    handler takes in its ServerErrorMiddleware, outside such a middleware, which then never counted
    the 500. Here a bug is logged with the request id and its traceback, answered 500 "internal
    error" with the id and nothing of the exception, and counted; a client that left before its
    body arrived is one log line (and counted as 499, as nginx counts it)."""

    def __init__(self, app, metrics: Metrics, limits: Limits, api_key: str | None):
        self.app, self.metrics, self.limits, self.api_key = app, metrics, limits, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from starlette.datastructures import Headers
        from starlette.requests import ClientDisconnect

        request_id, start, status = uuid.uuid4().hex[:16], time.perf_counter(), None
        path = scope["path"]

        async def counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        headers = Headers(scope=scope)
        try:
            declared = int(headers.get("content-length") or 0)
        except ValueError:  # h11 lets only digits through; said anyway
            declared = 0
        try:
            guarded = path.startswith(("/v1/", "/metrics"))
            if self.api_key is not None and guarded and not _key_ok(headers, self.api_key):
                await _error(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                             kind="authentication_error")(scope, receive, counted)
            elif declared > self.limits.max_body_bytes:
                await _error(413, f"the request body is {declared:,} bytes; the limit is "
                                  f"{self.limits.max_body_bytes:,} (--max-body-mb)", "body",
                             headers={"Connection": "close"})(scope, receive, counted)
            else:
                await self.app(scope, receive, counted)
        except ClientDisconnect:
            status = 499
            log.warning("request %s: %s %r: the client left before its body arrived", request_id, scope["method"], path)
        except Exception as e:  # noqa: BLE001 - a bug: said in the log, not to the caller
            log.error("request %s: %s %r failed", request_id, scope["method"], path, exc_info=e)
            if status is None:
                await _error(500, f"internal error (request id {request_id})", kind="server_error")(scope, receive,
                                                                                                    counted)
            status = 500
        finally:
            if path.startswith("/v1/"):
                endpoint = path if path in _ENDPOINTS else "other"
                self.metrics.requests.labels(endpoint, str(status)).inc()
                self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)


def _key_ok(headers, api_key: str) -> bool:
    given = headers.get("authorization", "").removeprefix("Bearer ").strip() or headers.get("x-api-key", "")
    return secrets.compare_digest(given.encode(), api_key.encode())


async def _body(request, limits: Limits) -> bytes:
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


async def _json_body(request, limits: Limits) -> dict:
    raw = await _body(request, limits)
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


def _shown(value, chars: int = 40) -> str:
    """A caller's value in an error message: its repr, cut short (reprlib's: a few levels and items
    of a nested one, which plain repr would walk whole), lone surrogates escaped."""
    import reprlib

    text = reprlib.repr(value)
    return text if len(text) <= chars else text[:chars] + "..."


async def _ground_inputs(request, limits: Limits) -> tuple[bytes, list[str]]:
    """JSON {"image", "phrase" | "phrases"} or multipart (an ``image`` file, ``phrase`` fields) ->
    the image file's bytes (decoded with the prompts' encoding, off the event loop) and phrases.
    A field the endpoint does not take is refused, not ignored."""
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        await _body(request, limits)
        form = await request.form(max_files=2, max_fields=limits.max_phrases + 2)
        unknown = [name for name in form if name not in ("image", "phrase", "phrases")]
        if unknown:
            raise RequestError(422, f"unknown field {_shown(unknown[0])}: a multipart request takes an 'image' file "
                                    "and 'phrase' fields", unknown[0])
        uploads = form.getlist("image")
        if len(uploads) != 1 or isinstance(uploads[0], str):
            raise RequestError(422, "multipart requests need one 'image' file field" +
                               (f", got {len(uploads)}" if len(uploads) > 1 else ""), "image")
        phrases = form.getlist("phrase") + form.getlist("phrases")
        return await uploads[0].read(), check_phrases(phrases, limits, "phrase")
    body = await _json_body(request, limits)
    unknown = [name for name in body if name not in ("image", "phrase", "phrases")]
    if unknown:
        raise RequestError(422, f"unknown field {_shown(unknown[0])}: /v1/ground takes 'image' and 'phrase' or "
                                "'phrases'", unknown[0][:100])
    if "image" not in body:
        raise RequestError(422, "missing 'image' (base64 or a data: URI)", "image")
    if ("phrase" in body) == ("phrases" in body):
        raise RequestError(422, "give exactly one of 'phrase' (a string) and 'phrases' (a list)", "phrase")
    param = "phrase" if "phrase" in body else "phrases"
    phrases = check_phrases(body[param], limits, param)
    return image_bytes(body["image"], "image"), phrases


def _chat_inputs(body: dict, limits: Limits) -> tuple[bytes, str]:
    """The last user message: its text is the phrase, its image_url (a data: URI) the image.
    Earlier messages (a system prompt, earlier turns) are read for their shape only: the model
    asks with its own prompt."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(422, "missing 'messages' (a list of messages)", "messages")
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise RequestError(422, f"every message must be an object with a 'role' of {', '.join(_ROLES)}; got "
                                    f"{_shown(message)}", "messages")
    user = next((m for m in reversed(messages) if m["role"] == "user"), None)
    if user is None:
        raise RequestError(422, "no user message: its text is the phrase, its image_url the image", "messages")
    content = user.get("content")
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(422, "the user message needs 'content': a list of an image_url part and text parts",
                           "messages")
    texts, image_urls = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url.startswith("data:"):
                raise RequestError(422, "image_url must be a data: URI: the server does not fetch URLs or read "
                                        "files on a caller's behalf", "messages")
            image_urls.append(url)
        else:
            raise RequestError(422, "a content part must be {'type': 'text', 'text': '...'} or {'type': 'image_url', "
                                    f"'image_url': {{'url': 'data:...'}}}}; got {_shown(part)}", "messages")
    if len(image_urls) != 1:
        raise RequestError(422, f"the user message needs exactly one image_url, got {len(image_urls)}", "messages")
    phrase = check_phrases(" ".join(t.strip() for t in texts if t.strip()), limits, "messages")[0]
    return image_bytes(image_urls[0], "messages"), phrase


_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# OpenAI's chat parameters that change nothing in the answer: taken as they are, when of their type
_CHAT_NO_EFFECT = {"seed": int, "user": str, "metadata": dict, "store": bool, "service_tier": str,
                   "parallel_tool_calls": bool, "prompt_cache_key": str, "safety_identifier": str}
# Those the server cannot honour: refused unless left out, null, or their "off" value
_CHAT_UNSUPPORTED = {
    "stream": ((False,), "streaming is not supported: the answer is one box"),
    "stream_options": ((), "goes with stream, which is not supported"),
    "n": ((1,), "must be 1: decoding is greedy, so every answer would be the same one"),
    "logprobs": ((False,), "is not supported: no log probabilities are returned"),
    "top_logprobs": ((), "is not supported: no log probabilities are returned"),
    "stop": (([],), "is not supported: the model's answer ends by itself"),
    "frequency_penalty": ((0, 0.0), "is not supported: decoding is greedy, without penalties"),
    "presence_penalty": ((0, 0.0), "is not supported: decoding is greedy, without penalties"),
    "logit_bias": (({},), "is not supported: decoding is greedy, without biases"),
    "tools": (([],), "are not supported: the answer is the model's text, its boxes in 'groundtune'"),
    "tool_choice": (("none",), "is not supported: there are no tools"),
    "functions": (([],), "are not supported: the answer is the model's text, its boxes in 'groundtune'"),
    "function_call": (("none",), "is not supported: there are no functions"),
    "response_format": (({"type": "text"},), "is not supported: the answer is the model's text, its boxes in "
                                              "'groundtune'"),
    "modalities": ((["text"],), "is not supported: the answer is text"),
    "audio": ((), "is not supported: the answer is text"),
    "prediction": ((), "is not supported"),
    "reasoning_effort": ((), "is not supported: the model answers without reasoning"),
    "verbosity": ((), "is not supported"),
    "web_search_options": ((), "is not supported: the server searches nothing"),
}


def _chat_settings(body: dict, model_name: str, max_new_tokens: int) -> int:
    """OpenAI's chat parameters -> the answer's token limit (``max_completion_tokens`` or its older
    name ``max_tokens``, at most the server's --max-new-tokens). A parameter the server cannot
    honour is a 422 naming it, never ignored: there is one greedy answer (no n > 1, sampling,
    penalties, biases, stop sequences, log probabilities) in plain text (no tools, functions,
    response formats, audio). top_p is taken as it is: greedy decoding's token is always inside
    it. A model other than the served one is OpenAI's 404, ``model_not_found``."""
    def refuse(name: str, why: str):
        raise RequestError(422, f"'{name}' {why}; got {_shown(body[name])}", name)

    def number(name: str, low: float, high: float, integer: bool = False):
        value = body.get(name)
        if value is None:
            return None
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
            refuse(name, f"must be {'an integer' if integer else 'a number'} from {low:g} to {high:g}")
        return value

    for name, value in body.items():
        if name in ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p"):
            continue
        if name in _CHAT_NO_EFFECT:
            if value is not None and (isinstance(value, bool) != (_CHAT_NO_EFFECT[name] is bool)
                                      or not isinstance(value, _CHAT_NO_EFFECT[name])):
                refuse(name, f"must be of type {_CHAT_NO_EFFECT[name].__name__}")
        elif name in _CHAT_UNSUPPORTED:
            allowed, why = _CHAT_UNSUPPORTED[name]
            if value is not None and not any(type(value) is type(a) and value == a for a in allowed):
                refuse(name, why)
        else:
            raise RequestError(422, f"unknown parameter {_shown(name)}", name[:100])
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError(422, f"'model' must be the served model's id, {model_name!r} (GET /v1/models)", "model")
    if model != model_name:
        raise RequestError(404, f"the model {_shown(model, 80)} does not exist: this server serves {model_name!r}",
                           "model", code="model_not_found")
    if number("temperature", 0, 2):
        refuse("temperature", "must be 0 or left out: the server decodes greedily (a box is not sampled)")
    number("top_p", 0, 1)
    limits = [number(name, 1, 2**31 - 1, integer=True) for name in ("max_completion_tokens", "max_tokens")]
    return min([max_new_tokens] + [limit for limit in limits if limit is not None])


def serve(model: str, host: str = HOST, port: int = PORT, api_key: str | None = None,
          limits: Limits = Limits(), device: str = InferSettings.device,
          max_new_tokens: int = InferSettings.max_new_tokens, compile: bool = InferSettings.compile) -> None:
    """Load ``model`` and serve it until interrupted."""
    try:
        import uvicorn
    except ImportError:
        raise MissingPackageError('groundtune serve needs FastAPI and uvicorn: pip install "groundtune[serve]"') from None
    listening = _listen(host, port)  # before the model loads: a taken port is said at once
    prepare_decoding()
    answering = Model(model, device, limits, max_new_tokens, Encoder, compile)
    try:
        app = create_app(answering, model, limits, api_key)
        if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
            print(f"warning: serving on {host} without --api-key: anyone who can reach it can use it")
        print(f"serving {model} ({answering.family}) on http://{host}:{port}  (UI at /, API at /v1/ground and "
              "/v1/chat/completions)", flush=True)
        # access lines off (warning); a connection idle for 5 s between requests is closed (a body
        # that stalls is the app's: --body-timeout-s)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=5))
        answering.on_death = lambda: setattr(server, "should_exit", True)
        # uvicorn shuts down gracefully on Ctrl-C or SIGTERM, then raises the signal again with the
        # handler it found: this one ends the process as a normal exit (its workers' queues and
        # semaphores released, no KeyboardInterrupt traceback), not by the signal
        for stop in (signal.SIGINT, signal.SIGTERM):
            signal.signal(stop, _stopped)
        server.run(sockets=[listening])
    finally:
        answering.close()
    if answering.died:
        raise SystemExit(1)  # said when it happened


def _stopped(signum, frame) -> None:
    raise SystemExit(0)


def _listen(host: str, port: int):
    """A socket bound to host:port for uvicorn; one that cannot be bound is a ConfigError naming the
    flags (uvicorn itself would log it and exit 3 after the model had loaded)."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, OverflowError) as e:  # OverflowError: a port past 65535
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({getattr(e, 'strerror', None) or e}); "
                          "choose another --port (or --host)") from None
    return sock


def launch(model: str, *flags: str, timeout_s: float = 60.0, **popen) -> tuple:
    """Start ``groundtune serve --model MODEL FLAGS`` in a process of its own on 127.0.0.1 at a free
    port and wait until /health answers; returns (the process, its URL). For what needs the real
    server from outside: the tests and bench/serve_load.py. ``popen``: subprocess.Popen's options
    (where its output goes). A server that exits or does not answer in ``timeout_s`` is a RuntimeError."""
    import socket
    import subprocess
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "groundtune", "serve", "--model", model, "--port", str(port),
                                *flags], **popen)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return process, url
        except OSError:  # not listening yet (URLError, a refused or reset connection)
            pass
        if process.poll() is not None:
            output = process.communicate()[0] if popen.get("stdout") is not None else None
            raise RuntimeError(f"the server exited with {process.returncode}" + (f": {output}" if output else ""))
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the server did not answer within {timeout_s:g} s")
