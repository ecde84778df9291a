"""The HTTP server: `groundtune serve --model M` (FastAPI on uvicorn; ``pip install "groundtune[serve]"``).

    groundtune serve --model runs/sft                                 # http://127.0.0.1:8000
    groundtune serve --model exports/sft --host 0.0.0.0 --api-key $KEY

Endpoints (the contract is in docs/export-and-serve.md, "Serve"):
- ``POST /v1/ground``: an image (JSON ``image`` as base64, MIME's line breaks allowed, or a data:
  URI, or a multipart ``image`` file) and ``phrase`` or ``phrases`` -> a box per phrase in pixels
  of the caller's ORIGINAL image (its EXIF orientation applied, as a viewer shows it), label, raw
  answer, timings;
- ``POST /v1/chat/completions``: OpenAI's chat API (the ``openai`` client works unchanged). The
  last user message's text is the phrase, asked with the model's own prompt; its image is an
  ``image_url`` data: URI. The answer is the model's text (cut at ``max_completion_tokens`` or
  ``max_tokens``), its ``usage``, plus ``groundtune`` with the boxes in the caller's pixels; with
  ``"stream": true`` the same as OpenAI's server-sent events, sent once the answer is ready. A
  parameter the server cannot honour (n > 1, sampling, tools, logprobs, a response format, ...)
  is a 422 naming it, another model OpenAI's 404 ``model_not_found`` (chat.py);
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /`` (a one-page UI);
  each answers HEAD too.

With ``--api-key KEY``, /v1/*, /metrics and /openapi.json ask for ``Authorization: Bearer KEY``
(the scheme in any case), the one way to give it; /health and the UI do not.

This module is the app, its errors and metrics; reading.py reads what a caller sends, chat.py is
the OpenAI adapter, limits.py the limits below, connections.py the connections. Behind it
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
before it is decoded, first come first served. So are the connections (connections.py): a
request's headers must arrive within ``--header-timeout-s``, at most ``--max-connections`` are
open (past it, a new one takes the place of the oldest still waiting for headers, or gets a 503
when every one is busy), and a failed accept is one log line a minute, not a traceback each.
"""


import asyncio
import contextlib
import json
import logging
import secrets
import signal
import time
import uuid
from pathlib import Path

from groundtune.config import InferSettings
from groundtune.deploy.batching import Answer, Model, QueueFull, prepare_decoding
from groundtune.deploy.chat import chat_completion, chat_events, chat_inputs, chat_settings
from groundtune.deploy.limits import Limits
from groundtune.deploy.reading import Encoder, RequestError, ground_inputs, json_body
from groundtune.errors import ConfigError, MissingPackageError

UI_FILE = Path(__file__).resolve().parent.parent / "assets" / "serve_ui.html"
HOST = "127.0.0.1"  # this machine only: another interface is the operator's choice (--host 0.0.0.0)
PORT = 8000
DEFAULT_LIMITS = Limits()  # every flag at its default (frozen: one instance serves every call)

log = logging.getLogger("uvicorn.error")  # uvicorn's own log: the server's stderr, in its format


