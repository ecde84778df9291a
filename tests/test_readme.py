"""The commands of README.md and docs/*.md, run as a newcomer would, and the pages held to their shape.

Every command line in a bash block of these pages, and every python block, is run by the test that
RULES names for it or skipped by a rule of RULES that says why (test_every_command_is_run_or_skipped).
A command runs as written: the files a newcomer would bring (a RefCOCO pickle, COCO instances, a
photo) are made first, small, and the runs eval and predict name are copies of the quickstart's run.
Only sizes are replaced (SIZES, and the step counts the tests append), and the server's port (a free
one for 8000, so that tests running side by side do not collide).
Processes are started where the page's command starts one: the server, torchrun, a script run
with python.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import pickle
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from groundtune.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# the README and the workflow pages; docs/benchmarks-history.md is a log of past measurements, whose
# commands ran on their day's machines: only its links are checked
HISTORY = ROOT / "docs" / "benchmarks-history.md"
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p != HISTORY)]
TORCHRUN = shutil.which("torchrun")

# Each command's first matching rule decides: None runs nothing and says why; a test's name runs it there.
RULES = [
    (r"^pip install ", None, "installs packages: .ci/run runs the install line "
     "(test_install_and_test_commands_are_what_ci_runs), and .[dev] holds every extra"),
    (r"^python -m pytest\b", None, "the tests themselves"),
    (r"^python scripts/test_profile\.py ", None, "summarises a run of the tests; tests/test_suite_profile.py runs it "
     "on a JUnit file of its own"),
    (r"^python bench/", None, "a benchmark: minutes to hours, most on a GPU; tests/test_claims.py holds its "
     "figures to bench/results"),
    (r"Qwen/", None, "downloads a real model from the hub"),
    (r"^hf auth login$|--push-to-hub", None, "logs in to, or uploads to, the real hub; tests/test_hub_push.py "
     "pushes to a stand-in of the hub's API"),
    (r"hf:lmms-lab/", None, "reads a real data set from the hub; tests/test_hf_data.py reads a stand-in in the "
     "hub's layout"),
    (r"^torchrun (?!.*device=cpu)", None, "several GPUs (NCCL) or several nodes"),
    (r"--resume runs/", None, "resumes the user's stopped run; tests/test_reliability.py and tests/test_rl.py "
     "stop and resume real runs"),
    (r"\bmy\.yaml\b", None, "the user's own config file"),
    (r"init_device_mesh", None, "a sketch of hybrid sharding on CUDA GPUs, which groundtune does not set up"),
    (r"^torchrun .*device=cpu", "test_cpu_torchrun_line_runs", ""),
    (r"quickstart-every|every/", "test_every_commands_run", ""),
    (r"^groundtune data ", "test_data_commands_run", ""),
    (r"^groundtune plan ", "test_plan_commands_run", ""),
    (r"^groundtune quickstart$", "test_quickstart_command_runs", ""),
    (r"^groundtune train --help$", "test_train_help_runs", ""),
    (r"head=box|quickstart/box", "test_box_head_commands_run", ""),
    (r"^groundtune (eval|predict) ", "test_eval_and_predict_commands_run", ""),
    (r"^groundtune rl ", "test_rl_commands_run", ""),
    (r"^groundtune export quickstart/run ", "test_export_command_runs", ""),
    (r"^(groundtune serve |curl |from openai import|chunks = list\()", "test_serve_commands_run", ""),
    (r"^groundtune train qwen2\.5-vl-[37]b-", None, "a GPU preset: a real hub model on a 24 GB GPU"),
    (r"^groundtune studio\b", None, "a server that runs until stopped; tests/test_studio.py starts it and drives "
     "each tab in headless Chromium"),
]
SIZES = {"--n 10000": "--n 24", "--n 500": "--n 8"}
QUICKSTART = ["quickstart", "--n-train", "64", "--n-eval", "8", "max_steps=4", "eval_every=2", "save_every=2",
              "log_every=1", "num_workers=0"]
SHORT = " max_steps=2 eval_every=0 save_every=0 num_workers=0"  # appended to a training command


def _blocks(language: str, pages=PAGES) -> list[str]:
    fence = re.compile(rf"^```{language}\n(.*?)^```", re.S | re.M)
    return [block for page in pages for block in fence.findall(page.read_text())]


def _all_commands(pages=PAGES) -> list[str]:
    """Every command line of the pages' bash blocks (continuation lines joined, comments dropped),
    then every python block whole."""
    text = "\n".join(_blocks("bash", pages)).replace("\\\n", " ")
    lines = [re.sub(r"\s+", " ", line.split("  #")[0]).strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith("#")] + [b.strip() for b in _blocks("python", pages)]


def _rule(command: str):
    return next(((test, why) for pattern, test, why in RULES if re.search(pattern, command)), None)


def _commands(test: str) -> list[str]:
    """The commands RULES gives to ``test``, in page order."""
    return [c for c in _all_commands() if (_rule(c) or (None,))[0] == test]


def _run(command: str, **replacements) -> int:
    for old, new in {**SIZES, **replacements}.items():
        command = command.replace(old, new)
    return main(shlex.split(command)[1:])


def _python(command: str, cwd: Path) -> str:
    """A ``python ...`` line, with this interpreter; returns its output."""
    done = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


# --------------------------------------------------------------------------------------------
# What a newcomer brings: small files at the paths the pages name


def _image(path: Path, size: tuple[int, int], fmt: str | None = None, index: int = 0) -> Path:
    """A synthetic scene of this size (something to find), saved at ``path``."""
    from groundtune.data import synth

    image, _ = synth.make_sample(seed=11, index=index, width=size[0], height=size[1], task="single")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format=fmt)
    return path


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _coco(instances: Path, images: Path) -> None:
    """A COCO detection file with several boxes per image (tests/fixtures/refgen's), and its images."""
    fixture = json.loads((ROOT / "tests" / "fixtures" / "refgen" / "instances_val.json").read_text())
    instances.parent.mkdir(parents=True, exist_ok=True)
    instances.write_text(json.dumps(fixture))
    for i, record in enumerate(fixture["images"]):
        _image(images / record["file_name"], (record["width"], record["height"]), index=i)


def _newcomer_files(folder: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # RefCOCO: the refer toolkit's pickle over COCO instances, and the COCO images
    for image_id in (1, 2):
        _image(folder / "coco" / "train2014" / f"COCO_train2014_{image_id:012d}.jpg", (160, 120), index=image_id)
    instances = {
        "images": [{"id": i, "file_name": f"COCO_train2014_{i:012d}.jpg", "width": 160, "height": 120} for i in (1, 2)],
        "annotations": [{"id": 100 + i, "image_id": i, "bbox": [20, 10, 60, 50], "category_id": 1, "iscrowd": 0,
                         "area": 3000} for i in (1, 2)],
        "categories": [{"id": 1, "name": "shape"}],
    }
    (folder / "refcoco").mkdir()
    (folder / "refcoco" / "instances.json").write_text(json.dumps(instances))
    refs = [{"ref_id": i, "ann_id": 100 + i, "image_id": i, "split": split, "category_id": 1,
             "file_name": f"COCO_train2014_{i:012d}_{100 + i}.jpg",
             "sentences": [{"raw": "the shape", "sent": "the shape", "tokens": ["the", "shape"], "sent_id": i}]}
            for i, split in ((1, "val"), (2, "train"))]
    (folder / "refcoco" / "refs(unc).p").write_bytes(pickle.dumps(refs, protocol=2))
    # lmms-lab/RefCOCO-style parquet: images embedded
    png = _image(folder / "photo.png", (168, 168), index=3).read_bytes()
    embedded = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # datasets' Image feature
    schema = pa.schema([("question_id", pa.string()), ("image", embedded), ("question", pa.string()),
                        ("answer", pa.list_(pa.string())), ("bbox", pa.list_(pa.float64())),
                        ("file_name", pa.string())])
    rows = [{"question_id": "q1", "image": {"bytes": png, "path": None}, "question": "?",
             "answer": ["the shape"], "bbox": [10.0, 10.0, 40.0, 40.0], "file_name": "photo.png"}]
    (folder / "RefCOCO" / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), folder / "RefCOCO/data/val-00000-of-00001.parquet")
    # COCO detections (also the refgen picture's synthetic scenes as detections, data/)
    _coco(folder / "instances_val2017.json", folder / "val2017")
    _coco(folder / "data" / "instances_train.json", folder / "data" / "images")
    # their own JSONL, a photo, queries, a shelf of detections
    _image(folder / "photo.jpg", (200, 150), "JPEG", index=4)
    _write_jsonl(folder / "mine.jsonl", [{"image": "photo.jpg", "phrase": "the shape", "bbox": [10, 10, 60, 50]}])
    _write_jsonl(folder / "queries.jsonl", [{"image": "photo.jpg", "phrase": "the red mug"},
                                            {"image": "photo.png", "phrase": "the red circle"}])
    _image(folder / "shelf.png", (640, 240), index=5)
    boxes = [[20 + 120 * i, 40, 90 + 120 * i, 200] for i in range(5)]
    _write_jsonl(folder / "shelves.jsonl", [{"image": "shelf.png", "width": 640, "height": 240, "bboxes": boxes,
                                             "labels": ["bottle", "bottle", "can", "bottle", "jar"]}])


# --------------------------------------------------------------------------------------------
# The pages' shape


def test_install_and_test_commands_are_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    install = re.search(r"^(pip install .*?)\s+# install$", README, re.M).group(1)
    test = re.search(r"^(python -m pytest)\s+# the tests", README, re.M).group(1)
    assert install in ci and test in ci


def test_readme_is_a_front_page():
    lines = README.splitlines()
    assert len(lines) <= 150
    first = "\n".join(lines[:30])
    assert "# install" in first and "\ngroundtune quickstart " in first and "# the tests" in first
    # the only bold numbers are the headline figures, one a row, each row linking the JSON it comes from
    table = re.search(r"^## Headline figures\n(.*?)^## ", README, re.S | re.M).group(1)
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith(("| what", "|---"))]
    assert rows and all(re.search(r"\*\*[^*]*\d[^*]*\*\*", r) and re.search(r"\(bench/results/[\w/]+\.json\)", r)
                        for r in rows)
    outside = README.replace(table, "")
    assert not re.findall(r"\*\*[^*]*\d[^*]*\*\*", outside)
    # one row per command, each with a link to its docs
    commands = re.search(r"^## Commands\n(.*?)^## ", README, re.S | re.M).group(1)
    named = re.findall(r"^\| `([^`]+)`", commands, re.M)
    assert named == [*(f"groundtune data {c}" for c in ("convert", "check", "show", "synth", "refgen")),
                     *(f"groundtune {c}" for c in ("plan", "train", "rl", "eval", "predict", "export", "serve", "studio",
                                                    "quickstart")),
                     "torchrun"]
    assert all("](docs/" in row for row in commands.splitlines() if row.startswith("| `"))


