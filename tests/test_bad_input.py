"""A corpus of bad input, each case a `groundtune` command line on real files.

Every case asserts three things:

* the exit code: 2 for a user's mistake, 1 only for `data check` finding errors (its documented
  code), 0 where the input must be taken (bad_records=skip, resuming a finished run);
* the message: it names the file and line, the setting or the model, and says what is wrong; no
  traceback; short (one ``error: ...`` line, or for a refused data file the `data check` table
  and the way out);
* nothing was damaged: a finished run made once for the module is byte-for-byte the same after
  every case, and a case with an out_dir of its own leaves nothing half-made there (no model/,
  no checkpoints/, no .lock).

Each case's command line is in CASES; the module's fixture runs them all once the finished run
is made, and each test asserts on its case's result. Most cases run the CLI's `main()` in this
process (tests/cli_in_process.py): a refusal takes milliseconds, a new interpreter ~3 s of
importing torch. The cases in AS_PROCESSES are real `python -m groundtune` processes, started
side by side while the others run: the console entry point itself, FIFOs and 10 GB sparse image
files (a regression would wait forever, or ten minutes, which only a process's timeout can end), a
hub lookup (huggingface_hub reads HF_HUB_OFFLINE and HF_ENDPOINT once, at import) and a file-size
limit (`ulimit -f`, a limit of the process, makes a checkpoint's write fail). The refusals happen
before any model loads (eval's of an image: once it loads), so only the bad_records=skip case and
the checkpoint case train.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import groundtune as groundtune_package
from cli_in_process import groundtune
from groundtune.data.synth import make_synthetic_set

REFGEN_INSTANCES = Path(__file__).parent / "fixtures" / "refgen" / "instances_val.json"

TIMEOUT = 300
# a training case: two short steps, and no eval (the preset names quickstart's own eval file); its model, and the
# model of every other case, is the small random one (``corpus.model``): no assertion here depends on the weights
SHORT = ("eval_data=", "max_steps=2", "batch_size=2", "num_workers=0", "save_every=0")
SIZE = 112  # make_synthetic_set's canvas
CPU_ONLY = not torch.cuda.is_available()
on_cpu_only = pytest.mark.skipif(not CPU_ONLY, reason="this machine has a CUDA GPU: device=cuda is valid here")


def _run(args, cwd: Path, env: dict | None = None, file_size: int | None = None) -> subprocess.CompletedProcess:
    """`python -m groundtune ARGS` in ``cwd``, a real process; ``.seconds`` is how long it took. A
    wide terminal, so the refusal's table keeps each row on one line. ``file_size``: no file it
    writes may be larger (``ulimit -f``), set by the process itself before groundtune starts: a
    preexec_fn runs Python between fork and exec, which can deadlock in a process with threads
    (this one's pool)."""
    start = ["-m", "groundtune"] if file_size is None else [
        "-c", f"import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, ({file_size}, {file_size})); "
              "sys.argv[0] = 'groundtune'; runpy.run_module('groundtune', run_name='__main__')"]
    # the groundtune this test imported, whatever the process's folder (PYTHONPATH=src is relative)
    path = os.pathsep.join(filter(None, [str(Path(groundtune_package.__file__).parents[1]),
                                         os.environ.get("PYTHONPATH")]))
    started = time.monotonic()
    done = subprocess.run([sys.executable, *start, *map(str, args)], capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=cwd, env={**os.environ, "COLUMNS": "200", "PYTHONPATH": path, **(env or {})})
    done.seconds = time.monotonic() - started
    return done


def _run_here(args, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """The same command line through the CLI's `main()` in this process."""
    return groundtune(*args, cwd=cwd, env={"COLUMNS": "200", **(env or {})})


def _show(done: subprocess.CompletedProcess) -> str:
    return (f"{done.args[3:]}: exit {done.returncode} after {getattr(done, 'seconds', 0):.1f}s\n"
            f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")


def _refused(done: subprocess.CompletedProcess, *, table: bool = False) -> str:
    """The message of a user's mistake: exit 2, no traceback, short. One line ``error: ...`` (the
    last and only line of stderr), or with ``table`` a refusal starting with ``error: `` and
    listing records. Returns the message."""
    assert done.returncode == 2, _show(done)
    assert "Traceback" not in done.stderr, _show(done)
    lines = done.stderr.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert len(starts) == 1, _show(done)
    if table:
        assert starts == [0] and len(lines) <= 15, _show(done)
    else:
        assert len(lines) == 1 and lines[-1].startswith("error: "), _show(done)
    return "\n".join(lines[starts[0]:])


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every file's bytes (and every folder, as None), by path inside ``folder``."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def _untouched(corpus) -> None:
    now = _snapshot(corpus.finished)
    assert now.keys() == corpus.snapshot.keys(), sorted(set(now) ^ set(corpus.snapshot))
    changed = [name for name in now if now[name] != corpus.snapshot[name]]
    assert not changed, f"the finished run changed: {changed}"


def _nothing_half_made(out: Path) -> None:
    """A refused run's own out_dir: absent or empty (a run is refused before anything is written)."""
    if out.exists():
        left = {p.name for p in out.iterdir()}  # hidden files too (.lock)
        assert not left, f"{out} holds {sorted(left)}"


def _table_row(message: str, kind: str, line: int) -> re.Match | None:
    """The row of `data check`'s table for one bad record: kind | level | count | fixed | lines | what to do."""
    return re.search(rf"^\s*{kind}\s+error\s+1\s+-\s+{line}\s", message, re.M)


# --------------------------------------------------------------------------------------------
# the corpus: files, and the command line of every case


def _broken_images(images: Path) -> None:
    rng = np.random.default_rng(0)
    # a truncated JPEG: noise compresses badly, so half the file cuts well into the scan data
    Image.fromarray(rng.integers(0, 255, (SIZE, SIZE, 3), dtype=np.uint8)).save(images / "full.jpg", quality=95)
    data = (images / "full.jpg").read_bytes()
    (images / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (images / "not-an-image.png").write_text("this is a text file with a .png name\n")
    Image.new("RGB", (80, 60), "blue").save(images / "small.png")  # recorded as 112x112
    Image.new("RGB", (1, 300), "white").save(images / "thin.png")  # aspect ratio 300


def _without_bbox(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "bbox"}


# case -> (kind, line it is on, the line's text made from the good record there)
BAD_RECORDS = {
    "01-image_missing": ("image_missing", 3, lambda r: json.dumps({**r, "image": "images/no-such-image.png"})),
    "02-truncated_image": ("image_unreadable", 4, lambda r: json.dumps({**r, "image": "images/truncated.jpg"})),
    "03-not_an_image": ("image_unreadable", 5, lambda r: json.dumps({**r, "image": "images/not-an-image.png"})),
    "04-size_mismatch": ("size_mismatch", 6, lambda r: json.dumps({**r, "image": "images/small.png"})),
    "05-bbox_nan": ("bbox_nan", 7, lambda r: json.dumps({**r, "bbox": [float("nan"), 10.0, 40.0, 40.0]})),
    "06-bbox_outside": ("bbox_outside", 8, lambda r: json.dumps({**r, "bbox": [10.0, 10.0, SIZE + 8.0, 50.0]})),
    "07-bbox_looks_xywh": ("bbox_looks_xywh", 2, lambda r: json.dumps({**r, "bbox": [40.0, 10.0, 20.0, 30.0]})),
    "08-phrase_empty": ("phrase_empty", 3, lambda r: json.dumps({**r, "phrase": ""})),
    "09-invalid_json": ("invalid_json", 5, lambda r: '{"id": "broken", "image": '),
    "10-aspect_ratio": ("aspect_ratio", 6, lambda r: json.dumps({**r, "image": "images/thin.png", "width": 1,
                                                                 "height": 300, "bbox": [0.0, 10.0, 1.0, 100.0]})),
    # a set's boxes that are not boxes: train refuses them as data check does; eval too (52-53 below)
    "52-bboxes_not_a_list": ("bbox_nan", 4, lambda r: json.dumps({**_without_bbox(r), "bboxes": "x"})),
    "53-bboxes_short_box": ("bbox_nan", 7, lambda r: json.dumps({**_without_bbox(r), "bboxes": [[1, 2, 3]]})),
}
# eval case -> (the file of BAD_RECORDS it reads, its one line)
EVAL_BAD_BOXES = {
    "52-eval-bboxes_not_a_list": ("52-bboxes_not_a_list", 'bboxes is "x", not a list of boxes [[x1, y1, x2, y2], ...]'),
    "53-eval-bboxes_short_box": ("53-bboxes_short_box", "bboxes[0] is [1, 2, 3], not a box: four finite numbers "
                                                        "[x1, y1, x2, y2]"),
}
OUT_OF_RANGE = {  # case -> (setting, what is wrong)
    "17-save_every=-1": ("save_every=-1", "must be 0 or more"),
    "17-eval_every=-1": ("eval_every=-1", "must be 0 or more"),
    "17-log_every=0": ("log_every=0", "must be positive"),
    "17-warmup_steps=-1": ("warmup_steps=-1", "must be 0 or more"),
}
NOT_A_NUMBER = {  # case -> (setting, what is said): refused before a run folder is made
    "50-lr=nan": ("lr=nan", "error: lr=nan: expected a finite number"),
    "50-lr=.inf": ("lr=.inf", "error: lr=inf: expected a finite number"),
    "50-lr=1e400": ("lr=1e400", "error: lr=1e400: expected a finite number"),
    "50-max_steps=10**23": (f"max_steps={10**23}", f"error: max_steps={10**23}: out of range (at most 2,147,483,647)"),
}
CANNOT_RUN = {  # case -> (a setting refused once the run is claimed, what is said)
    "31-device=cuda": ("device=cuda", r"device=cuda: this machine has no CUDA GPU"),
    "31-model=missing": ("model=./no/such/model", r"\./no/such/model: no such model folder"),
}
HUB_OFF = {"HF_HUB_OFFLINE": "1"}
# real processes (the module's docstring says why): the entry point with a refused record, FIFOs, hub lookups,
# 10 GB sparse images, a file-size limit
AS_PROCESSES = {"01-image_missing", "22-eval-no-folder", "24-eval-hub-offline", "42-check-fifo", "43-train-fifo",
                "44-train-image-fifo", "56-check-sparse-jpg", "56-predict-sparse-jpg", "56-eval-jpeg-then-zeros",
                "61-checkpoint-write-fails"}
FILE_SIZE = {"61-checkpoint-write-fails": 200_000}  # case -> its file-size limit: the optimizer's 0.29 MB fails
# a YAML alias bomb of 9**4 values (under the limit of 10,000: taken by YAML, refused as a setting) and of
# 9**9 (refused before it is expanded)
SMALL_BOMB = "[&a [x,x,x,x,x,x,x,x,x], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b], " \
             "[*c,*c,*c,*c,*c,*c,*c,*c,*c]]"


def _train(c, out, *settings, data=None):
    return ["train", "quickstart", f"model={c.model}", f"train_data={data or c.train}", f"out_dir={out}", *SHORT,
            *settings]


# case -> (its command line from the corpus ``c`` and the case's own out_dir, extra environment)
CASES = {
    **{case: (lambda c, out, case=case: _train(c, out, data=c.bad[case]), {}) for case in BAD_RECORDS},
    "11-skip": (lambda c, out: _train(c, out, "bad_records=skip", data=c.bad["01-image_missing"]), {}),
    "12-yaml": (lambda c, out: ["train", c.broken_yaml], {}),
    "13-unclosed-list": (lambda c, out: _train(c, out, "lora_targets=[llm_attn"), {}),
    "14-unknown-setting": (lambda c, out: _train(c, out, "learning_rate=1e-3"), {}),
    **({"15-device=cuda": (lambda c, out: _train(c, out, "device=cuda"), {})} if CPU_ONLY else {}),
    "16-folder": (lambda c, out: _train(c, out, data=c.data), {}),
    **{case: (lambda c, out, s=setting: _train(c, out, s), {}) for case, (setting, _) in OUT_OF_RANGE.items()},
    "18-into-finished": (lambda c, out: _train(c, c.finished), {}),
    "19-resume-finished": (lambda c, out: ["train", "--resume", c.finished], {}),
    "20-rl-packing": (lambda c, out: ["rl", "quickstart-rl", f"model={c.model}", f"train_data={c.train}",
                                      f"out_dir={out}", "packing=true"], {}),
    "21-rl-image_missing": (lambda c, out: ["rl", "quickstart-rl", f"model={c.model}",
                                            f"train_data={c.bad['01-image_missing']}", "eval_data=",
                                            f"out_dir={out}"], {}),
    # a hub lookup would go to HF_ENDPOINT and say so: there is nothing there
    "22-eval-no-folder": (lambda c, out: ["eval", "--model", "./no/such/folder", "--data", c.train],
                          {"HF_ENDPOINT": "http://127.0.0.1:9"}),
    "23-eval-compare-missing": (lambda c, out: ["eval", "--model", c.finished, "--compare", "./missing/model",
                                                "--data", c.train], {}),
    "24-eval-hub-offline": (lambda c, out: ["eval", "--model", "Qwen/Not-A-Real-Model", "--data", c.train],
                            {**HUB_OFF, "HF_HUB_CACHE": "hf-cache"}),
    "25-predict-missing-image": (lambda c, out: ["predict", "--image", c.base / "missing.png", "--phrase", "x",
                                                 "--model", c.model], {}),
    "26-predict-corrupt-image": (lambda c, out: ["predict", "--image", c.data / "images" / "truncated.jpg",
                                                 "--phrase", "x", "--model", c.model], {}),
    "27-predict-jsonl-no-phrase": (lambda c, out: ["predict", "--jsonl", c.queries, "--out", out / "predictions.jsonl",
                                                   "--model", c.model], {}),
    "28-check-folder": (lambda c, out: ["data", "check", c.data], {}),
    "29-check-missing": (lambda c, out: ["data", "check", c.base / "missing.jsonl"], {}),
    "30-resume-lr": (lambda c, out: ["train", "--resume", c.finished, "lr=1"], {}),
    **({case: (lambda c, out, s=setting: _train(c, out, "overwrite=true", s), {}) for case, (setting, _)
        in CANNOT_RUN.items()} if CPU_ONLY else {}),
    "32-check-errors": (lambda c, out: ["data", "check", c.bad["10-aspect_ratio"]], {}),
    # 33-41: what a command writes never lands on what it reads (each in a folder of its own: ``c.own``)
    "33-fix-out-is-the-input": (lambda c, out: ["data", "check", c.own["33"] / "train.jsonl", "--fix-out",
                                                c.own["33"] / ".." / "33" / "train.jsonl"], {}),
    "34-refgen-out-is-instances": (lambda c, out: ["data", "refgen", "--from", "coco", "--instances",
                                                   c.own["34"] / "instances.json", "--images", c.data / "images",
                                                   "--out", c.own["34"] / "instances.json"], {}),
    "35-export-out-holds-the-run": (lambda c, out: ["export", c.own["35"] / "run", "--out", c.own["35"],
                                                    "--overwrite"], {}),
    "36-export-out-is-the-run": (lambda c, out: ["export", c.own["36"] / "run", "--out", c.own["36"] / "run",
                                                 "--overwrite"], {}),
    "37-export-overwrite-foreign": (lambda c, out: ["export", c.finished, "--out", c.own["37"], "--overwrite"], {}),
    "38-predict-out-is-jsonl": (lambda c, out: ["predict", "--model", c.model, "--jsonl", c.own["38"] / "q.jsonl",
                                                "--out", c.own["38"] / "q.jsonl"], {}),
    "39-eval-out-is-data": (lambda c, out: ["eval", "--model", c.model, "--data", c.own["39"] / "val.jsonl",
                                            "--out", c.own["39"] / "val.jsonl"], {}),
    "40-synth-over-users-file": (lambda c, out: ["data", "synth", "--out", c.own["40"], "--n", "2"], {}),
    "41-out_dir-holds-train_data": (lambda c, out: _train(c, c.own["41"], data=c.own["41"] / "train.jsonl"), {}),
    # 42-47: files that are not what they seem
    "42-check-fifo": (lambda c, out: ["data", "check", c.fifo], {}),
    "43-train-fifo": (lambda c, out: _train(c, out, data=c.fifo), {}),
    "44-train-image-fifo": (lambda c, out: _train(c, out, data=c.fifo_image_data), {}),
    "45-out_dir-is-a-file": (lambda c, out: _train(c, c.train), {}),
    "46-check-bom": (lambda c, out: ["data", "check", c.bom, "--fix-out", out / "bom-clean.jsonl"], {}),
    "47-check-empty": (lambda c, out: ["data", "check", c.empty], {}),
    "48-train-empty": (lambda c, out: _train(c, out, data=c.empty), {}),
    # 49-: settings
    "49-duplicate-yaml-key": (lambda c, out: ["train", c.duplicate_yaml], {}),
    **{case: (lambda c, out, s=setting: _train(c, out, s), {}) for case, (setting, _) in NOT_A_NUMBER.items()},
    "51-synth-negative-count": (lambda c, out: ["data", "synth", "--out", out, "--n", "-1"], {}),
    "51-serve-port-99999": (lambda c, out: ["serve", "--model", c.model, "--port", "99999"], {}),
    **{case: (lambda c, out, bad=bad: ["eval", "--model", c.model, "--data", c.bad[bad]], {})
       for case, (bad, _) in EVAL_BAD_BOXES.items()},
    # 54-61: issue 48's corpus (each case's test says what it was)
    "54-yaml-alias-bomb": (lambda c, out: ["train", c.bomb_yaml, f"out_dir={out}"], {}),
    **{f"54-bomb-{key}": (lambda c, out, key=key: _train(c, out, f"{key}={SMALL_BOMB}"), {})
       for key in ("model", "max_steps", "report_to", "lora_targets")},
    # 50,000 deep: 100 KB, what one argument of a command line may hold (Linux: 128 KB)
    "54-deep-yaml": (lambda c, out: _train(c, out, "lr=" + "[" * 50_000 + "]" * 50_000), {}),
    **{f"55-{name}-nul": (lambda c, out, args=args: args(c, out), {}) for name, args in {
        "check": lambda c, out: ["data", "check", c.nul],
        "train": lambda c, out: _train(c, out, data=c.nul),
        "eval": lambda c, out: ["eval", "--model", c.model, "--data", c.nul],
        "predict": lambda c, out: ["predict", "--model", c.model, "--jsonl", c.nul, "--out", out / "p.jsonl"],
        "convert": lambda c, out: ["data", "convert", "--from", "jsonl", "--path", c.nul, "--out", out / "c.jsonl"],
        "refgen": lambda c, out: ["data", "refgen", "--from", "jsonl", "--path", c.nul_detections, "--out",
                                  out / "r.jsonl"]}.items()},
    "56-check-sparse-jpg": (lambda c, out: ["data", "check", c.sparse_data], {}),
    "56-predict-sparse-jpg": (lambda c, out: ["predict", "--model", c.model, "--image", c.sparse_jpg, "--phrase", "x"],
                              {}),
    "56-eval-jpeg-then-zeros": (lambda c, out: ["eval", "--model", c.model, "--data", c.zeros_data], {}),
    "57-check-deep-json": (lambda c, out: ["data", "check", c.deep_json], {}),
    "57-eval-deep-json": (lambda c, out: ["eval", "--model", c.model, "--data", c.deep_json], {}),
    "58-predict-long-phrase": (lambda c, out: ["predict", "--model", c.model, "--jsonl", c.long_phrase, "--out",
                                               out / "p.jsonl"], {}),
    "58-check-long-phrase": (lambda c, out: ["data", "check", c.long_phrase], {}),
    "58-train-long-phrase": (lambda c, out: _train(c, out, data=c.long_phrase), {}),
    "58-predict-long-phrase-flag": (lambda c, out: ["predict", "--model", c.model, "--image", c.image, "--phrase",
                                                    "x" * 600], {}),
    # 59: an --out that would destroy what the command reads (each in a folder of its own: ``c.own``)
    "59-eval-out-is-an-image": (lambda c, out: ["eval", "--model", c.model, "--data", c.own["59"] / "val.jsonl",
                                                "--out", c.own["59"] / "images" / "train-0000001.png"], {}),
    "59-predict-out-is-an-image": (lambda c, out: ["predict", "--model", c.model, "--jsonl", c.own["59"] / "val.jsonl",
                                                   "--out", c.own["59"] / "images" / "train-0000002.png",
                                                   "--overwrite"], {}),
    "59-eval-out-someone-elses": (lambda c, out: ["eval", "--model", c.model, "--data", c.own["59"] / "val.jsonl",
                                                  "--out", c.own["59"] / "notes.json"], {}),
    "59-eval-out-a-model-file": (lambda c, out: ["eval", "--model", c.finished, "--data", c.own["59"] / "val.jsonl",
                                                 "--out", c.finished / "model" / "groundtune.json", "--overwrite"], {}),
    "59-synth-over-a-synth-set": (lambda c, out: ["data", "synth", "--out", c.own["59"] / "synth", "--n", "2",
                                                  "--workers", "1"], {}),
    **{f"60-{name}-latin1": (lambda c, out, args=args: args(c, out), {}) for name, args in {
        "yaml": lambda c, out: ["train", c.latin1_yaml, f"out_dir={out}"],
        "eval": lambda c, out: ["eval", "--model", c.model, "--data", c.latin1],
        "predict": lambda c, out: ["predict", "--model", c.model, "--jsonl", c.latin1, "--out", out / "p.jsonl"],
        "convert": lambda c, out: ["data", "convert", "--from", "jsonl", "--path", c.latin1, "--out",
                                   out / "c.jsonl"]}.items()},
    "61-checkpoint-write-fails": (lambda c, out: _train(c, out, "max_steps=1", "save_every=1"), {}),
    # 62: the other outputs, as 59's --out (each over a file of ``c.own["62"]``; --overwrite where it is no excuse)
    **{f"62-{name}": (lambda c, out, args=args: args(c.own["62"], c), {}) for name, args in {
        "convert-out-is-an-image": lambda o, c: ["data", "convert", "--from", "jsonl", "--path", o / "val.jsonl",
                                                 "--out", o / "images" / "train-0000001.png", "--overwrite"],
        "convert-out-is-a-coco-image": lambda o, c: ["data", "convert", "--from", "coco", "--instances",
                                                     o / "instances.json", "--images", o / "images", "--out",
                                                     o / "images" / "train-0000002.png", "--overwrite"],
        "convert-out-someone-elses": lambda o, c: ["data", "convert", "--from", "jsonl", "--path", o / "val.jsonl",
                                                   "--out", o / "notes.json"],
        "refgen-out-is-an-image": lambda o, c: ["data", "refgen", "--from", "coco", "--instances", o / "instances.json",
                                                "--images", o / "images", "--out", o / "images" / "train-0000002.png",
                                                "--overwrite"],
        "refgen-out-a-model-file": lambda o, c: ["data", "refgen", "--from", "coco", "--instances",
                                                 o / "instances.json", "--images", o / "images", "--filter-model",
                                                 c.finished, "--out", c.finished / "model" / "groundtune.json",
                                                 "--overwrite"],
        "refgen-out-someone-elses": lambda o, c: ["data", "refgen", "--from", "coco", "--instances",
                                                  o / "instances.json", "--images", o / "images", "--out",
                                                  o / "notes.json"],
        "fix-out-is-an-image": lambda o, c: ["data", "check", o / "val.jsonl", "--fix-out",
                                             o / "images" / "train-0000003.png", "--overwrite"],
        "fix-out-someone-elses": lambda o, c: ["data", "check", o / "val.jsonl", "--fix-out", o / "notes.json"],
        "gallery-is-data": lambda o, c: ["eval", "--model", c.model, "--data", o / "val.jsonl", "--gallery",
                                         o / "val.jsonl", "--overwrite"],
        "gallery-is-an-image": lambda o, c: ["eval", "--model", c.model, "--data", o / "val.jsonl", "--gallery",
                                             o / "images" / "train-0000001.png", "--overwrite"],
        "gallery-is-a-model-file": lambda o, c: ["eval", "--model", c.finished, "--data", o / "val.jsonl",
                                                 "--gallery", c.finished / "model" / "groundtune.json"],
        # the images' folder as the gallery: its worst_000.png, an image of --data, is what it would draw first
        "gallery-file-is-an-image": lambda o, c: ["eval", "--model", c.model, "--data", o / "worst.jsonl", "--gallery",
                                                  o / "images", "--overwrite"],
        "gallery-someone-elses": lambda o, c: ["eval", "--model", c.model, "--data", o / "val.jsonl", "--gallery",
                                               o / "gallery"]}.items()},
    # 63: a JPEG whose header promises a frame its few bytes cannot hold
    "63-predict-short-jpeg": (lambda c, out: ["predict", "--model", c.model, "--image", c.short_jpg, "--phrase", "x"],
                              {}),
    "63-check-short-jpeg": (lambda c, out: ["data", "check", c.short_data], {}),
    "63-eval-short-jpeg": (lambda c, out: ["eval", "--model", c.model, "--data", c.short_data], {}),
    # 64: model folders transformers cannot read
    "64-predict-corrupt-config": (lambda c, out: ["predict", "--model", c.corrupt_config, "--image",
                                                  c.data / "images" / "train-0000000.png", "--phrase", "x"], {}),
    "64-eval-truncated-weights": (lambda c, out: ["eval", "--model", c.truncated_weights, "--data", c.train], {}),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, small_model):
    """A synthetic set of 8 records, broken images beside its own, a copy of train.jsonl with one
    bad record for each of BAD_RECORDS, the other files the cases read, and a finished run (2 steps)
    with a snapshot of its bytes; then every case of CASES started (``corpus.result(case)``)."""
    base = tmp_path_factory.mktemp("bad_input")
    data = base / "data"
    train = Path(make_synthetic_set(data, n=8, seed=1, task="single", workers=1))
    _broken_images(data / "images")
    good_lines = train.read_text().splitlines()
    assert len(good_lines) == 8
    bad = {}
    for case, (_, line, make) in BAD_RECORDS.items():
        lines = list(good_lines)
        lines[line - 1] = make(json.loads(good_lines[line - 1]))
        bad[case] = data / f"bad-{case}.jsonl"
        bad[case].write_text("\n".join(lines) + "\n")
    assert "NaN" in bad["05-bbox_nan"].read_text()  # the JSON token, as a careless writer leaves it
    c = SimpleNamespace(base=base, data=data, train=train, bad=bad, finished=base / "finished",
                        broken_yaml=base / "broken.yaml", queries=base / "queries.jsonl", model=small_model)
    # line 3, column 9: the second ": " of "lr: 1e-3: 2"
    c.broken_yaml.write_text(f"model: {c.model}\ntrain_data: {train}\nlr: 1e-3: 2\n"
                             f"out_dir: {base / 'runs' / '12-yaml'}\n")
    c.queries.write_text(json.dumps({"image": "data/images/train-0000000.png", "phrase": "the shape"}) + "\n"
                         + json.dumps({"image": "data/images/train-0000001.png"}) + "\n")
    # 64: the small model's folder with its config.json broken, and with its weights cut short
    c.corrupt_config, c.truncated_weights = base / "corrupt-config", base / "truncated-weights"
    for folder in (c.corrupt_config, c.truncated_weights):
        shutil.copytree(c.model, folder)
    (c.corrupt_config / "config.json").write_text("{\n")
    weights = c.truncated_weights / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])

    _files_that_are_not_what_they_seem(c, good_lines)
    _issue_48_files(c, good_lines)

    done = _run_here(_train(c, c.finished), base)
    assert done.returncode == 0, _show(done)
    assert (c.finished / "model").is_dir() and not (c.finished / ".lock").exists()
    c.snapshot = _snapshot(c.finished)
    _own_folders(c, good_lines)
    c.out = {case: base / "runs" / case for case in CASES}
    for case in CANNOT_RUN:  # overwrite=true: each into a copy of the finished run
        if case in CASES:
            shutil.copytree(c.finished, c.out[case])
    (base / "runs").mkdir(exist_ok=True)
    (base / "runs" / "27-predict-jsonl-no-phrase").mkdir()

    for case in CASES:  # the cases that write a file into their out folder
        if case.startswith(("55-predict", "55-convert", "55-refgen", "58-predict-long-phrase", "60-predict",
                            "60-convert")):
            c.out[case].mkdir(parents=True)

    assert AS_PROCESSES <= CASES.keys()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        processes = {case: pool.submit(_run, make(c, c.out[case]), base, env, FILE_SIZE.get(case))
                     for case, (make, env) in CASES.items() if case in AS_PROCESSES}
        here = {case: _run_here(make(c, c.out[case]), base, env) for case, (make, env) in CASES.items()
                if case not in AS_PROCESSES}
        c.result = lambda case: here[case] if case in here else processes[case].result()
        yield c


def _files_that_are_not_what_they_seem(c, good_lines: list[str]) -> None:
    """A FIFO as a data file and as an image (opening either would wait forever for a writer), a
    JSONL with a byte-order mark, an empty JSONL, a YAML file giving a setting twice."""
    c.fifo = c.base / "fifo.jsonl"
    os.mkfifo(c.fifo)
    os.mkfifo(c.data / "images" / "fifo.png")
    c.fifo_image_data = c.data / "fifo-image.jsonl"
    lines = list(good_lines)
    lines[2] = json.dumps({**json.loads(lines[2]), "image": "images/fifo.png"})
    c.fifo_image_data.write_text("\n".join(lines) + "\n")
    c.bom = c.data / "bom.jsonl"
    c.bom.write_bytes(b"\xef\xbb\xbf" + ("\n".join(good_lines) + "\n").encode())
    c.empty = c.data / "empty.jsonl"
    c.empty.write_text("\n")
    c.duplicate_yaml = c.base / "duplicate.yaml"
    c.duplicate_yaml.write_text(f"model: {c.model}\nlr: 1.0e-3\ntrain_data: {c.train}\nmax_steps: 2\nlr: 5.0\n")


def _with_line(path: Path, good_lines: list[str], number: int, text: str) -> Path:
    lines = list(good_lines)
    lines[number - 1] = text
    path.write_text("\n".join(lines) + "\n")
    return path


def _issue_48_files(c, good_lines: list[str]) -> None:
    """The files of issue 48, each small on disk: a YAML alias bomb (a few lines), a JSONL naming an
    image with a NUL byte, 10 GB sparse images (a JPEG's first bytes, or its header up to its scan,
    then zeros: nothing on disk), a line nested 200,000 deep, a 1 MB phrase, latin-1 bytes."""
    line = json.loads(good_lines[2])
    c.image = c.data / line["image"]
    c.bomb_yaml = c.base / "bomb.yaml"
    c.bomb_yaml.write_text(f"model: {c.model}\ntrain_data: {c.train}\nx: &a [x, x, x, x, x, x, x, x, x]\n"
                           + "".join(f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n"
                                     for a, b in zip("abcdefgh", "bcdefghi"))
                           + "lora_targets: *i\n")
    c.nul = _with_line(c.data / "nul.jsonl", good_lines, 3, json.dumps({**line, "image": "images/a\0b.png"}))
    c.nul_detections = c.data / "nul-detections.jsonl"
    c.nul_detections.write_text(json.dumps({"image": line["image"], "bbox": line["bbox"], "label": "shape"}) + "\n"
                                + json.dumps({"image": "images/a\0b.png", "bbox": line["bbox"], "label": "shape"})
                                + "\n")
    c.sparse_jpg = c.data / "images" / "sparse.jpg"
    c.sparse_jpg.write_bytes(b"\xff\xd8\xff\xe0")  # a JPEG's start, then junk Pillow skips a byte at a time
    os.truncate(c.sparse_jpg, 10 * 2**30)
    c.sparse_data = _with_line(c.data / "sparse.jsonl", good_lines, 3,
                               json.dumps({**line, "image": "images/sparse.jpg"}))
    jpeg = io.BytesIO()
    Image.new("RGB", (SIZE, SIZE), "red").save(jpeg, format="JPEG")
    zeros = c.data / "images" / "header-then-zeros.jpg"
    zeros.write_bytes(jpeg.getvalue()[:jpeg.getvalue().index(b"\xff\xda")])  # up to its scan, which never comes
    os.truncate(zeros, 10 * 2**30)
    c.zeros_data = _with_line(c.data / "zeros.jsonl", good_lines, 3,
                              json.dumps({**line, "image": "images/header-then-zeros.jpg"}))  # its width and height
    c.deep_json = _with_line(c.data / "deep.jsonl", good_lines, 6, "[" * 200_000 + "]" * 200_000)
    c.long_phrase = _with_line(c.data / "long-phrase.jsonl", good_lines, 5,
                               json.dumps({**json.loads(good_lines[4]), "phrase": "the red circle " * 70_000}))
    c.latin1 = c.data / "latin1.jsonl"
    c.latin1.write_bytes(("\n".join(good_lines[:3]) + "\n").encode() + b'{"phrase": "caf\xe9"}\n')
    c.latin1_yaml = c.base / "latin1.yaml"
    c.latin1_yaml.write_bytes(f"model: {c.model}\ntrain_data: {c.train}\n".encode() + b"prompt: 'caf\xe9 {phrase}'\n")
    # 63: a 16x16 JPEG whose frame header says 4000x4000, whole (its end marker too): libjpeg drew the rest grey
    small = io.BytesIO()
    Image.new("RGB", (16, 16), "red").save(small, format="JPEG")
    short = bytearray(small.getvalue())
    frame = short.index(b"\xff\xc0")
    short[frame + 5:frame + 9] = (4000).to_bytes(2, "big") * 2  # height, width
    c.short_jpg = c.data / "images" / "short.jpg"
    c.short_jpg.write_bytes(bytes(short))
    c.short_data = _with_line(c.data / "short.jsonl", good_lines, 3, json.dumps(
        {**line, "image": "images/short.jpg", "width": 4000, "height": 4000}))


def _own_folders(c, good_lines: list[str]) -> None:
    """Each case of 33-41 works in a folder of its own, ``c.own[N]``, holding what it reads beside
    files it must not touch; ``c.own_snapshot[N]`` is every byte of it before the case runs."""
    c.own = {n: c.base / "own" / n for n in ("33", "34", "35", "36", "37", "38", "39", "40", "41", "59", "62")}
    for folder in c.own.values():
        folder.mkdir(parents=True)
    (c.own["33"] / "train.jsonl").write_text("\n".join(good_lines) + "\n")
    shutil.copy(REFGEN_INSTANCES, c.own["34"] / "instances.json")
    for n in ("35", "36"):  # a run, and a folder beside it that is nobody's business
        shutil.copytree(c.finished, c.own[n] / "run")
        (c.own[n] / "keepme").mkdir()
        (c.own[n] / "keepme" / "notes.txt").write_text("not an export\n")
    (c.own["37"] / "config.json").write_text("{}\n")  # looks like a model folder; no export wrote it
    (c.own["37"] / "notes.txt").write_text("mine\n")
    (c.own["38"] / "q.jsonl").write_text("\n".join(good_lines) + "\n")
    (c.own["39"] / "val.jsonl").write_text("\n".join(good_lines) + "\n")
    (c.own["40"] / "train.jsonl").write_text(json.dumps({"id": "mine", "source": "my-labels"}) + "\n")
    (c.own["41"] / "train.jsonl").write_text("\n".join(
        json.dumps({**json.loads(line), "image": str(c.data / json.loads(line)["image"])}) for line in good_lines) + "\n")
    shutil.copytree(c.data / "images", c.own["59"] / "images", ignore=lambda folder, names: [  # not the FIFO
        n for n in names if not n.startswith("train-")])
    (c.own["59"] / "val.jsonl").write_text("\n".join(good_lines) + "\n")
    (c.own["59"] / "notes.json").write_text('{"mine": true}\n')
    make_synthetic_set(c.own["59"] / "synth", n=3, seed=2, task="single", workers=1)
    _own_62(c.own["62"], c, good_lines)
    c.own_snapshot = {n: _snapshot(folder) for n, folder in c.own.items()}


def _own_62(folder: Path, c, good_lines: list[str]) -> None:
    """What 62's outputs must not replace: the data and its images, COCO instances naming two of
    them, a user's notes, a user's index.html in a folder, an image named as a gallery's card."""
    shutil.copytree(c.data / "images", folder / "images", ignore=lambda _, names: [
        n for n in names if not n.startswith("train-")])
    (folder / "val.jsonl").write_text("\n".join(good_lines) + "\n")
    first = json.loads(good_lines[0])
    (folder / "images" / "worst_000.png").write_bytes((folder / first["image"]).read_bytes())
    (folder / "worst.jsonl").write_text(json.dumps({**first, "image": "images/worst_000.png"}) + "\n")
    (folder / "instances.json").write_text(json.dumps({
        "images": [{"id": k, "file_name": f"train-000000{k}.png", "width": SIZE, "height": SIZE} for k in (1, 2)],
        "annotations": [{"id": k, "image_id": k, "category_id": 1, "bbox": [10, 10, 30, 30]} for k in (1, 2)],
        "categories": [{"id": 1, "name": "shape"}]}))
    (folder / "notes.json").write_text('{"mine": true}\n')
    (folder / "gallery").mkdir()
    (folder / "gallery" / "index.html").write_text("<html><body>my own page</body></html>\n")


# --------------------------------------------------------------------------------------------
# 1-10: train refuses a file with a bad record before the model loads


@pytest.mark.parametrize("case", BAD_RECORDS)
def test_train_refuses_a_bad_record_before_the_model_loads(corpus, case):
    kind, line, _ = BAD_RECORDS[case]
    bad, done, out = corpus.bad[case], corpus.result(case), corpus.out[case]
    message = _refused(done, table=True)
    assert message.startswith(f"error: train_data: 1 of 8 records of {bad} cannot be trained on (bad_records=refuse)")
    assert _table_row(message, kind, line), message
    assert re.fullmatch(rf"Fix them at the source, or keep the usable ones: groundtune data check {re.escape(str(bad))} "
                        rf"--fix-out \S+-clean\.jsonl \(or set bad_records=skip\)", message.splitlines()[-1]), message
    assert "training" not in done.stdout  # the model never loaded
    assert not out.exists()
    _untouched(corpus)


# --------------------------------------------------------------------------------------------
# 11: bad_records=skip trains on the rest and lists what it left out


def test_11_bad_records_skip_trains_without_the_line(corpus):
    bad, done, out = corpus.bad["01-image_missing"], corpus.result("11-skip"), corpus.out["11-skip"]
    assert done.returncode == 0, _show(done)
    assert "Traceback" not in done.stderr
    assert f"train_data: 1 of 8 records of {bad} left out (bad_records=skip)" in done.stdout, _show(done)
    listed = [json.loads(line) for line in (out / "bad_records.jsonl").read_text().splitlines()]
    assert [(b["file"], b["line"], b["kinds"]) for b in listed] == [(str(bad), 3, ["image_missing"])]
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["data/bad_records"] == 1
    assert (out / "model").is_dir() and not (out / ".lock").exists()
    _untouched(corpus)


# --------------------------------------------------------------------------------------------
# 12-17, 20: settings


def test_12_yaml_syntax_error_names_file_line_column(corpus):
    message = _refused(corpus.result("12-yaml"))
    assert message == f"error: {corpus.broken_yaml}:3:9: not valid YAML (mapping values are not allowed here)"
    assert not corpus.out["12-yaml"].exists()
    _untouched(corpus)


def test_13_unclosed_list_on_the_command_line(corpus):
    message = _refused(corpus.result("13-unclosed-list"))
    assert re.fullmatch(r"error: override 'lora_targets=\[llm_attn' on the command line: not valid YAML \(.+\)", message)
    assert not corpus.out["13-unclosed-list"].exists()
    _untouched(corpus)


def test_14_unknown_setting_on_the_command_line(corpus):
    message = _refused(corpus.result("14-unknown-setting"))
    assert re.match(r"error: unknown setting\(s\) on the command line: learning_rate\b", message)
    assert "quickstart.yaml" not in message and "groundtune train --help" in message
    assert not corpus.out["14-unknown-setting"].exists()
    _untouched(corpus)


@on_cpu_only
def test_15_device_cuda_on_a_cpu_machine(corpus):
    message = _refused(corpus.result("15-device=cuda"))
    assert re.fullmatch(r"error: device=cuda: this machine has no CUDA GPU .*; use device=cpu \(or auto\)", message)
    _nothing_half_made(corpus.out["15-device=cuda"])
    _untouched(corpus)


def test_16_a_folder_as_train_data(corpus):
    message = _refused(corpus.result("16-folder"))
    assert re.match(rf"error: {re.escape(str(corpus.data))} is a folder; give a JSONL file", message)
    assert not corpus.out["16-folder"].exists()
    _untouched(corpus)


@pytest.mark.parametrize("case", OUT_OF_RANGE)
def test_17_out_of_range_setting(corpus, case):
    setting, wrong = OUT_OF_RANGE[case]
    assert _refused(corpus.result(case)) == f"error: {setting} {wrong}"
    assert not corpus.out[case].exists()
    _untouched(corpus)


def test_20_rl_with_a_train_only_setting(corpus):
    message = _refused(corpus.result("20-rl-packing"))
    assert re.match(r"error: unknown setting\(s\) on the command line: packing; packing: the update puts the answers "
                    r"to a prompt in one row itself", message)
    assert "groundtune rl --help" in message
    assert not corpus.out["20-rl-packing"].exists()
    _untouched(corpus)


# --------------------------------------------------------------------------------------------
# 18, 19, 30, 31: the finished run


def test_18_a_new_run_into_a_finished_run(corpus):
    message = _refused(corpus.result("18-into-finished"))
    assert re.match(rf"error: {re.escape(str(corpus.finished))} already holds a run \(model/, checkpoints\)", message)
    assert "overwrite=true" in message
    _untouched(corpus)


def test_19_resume_of_a_finished_run(corpus):
    done = corpus.result("19-resume-finished")
    assert done.returncode == 0, _show(done)
    assert "Traceback" not in done.stderr
    assert re.search(rf"{re.escape(str(corpus.finished))} finished at step 2: nothing to resume\. Its model is "
                     rf"{re.escape(str(corpus.finished / 'model'))}", done.stdout), _show(done)
    _untouched(corpus)


def test_30_resume_takes_no_other_setting(corpus):
    message = _refused(corpus.result("30-resume-lr"))
    assert re.fullmatch(r"error: --resume takes no lr: .*\(only train_data and eval_data may name a corrected file "
                        r"of the same records\)", message)
    _untouched(corpus)


@on_cpu_only
@pytest.mark.parametrize("case", CANNOT_RUN)
def test_31_overwrite_with_a_setting_this_machine_cannot_run_keeps_the_old_run(corpus, case):
    """overwrite=true asks to replace a run by a new one; a new run refused before it starts
    should leave the old one as it was (here: a copy of the finished run)."""
    _, said = CANNOT_RUN[case]
    message = _refused(corpus.result(case))
    assert re.match(f"error: {said}", message)
    _untouched(corpus)
    assert _snapshot(corpus.out[case]) == corpus.snapshot  # checked before the old run is replaced


# --------------------------------------------------------------------------------------------
# 21: rl checks records as train does


def test_21_rl_refuses_a_missing_image_before_the_model_loads(corpus):
    bad, done = corpus.bad["01-image_missing"], corpus.result("21-rl-image_missing")
    message = _refused(done, table=True)
    assert message.startswith(f"error: train_data: 1 of 8 records of {bad} cannot be trained on (bad_records=refuse)")
    assert _table_row(message, "image_missing", 3), message
    assert f"groundtune data check {bad} --fix-out" in message.splitlines()[-1]
    assert not corpus.out["21-rl-image_missing"].exists()
    _untouched(corpus)


# --------------------------------------------------------------------------------------------
# 22-24: eval's models


def test_22_eval_of_a_model_folder_that_is_not_there(corpus):
    done = corpus.result("22-eval-no-folder")
    assert _refused(done) == "error: ./no/such/folder: no such model folder"  # not HF_ENDPOINT's 127.0.0.1
    assert done.seconds < 20, _show(done)
    _untouched(corpus)


def test_23_eval_compare_with_a_missing_model_fails_before_the_first_eval(corpus):
    done = corpus.result("23-eval-compare-missing")
    assert _refused(done) == "error: ./missing/model: no such model folder"
    assert "grounding eval" not in done.stdout and "Acc@" not in done.stdout and not done.stdout.strip(), _show(done)
    assert done.seconds < 20, _show(done)
    _untouched(corpus)


def test_24_eval_of_a_hub_id_not_in_the_offline_cache(corpus):
    done = corpus.result("24-eval-hub-offline")
    assert re.fullmatch(r"error: Qwen/Not-A-Real-Model: .*not in the local Hugging Face cache with HF_HUB_OFFLINE "
                        r"set: .*", _refused(done))
    assert done.seconds < 20, _show(done)
    _untouched(corpus)


# --------------------------------------------------------------------------------------------
# 25-27: predict's inputs


def test_25_predict_with_a_missing_image(corpus):
    assert _refused(corpus.result("25-predict-missing-image")) == f"error: {corpus.base / 'missing.png'}: image file not found"
    _untouched(corpus)


def test_26_predict_with_a_corrupt_image(corpus):
    image = corpus.data / "images" / "truncated.jpg"
    assert re.fullmatch(rf"error: {re.escape(str(image))}: cannot decode image \(.+\)",
                        _refused(corpus.result("26-predict-corrupt-image")))
    _untouched(corpus)


def test_27_predict_jsonl_with_a_line_missing_its_phrase(corpus):
    message = _refused(corpus.result("27-predict-jsonl-no-phrase"))
    assert message == f"error: {corpus.queries}:2: missing field(s) phrase"
    assert list(corpus.out["27-predict-jsonl-no-phrase"].iterdir()) == []  # no --out file, not even a part
    _untouched(corpus)


# --------------------------------------------------------------------------------------------
# 28, 29 and `data check`'s own exit code


def test_28_data_check_of_a_folder(corpus):
    message = _refused(corpus.result("28-check-folder"))
    assert re.match(rf"error: {re.escape(str(corpus.data))} is a folder; give a JSONL file", message)
    _untouched(corpus)


def test_29_data_check_of_a_missing_file(corpus):
    assert _refused(corpus.result("29-check-missing")) == f"error: {corpus.base / 'missing.jsonl'}: no such file"
    _untouched(corpus)


def test_32_data_check_finding_errors_exits_1(corpus):
    bad, done = corpus.bad["10-aspect_ratio"], corpus.result("32-check-errors")
    assert done.returncode == 1, _show(done)  # its documented code: the file has errors
    assert "Traceback" not in done.stderr and not done.stderr.strip(), _show(done)
    assert done.stdout.startswith(f"{bad}: 8 records, 1 with errors")
    assert _table_row(done.stdout, "aspect_ratio", 6), done.stdout


# --------------------------------------------------------------------------------------------
# 33-41: a command never writes over what it reads


DESTROY = "writing it would destroy what the command reads"
TAKE_ALONG = "an output folder must not hold what the command reads \\(replaced, it would take it along\\)"
OWN_INPUT = {  # case -> (its folder, what is said: a regular expression, B the corpus's folder)
    "33-fix-out-is-the-input": ("33", rf"--fix-out B/own/33/\.\./33/train\.jsonl is the file being checked "
                                      rf"\(B/own/33/train\.jsonl\): {DESTROY}; choose another --fix-out"),
    "34-refgen-out-is-instances": ("34", rf"--out B/own/34/instances\.json is --instances \(B/own/34/instances\.json\): "
                                         rf"{DESTROY}; choose another --out"),
    "35-export-out-holds-the-run": ("35", rf"--out B/own/35 holds the model being exported \(B/own/35/run\): "
                                          rf"{TAKE_ALONG}; choose another --out"),
    "36-export-out-is-the-run": ("36", rf"--out B/own/36/run is the model being exported \(B/own/36/run\): {DESTROY}; "
                                       r"choose another --out"),
    "37-export-overwrite-foreign": ("37", r"--overwrite: B/own/37 does not hold a previous export \(no groundtune\.json "
                                          r"listing its files\), so nothing there is replaced; choose another --out, or "
                                          r"empty it yourself"),
    "38-predict-out-is-jsonl": ("38", rf"--out B/own/38/q\.jsonl is --jsonl \(B/own/38/q\.jsonl\): {DESTROY}; "
                                      r"choose another --out"),
    "39-eval-out-is-data": ("39", rf"--out B/own/39/val\.jsonl is --data \(B/own/39/val\.jsonl\): {DESTROY}; "
                                  r"choose another --out"),
    "40-synth-over-users-file": ("40", r"B/own/40/train\.jsonl exists and was not written by `groundtune data synth`: "
                                       r"it would be replaced; choose another --out \(or --split\)"),
    "41-out_dir-holds-train_data": ("41", rf"out_dir=B/own/41 holds train_data \(B/own/41/train\.jsonl\): "
                                          rf"{TAKE_ALONG}; choose another out_dir"),
}


@pytest.mark.parametrize("case", OWN_INPUT)
def test_an_output_never_lands_on_its_input(corpus, case):
    """Refused in one line, and every byte of the case's folder (what it reads, and a bystander's
    files beside it) as it was."""
    folder, said = OWN_INPUT[case]
    message = _refused(corpus.result(case)).replace(str(corpus.base), "B")
    assert re.fullmatch("error: " + said, message), message
    assert _snapshot(corpus.own[folder]) == corpus.own_snapshot[folder]
    _untouched(corpus)


# --------------------------------------------------------------------------------------------
# 42-48: FIFOs, a byte-order mark, an empty file


def test_42_43_a_fifo_as_the_data_file_is_refused_not_waited_on(corpus):
    for case in ("42-check-fifo", "43-train-fifo"):
        done = corpus.result(case)
        assert _refused(done) == f"error: {corpus.fifo}: a FIFO (named pipe), not a regular file; give the JSONL file " \
                                  "itself", _show(done)
        assert done.seconds < 60, _show(done)
    assert not corpus.out["43-train-fifo"].exists()


def test_44_a_fifo_as_an_image_is_a_bad_record(corpus):
    message = _refused(corpus.result("44-train-image-fifo"), table=True)
    assert _table_row(message, "image_not_a_file", 3), message
    assert not corpus.out["44-train-image-fifo"].exists()


def test_45_out_dir_naming_a_file(corpus):
    assert _refused(corpus.result("45-out_dir-is-a-file")) == f"error: out_dir={corpus.train}: a file is there; " \
                                                              "name a folder for the run"


def test_46_a_byte_order_mark_is_read_as_one(corpus):
    done = corpus.result("46-check-bom")
    assert done.returncode == 0, _show(done)
    assert done.stdout.startswith(f"{corpus.bom}: 8 records, 0 with errors"), _show(done)
    clean = corpus.out["46-check-bom"] / "bom-clean.jsonl"
    assert len(clean.read_text().splitlines()) == 8 and not clean.read_bytes().startswith(b"\xef\xbb\xbf")


def test_47_48_an_empty_file_is_refused_by_check_and_train_alike(corpus):
    check = corpus.result("47-check-empty")
    assert check.returncode == 1 and "Traceback" not in check.stderr, _show(check)
    assert "holds no records: there is nothing to train on" in check.stdout, _show(check)
    assert _refused(corpus.result("48-train-empty")) == (f"error: train_data={corpus.empty}: holds no records; see "
                                                         f"`groundtune data check {corpus.empty}`")
    assert not corpus.out["48-train-empty"].exists()


# --------------------------------------------------------------------------------------------
# 49-50: settings


def test_49_a_setting_given_twice_in_yaml(corpus):
    assert _refused(corpus.result("49-duplicate-yaml-key")) == (f"error: {corpus.duplicate_yaml}:5:1: not valid YAML "
                                                                "('lr' is given twice (first on line 2))")


@pytest.mark.parametrize("case", NOT_A_NUMBER)
def test_50_a_setting_that_is_not_a_usable_number(corpus, case):
    assert _refused(corpus.result(case)) == NOT_A_NUMBER[case][1]
    assert not corpus.out[case].exists()


def test_51_a_flag_argparse_refuses_is_one_line_too(corpus):
    assert _refused(corpus.result("51-synth-negative-count")) == (
        "error: groundtune data synth: argument --n: must be at least 0, got -1 (see groundtune data synth --help)")
    assert not corpus.out["51-synth-negative-count"].exists()
    assert _refused(corpus.result("51-serve-port-99999")) == (
        "error: groundtune serve: argument --port: must be from 1 to 65535, got 99999 (see groundtune serve --help)")


# --------------------------------------------------------------------------------------------
# 52-53: a set's boxes that are not boxes (train: 1-10's refusal, above)


@pytest.mark.parametrize("case", EVAL_BAD_BOXES)
def test_52_53_eval_refuses_a_malformed_set_before_the_model_loads(corpus, case):
    bad_case, said = EVAL_BAD_BOXES[case]
    bad, line = corpus.bad[bad_case], BAD_RECORDS[bad_case][1]
    done = corpus.result(case)
    assert _refused(done) == f"error: {bad}:{line}: {said}; run `groundtune data check {bad}`"
    assert not done.stdout.strip() and done.seconds < 20, _show(done)  # no model loaded, nothing evaluated
    _untouched(corpus)


@pytest.mark.parametrize("value, said", [
    ("x", 'bboxes is "x", not a list of boxes'),
    ({"a": 1}, 'bboxes is {"a": 1}, not a list of boxes'),
    ([[1, 2, 3]], "bboxes[0] is [1, 2, 3], not a box"),
    ([[0, 0, 5, 5], [1, 2, "3", 4]], 'bboxes[1] is [1, 2, "3", 4], not a box'),
    ([[0, 0, 5, float("nan")]], "bboxes[0] is [0, 0, 5, NaN], not a box"),
    ([[0, 0, 5, 5, 6]], "bboxes[0] is [0, 0, 5, 5, 6], not a box"),
    ([[True, 0, 5, 5]], "bboxes[0] is [true, 0, 5, 5], not a box"),
    ([0, 0, 5, 5], "bboxes[0] is 0, not a box"),  # one box where a list of boxes belongs
])
def test_reading_records_names_the_line_of_a_malformed_set(tmp_path, value, said):
    """What eval (and the quickstart) read records with: the first line whose boxes are not boxes
    raises, naming file and line, before anything else reads them."""
    from groundtune.data.records import DataError, read_samples

    good = {"id": "a", "image": "a.png", "width": 64, "height": 64, "phrase": "every red circle"}
    path = tmp_path / "sets.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ({**good, "bboxes": []}, {**good, "bboxes": [[1, 2, 30, 40]]},
                                                      {**good, "bboxes": value})) + "\n")
    with pytest.raises(DataError) as raised:
        read_samples(path)
    assert str(raised.value).startswith(f"{path}:3: {said}")
    path.write_text(json.dumps({**good, "bboxes": []}) + "\n" + json.dumps({**good, "bbox": [1, 2, 3]}) + "\n")
    with pytest.raises(DataError, match=r":2: bbox is \[1, 2, 3\], not a box"):
        read_samples(path)


