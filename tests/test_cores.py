"""torch's threads set to the cores this process may use: its affinity, a container's CPU quota,
OMP_NUM_THREADS where the user set it; OpenMP's waiting threads asleep; set by the command line
before a command that runs a model, never for one that does not (plan, --help), in this process."""

from __future__ import annotations

import os

import pytest

from groundtune import cli, cores


@pytest.fixture
def four_cores(monkeypatch, tmp_path):
    """A process allowed 4 cores, with no CPU quota unless a test writes one."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(cores, "CPU_MAX", tmp_path / "cpu.max")
    monkeypatch.setattr(cores, "CFS_QUOTA", tmp_path / "cpu.cfs_quota_us")
    monkeypatch.setattr(cores, "CFS_PERIOD", tmp_path / "cpu.cfs_period_us")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return tmp_path


@pytest.mark.parametrize("files, expected", [
    ({}, 4),  # no quota: the affinity
    ({"cpu.max": "max 100000\n"}, 4),
    ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 cores' worth of time: 2 threads, rounded up
    ({"cpu.max": "800000 100000\n"}, 4),  # more time than cores to spend it on
    ({"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"}, 4),  # cgroup v1, no quota
    ({"cpu.cfs_quota_us": "100000\n", "cpu.cfs_period_us": "100000\n"}, 1),
    ({"cpu.max": "garbled"}, 4),
])
def test_cores_are_the_affinity_within_the_cpu_quota(four_cores, files, expected):
    for name, text in files.items():
        (four_cores / name).write_text(text)
    assert cores.cores() == expected
    assert cores.threads() == expected


@pytest.mark.parametrize("value, expected", [("3", 3), ("1", 1), ("0", 4), ("many", 4), ("", 4)])
def test_omp_num_threads_is_the_users_word(four_cores, monkeypatch, value, expected):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert cores.threads() == expected


@pytest.mark.parametrize("load, sleeping", [(1.5, True), (0.2, False)])
def test_waiting_threads_sleep_on_a_busy_machine_unless_the_user_chose(monkeypatch, load, sleeping):
    monkeypatch.setattr(cores, "cores", lambda: 2)  # two cores: busy above a load of 1
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    cores.before_torch()
    assert os.environ.get("OMP_WAIT_POLICY") == ("PASSIVE" if sleeping else None)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cores.before_torch()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")  # GNU OpenMP's own default spin: the user's choice too
    cores.before_torch()
    assert "OMP_WAIT_POLICY" not in os.environ


def test_use_cores_sets_torchs_threads(monkeypatch):
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the test process's own share: nothing changes for the rest
    before = torch.get_num_threads()
    try:
        assert cores.use_cores() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_command_line_sets_threads_for_model_commands_only(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cores, "use_cores", lambda: calls.append(1) or 1)
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))  # a busy machine
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert cli.main(["plan", "qwen2.5-vl-7b-qlora", "--json"]) == 0  # no model: no torch
    assert calls == [] and os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    assert calls == []
    # a model command: set before it starts (this one then stops at its mistake, before any model)
    assert cli.main(["train", "quickstart", "train_data=synth:full", "kernels=fast"]) == 2
    assert calls == [1]
    capsys.readouterr()
