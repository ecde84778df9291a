"""A real `groundtune serve` in a process of its own, for what measures or tests the server from
outside (bench/serve_load.py, serve_memory.py, serve_connections.py; tests/test_serve.py):

    from serving import launch                     # bench/ is the script's folder: on sys.path
    process, url = launch("tiny", "--batch-size", "8")
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request


def launch(model: str, *flags: str, timeout_s: float = 60.0, **popen) -> tuple:
    """Start ``groundtune serve --model MODEL FLAGS`` in a process of its own on 127.0.0.1 at a free
    port and wait until /health answers; returns (the process, its URL). For what needs the real
    server from outside: the serve benches and the tests (tests/conftest.py puts bench/ on their
    path). ``popen``: subprocess.Popen's options (where its output goes). A server that exits or does
    not answer in ``timeout_s`` is a RuntimeError."""

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