# --------------------------------------------------------------------------------------------
# 54-61: issue 48 (each reproduced on an earlier version: the message or exit code it gave then)


def _quick_line(done: subprocess.CompletedProcess) -> str:
    """A refusal of one line, under 1,000 characters, in under 10 s (60 for a process: its start and
    torch's import alone take seconds, and its siblings share the cores)."""
    message = _refused(done)
    assert len(message) <= 1000 and done.seconds < (60 if done.args[0] == sys.executable else 10), _show(done)
    return message


def test_54_a_yaml_alias_bomb_is_refused_before_it_is_expanded(corpus):
    """Was: 120 s at 9 GB RSS and 2 GB of stderr, the error printing the expanded value."""
    assert _quick_line(corpus.result("54-yaml-alias-bomb")) == (
        f"error: {corpus.bomb_yaml}:7:4: expands to more than 10,000 values (YAML aliases repeat what they name: an "
        "alias bomb?); settings are a few dozen")
    assert not corpus.out["54-yaml-alias-bomb"].exists()


@pytest.mark.parametrize("key, said", [
    ("model", "model=[['x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x'], [['x', 'x', ... (a list of 4 items): expected "
              "str"),
    ("max_steps", "max_steps=[['x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x'], [['x', 'x', ... (a list of 4 items): "
                  "expected int"),
    ("report_to", "report_to=[['x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x'], [['x', 'x', ... (a list of 4 items): "
                  "expected names, some of tensorboard, wandb, mlflow"),
    ("lora_targets", "lora_targets: unknown [['x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x'], [['x', 'x', ... (a list "
                     "of 4 items); expected some of ['llm_attn', 'llm_mlp', 'merger', 'vision']"),
])
def test_54_a_value_an_error_echoes_is_cut_to_a_prefix_with_its_size(corpus, key, said):
    """A bomb under the limit (6,561 values) is read; the setting refuses it, showing 60 characters
    of it (was: a 39 MB message for model= or max_steps=)."""
    assert _quick_line(corpus.result(f"54-bomb-{key}")) == "error: " + said


