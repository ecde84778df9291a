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

Three kinds of process (all started by the server, all ended with it):
- the server's own: HTTP (uvicorn's event loop), the checks on each request, and the answers;
- encoding workers (``--workers``; on a CPU machine threads of the server instead): each
  request's image decoded and its prompts encoded as it arrives (``infer.encode_prompt``, the
  resize and prompt of training), straight into the model's inbox, so the next batch is ready
  while the model answers this one;
- the model's (``_model_process``): the prompts waiting (up to ``batch_size``, for at most
  ``max_wait_ms`` after the first) go through ONE ``infer.generate`` call on the inference
  engine. It has the process to itself: sharing the server's interpreter with the event loop, a
  batch of the tiny model on the CPU took ~30% longer (BENCHMARKS.md, "Serving").

The queue is bounded (phrases sent to the model and not answered yet): a full one answers 503
with Retry-After, never an unbounded backlog. The server reads nothing from its own disk or
network on a caller's behalf (no file paths, no http(s) image URLs), listens on 127.0.0.1 unless
told otherwise, and answers every caller mistake with a 4xx JSON error that names what was wrong:
``{"error": {"message", "type", "param"}}``.
"""


import asyncio
import base64
import binascii
import io
import json
import secrets
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from typing import NamedTuple
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from groundtune.errors import ConfigError, DataError, MissingPackageError

UI_FILE = Path(__file__).resolve().parent / "assets" / "serve_ui.html"


@dataclass(frozen=True)
class Limits:
    """What one request may ask, and how requests are queued and batched; each is a flag of
    `groundtune serve`."""

    max_body_bytes: int = 20 * 2**20  # a 20 MB upload: a large phone photo, base64-encoded
    max_image_pixels: int = 50_000_000  # decoded pixels; PIL would decode a forged header's billions
    max_phrases: int = 16  # phrases per request
    max_phrase_chars: int = 500
    queue_size: int = 256  # phrases waiting for the model; beyond: 503
    batch_size: int = 16  # phrases answered together (1: no batching)
    max_wait_ms: float = 5.0  # how long the first waiting phrase waits for others
    workers: int | None = None  # processes decoding and encoding images (None: infer.default_workers)


class RequestError(Exception):
    """A caller's mistake: answered with ``status`` and a JSON error naming ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def __reduce__(self):  # raised in an encoding process, said by the server
        return RequestError, (self.status, self.message, self.param, self.kind)


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
        # PIL names the buffer it read from ("<_io.BytesIO object at 0x...>"), nothing a caller sent
        why = "not an image format the server reads" if isinstance(e, UnidentifiedImageError) else str(e)
        raise RequestError(422, f"the image cannot be decoded ({why})", param) from None
    from groundtune.data.images import to_rgb

    return to_rgb(image)


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
        if len(phrase) > limits.max_phrase_chars:
            raise RequestError(422, f"a phrase of {len(phrase)} characters; the limit is {limits.max_phrase_chars} "
                                    "(--max-phrase-chars)", param)
    return phrases


class Encoder:
    """A request's image bytes and phrases -> (width, height, [(encoded prompt, sizes)]): the image
    decoded as a viewer shows it, each phrase encoded as eval encodes it (``infer.PromptEncoder``).
    Made by the model's process, used by the encoding workers (or threads)."""

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


def _to_wire(encoded: dict) -> dict:
    """An encoded prompt's tensors as numpy arrays, which a queue carries in its own bytes: torch
    would hand each tensor over as a shared-memory file descriptor, one per tensor in flight."""
    import torch

    def wire(tensor: torch.Tensor):  # numpy has no bfloat16: its bits, as int16
        bf16 = tensor.dtype == torch.bfloat16
        return bf16, (tensor.view(torch.int16) if bf16 else tensor).numpy()

    return {k: wire(v) for k, v in encoded.items()}


def _from_wire(encoded: dict) -> dict:
    import torch

    def tensor(value) -> torch.Tensor:
        bf16, array = value
        t = torch.from_numpy(array)
        return t.view(torch.bfloat16) if bf16 else t

    return {k: tensor(v) for k, v in encoded.items()}


def _encode_and_send(encoder: Encoder, inbox, keys: list[int], data: bytes, phrases: list[str],
                     param: str) -> tuple[int, int]:
    """Encode a request and put its prompts in the model's inbox, one item per phrase; returns the
    image's size. Nothing is sent for a request that fails (a RequestError for the caller)."""
    width, height, prompts = encoder(data, phrases, param)
    queued = time.monotonic()  # the system's monotonic clock: the model's process reads it too
    for key, (encoded, sizes) in zip(keys, prompts):
        inbox.put((key, _to_wire(encoded), sizes, queued))
    return width, height