def test_every_docs_page_opens_with_its_commands():
    for page in PAGES[1:]:
        text = page.read_text()
        assert re.match(r"# [^\n]+\n\n```bash\n", text), page.name
    # the box-head training command is written once
    assert sum(page.read_text().count("groundtune train quickstart head=box") for page in PAGES) == 1


def _anchors(page: Path) -> set[str]:
    """The heading anchors GitHub gives a page: lower case, punctuation dropped, spaces to hyphens,
    -1, -2 ... after repeats."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links() -> list[tuple[Path, str]]:
    """(page, target) of every relative link and image of the pages, outside code."""
    found = []
    for page in [*PAGES, HISTORY, ROOT / "BENCHMARKS.md"]:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        text = re.sub(r"`[^`\n]*`", "", text)
        found += [(page, t) for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]
    return found


def _resolves(page: Path, target: str) -> bool:
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
        return False
    return not anchor or (file.suffix == ".md" and anchor in _anchors(file))


def test_every_relative_link_resolves():
    links = _links()
    assert len(links) > 40
    broken = [f"{page.name}: {target}" for page, target in links if not _resolves(page, target)]
    assert not broken


def test_every_command_is_run_or_skipped():
    commands = _all_commands()
    unruled = [c for c in commands if _rule(c) is None]
    assert not unruled, "give each a test or a reason in RULES: " + "; ".join(unruled)
    tests = {test for test, _ in map(_rule, commands) if test}
    assert tests <= set(globals()), tests - set(globals())
    deciding = {next(p for p, _, _ in RULES if re.search(p, c)) for c in commands}
    unused = [pattern for pattern, _, _ in RULES if pattern not in deciding]
    assert not unused, f"rules that match no command: {unused}"


def test_presets_named_in_the_docs_exist():
    from groundtune.config import preset_path

    presets = re.search(r"^## Presets\n(.*?)^## ", (ROOT / "docs" / "training.md").read_text(), re.S | re.M).group(1)
    names = re.findall(r"`([a-z0-9.\-]+)`:", presets)
    assert len(names) == 8
    for name in names:
        assert preset_path(name).exists(), name
    for command in _all_commands():
        words = command.split()
        if words[:2] in (["groundtune", "train"], ["groundtune", "rl"]) and not words[2].startswith("--"):
            if not words[2].endswith(".yaml"):
                assert preset_path(words[2]).exists(), words[2]


# --------------------------------------------------------------------------------------------
# Plan: every command of docs/plan.md, and the answer its page shows


def test_plan_commands_run(tmp_path, monkeypatch, capsys):
    from groundtune.data.records import write_samples

    monkeypatch.chdir(tmp_path)
    write_samples(tmp_path / "train.jsonl", [{"id": str(i), "image": f"{i}.jpg", "width": 640, "height": 427,
                                              "phrase": "a dog", "bbox": [1, 1, 20, 20], "split": "train",
                                              "source": "mine"} for i in range(50)])
    commands = _commands("test_plan_commands_run")
    assert len(commands) == 6
    for command in commands:
        assert _run(command) == 0, command
    capsys.readouterr()
    # the page's example answer is what the command prints today
    page = (ROOT / "docs" / "plan.md").read_text()
    shown = re.search(r"^```\n(Qwen/.*?)^```", page, re.S | re.M).group(1)
    assert main(["plan", "qwen2.5-vl-3b-lora-24gb", "batch_size=128", "--gpu", "rtx4090"]) == 0
    assert capsys.readouterr().out == shown


# Data: every command of docs/data.md, and its pictures' captions


def test_data_commands_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _newcomer_files(tmp_path)
    commands = _commands("test_data_commands_run")
    assert len(commands) == 13
    for command in commands:
        assert _run(command) == 0, command
    assert len(Path("synth/train.jsonl").read_text().splitlines()) == 24
    assert len(Path("synth/val.jsonl").read_text().splitlines()) == 8
    mixed = [json.loads(line) for line in Path("synth-mixed/train.jsonl").read_text().splitlines()]
    assert len(mixed) == 8 and all(112 <= r["width"] <= 224 and 112 <= r["height"] <= 224 for r in mixed)
    assert len({(r["width"], r["height"]) for r in mixed}) > 1
    assert Path("grid.png").stat().st_size > 0
    assert [json.loads(line)["split"] for line in Path("refcoco-val.jsonl").read_text().splitlines()] == ["val"]
    for out in ("refcoco.jsonl", "coco.jsonl", "mine-clean.jsonl", "clean.jsonl", "refs.jsonl", "shelf-refs.jsonl"):
        assert Path(out).read_text().strip(), out
    assert any(json.loads(line)["kind"] == "ordinal" for line in Path("shelf-refs.jsonl").read_text().splitlines())
    # the pictures' captions
    data = (ROOT / "docs" / "data.md").read_text().replace("\n", " ")
    caption = re.search(r"\*`(groundtune data synth[^`]*)` then `(groundtune data show[^`]*)`", data)
    assert _run(caption.group(1), **{"--out synth-wide": "--out caption"}) == 0
    assert _run(caption.group(2), **{"synth-wide/train.jsonl": "caption/train.jsonl"}) == 0
    # the refgen picture's commands write refs.jsonl and grid.png too: in a folder of their own
    refgen = re.search(r"then `(groundtune data refgen[^`]*)` and `(groundtune data show[^`]*)`", data)
    shutil.copytree(tmp_path / "data", tmp_path / "caption-refgen" / "data")
    monkeypatch.chdir(tmp_path / "caption-refgen")
    assert _run(refgen.group(1)) == 0 and _run(refgen.group(2)) == 0 and Path("grid.png").exists()


def test_train_help_runs(capsys):
    (command,) = _commands("test_train_help_runs")
    with pytest.raises(SystemExit) as exit:
        _run(command)
    assert exit.value.code == 0 and "lora_targets" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# From the quickstart on: one shortened quickstart, the pages' commands after it


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder where `groundtune quickstart` ran (shortened: same code path, a few steps), with the
    newcomer's files and refcoco-val.jsonl converted as docs/data.md does."""
    folder = tmp_path_factory.mktemp("newcomer")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        _newcomer_files(folder)
        (convert,) = [c for c in _commands("test_data_commands_run") if "--from refcoco" in c]
        assert _run(convert) == 0
        with contextlib.redirect_stdout(printed):
            code = main(QUICKSTART)
    return SimpleNamespace(path=folder, code=code, printed=printed.getvalue())