def test_54_settings_nested_50000_deep(corpus):
    """Was: a RecursionError's traceback (PyYAML composes recursively)."""
    assert _quick_line(corpus.result("54-deep-yaml")) == (
        "error: override 'lr=" + "[" * 56 + "... (100,003 characters) on the command line: nested deeper than 16 "
        "levels; settings are values and lists of them")  # the value's first 60 characters, its quote included


NUL_SAID = "image 'images/a\\x00b.png' holds a NUL byte, which no file name can"


def test_55_an_image_path_with_a_nul_byte(corpus):
    """Was: a traceback from check and train (ValueError: embedded null byte); eval and predict said
    one line without the line. Now one line naming file and line (a bad record in check's table)."""
    nul, detections = corpus.nul, corpus.nul_detections
    check = corpus.result("55-check-nul")
    assert check.returncode == 1 and "Traceback" not in check.stderr and _table_row(check.stdout, "image_not_a_file", 3)
    assert _table_row(_refused(corpus.result("55-train-nul"), table=True), "image_not_a_file", 3)
    for case, said in {"eval": f"{nul}:3: {NUL_SAID}; run `groundtune data check {nul}`",
                       "predict": f"{nul}:3: {NUL_SAID}",
                       "convert": f"{nul}:3: {NUL_SAID}; run `groundtune data check {nul}` to see every problem",
                       "refgen": f"{detections}:2: {NUL_SAID}"}.items():
        assert _quick_line(corpus.result(f"55-{case}-nul")) == "error: " + said
        out = corpus.out[f"55-{case}-nul"]
        assert not out.exists() or not list(out.iterdir()), case  # nothing written
    _untouched(corpus)