_worker_state: tuple | None = None  # an encoding process's (encoder, inbox)


def _start_worker(encoder: Encoder, inbox) -> None:
    global _worker_state
    import torch

    _detach_from_server()
    torch.set_num_threads(1)  # one image at a time each: the workers together use the cores
    inbox.cancel_join_thread()  # at exit, prompts the model will never read are not waited for
    _worker_state = (encoder, inbox)


def _encode_in_worker(keys: list[int], data: bytes, phrases: list[str], param: str) -> tuple[int, int]:
    return _encode_and_send(*_worker_state, keys, data, phrases, param)


def _worker_ready() -> None:
    """A task that only shows its worker has started."""


def _detach_from_server() -> None:
    """In a process the server started: Ctrl-C and SIGTERM stop the server, which ends this process;
    a server killed outright (SIGKILL, out of memory) cannot, so this process ends itself then."""
    import os
    import threading

    from groundtune.data.samples import ignore_stop_signals

    ignore_stop_signals(0)
    parent = os.getppid()

    def exit_with_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()


# --------------------------------------------------------------------------------------------
# The model's process


def _model_process(model: str, device: str, limits: Limits, max_new_tokens: int, inbox, outbox, ready) -> None:
    """The model, in a process of its own so that nothing competes with its thread for the
    interpreter (the server's event loop did: a batch took ~30% longer on the CPU). Loads
    ``model``, says ("ready", Encoder, family, device) or ("error", exception) on ``ready``, then
    answers batches: the items waiting in ``inbox`` (up to ``batch_size``, for at most
    ``max_wait_ms`` after the first), one ``infer.generate`` call, the predictions to ``outbox``
    as ([(key, Prediction or an error's text)], the batch's stats). None in the inbox ends it."""
    import pickle
    import queue
    import threading

    from groundtune import infer

    _detach_from_server()
    try:
        gm = infer.load(model, device=device)
    except BaseException as e:  # noqa: BLE001 - said by the server, which exits with it
        try:
            pickle.dumps(e)
        except Exception:  # noqa: BLE001
            e = RuntimeError(f"{type(e).__name__}: {e}")
        ready.send(("error", e))
        return
    engine, decoding = infer.engine_for(gm), infer.Decoding.greedy(max_new_tokens)
    outbox.cancel_join_thread()  # at exit, answers to a server that is gone are not waited for
    ready.send(("ready", Encoder(gm, limits), gm.family, str(gm.device)))

    waiting: queue.Queue = queue.Queue()

    def read_inbox() -> None:  # (its items unpickled) on a thread of its own, while the model works
        for item in iter(inbox.get, None):
            waiting.put(item)
        waiting.put(None)

    threading.Thread(target=read_inbox, daemon=True).start()
    while True:
        first = waiting.get()
        if first is None:
            return
        batch, deadline, stop = [first], time.monotonic() + limits.max_wait_ms / 1000, False
        while len(batch) < limits.batch_size:
            try:  # what waits already is taken at once; then more, until the deadline
                item = waiting.get(timeout=max(0.0, deadline - time.monotonic())) if waiting.empty() else waiting.get()
            except queue.Empty:
                break
            if item is None:
                stop = True
                break
            batch.append(item)
        start = time.monotonic()
        try:
            answers = infer.generate(gm, [_from_wire(item[1]) for item in batch], [item[2] for item in batch],
                                     decoding, engine=engine)
            results = [(item[0], prediction) for item, (_, prediction) in zip(batch, answers)]
        except Exception as e:  # noqa: BLE001 - the server must outlive a failed batch
            results = [(item[0], f"{type(e).__name__}: {e}") for item in batch]
        outbox.put((results, {"size": len(batch), "seconds": time.monotonic() - start,
                              "waits": [start - item[3] for item in batch]}))
        if stop:
            return


class QueueFull(Exception):
    pass


class Answer(NamedTuple):
    width: int  # the caller's image as a viewer shows it
    height: int
    predictions: list  # infer.Prediction, one per phrase
    encoded_at: float  # time.perf_counter() when the prompts were ready and queued


