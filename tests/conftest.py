"""Shared fixtures: small synthetic data sets made once per test session."""

import pytest

from groundtune.data import synth


@pytest.fixture(scope="session")
def synth_single(tmp_path_factory):
    """64 training + 16 validation samples of the one-shape task."""
    out = tmp_path_factory.mktemp("synth_single")
    synth.make_synthetic_set(out, n=64, seed=1, task="single", workers=1)
    synth.make_synthetic_set(out, n=16, seed=2, task="single", split="val", workers=1)
    return out