def test_56_a_10_gb_sparse_image_is_refused_in_seconds(corpus):
    """Was: data check and predict --image hung (killed at 120 s): Pillow skips what follows a
    JPEG's first bytes a byte at a time. eval, its width and height given, hung on a JPEG header
    followed by 10 GB of zeros."""
    check = corpus.result("56-check-sparse-jpg")
    assert check.returncode == 1 and _table_row(check.stdout, "image_unreadable", 3), _show(check)
    assert check.seconds < 60, _show(check)  # a process: its start and its siblings' take some
    header = "read 8,454,144 bytes of a 10,737,418,240-byte file without finding the end of the image's header"
    assert _quick_line(corpus.result("56-predict-sparse-jpg")) == (
        f"error: {corpus.sparse_jpg}: cannot decode image ({header})")
    zeros = corpus.data / "images" / "header-then-zeros.jpg"
    assert _quick_line(corpus.result("56-eval-jpeg-then-zeros")) == f"error: {zeros}: cannot decode image ({header})"


def test_57_a_line_nested_200000_deep(corpus):
    """Was: a RecursionError's traceback from data check."""
    check = corpus.result("57-check-deep-json")
    assert check.returncode == 1 and "Traceback" not in check.stderr and _table_row(check.stdout, "invalid_json", 6)
    assert _quick_line(corpus.result("57-eval-deep-json")) == (
        f"error: {corpus.deep_json}:6: nested deeper than 64 levels (a record nests 4); run `groundtune data check "
        f"{corpus.deep_json}`")


