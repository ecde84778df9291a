"""What the studio lets a page do: read and write inside its work folder only, and answer only its
own pages.

- Paths: every path a page gives is taken relative to the work folder (or absolute), resolved with
  its links followed, and refused unless it lies inside the work folder; an image a record names is
  held to the same rule (plus groundtune's cache, where ``hf:`` data sets are converted), so no
  file of the machine is read through the studio by naming it.
- Who may ask: on 127.0.0.1 only pages this machine serves itself (the Host header must be the
  studio's own address: a web page of elsewhere that points a name of its own at 127.0.0.1, DNS
  rebinding, is refused); anywhere else only with the token (given, or made and printed at the
  start), which the first visit's ``?token=`` leaves in a cookie. Every POST carries a header of
  the studio's own, which a form of another site cannot send without the browser asking first.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from pathlib import Path
from urllib.parse import parse_qs, urlencode

from groundtune.errors import UsageError
from groundtune.files import cache_dir

HOST = "127.0.0.1"  # this machine only; another interface is the user's choice, with a token
PORT = 7860
POST_HEADER = "x-groundtune-studio"  # every POST of the page sends it (studio.js)
COOKIE = "groundtune_studio_token"
MAX_BODY_BYTES = 64 * 2**20  # an uploaded image as a data: URL, with room to spare


class Refusal(UsageError):
    """What the studio will not do for a page: said in the page, nothing written."""


def loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve to any interface
        return False


class Paths:
    """The work folder, and the paths a page may name: inside it, links resolved."""

    def __init__(self, workdir: str | Path):
        self.root = Path(workdir).resolve()
        if not self.root.is_dir():
            raise UsageError(f"--workdir {workdir}: not a folder; name the folder the studio may read and write")

    def inside(self, given: str, what: str = "path") -> Path:
        """``given`` (relative to the work folder, or absolute) resolved; a Refusal when it lies outside."""
        text = str(given or "").strip()
        if not text or "\x00" in text:
            raise Refusal(f"no {what} given" if not text else f"{what} {text!r}: not a path")
        path = (self.root / Path(text).expanduser()).resolve()  # an absolute path stays itself
        if not path.is_relative_to(self.root):
            named = f"{what}{text}" if what.endswith("=") else f"{what} {text}"
            raise Refusal(f"{named}: outside the work folder {self.root} (links followed); the studio "
                          "reads and writes only there: start it with --workdir naming a folder that holds it")
        return path

    def readable(self, path: Path, what: str = "image") -> Path:
        """A file a record names (an image): inside the work folder or groundtune's cache."""
        resolved = Path(path).resolve()
        if resolved.is_relative_to(self.root) or resolved.is_relative_to(cache_dir().resolve()):
            return resolved
        raise Refusal(f"{what} {path}: outside the work folder {self.root}; the studio shows no file from there")

    def shown(self, path: Path) -> str:
        """``path`` as the page shows it: relative to the work folder."""
        path = Path(path).resolve()
        return str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)


class Guard:
    """ASGI middleware: the Host check on loopback, the token elsewhere, the POST header, the body size."""

    def __init__(self, app, token: str | None, hosts: set[str] | None):
        self.app, self.token, self.hosts = app, token, hosts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        query = parse_qs(scope.get("query_string", b"").decode())
        refusal = self._refusal(scope, headers, query)
        if refusal:
            return await _answer(send, *refusal)
        if self.token and query.get("token") and scope["method"] == "GET":  # the first visit: a cookie
            rest = urlencode({k: v for k, v in query.items() if k != "token"}, doseq=True)
            cookie = f"{COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/"
            return await _answer(send, 303, "", [("location", scope["path"] + ("?" + rest if rest else "")),
                                                 ("set-cookie", cookie)])
        await self.app(scope, receive, send)

    def _refusal(self, scope, headers: dict, query: dict) -> tuple[int, str] | None:
        if self.hosts is not None and headers.get("host", "") not in self.hosts:
            return 403, (f"this studio answers only at {' or '.join(sorted(self.hosts))} (Host header "
                         f"{headers.get('host', '')!r}): a page of another site cannot use it")
        if self.token and not self._token_ok(headers, query):
            return 401, "this studio needs its token: open the address it printed at the start (…/?token=…)"
        if scope["method"] == "POST" and headers.get(POST_HEADER) != "1":
            return 403, f"a POST to the studio needs the header {POST_HEADER}: 1 (its own page sends it)"
        length = headers.get("content-length") or "0"
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            return 413, f"a request body of at most {MAX_BODY_BYTES // 2**20} MB"
        return None

    def _token_ok(self, headers: dict, query: dict) -> bool:
        cookies = dict(part.strip().split("=", 1) for part in headers.get("cookie", "").split(";") if "=" in part)
        given = [cookies.get(COOKIE, ""), headers.get("authorization", "").removeprefix("Bearer ").strip(),
                 *query.get("token", [])]
        return any(hmac.compare_digest(g.encode(), self.token.encode()) for g in given if g)


async def _answer(send, status: int, message: str, headers: list[tuple[str, str]] = ()) -> None:
    body = json.dumps({"error": message}).encode() if message else b""
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.encode(), v.encode()) for k, v in headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def own_hosts(host: str, port: int) -> set[str] | None:
    """The Host headers a page served on loopback ``host`` sends; None (no check) on another interface,
    where the token guards instead."""
    if not loopback(host):
        return None
    return {f"{name}:{port}" for name in ("127.0.0.1", "localhost", "[::1]", host if ":" not in host else f"[{host}]")}