@pytest.fixture(scope="module")
def exported(workspace):
    """The export command of docs/export-and-serve.md, run in the workspace."""
    (command,) = _commands("test_export_command_runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workspace.path)
        assert _run(command) == 0
    return workspace.path / "quickstart" / "export"


@pytest.mark.slow
def test_quickstart_command_runs(workspace, monkeypatch):
    monkeypatch.chdir(workspace.path)
    assert set(_commands("test_quickstart_command_runs")) == {"groundtune quickstart"}  # README, docs/training.md
    assert workspace.code == 0
    out = workspace.printed
    assert "Acc@.5" in out and "gallery:" in out and "before ->" in out
    report = json.loads(Path("quickstart/report.json").read_text())
    before, after = report["before"], report["after"]
    assert before["model"] == "tiny" and after["model"] == "quickstart/run"
    assert before["n"] == after["n"] == 8 and {"acc@0.5", "acc@0.75", "miou", "parse_fail_rate"} <= set(after)
    assert report["gain"] == pytest.approx(after["acc@0.5"] - before["acc@0.5"])
    # the variant: a background the tiny model was not trained on (dark: most pixels, the background,
    # well below the light grey of 200-240 the tiny model was pre-trained on)
    record = json.loads(Path("quickstart/data/val.jsonl").read_text().splitlines()[0])
    assert (record["width"], record["height"]) == (112, 112)
    from PIL import Image, ImageStat

    assert ImageStat.Stat(Image.open(Path("quickstart/data") / record["image"]).convert("L")).median[0] <= 70
    assert Path("quickstart/gallery/index.html").exists()
    assert (Path("quickstart/run/model") / "groundtune.json").exists()
    # running it again resumes nothing (finished) and only re-evaluates
    assert main(["quickstart", "--n-train", "64", "--n-eval", "8"]) == 0


@pytest.mark.slow
def test_eval_and_predict_commands_run(workspace, monkeypatch):
    """docs/eval-and-inference.md's commands; the runs they name are the user's, so the quickstart's
    run stands in for each (copied to runs/qwen2.5-vl-3b-lora, runs/a, runs/b)."""
    monkeypatch.chdir(workspace.path)
    commands = _commands("test_eval_and_predict_commands_run")
    assert len(commands) == 4
    for run in ("runs/qwen2.5-vl-3b-lora", "runs/a", "runs/b"):
        if not Path(run).exists():
            shutil.copytree("quickstart/run", run, ignore=shutil.ignore_patterns(".lock"))
    for command in commands:
        assert _run(command) == 0, command
    report = json.loads(Path("report.json").read_text())
    assert report["n"] == 1 and "acc@0.5" in report
    assert Path("gallery/index.html").exists() and Path("out.png").stat().st_size > 0
    predictions = [json.loads(line) for line in Path("predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 2 and all("prediction" in p for p in predictions)


@pytest.mark.slow
def test_rl_commands_run(workspace, monkeypatch):
    monkeypatch.chdir(workspace.path)
    (command,) = _commands("test_rl_commands_run")
    assert command == "groundtune rl quickstart-rl model=quickstart/run"
    assert _run(command + " max_steps=2 batch_size=2 group_size=2 eval_samples=4 eval_every=0 save_every=0") == 0
    assert (Path("quickstart/rl/model") / "adapter_config.json").exists()


@pytest.mark.slow
def test_every_commands_run(tmp_path, monkeypatch):
    """docs/training.md's "every object, or none": the val set, the preset (a few steps), eval; then
    RL on sets from that run (a few steps) and its eval."""
    monkeypatch.chdir(tmp_path)
    synth, train, evaluate, rl, rl_evaluate = _commands("test_every_commands_run")
    assert _run(synth.replace("--n 300", "--n 6")) == 0
    assert train.startswith("groundtune train quickstart-every ") and _run(train + SHORT) == 0
    assert Path("every/run/model/model.safetensors").exists()
    assert _run(evaluate) == 0
    assert rl == "groundtune rl quickstart-every-rl"
    assert _run(rl + " max_steps=2 batch_size=2 group_size=2 max_new_tokens=16 eval_samples=4 eval_every=0 "
                     "save_every=0") == 0
    assert (Path("every/rl/model") / "adapter_config.json").exists()
    assert _run(rl_evaluate) == 0


@pytest.mark.slow
def test_export_command_runs(exported, workspace, monkeypatch):
    """The export writes what its listing shows, and the export loads back."""
    monkeypatch.chdir(workspace.path)
    page = (ROOT / "docs" / "export-and-serve.md").read_text()
    listed = re.search(r"quickstart/export/\n(.*?)```", page, re.S).group(1)
    for name in re.findall(r"^  (\S+?)[ ,]", listed, re.M) + ["chat_template.jinja"]:
        assert (exported / name).exists(), name
    image = next(Path("quickstart/data/images").glob("*.png"))
    assert main(["predict", "--model", "quickstart/export", "--image", str(image), "--phrase", "the red circle"]) == 0


@pytest.mark.slow
def test_box_head_commands_run(workspace, monkeypatch):
    """docs/box-head.md: train (a few steps), eval, export --onnx, and the runner without torch."""
    monkeypatch.chdir(workspace.path)
    train, evaluate, export, predict = _commands("test_box_head_commands_run")
    assert train.startswith("groundtune train ") and _run(train + SHORT) == 0
    assert Path("quickstart/box/model/box_head.safetensors").exists()
    assert _run(evaluate) == 0
    assert _run(export) == 0 and Path("quickstart/box-export/model.onnx").exists()
    (answer,) = [json.loads(line) for line in _python(predict, workspace.path).splitlines()]
    # a few steps leave the slots' scores near their prior, under the threshold: 0 or more boxes
    assert answer["phrase"] == "the yellow triangle on the left" and len(answer["boxes"]) == len(answer["scores"])
    assert all(len(box) == 4 for box in answer["boxes"]) and all(0 <= s <= 1 for s in answer["scores"])


@pytest.mark.slow
def test_serve_commands_run(exported, workspace):
    """docs/export-and-serve.md: the server as its command starts it, then the curl lines and the
    openai snippets (answered whole, then streamed) against it (at a free port instead of 8000)."""
    from PIL import Image

    from serving import launch  # bench/serving.py

    serve, *clients = _commands("test_serve_commands_run")
    words = shlex.split(serve)
    assert words[:3] == ["groundtune", "serve", "--model"]
    log = workspace.path / "serve.log"
    with log.open("w") as out:
        try:
            process, url = launch(*words[3:], timeout_s=120, cwd=workspace.path, stdout=out, stderr=subprocess.STDOUT)
        except RuntimeError as e:
            raise AssertionError(f"{e}\n{log.read_text()}") from None
    try:
        curls = [c for c in clients if c.startswith("curl ")]
        assert len(curls) == 2
        for command, phrases, image in zip(curls, (2, 1), ("photo.png", "photo.jpg")):
            done = subprocess.run(["bash", "-c", command.replace("http://127.0.0.1:8000", url)], cwd=workspace.path,
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            answer = json.loads(done.stdout)
            assert (answer["width"], answer["height"]) == Image.open(workspace.path / image).size, answer
            assert len(answer["results"]) == phrases and all("bbox" in r for r in answer["results"])
        (snippet,) = [c for c in clients if c.startswith("from openai import")]
        scope = {"image_b64": base64.b64encode((workspace.path / "photo.png").read_bytes()).decode()}
        exec(snippet.replace("http://127.0.0.1:8000", url), scope)
        content, box = eval(snippet.splitlines()[-1], scope)
        assert isinstance(content, str) and (box is None or len(box) == 4)
        assert scope["reply"].model_extra["groundtune"]["width"] == 168
        (streaming,) = [c for c in clients if c.startswith("chunks = list(")]  # the same question, streamed
        exec(streaming, scope)
        assert eval(streaming.splitlines()[-1], scope) == (content, box)
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH")
def test_cpu_torchrun_line_runs(tmp_path):
    """docs/scaling.md's two ranks on a CPU (gloo), with fewer steps."""
    (command,) = _commands("test_cpu_torchrun_line_runs")
    words = shlex.split(command.replace("max_steps=20", "max_steps=2"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([TORCHRUN, *words[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "runs" / "ddp" / "model" / "groundtune.json").exists()