def test_58_a_phrase_of_a_megabyte(corpus):
    """Was: predict --jsonl grew to 24 GB (5 MB) or asked for a 25 GB KV cache (50 MB); data check
    took it. Now the server's limit, 500 characters, holds for files: predict refuses the line,
    check counts it, train refuses it as any bad record (bad_records=skip leaves it out)."""
    path = corpus.long_phrase
    phrase = "phrase 'the red circle the red circle the red c... (1,050,000 characters) is longer than 500 characters"
    assert _quick_line(corpus.result("58-predict-long-phrase")).startswith(f"error: {path}:5: {phrase}")
    check = corpus.result("58-check-long-phrase")
    assert check.returncode == 1 and _table_row(check.stdout, "phrase_too_long", 5)
    assert _table_row(_refused(corpus.result("58-train-long-phrase"), table=True), "phrase_too_long", 5)
    assert _quick_line(corpus.result("58-predict-long-phrase-flag")).startswith(
        "error: --phrase: phrase 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx... (600 characters) is longer than 500")
    assert not list(corpus.out["58-predict-long-phrase"].iterdir())


@pytest.mark.parametrize("case, said", [
    ("59-eval-out-is-an-image", r"--out B/own/59/images/train-0000001\.png is an image of --data "
                                r"\(B/own/59/images/train-0000001\.png\): writing it would destroy what the command "
                                r"reads; choose another --out"),
    ("59-predict-out-is-an-image", r"--out B/own/59/images/train-0000002\.png is an image of --jsonl "
                                   r"\(B/own/59/images/train-0000002\.png\): writing it would destroy what the command "
                                   r"reads; choose another --out"),
    ("59-eval-out-someone-elses", r"--out B/own/59/notes\.json exists and was not written by `groundtune eval`: it "
                                  r"would be replaced; choose another --out, or give --overwrite to replace it"),
    ("59-eval-out-a-model-file", r"--out B/finished/model/groundtune\.json is a file of --model B/finished "
                                 r"\(B/finished/model/groundtune\.json\): writing it would destroy what the command "
                                 r"reads; choose another --out"),
    ("59-synth-over-a-synth-set", r"B/own/59/synth/train\.jsonl holds a synthetic set already: give --overwrite to "
                                  r"replace it \(its images too\), or choose another --out \(or --split\)"),
])
def test_59_an_out_never_replaces_what_the_command_reads_nor_a_file_it_did_not_write(corpus, case, said):
    """Was: eval --out or predict --out onto an image of the data replaced it with JSON, exit 0;
    data synth --n 20 over a set of 10,000 cut it to 20 and left the rest of its images orphaned."""
    message = _quick_line(corpus.result(case)).replace(str(corpus.base), "B")
    assert re.fullmatch("error: " + said, message), message
    assert _snapshot(corpus.own["59"]) == corpus.own_snapshot["59"]
    _untouched(corpus)


