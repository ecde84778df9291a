"""Where the test suite's time goes: a pytest JUnit XML file summed per test module, with the slowest
tests, stamped with the machine, commit and date, written under one label of a JSON file.

    python -m pytest --junitxml=/tmp/suite.xml            # the README's test command, plus the XML
    python scripts/test_profile.py /tmp/suite.xml --label after --out docs/test-profile.json

docs/testing.md shows the file's "before" and "after" (the suite before and after it was made to fit
in minutes). A test's seconds are its setup, call and teardown together; with several workers their
sum exceeds the wall time, which is the suite's own ("wall_s").
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile(junit: Path, slowest: int = 25) -> dict:
    """The suite's wall time, outcome counts, seconds per module and its ``slowest`` tests."""
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    per_module, tests_per_module, rows = collections.Counter(), collections.Counter(), []
    outcomes = collections.Counter()
    for case in suite.iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.test_x (or tests.test_x.TestClass)
        module = next((part for part in parts if part.startswith("test_")), parts[-1])
        seconds = float(case.get("time", 0))
        per_module[module] += seconds
        tests_per_module[module] += 1
        rows.append((seconds, f"{case.get('classname')}::{case.get('name')}"))
        kind = next((child.tag for child in case if child.tag in ("skipped", "failure", "error")), "passed")
        outcomes[kind] += 1
    return {
        "wall_s": round(float(suite.get("time", 0)), 1),
        "passed": outcomes["passed"], "skipped": outcomes["skipped"],
        "failed": outcomes["failure"] + outcomes["error"],
        "per_module_s": {m: {"seconds": round(s, 1), "tests": tests_per_module[m]}
                         for m, s in per_module.most_common()},
        "slowest": [{"test": name, "seconds": round(s, 2)} for s, name in sorted(rows, reverse=True)[:slowest]],
    }


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, as every groundtune command says a mistake
        self.exit(2, f"error: {message}\n")


def main() -> None:
    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit", type=Path, help="pytest's --junitxml file")
    parser.add_argument("--label", required=True, help="the key the profile is written under (before, after, ...)")
    parser.add_argument("--command", default="python -m pytest", help="the command that ran the suite")
    parser.add_argument("--commit", help="the commit measured (default: this checkout's HEAD)")
    parser.add_argument("--out", type=Path, default=Path("docs/test-profile.json"))
    args = parser.parse_args()
    if not args.junit.is_file():
        parser.error(f"{args.junit}: no such file")
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    stamp = {"command": args.command, "commit": commit, "date": datetime.date.today().isoformat(),
             "machine": f"{os.cpu_count()} cores, {_cpu()}"}
    try:
        measured = profile(args.junit)
    except ET.ParseError as e:
        parser.error(f"{args.junit}: not a JUnit XML file ({e})")
    profiles = json.loads(args.out.read_text()) if args.out.is_file() else {}
    profiles[args.label] = {**stamp, **measured}
    args.out.write_text(json.dumps(profiles, indent=1) + "\n")
    print(f"{args.label}: {profiles[args.label]['wall_s']} s wall, {profiles[args.label]['passed']} passed -> {args.out}")


if __name__ == "__main__":
    main()
