"""What a client that never sends a whole request can hold of `groundtune serve`: its connections.

uvicorn bounds none of it: a connection that sends nothing, or a header byte every few seconds,
stays open for good (its keep-alive timer starts only after a first answer, and every byte
restarts it). Some 20,000 such connections filled the server's open-file limit; from then on
asyncio logged a traceback for every accept that failed (91 MB of log in a minute), /health timed
out, and the process stayed 94 MB larger. So the server speaks HTTP through ``GuardedH11``,
uvicorn's h11 protocol with a header timeout and a place under a connection cap, the cap fits
the open-file limit, and the loop says failed accepts quietly (bench/serve_connections.py
measures 20,000 such connections against it; docs/export-and-serve.md has the figures):

- a header timeout (``--header-timeout-s``): from when a connection starts waiting for a request
  (it opens, or its previous answer has been sent), the request's line and headers must all have
  arrived within the timeout, however slowly they trickle: one deadline, not restarted by each byte.
  Late, the connection is closed: with a 408 when part of a request came, silently when nothing
  did (as an idle keep-alive connection is closed; a 408 there would be read as the answer to the
  client's next request).
- a cap (``--max-connections``): a new connection past it takes the place of the oldest open one
  that is waiting for a request's headers (idle or trickling), so that a client sending real
  requests still gets in while thousands of connections do nothing; when every open connection
  is busy with a request, the new one is answered 503 (Retry-After: 1) and closed at once.
  Nothing is logged per connection; ``/metrics`` counts them (``groundtune_connections``,
  ``groundtune_connections_shed_total``).
- the open-file limit: ``budget`` raises the soft limit (``ulimit -n``; read with
  ``resource.getrlimit``) as far as the hard one allows, so that the cap, a burst of accepts and
  the server's own files fit under it, and says so where they cannot.
- ``quiet_accept_errors``: a failed accept (out of open files, EMFILE) is one log line at most
  once a minute, with how many failed since. (asyncio logs each with its traceback, and Python
  3.11's loop goes on accepting after one fails: up to a backlog's worth of tracebacks at once.)
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import math
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from groundtune.errors import ConfigError

log = logging.getLogger("uvicorn.error")

DEFAULT_CONNECTIONS = 4096
# the server's own descriptors: the listening socket, its processes' pipes, an image file (14 idle, 37
# with --workers 8)
OWN_FILES = 256
# connections the kernel queues for accepting (uvicorn's default); asyncio accepts up to this many at
# once. 1,024 was slower: a probe found the queue full and retried after 1 s more often (bench)
BACKLOG = 2048


def budget(max_connections: int | None) -> tuple[int, int]:
    """(the connection cap, the listening backlog) that fit under this process's open-file limit.

    Every held connection is a descriptor; asyncio accepts up to a backlog's worth at once before
    any is refused, and as many again may be closing: so the limit must hold the cap, twice the
    backlog and the server's own files. The soft limit is raised toward that as far as the hard
    limit allows (Linux's soft limit is often 1,024, its hard one far higher); the default cap
    (None) is ``DEFAULT_CONNECTIONS`` or what is left under the limit; a cap given that does not
    fit is a ConfigError naming --max-connections."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    wanted = (max_connections or DEFAULT_CONNECTIONS) + 2 * BACKLOG + OWN_FILES
    if soft != unlimited and soft < wanted:
        raised = wanted if hard == unlimited else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):  # a hard limit the system will not lend: the soft one stands
            pass
    limit = math.inf if soft == unlimited else soft
    backlog = int(min(BACKLOG, limit // 4))  # a small limit (1,024): a smaller burst, room for connections
    room = int(min(limit - 2 * backlog - OWN_FILES, 2**31 - 1))
    if max_connections is None:
        return max(1, min(DEFAULT_CONNECTIONS, room)), backlog
    if max_connections > room:
        raise ConfigError(f"--max-connections {max_connections}: the open-file limit (ulimit -n) is {soft} "
                          f"(hard {hard}), which leaves room for {max(room, 0)} connections ({2 * backlog} for "
                          f"connections being accepted and closed, {OWN_FILES} for the server's own files); give "
                          "fewer, or raise the limit")
    return max_connections, backlog


def _answer(status: int, message: str, kind: str, headers: str = "") -> bytes:
    """A whole HTTP answer, written on a connection uvicorn has not answered on (h11 sends no
    answer before a request): serve's JSON error shape, and the connection closed after it."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n{headers}\r\n")
    return head.encode() + body


class Gate:
    """What one server's connections share: the cap, the open ones, those waiting for a request's
    headers (oldest first: a dict keeps the order its keys came in), and the counts /metrics shows."""

    def __init__(self, max_connections: int, header_timeout_s: float, metrics=None):
        self.max_connections, self.header_timeout_s = max_connections, header_timeout_s
        self.open: set[GuardedH11] = set()
        self.waiting: dict[GuardedH11, None] = {}
        self.shed = metrics.connections_shed if metrics is not None else None
        if metrics is not None:
            metrics.connections.set_function(lambda: len(self.open))
        self.refusal = _answer(503, f"the server has {max_connections} connections open, each busy with a request "
                                    "(--max-connections); retry shortly", "server_busy", "retry-after: 1\r\n")
        self.late = _answer(408, f"the request's headers did not arrive within {header_timeout_s:g} s "
                                 "(--header-timeout-s)", "invalid_request_error")
        self.evicted = _answer(503, "the server is at its connection limit (--max-connections) and this "
                                    "connection had not sent a whole request; retry", "server_busy",
                               "retry-after: 1\r\n")

    def admit(self, connection: GuardedH11) -> bool:
        """True when ``connection`` may stay open: under the cap, or in the place of the oldest
        connection waiting for headers (which is closed)."""
        if len(self.open) >= self.max_connections:
            if not self.waiting:
                self.count("refused")
                return False
            next(iter(self.waiting)).drop(self.evicted)
            self.count("evicted")
        self.open.add(connection)
        return True

    def forget(self, connection: GuardedH11) -> None:
        self.open.discard(connection)
        self.waiting.pop(connection, None)

    def count(self, reason: str) -> None:
        if self.shed is not None:
            self.shed.labels(reason).inc()


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a header timeout and a place under the connection cap (the
    module's docstring). uvicorn makes one per connection, with its own arguments; ``gate`` is
    bound by ``protocol``. h11 even where httptools is installed (which uvicorn's "auto" would
    take): one protocol to guard, the one the hostile-request tests were written against."""

    def __init__(self, config, server_state, app_state, _loop=None, *, gate: Gate):
        super().__init__(config, server_state, app_state, _loop)
        self.gate, self.header_timer = gate, None

    def connection_made(self, transport) -> None:
        if not self.gate.admit(self):  # refused before uvicorn sees it: nothing of it to undo
            transport.write(self.gate.refusal)
            transport.close()
            return
        super().connection_made(transport)
        self._watch()

    def connection_lost(self, exc) -> None:
        if self.transport is None:  # refused in connection_made
            return
        self._unwatch()
        self.gate.forget(self)
        super().connection_lost(exc)

    def handle_events(self) -> None:  # a request's headers may have come in: the timer stops
        super().handle_events()
        self._watch()

    def on_response_complete(self) -> None:  # an answer sent: waiting for the next request
        super().on_response_complete()
        self._watch()

    def _unsupported_upgrade_warning(self) -> None:
        """Said by uvicorn for each request asking for a protocol upgrade (two warnings a request,
        which any client can send at will); the server serves no upgrades and answers it as a
        plain request, saying nothing."""

    def _watch(self) -> None:
        """The header timer runs while the connection waits for a request's headers: before its
        first request, and after each answer until the next request's headers are in (whether or
        not the rest of the previous request's body still arrives)."""
        waiting = not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete)
        if waiting and self.header_timer is None:
            self.header_timer = self.loop.call_later(self.gate.header_timeout_s, self._headers_late)
            self.gate.waiting[self] = None
        elif not waiting:
            self._unwatch()

    def _unwatch(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None
        self.gate.waiting.pop(self, None)

    def _headers_late(self) -> None:
        self.header_timer = None
        self.gate.count("header_timeout")
        self.drop(self.gate.late)

    def drop(self, answer: bytes) -> None:
        """Close the connection, its place under the cap free at once: ``answer`` written first when
        part of a request has come (a connection that sent nothing gets nothing)."""
        self._unwatch()
        self.gate.forget(self)
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self.transport.write(answer)
        self.transport.close()


def protocol(gate: Gate):
    """What uvicorn.Config takes as ``http``: it makes a connection's protocol with its own
    arguments; this one adds ``gate``."""
    def make(config, server_state, app_state, _loop=None) -> GuardedH11:
        return GuardedH11(config, server_state, app_state, _loop, gate=gate)

    return make


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, every_s: float = 60.0) -> None:
    """The loop's failed accepts (out of open files or memory) said in one line at most every
    ``every_s`` seconds, with how many failed since; every other error as asyncio says it."""
    said_at, failed = -math.inf, 0

    def handler(loop, context: dict) -> None:
        nonlocal said_at, failed
        if not context.get("message", "").startswith("socket.accept() out of system resource"):
            loop.default_exception_handler(context)
            return
        failed += 1
        now = time.monotonic()
        if now - said_at >= every_s:
            error = context.get("exception")
            log.warning("cannot accept connections: %s (%d failed accepts since this was last said; at most once "
                        "every %g s); lower --max-connections or raise the open-file limit (ulimit -n)",
                        getattr(error, "strerror", None) or error, failed, every_s)
            said_at, failed = now, 0

    loop.set_exception_handler(handler)
