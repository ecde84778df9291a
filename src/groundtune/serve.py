"""The HTTP server: `groundtune serve --model M` (FastAPI on uvicorn; ``pip install "groundtune[serve]"``).

    groundtune serve --model runs/sft                                 # http://127.0.0.1:8000
    groundtune serve --model exports/sft --host 0.0.0.0 --api-key $KEY

Endpoints (the contract is in the README, "Serve"):
- ``POST /v1/ground``: an image (JSON ``image`` as base64 or a data: URI, or a multipart ``image``
  file) and ``phrase`` or ``phrases`` -> a box per phrase in pixels of the caller's ORIGINAL
  image (its EXIF orientation applied, as a viewer shows it), label, raw answer, timings;
- ``POST /v1/chat/completions``: OpenAI's chat API (the ``openai`` client works unchanged). The
  last user message's text is the phrase, asked with the model's own prompt; its image is an
  ``image_url`` data: URI. The answer is the model's text, plus ``groundtune`` with the boxes in
  the caller's pixels;
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /`` (a one-page UI).

Requests are answered in batches: the phrases of all waiting requests (up to ``batch_size``, for
at most ``max_wait_ms`` after the first arrives) go through ONE ``infer.predict`` call, on a
worker thread while the server keeps accepting. The queue is bounded: a full one answers 503 with
Retry-After, never an unbounded backlog. The server reads nothing from its own disk or network
on a caller's behalf (no file paths, no http(s) image URLs), listens on 127.0.0.1 unless told
otherwise, and answers every caller mistake with a 4xx JSON error that names what was wrong:
``{"error": {"message", "type", "param"}}``.
"""


import asyncio
import base64
import binascii
import io
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps

from groundtune.boxes import ResizeError
from groundtune.errors import ConfigError, DataError, MissingPackageError

UI_FILE = Path(__file__).resolve().parent / "assets" / "serve_ui.html"


@dataclass(frozen=True)
class Limits:
    """What one request may ask; each is a flag of `groundtune serve`."""

    max_body_bytes: int = 20 * 2**20  # a 20 MB upload: a large phone photo, base64-encoded
    max_image_pixels: int = 50_000_000  # decoded pixels; PIL would decode a forged header's billions
    max_phrases: int = 16  # phrases per request
    max_phrase_chars: int = 500
    queue_size: int = 256  # phrases waiting for the model; beyond: 503
    batch_size: int = 16  # phrases answered together (1: no batching)
    max_wait_ms: float = 5.0  # how long the first waiting phrase waits for others


class RequestError(Exception):
    """A caller's mistake: answered with ``status`` and a JSON error naming ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


# --------------------------------------------------------------------------------------------
# Reading what a caller sends


def decode_image(data: bytes, limits: Limits, param: str = "image") -> Image.Image:
    """Image bytes -> RGB as a viewer shows it (EXIF orientation applied), refused before decoding
    when its header claims more than ``limits.max_image_pixels``."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.width * im.height > limits.max_image_pixels:
                raise RequestError(413, f"the image is {im.width}x{im.height} = {im.width * im.height:,} pixels; "
                                        f"the limit is {limits.max_image_pixels:,} (--max-image-pixels)", param)
            im.load()
            image = ImageOps.exif_transpose(im)
    except RequestError:
        raise
    except Image.DecompressionBombError as e:
        raise RequestError(413, f"the image is too large to decode ({e})", param) from None
    except (OSError, SyntaxError, ValueError) as e:
        raise RequestError(422, f"the image cannot be decoded ({e})", param) from None
    from groundtune.data.images import to_rgb

    return to_rgb(image)


def image_from_string(value: str, limits: Limits, param: str) -> Image.Image:
    """A base64 string or a data: URI -> image. Anything else (a URL, a file path) is refused:
    the server reads nothing from its disk or network on a caller's behalf."""
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
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        looks_like_a_path = value.startswith(("/", "./", "~")) or "." in value[-6:]
        raise RequestError(422, "the server does not read files on a caller's behalf: send the image itself, "
                                "as base64 or a data: URI" if looks_like_a_path else "the image is not valid base64",
                           param) from None
    return decode_image(data, limits, param)


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
        if len(phrase) > limits.max_phrase_chars:
            raise RequestError(422, f"a phrase of {len(phrase)} characters; the limit is {limits.max_phrase_chars} "
                                    "(--max-phrase-chars)", param)
    return phrases


# --------------------------------------------------------------------------------------------
# Batching


class QueueFull(Exception):
    pass


