"""Where a benchmark's result came from, stamped into every JSON a bench script writes.

    from provenance import stamped                 # bench/ is the script's folder: on sys.path
    Path(args.out).write_text(json.dumps(stamped(rows), indent=1) + "\\n")

``stamped(result)`` is ``{"provenance": {...}, "results": result}`` for a list (rows), or the dict
with a ``provenance`` key added: the command as it was typed, the commit and whether the tree
differed from it, the date and time (UTC), the device (GPU name and memory, or CPU model and
cores), and the versions of Python, torch (and its CUDA), transformers, peft and groundtune, and of
the optional packages that change a step's speed or that a peer's variant ran, where installed
(``OPTIONAL_PACKAGES``). A figure quoted in
README.md or BENCHMARKS.md links to such a file (tests/test_claims.py holds them to it).

On a machine that gets a copy of the tree without its git history (a lent GPU), the commit comes
from the environment: ``BENCH_COMMIT=$(git rev-parse HEAD)`` where the copy was made, and
``BENCH_DIRTY=1`` when the copy held changes.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KEYS = ("command", "commit", "date", "device")  # what every result carries at least


def provenance(command: str | None = None) -> dict:
    """The stamp itself (see the module's docstring)."""
    return {
        "command": command or _command(),
        **_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": _device(),
        "versions": _versions(),
    }


def stamped(result, command: str | None = None) -> dict:
    """``result`` (a dict, or a list of rows) with its provenance."""
    stamp = provenance(command)
    if isinstance(result, dict):
        return {"provenance": stamp, **{k: v for k, v in result.items() if k != "provenance"}}
    return {"provenance": stamp, "results": result}


def measure_models(parser, models: list[str], measure, out: str | None) -> dict:
    """``measure(model)`` for each model named on the command line, each printed, all written
    stamped to ``out`` where given. A folder that is not a model ends the script with argparse's
    one line, exit 2."""
    import json

    from groundtune.errors import GroundtuneError

    results = {}
    for model in models:
        try:
            results[model] = measure(model)
        except GroundtuneError as e:
            parser.error(str(e))
        print(model, results[model])
    if out:
        Path(out).write_text(json.dumps(stamped(results), indent=1) + "\n")
    return results


def unstamped(result):
    """What ``stamped`` was given: the rows (or dict) of a result file, without the stamp. For a
    bench that gathers the files its own child processes wrote."""
    if isinstance(result, dict) and set(result) == {"provenance", "results"}:
        return result["results"]
    return {k: v for k, v in result.items() if k != "provenance"} if isinstance(result, dict) else result


def _command() -> str:
    """How the script was started: ``python bench/NAME.py ARGS``, as typed from the repository's root."""
    script = Path(sys.argv[0]).resolve()
    try:
        shown = script.relative_to(REPO).as_posix()
    except ValueError:
        shown = sys.argv[0]
    return " ".join(["python", shown, *map(shlex.quote, sys.argv[1:])])


def _commit() -> dict:
    """BENCH_COMMIT when set (the tree was copied from that commit); else git's, when this tree is a
    checkout of its own (not a copy inside another checkout, whose commit it is not)."""
    if os.environ.get("BENCH_COMMIT"):
        return {"commit": os.environ["BENCH_COMMIT"], "uncommitted_changes": os.environ.get("BENCH_DIRTY") == "1"}

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel") or "/nonexistent").resolve() != REPO:
            return {"commit": "unknown", "uncommitted_changes": None}
        return {"commit": git("rev-parse", "HEAD"),
                # result files written by earlier runs are no change to what is measured
                "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no", "--", ".",
                                                ":!bench/results"))}
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": "unknown", "uncommitted_changes": None}


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            count = torch.cuda.device_count()
            return f"{count} x {props.name} ({props.total_memory / 2**30:.0f} GiB)" if count > 1 else (
                f"{props.name} ({props.total_memory / 2**30:.0f} GiB)")
    except ImportError:
        pass
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU: {cpu}, {os.cpu_count()} cores"


# Always recorded (None when missing) ...
PACKAGES = ("torch", "transformers", "peft")
# ... and, where installed, what changes a step's speed or what a peer's variant ran
OPTIONAL_PACKAGES = ("accelerate", "liger-kernel", "bitsandbytes", "deepspeed", "torchao", "flash-attn", "trl",
                     "onnxruntime", "scipy", "pycocotools")


def _versions() -> dict:
    versions = {"python": platform.python_version()}
    for package in PACKAGES + OPTIONAL_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            if package in PACKAGES:
                versions[package] = None
    try:
        import torch

        versions["cuda"] = torch.version.cuda  # None on a CPU build
    except ImportError:
        pass
    try:  # from the source it runs (PYTHONPATH on a machine where it is not installed)
        import groundtune

        versions["groundtune"] = groundtune.__version__
    except (ImportError, AttributeError):
        versions["groundtune"] = None
    return versions
