"""scripts/test_profile.py, which turns a run of the suite into docs/test-profile.json: seconds per
module, outcome counts and the slowest tests, from pytest's own JUnit file (made here by hand)."""

from __future__ import annotations

import json
from pathlib import Path

from cli_in_process import script

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "test_profile.py"
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="1" tests="4" time="12.5">
<testcase classname="tests.test_a" name="test_one" time="3.25"/>
<testcase classname="tests.test_a" name="test_two[x]" time="1.5"><skipped message="no GPU"/></testcase>
<testcase classname="tests.test_b" name="test_three" time="6.0"><failure message="assert 1 == 2"/></testcase>
<testcase classname="tests.test_b.TestGroup" name="test_four" time="0.75"/>
</testsuite></testsuites>
"""


def test_a_junit_file_is_summed_per_module_under_its_label(tmp_path):
    (tmp_path / "suite.xml").write_text(JUNIT)
    out = tmp_path / "profile.json"
    out.write_text(json.dumps({"before": {"wall_s": 99.0}}))
    done = script(SCRIPT, tmp_path / "suite.xml", "--label", "after", "--commit", "abc1234", "--out", out)
    assert done.returncode == 0, done.stderr
    profiles = json.loads(out.read_text())
    assert profiles["before"] == {"wall_s": 99.0}  # other labels are kept
    after = profiles["after"]
    assert after["commit"] == "abc1234" and after["command"] == "python -m pytest" and "cores" in after["machine"]
    assert (after["wall_s"], after["passed"], after["skipped"], after["failed"]) == (12.5, 2, 1, 1)
    assert after["per_module_s"] == {"test_b": {"seconds": 6.8, "tests": 2}, "test_a": {"seconds": 4.8, "tests": 2}}
    assert [row["test"] for row in after["slowest"]] == ["tests.test_b::test_three", "tests.test_a::test_one",
                                                         "tests.test_a::test_two[x]", "tests.test_b.TestGroup::test_four"]


def test_a_missing_or_broken_file_is_one_line_and_exit_2(tmp_path):
    done = script(SCRIPT, tmp_path / "nothing.xml", "--label", "after", "--out", tmp_path / "p.json")
    assert (done.returncode, done.stderr) == (2, f"error: {tmp_path / 'nothing.xml'}: no such file\n")
    (tmp_path / "cut.xml").write_text(JUNIT[:200])
    done = script(SCRIPT, tmp_path / "cut.xml", "--label", "after", "--out", tmp_path / "p.json")
    assert done.returncode == 2 and done.stderr.startswith(f"error: {tmp_path / 'cut.xml'}: not a JUnit XML file (")
    assert len(done.stderr.splitlines()) == 1 and not (tmp_path / "p.json").exists()