class Model:
    """The server's side of the model's process: starts it (and the encoding workers), sends it
    each request's prompts, and hands its answers to the requests that wait for them."""

    def __init__(self, model: str, device: str, limits: Limits, max_new_tokens: int):
        import multiprocessing

        from groundtune import infer

        self.limits, self.metrics = limits, None
        # spawned, not forked: the server has threads by now
        self.context = multiprocessing.get_context("spawn")
        self.inbox, self.outbox = self.context.Queue(), self.context.Queue()
        ours, theirs = self.context.Pipe()
        self.process = self.context.Process(target=_model_process, name="groundtune-model",
                                            args=(model, device, limits, max_new_tokens, self.inbox, self.outbox,
                                                  theirs))
        self.process.start()
        theirs.close()
        self.pool = None
        try:
            said, *what = ours.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"the model's process exited with {self.process.exitcode} while loading "
                               f"{model}") from None
        except BaseException:  # Ctrl-C while it loads: it ignores the signal, and would be waited for
            self.close()
            raise
        if said == "error":
            self.process.join()
            raise what[0]
        self.encoder, self.family, device = what  # the device it chose ("auto" resolved)
        self.workers = infer.default_workers(device) if limits.workers is None else limits.workers
        self.pending: dict[int, tuple] = {}  # key -> (loop, future): the phrases sent and not answered
        self.next_key = 0
        self.died: str | None = None
        self.on_death = None  # what the server does then (serve: stop)

    async def start(self, metrics) -> None:
        import threading

        self.metrics = metrics
        threading.Thread(target=self._read_answers, daemon=True).start()
        if self.workers:  # started (each submit starts one) and imported before the server says it is up
            self.pool = self._new_pool()
            loop = asyncio.get_running_loop()
            await asyncio.gather(*(loop.run_in_executor(self.pool, _worker_ready) for _ in range(self.workers)))

    def _new_pool(self):
        from concurrent.futures import ProcessPoolExecutor

        return ProcessPoolExecutor(self.workers, mp_context=self.context, initializer=_start_worker,
                                   initargs=(self.encoder, self.inbox))

    async def stop(self) -> None:
        """The workers and the model's process ended and waited for (the server's shutdown)."""
        self.inbox.cancel_join_thread()  # prompts the model will not read are not waited for at exit
        if self.pool is not None:
            await asyncio.to_thread(self.pool.shutdown, wait=True, cancel_futures=True)
        if self.process.is_alive():
            self.inbox.put(None)
            await asyncio.to_thread(self.process.join, 30)
            if self.process.is_alive():
                self.process.kill()

    def close(self) -> None:
        """What ``stop`` did not end (a server that failed or was stopped before it started) ended
        now: the model's process ignores the signals that stop the server."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    async def answer(self, data: bytes, phrases: list[str], param: str = "image") -> Answer:
        """The predictions for ``phrases`` in the image file ``data``; QueueFull when they do not
        fit the queue, a RequestError naming ``param`` for an image the server or the model cannot
        take."""
        from concurrent.futures.process import BrokenProcessPool

        if self.died:
            raise RuntimeError(self.died)
        if len(self.pending) + len(phrases) > self.limits.queue_size:
            raise QueueFull()
        loop = asyncio.get_running_loop()
        keys = list(range(self.next_key, self.next_key + len(phrases)))
        self.next_key += len(phrases)
        futures = [loop.create_future() for _ in keys]
        self.pending.update({key: (loop, future) for key, future in zip(keys, futures)})
        start = time.perf_counter()
        try:
            if self.pool is None:
                width, height = await asyncio.to_thread(_encode_and_send, self.encoder, self.inbox, keys, data,
                                                        phrases, param)
            else:
                pool = self.pool
                try:
                    width, height = await loop.run_in_executor(pool, _encode_in_worker, keys, data, phrases, param)
                except BrokenProcessPool:  # a worker died (killed, out of memory): new ones for the next
                    if self.pool is pool:
                        self.pool = self._new_pool()
                        pool.shutdown(wait=False)
                    raise
        except BaseException:
            for key in keys:
                self.pending.pop(key, None)
            raise
        encoded_at = time.perf_counter()
        self.metrics.encode_seconds.observe(encoded_at - start)
        return Answer(width, height, list(await asyncio.gather(*futures)), encoded_at)

    def _read_answers(self) -> None:
        """The answers, as the model's process sends them, to their requests' futures (a thread)."""
        import queue

        while True:
            try:
                results, stats = self.outbox.get(timeout=1)
            except queue.Empty:
                if not self.process.is_alive():
                    return self._model_died()
                continue
            self.metrics.batch_size.observe(stats["size"])
            self.metrics.batch_seconds.observe(stats["seconds"])
            for wait in stats["waits"]:
                self.metrics.queue_seconds.observe(wait)
            for key, result in results:
                loop, future = self.pending.pop(key, (None, None))
                if future is not None:
                    loop.call_soon_threadsafe(_settle, future, result)

    def _model_died(self) -> None:
        if self.process.exitcode == 0:  # ended by stop()
            return
        self.died = f"the model's process exited with {self.process.exitcode}; the server stops"
        print(f"error: {self.died}", file=sys.stderr, flush=True)
        for key in list(self.pending):
            loop, future = self.pending.pop(key)
            loop.call_soon_threadsafe(_settle, future, self.died)
        if self.on_death is not None:
            self.on_death()


def _settle(future, result) -> None:
    if future.done():
        return
    if isinstance(result, str):  # the model failed on this phrase's batch
        future.set_exception(RuntimeError(result))
    else:
        future.set_result(result)


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
                                        "(waiting for a worker included)", registry=self.registry, buckets=seconds)
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
        from fastapi.responses import HTMLResponse, JSONResponse, Response
        from starlette.exceptions import HTTPException
    except ImportError:
        raise MissingPackageError('groundtune serve needs FastAPI and uvicorn: pip install "groundtune[serve]"') from None
    import contextlib

    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await model.start(metrics)
        yield
        await model.stop()

    app = FastAPI(title="groundtune", lifespan=lifespan, docs_url=None, redoc_url=None)

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

    async def answer(data: bytes, phrases: list[str], param: str):
        try:
            return await model.answer(data, phrases, param)
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
            "results": [{"phrase": phrase, **p.to_json(all_boxes=True)}
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
        if body.get("stream"):
            raise RequestError(422, "streaming is not supported: the answer is one box", "stream")
        data, phrase = _chat_inputs(body, limits)
        answered = await answer(data, [phrase], "messages")
        prediction = answered.predictions[0]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": prediction.raw},
                         "finish_reason": "stop", "logprobs": None}],
            # the answer's boxes in the caller's pixels (its raw text is the message above)
            "groundtune": {**{k: v for k, v in prediction.to_json(all_boxes=True).items() if k != "raw"},
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


async def _ground_inputs(request, limits: Limits) -> tuple[bytes, list[str]]:
    """JSON {"image", "phrase" | "phrases"} or multipart (an ``image`` file, ``phrase`` fields) ->
    the image file's bytes (decoded with the prompts' encoding, off the event loop) and phrases."""
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        await _body(request, limits)
        form = await request.form()
        upload = form.get("image")
        if upload is None or isinstance(upload, str):
            raise RequestError(422, "multipart requests need an 'image' file field", "image")
        phrases = form.getlist("phrase") + form.getlist("phrases")
        return await upload.read(), check_phrases(phrases, limits, "phrase")
    body = await _json_body(request, limits)
    if "image" not in body:
        raise RequestError(422, "missing 'image' (base64 or a data: URI)", "image")
    if ("phrase" in body) == ("phrases" in body):
        raise RequestError(422, "give exactly one of 'phrase' (a string) and 'phrases' (a list)", "phrase")
    param = "phrase" if "phrase" in body else "phrases"
    phrases = check_phrases(body[param], limits, param)
    return image_bytes(body["image"], "image"), phrases


def _chat_inputs(body: dict, limits: Limits) -> tuple[bytes, str]:
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
    return image_bytes(images[0], "messages"), phrase


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          limits: Limits = Limits(), device: str = "auto", max_new_tokens: int | None = None) -> None:
    """Load ``model`` and serve it until interrupted."""
    try:
        import uvicorn
    except ImportError:
        raise MissingPackageError('groundtune serve needs FastAPI and uvicorn: pip install "groundtune[serve]"') from None
    from groundtune import infer

    listening = _listen(host, port)  # before the model loads: a taken port is said at once
    answering = Model(model, device, limits, max_new_tokens or infer.DEFAULT_MAX_NEW_TOKENS)
    try:
        app = create_app(answering, model, limits, api_key)
        if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
            print(f"warning: serving on {host} without --api-key: anyone who can reach it can use it")
        print(f"serving {model} ({answering.family}) on http://{host}:{port}  (UI at /, API at /v1/ground and "
              "/v1/chat/completions)", flush=True)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
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
