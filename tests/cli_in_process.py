"""`groundtune ARGS` (or `python SCRIPT ARGS`) run inside the test process: the CLI's own `main()`
(the script as ``__main__``), its stdout and stderr captured, its exit code returned, as a
subprocess would report them.

Why: a `python -m groundtune` process pays ~3-5 s of importing torch and transformers on a
2-core machine before it does anything, and most command-line tests check a refusal that takes
milliseconds. A test where the process itself is the point (the console entry point, signals,
a hang that only a timeout can end, environment read at import) keeps a real process.

What a fresh process would show is kept: the working folder and the environment are the call's
own and put back after it; warnings are shown on the captured stderr once per call under the
filters a process has (as a new process shows each once), not collected by pytest; the libraries'
logging handlers write to the captured stderr while the call runs.
"""

from __future__ import annotations

import io
import logging
import os
import runpy
import sys
import time
import warnings
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from subprocess import CompletedProcess


_PYTEST_FILTERS = [("always", None, DeprecationWarning, None, 0), ("always", None, PendingDeprecationWarning, None, 0)]


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in logging.root.manager.loggerDict]
    return [h for logger in loggers for h in getattr(logger, "handlers", ())
            if type(h) is logging.StreamHandler and h.stream in (sys.__stderr__, sys.stderr)]


@contextmanager
def _as_a_process(cwd: str | Path | None, env: dict | None):
    """What the call prints goes to the two buffers yielded (stdout, stderr); the working folder,
    the environment and the logging handlers' streams are put back afterwards."""
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    handlers = {handler: handler.stream for handler in _stream_handlers()}
    try:
        for key, value in (env or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = str(value)
        if cwd is not None:
            os.chdir(cwd)
        for handler in handlers:
            handler.setStream(err)
        with redirect_stdout(out), redirect_stderr(err), warnings.catch_warnings():
            # the filters of this process less the two pytest adds around each test (a process shows
            # deprecations only where Python's defaults and the libraries' own filters say); entering
            # catch_warnings forgets which warnings were shown, so each shows again, once, as in a new process
            warnings.filters[:] = [f for f in warnings.filters if f not in _PYTEST_FILTERS]
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: err.write(
                warnings.formatwarning(message, category, filename, lineno, line))
            yield out, err
    finally:
        for handler, stream in handlers.items():
            handler.setStream(stream)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


def _exit_code(stop: SystemExit, err: io.StringIO) -> int:
    """sys.exit's argument as the process's exit code (argparse's refusals, --help)."""
    if isinstance(stop.code, str):
        err.write(stop.code + "\n")
        return 1
    return 0 if stop.code is None else stop.code


def groundtune(*args, cwd: str | Path | None = None, env: dict | None = None) -> CompletedProcess:
    """Run the command line in this process; ``.seconds`` is how long it took. ``args`` may hold
    paths; ``env`` adds to (or, with None values, removes from) the environment for this call."""
    from groundtune.cli import main

    argv = [str(a) for a in args]
    started = time.monotonic()
    with _as_a_process(cwd, env) as (out, err):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = _exit_code(stop, err)
    done = CompletedProcess(["python", "-m", "groundtune", *argv], code, out.getvalue(), err.getvalue())
    done.seconds = time.monotonic() - started
    return done


def script(path: str | Path, *args, cwd: str | Path | None = None) -> CompletedProcess:
    """``python PATH ARGS`` in this process: the script run as ``__main__`` with its folder first on
    sys.path (as Python puts it), and sys.argv set; for a script's refusals of its arguments."""
    argv = [str(path), *map(str, args)]
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv, sys.path[:0] = argv, [str(Path(path).parent)]
    try:
        with _as_a_process(cwd, None) as (out, err):
            try:
                runpy.run_path(str(path), run_name="__main__")
                code = 0
            except SystemExit as stop:
                code = _exit_code(stop, err)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return CompletedProcess(["python", *argv], code, out.getvalue(), err.getvalue())