class Batcher:
    """Phrases from any number of requests -> one ``infer.predict`` call per batch."""

    def __init__(self, gm, limits: Limits, max_new_tokens: int, metrics):
        from groundtune import infer

        self.gm, self.limits, self.max_new_tokens, self.metrics = gm, limits, max_new_tokens, metrics
        self.engine = infer.engine_for(gm)  # kept: on a GPU its captured decode steps are reused
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.queue = asyncio.Queue(maxsize=self.limits.queue_size)
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def answer(self, image: Image.Image, phrases: list[str]) -> list:
        """The predictions for ``phrases`` in ``image``; QueueFull when they do not fit the queue."""
        if self.queue.qsize() + len(phrases) > self.limits.queue_size:
            raise QueueFull()
        loop = asyncio.get_running_loop()
        futures = []
        for phrase in phrases:
            future = loop.create_future()
            self.queue.put_nowait((image, phrase, future))
            futures.append(future)
        return list(await asyncio.gather(*futures))

    async def _run(self) -> None:
        from groundtune import infer

        while True:
            batch = [await self.queue.get()]
            deadline = time.monotonic() + self.limits.max_wait_ms / 1000
            while len(batch) < self.limits.batch_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), remaining))
                except asyncio.TimeoutError:
                    break
            self.metrics.batch_size.observe(len(batch))
            try:
                predictions = await asyncio.to_thread(
                    infer.predict, self.gm, [b[0] for b in batch], [b[1] for b in batch],
                    batch_size=len(batch), max_new_tokens=self.max_new_tokens, engine=self.engine)
            except DataError as e:  # an image the resize refuses: checked per request before it queues; a guard
                predictions = [RequestError(422, str(e), "image")] * len(batch)
            except Exception as e:  # noqa: BLE001 - the server must outlive a failed batch
                predictions = [e] * len(batch)
            for (_, _, future), prediction in zip(batch, predictions):
                if not future.done():
                    (future.set_exception if isinstance(prediction, Exception) else future.set_result)(prediction)


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


# --------------------------------------------------------------------------------------------
# The app


def create_app(gm, model_name: str, limits: Limits = Limits(), api_key: str | None = None,
               max_new_tokens: int | None = None):
    """The FastAPI app serving ``gm`` (a loaded GroundingModel)."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import HTMLResponse, JSONResponse, Response
        from starlette.exceptions import HTTPException
    except ImportError:
        raise MissingPackageError('groundtune serve needs FastAPI and uvicorn: pip install "groundtune[serve]"') from None
    import contextlib

    from groundtune import infer

    metrics = Metrics()
    batcher = Batcher(gm, limits, max_new_tokens or infer.DEFAULT_MAX_NEW_TOKENS, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="groundtune", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.batcher = batcher

    def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
              headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "param": param}}, status, headers=headers)

    @app.exception_handler(RequestError)
    async def _request_error(request, e: RequestError):
        return error(e.status, e.message, e.param, e.kind, headers={"Retry-After": "1"} if e.status == 503 else None)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error(422, f"{first.get('msg', 'invalid request')}", where)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        return error(e.status_code, str(e.detail), kind="not_found" if e.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def _server_error(request, e: Exception):
        return error(500, f"the server failed on this request ({type(e).__name__}: {e})", kind="server_error")

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """API key, body size, metrics: before any endpoint reads the body."""
        endpoint = request.url.path
        start = time.perf_counter()
        if api_key is not None and endpoint.startswith(("/v1/", "/metrics")) and not _key_ok(request, api_key):
            response = error(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", kind="authentication_error")
        elif int(request.headers.get("content-length") or 0) > limits.max_body_bytes:
            response = error(413, f"the request body is {int(request.headers['content-length']):,} bytes; the limit "
                                  f"is {limits.max_body_bytes:,} (--max-body-mb)", "body")
        else:
            response = await call_next(request)
        if endpoint.startswith("/v1/"):
            metrics.requests.labels(endpoint, str(response.status_code)).inc()
            metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
        return response

    async def answer(image: Image.Image, phrases: list[str]):
        try:  # refused here, not in the batch it would fail for every caller in it
            gm.resize.resized_size(image.size)
        except ResizeError as e:
            raise RequestError(422, f"the image ({image.width}x{image.height}) cannot be resized for the model: {e}",
                               "image") from None
        try:
            return await batcher.answer(image, phrases)
        except QueueFull:
            raise RequestError(503, f"the server is busy ({limits.queue_size} phrases waiting); retry shortly",
                               kind="server_busy") from None

    @app.post("/v1/ground")
    async def ground(request: Request):
        start = time.perf_counter()
        image, phrases = await _ground_inputs(request, limits)
        decoded = time.perf_counter()
        predictions = await answer(image, phrases)
        done = time.perf_counter()
        return {
            "model": model_name,
            "width": image.width,
            "height": image.height,
            "results": [{"phrase": phrase, **p.to_json(all_boxes=True)} for phrase, p in zip(phrases, predictions)],
            "timing_ms": {"decode": round((decoded - start) * 1000, 1), "model": round((done - decoded) * 1000, 1),
                          "total": round((done - start) * 1000, 1)},
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json_body(request, limits)
        if body.get("stream"):
            raise RequestError(422, "streaming is not supported: the answer is one box", "stream")
        image, phrase = _chat_inputs(body, limits)
        prediction = (await answer(image, [phrase]))[0]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": prediction.raw},
                         "finish_reason": "stop", "logprobs": None}],
            # the answer's boxes in the caller's pixels (its raw text is the message above)
            "groundtune": {**{k: v for k, v in prediction.to_json(all_boxes=True).items() if k != "raw"},
                           "width": image.width, "height": image.height},
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "groundtune"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "family": gm.family, "waiting": batcher.queue.qsize()}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def ui():
        return UI_FILE.read_text()

    return app


def _key_ok(request, api_key: str) -> bool:
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip() or request.headers.get("x-api-key", "")
    return secrets.compare_digest(given.encode(), api_key.encode())


async def _body(request, limits: Limits) -> bytes:
    """The whole body, refused past the limit (a body sent without a Content-Length included)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limits.max_body_bytes:
            raise RequestError(413, f"the request body is over the limit of {limits.max_body_bytes:,} bytes "
                                    "(--max-body-mb)", "body")
    request._body = body  # what request.form() parses
    return body


