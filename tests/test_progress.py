"""Progress where stderr is not a terminal (a log file, a pipe, CI): plain lines every
GROUNDTUNE_PROGRESS_EVERY seconds instead of a bar, with where the loop is, its bar's summary, the
time so far and left; nothing from a loop too short to need it. In this process, on pytest's
captured stderr, which is not a terminal."""

from __future__ import annotations

import pytest

from groundtune import progress
from groundtune.cli import main


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _bar(monkeypatch, every: str | None = None) -> tuple[progress.Progress, _Clock]:
    if every is not None:
        monkeypatch.setenv(progress.EVERY_ENV, every)
    bar, clock = progress.progress_bar(), _Clock()
    bar.clock = clock
    return bar, clock


def test_a_long_loop_prints_a_line_soon_then_every_interval_then_its_end(monkeypatch, capsys):
    bar, clock = _bar(monkeypatch, "30")
    with bar:
        task = bar.add_task("train", total=100, completed=20, info="")  # resumed at step 20
        for step in range(21, 101):
            clock.now += 1.0  # a step a second
            bar.update(task, completed=step, info=f"loss {1 / step:.4f} 8.0 samples/s")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "train 25/100 (25%)  loss 0.0400 8.0 samples/s  elapsed 5s, ETA 1m15s"  # at FIRST_S
    assert lines[1].startswith("train 55/100 (55%)  loss 0.0182") and lines[1].endswith("elapsed 35s, ETA 45s")
    assert lines[2].startswith("train 85/100 (85%)")
    assert lines[3] == "train 100/100 (100%)  loss 0.0100 8.0 samples/s  done after 1m20s"
    assert len(lines) == 4


def test_track_without_a_total_and_a_stopped_loop(monkeypatch, capsys):
    bar, clock = _bar(monkeypatch, "10")
    with bar:
        task = bar.add_task("checking records", total=None, info="")
        for _ in range(1920):
            clock.now += 1 / 64  # exact in binary: the lines come at exactly these records
            bar.advance(task)
    assert capsys.readouterr().err.splitlines() == [
        "checking records 320  elapsed 5s", "checking records 960  elapsed 15s",
        "checking records 1,600  elapsed 25s", "checking records 1,920  stopped after 30s"]


def test_a_short_loop_and_a_terminal_print_nothing_of_it(monkeypatch, capsys):
    list(progress.track(range(1000), "quick"))  # well under the first line's 5 s
    bar, clock = _bar(monkeypatch, "0")  # 0: no lines
    with bar:
        task = bar.add_task("train", total=10, info="")
        clock.now += 100
        bar.update(task, completed=10)
    monkeypatch.setenv("RANK", "1")  # under torchrun rank 0 speaks for the run
    bar, clock = _bar(monkeypatch, "1")
    with bar:
        task = bar.add_task("train", total=10, info="")
        clock.now += 100
        bar.update(task, completed=10)
    assert capsys.readouterr().err == ""


def test_eval_loops_print_lines_too(monkeypatch, capsys):
    """predict_records' loop (eval, predict, refgen's filter) is a `track`: the same lines."""
    monkeypatch.setenv(progress.EVERY_ENV, "1e-9")
    assert list(progress.track(iter(range(4)), "eval (2/batch)", total=4)) == [0, 1, 2, 3]
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("eval (2/batch) 1/4 (25%)  elapsed 0s, ETA") and err[-1].startswith("eval (2/batch) 4/4")


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_wrong_interval_is_one_line_and_exit_2(value, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv(progress.EVERY_ENV, value)
    assert main(["data", "synth", "--out", str(tmp_path / "set"), "--n", "1"]) == 2
    assert not (tmp_path / "set").exists()  # said when the command starts, before it writes anything
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {progress.EVERY_ENV}={value}: expected seconds between progress lines, a number >= 0 "
                   "(0: none)"]


def test_library_bars_are_off_even_when_the_library_was_imported_first():
    """transformers and huggingface_hub read HF_HUB_DISABLE_PROGRESS_BARS once, on import: in a
    process that imported them before the command line set it (a program, a test worker), a model
    load drew "Loading weights" above a one-line error (it failed CI once)."""
    import huggingface_hub.utils as hub
    from transformers.utils import logging as hf_logging

    from groundtune.progress import quiet_libraries

    were = hub.are_progress_bars_disabled(), hf_logging.is_progress_bar_enabled()
    hub.enable_progress_bars()
    hf_logging.enable_progress_bar()
    try:
        quiet_libraries()
        assert hub.are_progress_bars_disabled() and not hf_logging.is_progress_bar_enabled()
    finally:  # as they were, for the tests after this one
        (hub.disable_progress_bars if were[0] else hub.enable_progress_bars)()
        (hf_logging.enable_progress_bar if were[1] else hf_logging.disable_progress_bar)()
