"""The in-process runner (tests/cli_in_process.py) reports what a real process reports.

Most command-line tests run `groundtune` through the CLI's `main()` inside the test process, which
saves an interpreter start (~3 s of importing torch) per case. That is only sound if nothing a
process would show is lost: the exit code, every line of stdout and stderr (argparse's refusals,
the `data check` table, warnings, --help at the terminal's width), and the environment and working
folder left as they were. Each case here runs both ways and the two must agree byte for byte.

This module starts real processes on purpose: they are the reference the runner is held to. They
start side by side (two cores) while the in-process runs go on in the main thread.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cli_in_process import groundtune, script

from groundtune.data.synth import make_synthetic_set

ENV = {"COLUMNS": "120"}
# case -> its command line, made from the corpus folder ``c``
CASES = {
    "check-missing": lambda c: ["data", "check", c / "missing.jsonl"],
    "check-errors-exit-1": lambda c: ["data", "check", c / "bad.jsonl"],
    "argparse-refusal": lambda c: ["data", "synth", "--out", c / "out", "--n", "-1"],
    "unknown-setting": lambda c: ["train", "quickstart", f"train_data={c / 'data' / 'train.jsonl'}", "learning_rate=1"],
    "help-at-a-width": lambda c: ["eval", "--help"],
    "refused-records-table": lambda c: ["train", "quickstart", f"train_data={c / 'bad.jsonl'}",
                                        f"out_dir={c / 'run'}", "eval_data="],
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    base = tmp_path_factory.mktemp("in_process")
    train = Path(make_synthetic_set(base / "data", n=4, seed=3, task="single", workers=1))
    lines = train.read_text().splitlines()
    lines[1] = json.dumps({**json.loads(lines[1]), "bbox": [30.0, 10.0, 20.0, 5.0]})  # x2 < x1
    (base / "bad.jsonl").write_text("\n".join(json.dumps({**json.loads(line), "image": f"data/{json.loads(line)['image']}"})
                                              for line in lines) + "\n")
    return base


@pytest.fixture(scope="module")
def both(corpus):
    """Each case as a real process (started side by side) and in this process."""
    def process(args):
        return subprocess.run([sys.executable, "-m", "groundtune", *map(str, args)], capture_output=True, text=True,
                              timeout=300, cwd=corpus, env={**os.environ, **ENV})

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        processes = {case: pool.submit(process, make(corpus)) for case, make in CASES.items()}
        here = {case: groundtune(*make(corpus), cwd=corpus, env=ENV) for case, make in CASES.items()}
        yield {case: (processes[case].result(), here[case]) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_a_case_reports_as_a_process_does(both, case):
    real, here = both[case]
    assert (here.returncode, here.stdout, here.stderr) == (real.returncode, real.stdout, real.stderr)
    assert real.stdout or real.stderr  # each case says something


def test_exit_codes_as_expected(both):
    codes = {case: here.returncode for case, (_, here) in both.items()}
    assert codes == {"check-missing": 2, "check-errors-exit-1": 1, "argparse-refusal": 2, "unknown-setting": 2,
                     "help-at-a-width": 0, "refused-records-table": 2}


def test_the_environment_and_working_folder_are_put_back(corpus, tmp_path):
    before_env, before_cwd = dict(os.environ), os.getcwd()
    done = groundtune("data", "check", corpus / "missing.jsonl", cwd=tmp_path, env={"GT_PROBE": "1", "COLUMNS": None})
    assert done.returncode == 2
    assert dict(os.environ) == before_env and os.getcwd() == before_cwd


def test_a_script_is_run_as_main_with_its_folder_on_the_path(tmp_path):
    helper = tmp_path / "helper_module_for_the_runner.py"
    helper.write_text("VALUE = 41\n")
    main = tmp_path / "main_script.py"
    main.write_text("import sys\nimport helper_module_for_the_runner as h\n"
                    "print(h.VALUE + 1, sys.argv[1:])\nsys.exit(3 if __name__ == '__main__' else 0)\n")
    path_before = list(sys.path)
    done = script(main, "a", "b")
    assert (done.returncode, done.stdout) == (3, "42 ['a', 'b']\n")
    assert sys.path == path_before


STARTS_PROCESSES = re.compile(r"subprocess\.(run|Popen)\(|(?<![\w.])launch\(|\bTORCHRUN\b")


def test_every_test_module_that_starts_processes_says_why():
    """A process costs seconds of imports on a 2-core machine: a test module that starts one says
    in its docstring what the process is for (the rule of docs/testing.md)."""
    import ast

    silent = []
    for module in sorted(Path(__file__).parent.glob("test_*.py")):
        source = module.read_text()
        if STARTS_PROCESSES.search(source):
            if "process" not in (ast.get_docstring(ast.parse(source)) or "").lower():
                silent.append(module.name)
    assert not silent, f"these test modules start processes and their docstrings do not say why: {silent}"