@pytest.mark.parametrize("case, line", [("60-yaml-latin1", 3), ("60-eval-latin1", 4), ("60-predict-latin1", 4),
                                        ("60-convert-latin1", 4)])
def test_60_a_file_that_is_not_utf8_is_named_with_line_and_byte(corpus, case, line):
    """Was: tracebacks (UnicodeDecodeError) from a YAML file, eval --data, predict --jsonl and data
    convert."""
    path = corpus.latin1_yaml if case == "60-yaml-latin1" else corpus.latin1
    before = path.read_bytes().index(b"\xe9")  # the bytes before the latin-1 one
    assert _quick_line(corpus.result(case)) == (f"error: {path}:{line}: not UTF-8 text (byte 0xE9 at byte offset "
                                                f"{before:,}); save the file as UTF-8")


def test_61_a_checkpoint_write_that_fails_is_one_line(corpus):
    """Was: exit 1 and torch's traceback ("unexpected pos ... vs ...", a file cut short by ulimit
    -f). Now one line with where, how much and what is intact; nothing half-written."""
    done, out = corpus.result("61-checkpoint-write-fails"), corpus.out["61-checkpoint-write-fails"]
    assert done.returncode == 2 and "Traceback" not in done.stderr, _show(done)
    message = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: could not write {re.escape(str(out))}/checkpoints/step-000001: the disk refused it "
                        r"\(.+\); it needs about .+ and .+ is free there, and no file here may be over 0\.2 MiB "
                        r"\(ulimit -f\); no checkpoint was written before it\. Free some space \(or set out_dir on "
                        r"another disk\), then start the run again", message), message
    assert len(message) <= 1000
    assert list((out / "checkpoints").iterdir()) == [] and not (out / "model").exists() and not (out / ".lock").exists()