async def _json_body(request, limits: Limits) -> dict:
    try:
        body = json.loads(await _body(request, limits))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not JSON ({e})", "body") from None
    if not isinstance(body, dict):
        raise RequestError(422, "the body must be a JSON object", "body")
    return body


async def _ground_inputs(request, limits: Limits) -> tuple[Image.Image, list[str]]:
    """JSON {"image", "phrase" | "phrases"} or multipart (an ``image`` file, ``phrase`` fields)."""
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        await _body(request, limits)
        form = await request.form()
        upload = form.get("image")
        if upload is None or isinstance(upload, str):
            raise RequestError(422, "multipart requests need an 'image' file field", "image")
        phrases = form.getlist("phrase") + form.getlist("phrases")
        return decode_image(await upload.read(), limits), check_phrases(phrases, limits, "phrase")
    body = await _json_body(request, limits)
    if "image" not in body:
        raise RequestError(422, "missing 'image' (base64 or a data: URI)", "image")
    if ("phrase" in body) == ("phrases" in body):
        raise RequestError(422, "give exactly one of 'phrase' (a string) and 'phrases' (a list)", "phrase")
    param = "phrase" if "phrase" in body else "phrases"
    phrases = check_phrases(body[param], limits, param)
    return image_from_string(body["image"], limits, "image"), phrases


def _chat_inputs(body: dict, limits: Limits) -> tuple[Image.Image, str]:
    """The last user message: its text is the phrase, its image_url (a data: URI) the image."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(422, "missing 'messages'", "messages")
    user = next((m for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "user"), None)
    if user is None:
        raise RequestError(422, "no user message", "messages")
    content = user.get("content")
    parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
    texts, images = [], []
    for part in parts:
        if not isinstance(part, dict):
            raise RequestError(422, "message content parts must be objects", "messages")
        if part.get("type") == "text":
            texts.append(str(part.get("text", "")))
        elif part.get("type") == "image_url":
            url = part.get("image_url", {})
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url.startswith("data:"):
                raise RequestError(422, "image_url must be a data: URI: the server does not fetch URLs or read "
                                        "files on a caller's behalf", "messages")
            images.append(url)
        else:
            raise RequestError(422, f"unsupported content part type {part.get('type')!r}", "messages")
    if len(images) != 1:
        raise RequestError(422, f"the user message needs exactly one image_url, got {len(images)}", "messages")
    phrase = check_phrases(" ".join(t.strip() for t in texts if t.strip()), limits, "messages")[0]
    return image_from_string(images[0], limits, "messages"), phrase


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          limits: Limits = Limits(), device: str = "auto", max_new_tokens: int | None = None) -> None:
    """Load ``model`` and serve it until interrupted."""
    try:
        import uvicorn
    except ImportError:
        raise MissingPackageError('groundtune serve needs FastAPI and uvicorn: pip install "groundtune[serve]"') from None
    from groundtune import infer

    listening = _listen(host, port)  # before the model loads: a taken port is said at once
    gm = infer.load(model, device=device)
    app = create_app(gm, model, limits, api_key, max_new_tokens)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"warning: serving on {host} without --api-key: anyone who can reach it can use it")
    print(f"serving {model} ({gm.family}) on http://{host}:{port}  (UI at /, API at /v1/ground and /v1/chat/completions)",
          flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listening])


def _listen(host: str, port: int):
    """A socket bound to host:port for uvicorn; one that cannot be bound is a ConfigError naming the
    flags (uvicorn itself would log it and exit 3 after the model had loaded)."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); "
                          "choose another --port (or --host)") from None
    return sock


def launch(model: str, *flags: str, timeout_s: float = 60.0, **popen) -> tuple:
    """Start ``groundtune serve --model MODEL FLAGS`` in a process of its own on 127.0.0.1 at a free
    port and wait until /health answers; returns (the process, its URL). For what needs the real
    server from outside: the tests and bench/serve_load.py. ``popen``: subprocess.Popen's options
    (where its output goes). A server that exits or does not answer in ``timeout_s`` is a RuntimeError."""
    import socket
    import subprocess
    import sys
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
