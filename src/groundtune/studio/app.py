"""`groundtune studio`: the app (FastAPI on uvicorn), its table of endpoints, and the page.

    groundtune studio                                  # http://127.0.0.1:7860, the current folder
    groundtune studio --workdir ~/grounding --port 8080
    groundtune studio --host 0.0.0.0 --token $TOKEN    # another interface: the token is required

One page (assets/studio/: HTML, a little vanilla JS and CSS) with five tabs; each tab's work is a
module of its own (data, launch, watch, judge, tryout) whose functions take the page's arguments
and answer JSON or a PNG. The table below maps each endpoint to its function, as the command line's
table maps commands. A refusal (safety.Refusal) or any user error of groundtune's is a 400 with its
message, shown in the page; anything else is a 500 saying so, its traceback in the terminal, and
the studio goes on answering.

FastAPI, not Gradio: measured on a 2-core machine from the process's start to the first page, a
one-textbox Gradio app took 6.5 to 6.8 s (Gradio 6.31) and 3.9 to 4.8 s (5.50), most or all of the
5 s the studio has; this app takes 1.2 to 1.4 s (docs/studio.md).
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

from groundtune.errors import GroundtuneError, MissingPackageError
from groundtune.studio import data, judge, launch, tryout, watch
from groundtune.studio.jobs import Jobs
from groundtune.studio.safety import HOST, PORT, Guard, Paths, loopback, own_hosts

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "studio"
FILES = {"studio.js": "text/javascript", "studio.css": "text/css"}  # what the page loads besides itself
log = logging.getLogger("uvicorn.error")

# method, path -> the function answering it: (studio, arguments) -> dict (JSON) | bytes (a PNG)
ROUTES = {
    ("POST", "/api/data/open"): data.open_file,
    ("GET", "/api/data/samples"): data.samples,
    ("GET", "/api/data/image"): data.image,
    ("GET", "/api/data/view"): data.view,
    ("POST", "/api/data/check"): data.start_check,
    ("GET", "/api/launch/form"): launch.form,
    ("POST", "/api/launch/plan"): launch.plan_run,
    ("POST", "/api/launch/start"): launch.start,
    ("POST", "/api/runs/stop"): launch.stop,
    ("POST", "/api/runs/resume"): launch.resume,
    ("GET", "/api/runs"): watch.runs,
    ("GET", "/api/runs/metrics"): watch.metrics,
    ("GET", "/api/runs/latest-eval"): watch.latest_eval,
    ("POST", "/api/judge/eval"): judge.start_eval,
    ("GET", "/api/judge/evals"): judge.evals,
    ("GET", "/api/judge/answers"): judge.answers,
    ("GET", "/api/judge/compare"): judge.compare,
    ("GET", "/api/answer.png"): judge.answer_png,
    ("POST", "/api/try"): tryout.ground,
    ("GET", "/api/jobs"): lambda studio, args: {"jobs": [j.to_json() for j in reversed(studio.jobs.jobs.values())]},
    ("POST", "/api/jobs/cancel"): lambda studio, args: studio.jobs.cancel(str(args.get("job", ""))).to_json(),
}
USER_ERRORS = (GroundtuneError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


@dataclass
class Studio:
    """What every tab shares: the work folder's paths, the jobs, what was read (by file version)."""

    paths: Paths
    jobs: Jobs
    cache: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _fastapi():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise MissingPackageError('groundtune studio needs FastAPI and uvicorn: pip install "groundtune[studio]"') \
            from None


def create_app(workdir: str | Path, token: str | None = None, hosts: set[str] | None = None):
    """The studio's app over ``workdir``; ``token``: required of every request; ``hosts``: the only
    Host headers answered (None: any)."""
    _fastapi()
    import contextlib

    from fastapi import FastAPI
    from fastapi.responses import FileResponse, HTMLResponse

    studio = Studio(Paths(workdir), Jobs(Path(workdir).resolve()))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        studio.jobs.close()  # a run saves its checkpoint and exits; an eval ends

    app = FastAPI(title="groundtune studio", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, token=token, hosts=hosts)
    app.state.studio = studio
    for (method, path), handler in ROUTES.items():
        app.add_api_route(path, _endpoint(studio, handler), methods=[method])

    @app.get("/")
    async def page():
        return HTMLResponse((ASSETS / "index.html").read_text(encoding="utf-8"), headers={"Cache-Control": "no-store"})

    @app.get("/static/{name}")
    async def static(name: str):
        if name not in FILES:
            return _error(404, f"no file {name!r} here")
        return FileResponse(ASSETS / name, media_type=FILES[name], headers={"Cache-Control": "no-store"})

    return app


def _error(status: int, message: str):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=status)


def _endpoint(studio: Studio, handler):
    """An endpoint calling ``handler(studio, arguments)`` off the event loop: the query's arguments,
    and a POST's JSON object over them."""
    from fastapi import Request, Response
    from starlette.concurrency import run_in_threadpool

    async def endpoint(request: Request):
        args = dict(request.query_params)
        if request.method == "POST":
            try:
                body = await request.json()
            except ValueError:
                return _error(400, "the request's body is not JSON")
            if not isinstance(body, dict):
                return _error(400, "the request's body must be a JSON object")
            args.update(body)
        try:
            result = await run_in_threadpool(handler, studio, args)
        except USER_ERRORS as e:
            return _error(400, str(e))
        except Exception as e:  # noqa: BLE001 - a bug of ours: said, and the studio goes on
            log.error("%s %s failed", request.method, request.url.path, exc_info=e)
            return _error(500, f"internal error ({type(e).__name__}: {e}); the studio's terminal has the traceback")
        if isinstance(result, bytes):
            return Response(result, media_type="image/png", headers={"Cache-Control": "no-store"})
        return result

    endpoint.__annotations__ = {"request": Request}  # the class itself: this module's annotations are strings
    return endpoint


def studio(workdir: str | Path = ".", host: str = HOST, port: int = PORT, token: str | None = None) -> None:
    """Serve the studio over ``workdir`` until interrupted."""
    _fastapi()
    import uvicorn

    from groundtune.deploy.serve import listen

    paths = Paths(workdir)  # a bad --workdir is said before the port is taken
    if token is None and not loopback(host):
        token = secrets.token_urlsafe(18)  # never open to a network without one
    listening = listen(host, port)
    app = create_app(paths.root, token, own_hosts(host, port))
    shown = f"[{host}]" if ":" in host else host
    print(f"groundtune studio on http://{shown}:{port}/" + (f"?token={token}" if token else "")
          + f"  (work folder {paths.root}; Ctrl-C to stop)", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listening])