DESTROYS = r"writing it would destroy what the command reads"
NOT_BY = (r"exists and was not written by `groundtune {command}`: it would be replaced; choose another {flag}, or "
          r"give --overwrite to replace it")


@pytest.mark.parametrize("case, said", [
    ("62-convert-out-is-an-image", rf"--out B/own/62/images/train-0000001\.png is an image of --path "
                                   rf"\(B/own/62/images/train-0000001\.png\): {DESTROYS}; choose another --out"),
    ("62-convert-out-is-a-coco-image", rf"--out B/own/62/images/train-0000002\.png is an image of --instances "
                                       rf"\(B/own/62/images/train-0000002\.png\): {DESTROYS}; choose another --out"),
    ("62-convert-out-someone-elses", r"--out B/own/62/notes\.json "
                                     + NOT_BY.format(command="data convert", flag="--out")),
    ("62-refgen-out-is-an-image", rf"--out B/own/62/images/train-0000002\.png is an image of --instances "
                                  rf"\(B/own/62/images/train-0000002\.png\): {DESTROYS}; choose another --out"),
    ("62-refgen-out-a-model-file", rf"--out B/finished/model/groundtune\.json is a file of --filter-model B/finished "
                                   rf"\(B/finished/model/groundtune\.json\): {DESTROYS}; choose another --out"),
    ("62-refgen-out-someone-elses", r"--out B/own/62/notes\.json "
                                    + NOT_BY.format(command="data refgen", flag="--out")),
    ("62-fix-out-is-an-image", rf"--fix-out B/own/62/images/train-0000003\.png is an image of the file being checked "
                               rf"\(B/own/62/images/train-0000003\.png\): {DESTROYS}; choose another --fix-out"),
    ("62-fix-out-someone-elses", r"--fix-out B/own/62/notes\.json "
                                 + NOT_BY.format(command="data check", flag="--fix-out")),
    ("62-gallery-is-data", rf"--gallery B/own/62/val\.jsonl is --data \(B/own/62/val\.jsonl\): {DESTROYS}; choose "
                           r"another --gallery"),
    ("62-gallery-is-an-image", rf"--gallery B/own/62/images/train-0000001\.png is an image of --data "
                               rf"\(B/own/62/images/train-0000001\.png\): {DESTROYS}; choose another --gallery"),
    ("62-gallery-is-a-model-file", rf"--gallery B/finished/model/groundtune\.json is a file of --model B/finished "
                                   rf"\(B/finished/model/groundtune\.json\): {DESTROYS}; choose another --gallery"),
    ("62-gallery-file-is-an-image", rf"--gallery B/own/62/images/worst_000\.png is an image of --data "
                                    rf"\(B/own/62/images/worst_000\.png\): {DESTROYS}; choose another --gallery"),
    ("62-gallery-someone-elses", r"--gallery B/own/62/gallery/index\.html " + NOT_BY.format(command="eval",
                                                                                            flag="--gallery")),
])
def test_62_no_output_replaces_what_the_command_reads_nor_a_file_it_did_not_write(corpus, case, said):
    """59's rule for the other outputs. Was: data convert and refgen --out, data check --fix-out
    replaced an image of their data (with a JSONL file), a model's file or a user's file, exit 0;
    eval --gallery drew its cards over the data's images and its index.html over a user's page
    after the whole eval (onto the data file itself or an image: a traceback)."""
    message = _quick_line(corpus.result(case)).replace(str(corpus.base), "B")
    assert re.fullmatch("error: " + said, message), message
    assert _snapshot(corpus.own["62"]) == corpus.own_snapshot["62"]
    _untouched(corpus)


