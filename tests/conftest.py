"""Shared fixtures: small synthetic data sets made once per test session; the threads of a worker."""

import json
import os
import sys
from pathlib import Path

# bench/serving.py (``launch``: a real server in a process of its own) is the serve benches' and
# the tests'; appended, so that nothing of bench/ can shadow a module of the tests or the package
sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))

# Under pytest-xdist (the README's test command runs one worker per core) each worker, and every
# process a test starts, gets its share of the cores as torch's thread count: with each worker's
# OpenMP pool spinning on both cores of a 2-core machine, a box-head training test took 59 s, with
# one thread each 8 s. Set before torch is imported; a thread count the caller chose is kept.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest  # noqa: E402
from family_models import FAMILIES, build_family_folder, build_loud_model, build_small_model  # noqa: E402

from groundtune.data import synth  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _own_cache(tmp_path_factory):
    """What `data check` and training cache about images goes to a folder of the test session's,
    not the user's ~/.cache (subprocesses inherit it)."""
    import os

    os.environ["GROUNDTUNE_CACHE"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def synth_single(tmp_path_factory):
    """64 training + 16 validation samples of the one-shape task."""
    out = tmp_path_factory.mktemp("synth_single")
    synth.make_synthetic_set(out, n=64, seed=1, task="single", workers=1)
    synth.make_synthetic_set(out, n=16, seed=2, task="single", split="val", workers=1)
    return out


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> str:
    """The folder of a small random Qwen2.5-VL that speaks and sees as the built-in tiny model does:
    for every test whose assertions hold whatever the weights (plumbing, refusals, files, equal
    answers of two code paths). Tests of what a trained model answers load ``tiny``."""
    return str(build_small_model(tmp_path_factory.mktemp("small_model")))


@pytest.fixture(scope="session")
def loud_model(small_model, tmp_path_factory) -> str:
    """The small model with large random weights (family_models.build_loud_model): its answers differ
    from one input to the next, for tests that compare two code paths' answers or a batch's rows."""
    return str(build_loud_model(Path(small_model), tmp_path_factory.mktemp("loud_model")))


@pytest.fixture(scope="session", params=FAMILIES)
def family_folder(request, tmp_path_factory):
    """(family, folder) of a tiny random Qwen2-VL / Qwen3-VL model."""
    family = request.param
    return family, build_family_folder(family, tmp_path_factory.mktemp(family))


@pytest.fixture(scope="session", params=("qwen2.5-vl",) + FAMILIES)
def any_family_model(request, small_model, tmp_path_factory):
    """A model folder for each family: small random Qwen2.5-VL, Qwen2-VL and Qwen3-VL models."""
    if request.param == "qwen2.5-vl":
        return small_model
    return str(build_family_folder(request.param, tmp_path_factory.mktemp(request.param)))


def pytest_unconfigure(config):
    """A test run that has printed its summary must also end: something still holding the process
    (a worker deaf to its parent, a thread that never returns) once kept CI waiting until its time
    ran out, with nothing to say why. Five minutes after the session, every thread's stack is
    printed and the process exits 1."""
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(300, exit=True, file=sys.__stderr__)


def pytest_collection_modifyitems(config, items):
    """The slowest test modules first, by their seconds in docs/test-profile.json (a module not
    there, whose time is unknown, before them all). Each module runs whole on one worker: a long one
    started near the end would keep its worker busy while the others, done, wait."""
    try:
        seconds = json.loads((Path(__file__).parent.parent / "docs" / "test-profile.json").read_text())
        seconds = {module: row["seconds"] for module, row in seconds["after"]["per_module_s"].items()}
    except (OSError, KeyError, ValueError):
        return
    items.sort(key=lambda item: -seconds.get(Path(str(item.fspath)).stem, float("inf")))  # stable: a module's order kept