class Metrics:
    """Prometheus metrics in a registry of the app's own (two apps in one process stay apart)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
        # the connections (connections.Gate): how many are open, and those closed before a whole request
        self.connections = Gauge("groundtune_connections", "open HTTP connections", registry=self.registry)
        self.connections_shed = Counter(
            "groundtune_connections_shed", "connections closed before a whole request came: header_timeout "
            "(--header-timeout-s), evicted (the oldest waiting for headers, at --max-connections), refused (a 503 "
            "at --max-connections, every one busy)", ["reason"], registry=self.registry)


# --------------------------------------------------------------------------------------------
# The app


def create_app(model: Model, model_name: str, limits: Limits = DEFAULT_LIMITS, api_key: str | None = None):
    """The FastAPI app serving ``model`` (its process started)."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import HTMLResponse, Response, StreamingResponse
        from starlette.exceptions import HTTPException
    except ImportError:
        raise MissingPackageError('groundtune serve needs FastAPI and uvicorn: pip install "groundtune[serve]"') from None

    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        from groundtune.deploy.connections import quiet_accept_errors

        quiet_accept_errors(asyncio.get_running_loop())
        await model.start(metrics)
        yield
        await model.stop()

    app = FastAPI(title="groundtune", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.metrics = metrics  # the connections' counts go here too (serve)
    app.add_middleware(_Guard, metrics=metrics, limits=limits, api_key=api_key)

    _add_error_handlers(app, RequestValidationError, HTTPException)

    async def answer(data: bytes, phrases: list[str], param: str, max_tokens: int | None = None) -> Answer:
        try:
            return await model.answer(data, phrases, param, max_tokens)
        except QueueFull:
            raise RequestError(503, f"the server is busy ({limits.queue_size} phrases waiting); retry shortly",
                               kind="server_busy") from None

    @app.post("/v1/ground")
    async def ground(request: Request):
        start = time.perf_counter()
        data, phrases = await ground_inputs(request, limits)
        return _ground_answer(model_name, phrases, await answer(data, phrases, "image"), start)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await json_body(request, limits)
        settings = chat_settings(body, model_name, model.max_new_tokens)
        data, phrase = chat_inputs(body, limits)
        answered = await answer(data, [phrase], "messages", settings.max_tokens)  # a mistake is found by now
        if not settings.stream:
            return chat_completion(answered, model_name)
        # no-cache, and nginx's X-Accel-Buffering off: no cache or proxy holds the events back
        return StreamingResponse(chat_events(answered, model_name, settings.include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @_get(app, "/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "groundtune"}]}

    @_get(app, "/health")
    async def health():
        return {"status": "ok", "model": model_name, "family": model.family, "waiting": len(model.pending)}

    @_get(app, "/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @_get(app, "/", response_class=HTMLResponse)
    async def ui():
        return UI_FILE.read_text()

    return app


def _get(app, path: str, **options):
    """``app.get`` answering HEAD too: the same headers, no body (uvicorn drops it), as a load
    balancer's check may ask. HEAD is left out of /openapi.json (one operation a path and method)."""
    def route(endpoint):
        app.head(path, include_in_schema=False, **options)(endpoint)
        return app.get(path, **options)(endpoint)
    return route


def _add_error_handlers(app, validation_error, http_exception) -> None:
    """Every failure answered in OpenAI's error shape: a caller's ``RequestError``, FastAPI's
    validation and HTTP errors (``validation_error``, ``http_exception``: their classes), and (with
    no detail) an exception of ours."""

    @app.exception_handler(RequestError)
    async def _request_error(request, e: RequestError):
        headers = {"Retry-After": "1"} if e.status == 503 else None
        if e.status in (408, 413):  # the rest of the body is not read: the connection cannot carry another request
            headers = {"Connection": "close"}
        return _error(e.status, e.message, e.param, e.kind, e.code, headers)

    @app.exception_handler(Exception)
    async def _server_error(request, e: Exception):  # what _Guard did not answer (a bug in it): still no details
        return _error(500, "internal error", kind="server_error")

    @app.exception_handler(validation_error)
    async def _validation_error(request, e):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(422, f"{first.get('msg', 'invalid request')}", where)

    @app.exception_handler(http_exception)
    async def _http_error(request, e):
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, str(e.detail), kind=kind, headers=e.headers)


def _ground_answer(model_name: str, phrases: list[str], answered: Answer, start: float) -> dict:
    """/v1/ground's answer: a result per phrase, in the caller's pixels, and where the time went."""
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
            if self.api_key is not None and path.startswith(_GUARDED) and not _key_ok(headers, self.api_key):
                await _error(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                             kind="authentication_error", headers={"WWW-Authenticate": "Bearer"})(scope, receive,
                                                                                                 counted)
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


# What --api-key guards: the API, the metrics and the API's description (the UI at / and /health stay
# open: a page that asks for the key, a load balancer's check)
_GUARDED = ("/v1/", "/metrics", "/openapi.json", "/docs", "/redoc")


def _key_ok(headers, api_key: str) -> bool:
    """The one way to give the key: ``Authorization: Bearer KEY`` (the scheme's case is free, as
    HTTP's auth schemes are; what the openai client sends)."""
    scheme, _, given = headers.get("authorization", "").strip().partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), api_key.encode())


def serve(model: str, host: str = HOST, port: int = PORT, api_key: str | None = None,
          limits: Limits = DEFAULT_LIMITS, device: str = InferSettings.device,
          max_new_tokens: int = InferSettings.max_new_tokens, compile: bool = InferSettings.compile) -> None:
    """Load ``model`` and serve it until interrupted."""
    try:
        import uvicorn
    except ImportError:
        raise MissingPackageError('groundtune serve needs FastAPI and uvicorn: pip install "groundtune[serve]"') from None
    from groundtune.deploy.connections import DEFAULT_CONNECTIONS, Gate, budget, protocol

    # before the model loads, as a taken port or a connection cap the open-file limit cannot hold
    listening = listen(host, port)
    max_connections, backlog = budget(limits.max_connections)
    prepare_decoding()
    answering = Model(model, device, limits, max_new_tokens, Encoder, compile)
    try:
        app = create_app(answering, model, limits, api_key)
        if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
            print(f"warning: serving on {host} without --api-key: anyone who can reach it can use it")
        if limits.max_connections is None and max_connections < DEFAULT_CONNECTIONS:
            print(f"note: at most {max_connections} connections (--max-connections): what the open-file limit "
                  "(ulimit -n) leaves room for")
        print(f"serving {model} ({answering.family}) on http://{host}:{port}  (UI at /, API at /v1/ground and "
              "/v1/chat/completions)", flush=True)
        # access lines off (warning); a connection idle for 5 s between requests is closed; its
        # headers' time and the connections' number are the protocol's (connections.py), a body
        # that stalls is the app's (--body-timeout-s); no WebSocket upgrades (there is no such route)
        gate = Gate(max_connections, limits.header_timeout_s, app.state.metrics)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=5, http=protocol(gate),
                                               backlog=backlog, ws="none"))
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


def listen(host: str, port: int):
    """A socket bound to host:port for uvicorn; one that cannot be bound is a ConfigError naming the
    flags (uvicorn itself would log it and exit 3 after the model had loaded). Serve's and the
    studio's (the same --host and --port)."""
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