def test_63_a_jpeg_too_short_for_its_frame_is_refused_unread(corpus):
    """Was: a 633-byte JPEG whose header says 4000x4000 decoded to a grey 4000x4000 image (libjpeg
    fills a scan cut short by its end marker), so predict answered on it, exit 0, and data check
    and eval took it (at 13000x13000: 1.3 GB and 2 s an image). Now refused before decoding."""
    short, data = corpus.short_jpg, corpus.short_jpg.read_bytes()
    sos = data.index(b"\xff\xda")
    scan = sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big")  # where the scan's data begins
    # 4000 x 4000 / 4 (a 4:2:0 chroma component) / 64 pixels a block = 62,500 bits
    said = (rf"its header says 4000x4000, whose scan takes at least 7,812 bytes \(a bit for each 8x8 block\); the "
            rf"file holds {len(data) - scan} after its header")
    assert re.fullmatch(rf"error: {re.escape(str(short))}: cannot decode image \({said}\)",
                        _quick_line(corpus.result("63-predict-short-jpeg")))
    check = corpus.result("63-check-short-jpeg")
    assert check.returncode == 1 and _table_row(check.stdout, "image_unreadable", 3), _show(check)
    assert re.fullmatch(rf"error: {re.escape(str(short))}: cannot decode image \({said}\)",
                        _quick_line(corpus.result("63-eval-short-jpeg")))


def test_64_a_model_folder_transformers_cannot_read_is_one_line(corpus):
    """Was: transformers' OSError (a config.json that is not JSON) or safetensors' header error (weights
    cut short) as a traceback, exit 1, from every command that loads a model."""
    folder = re.escape(str(corpus.corrupt_config))
    assert re.fullmatch(rf"error: {folder}: cannot be loaded as a model: .*{folder}/config\.json.* not a valid JSON file\.",
                        _quick_line(corpus.result("64-predict-corrupt-config")))
    assert re.fullmatch(rf"error: {re.escape(str(corpus.truncated_weights))}: cannot be loaded as a model: .*header.*",
                        _quick_line(corpus.result("64-eval-truncated-weights")))


def test_99_every_case_done_and_the_finished_run_untouched(corpus):
    for case in CASES:
        corpus.result(case)
    _untouched(corpus)
    for run in [corpus.finished, *corpus.out.values()]:
        assert not (run / ".lock").exists(), run
