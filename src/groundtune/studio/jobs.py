"""The long work the studio starts: real `groundtune train|rl|eval|data check` processes, each
`python -m groundtune ...` in the work folder, the same command a terminal would run, so that what
the studio does is what the command line does and a run outlives a page left open or closed.

Each job's output goes to WORKDIR/studio/jobs/N-KIND.log; the page shows its last lines and how
long it has run. A run is stopped with its STOP file (it saves a checkpoint and exits, resumable);
any other job is cancelled by SIGTERM to its process group. When the studio stops, it sends SIGTERM
to what is still running: a run then saves and exits 0 (`--resume` goes on), an eval ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from groundtune.studio.safety import Refusal

TAIL_LINES = 40
FOLDER = "studio"  # WORKDIR/studio: the studio's own files (job logs, evals)


@dataclass
class Job:
    id: str
    kind: str  # train, rl, eval, check
    argv: list[str]
    log: Path
    process: subprocess.Popen
    started: float = field(default_factory=time.time)
    ended: float | None = None
    cancelled: bool = False
    about: dict = field(default_factory=dict)  # what the page needs to follow it: its run, its report

    def state(self) -> str:
        code = self.process.poll()
        if code is None:
            return "running"
        self.ended = self.ended or time.time()
        return "cancelled" if self.cancelled else "done" if code == 0 else "failed"

    def to_json(self, tail: bool = True) -> dict:
        state = self.state()
        return {"id": self.id, "kind": self.kind, "command": "groundtune " + " ".join(self.argv), "state": state,
                "returncode": self.process.returncode, "seconds": round((self.ended or time.time()) - self.started, 1),
                "tail": _tail(self.log) if tail else "", **self.about}


def _absolute_pythonpath() -> dict:
    """PYTHONPATH with its relative entries made absolute: they name folders of the studio's working
    folder, and a job runs in the work folder (it would import another groundtune, or none)."""
    given = os.environ.get("PYTHONPATH")
    if not given:
        return {}
    return {"PYTHONPATH": os.pathsep.join(os.path.abspath(p) if p else p for p in given.split(os.pathsep))}


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 16_384))  # the end of a long log, not all of it
            return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


class Jobs:
    def __init__(self, workdir: Path):
        self.workdir, self.folder = workdir, workdir / FOLDER / "jobs"
        self.jobs: dict[str, Job] = {}
        self.lock = threading.Lock()

    def start(self, kind: str, argv: list[str], **about) -> Job:
        """``groundtune ARGV`` in the work folder, its output to its log."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with self.lock:
            job_id = f"{len(self.jobs) + 1}-{kind}-{int(time.time())}"
            log = self.folder / f"{job_id}.log"
            # its own process group: a cancel reaches the data loader's workers too; unbuffered: the
            # page sees each line as it is printed
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **_absolute_pythonpath()}
            with open(log, "wb") as out:
                process = subprocess.Popen([sys.executable, "-m", "groundtune", *argv], cwd=self.workdir, stdout=out,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                           start_new_session=True)
            job = self.jobs[job_id] = Job(job_id, kind, argv, log, process, about=about)
        return job

    def get(self, job_id: str) -> Job:
        if job_id not in self.jobs:
            raise Refusal(f"no job {job_id!r} in this studio (jobs are forgotten when the studio restarts)")
        return self.jobs[job_id]

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job.state() == "running":
            job.cancelled = True
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.killpg(job.process.pid, signal.SIGTERM)
        return job

    def running(self, kind: str | None = None) -> list[Job]:
        return [j for j in self.jobs.values() if j.state() == "running" and kind in (None, j.kind)]

    def close(self, wait_s: float = 30.0) -> None:
        """SIGTERM to every job still running, then wait for them (a run saves its checkpoint)."""
        for job in self.running():
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.killpg(job.process.pid, signal.SIGTERM)
        deadline = time.time() + wait_s
        for job in self.jobs.values():
            try:
                job.process.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.killpg(job.process.pid, signal.SIGKILL)
