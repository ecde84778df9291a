"""``hf:REPO:SPLIT`` data (data/hub.py), offline, on a tiny data set laid out as the hub cache keeps it.

No download: HF_HOME is a folder of the test's holding ``hub/datasets--lmms-lab--RefCOCO`` with a
snapshot (``snapshots/<commit>/README.md``, ``data/val-00000-of-00001.parquet``,
``data/test-...``) and ``refs/main``, which is what ``hf download lmms-lab/RefCOCO --repo-type
dataset`` or an online ``datasets.load_dataset`` leaves (the hub keeps the files in ``blobs/`` and
links them from the snapshot; plain files read the same). The parquet rows have the columns of
lmms-lab/RefCOCO, and the README its features and splits.

How the installed ``datasets`` (5.x) reads it offline: ``load_dataset("lmms-lab/RefCOCO")`` with
HF_HUB_OFFLINE=1 looks only in datasets' own arrow cache, never in the hub cache, so hub.py finds
the snapshot with ``huggingface_hub.snapshot_download(local_files_only=True)`` and has ``datasets``
read that folder (README splits and features included), preparing its arrow copy under
HF_HOME/datasets as it does for any data set. No arrow cache is built beforehand here.

Every resolution runs in a process of its own, as users run the commands: ``datasets`` and
``huggingface_hub`` read HF_HOME and the offline switches once, when imported.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from groundtune.cli import main
from groundtune.data import hub
from groundtune.data.records import DataError, image_path

SPEC = "hf:lmms-lab/RefCOCO:val"
COMMIT = "e15256ece129a21d62e216f95f98ba2e808f96a0"

# lmms-lab/RefCOCO's columns, as its README declares them
SCHEMA = pa.schema([
    ("question_id", pa.string()), ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
    ("question", pa.string()), ("answer", pa.list_(pa.string())), ("segmentation", pa.list_(pa.float32())),
    ("bbox", pa.list_(pa.float32())), ("iscrowd", pa.int8()), ("file_name", pa.string()),
])
README = """---
dataset_info:
  features:
  - name: question_id
    dtype: string
  - name: image
    dtype: image
  - name: question
    dtype: string
  - name: answer
    sequence: string
  - name: segmentation
    sequence: float32
  - name: bbox
    sequence: float32
  - name: iscrowd
    dtype: int8
  - name: file_name
    dtype: string
configs:
- config_name: default
  data_files:
  - split: val
    path: data/val-*
  - split: test
    path: data/test-*
---
"""
QUESTION = "Please carefully observe the area circled in the image and come up with a caption for the area."


def jpeg(size: tuple[int, int], color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="JPEG")
    return buf.getvalue()


def rows(prefix: str) -> list[dict]:
    pictures = [jpeg((64, 48), (200, 30, 30)), jpeg((40, 56), (20, 90, 200))]
    return [
        {"question_id": f"{prefix}{k}", "image": {"bytes": pictures[k % 2], "path": None}, "question": QUESTION,
         "answer": [f"thing {k}", f" the one on the left {k} "], "segmentation": [1.5, 2.5, 10.25, 12.75],
         "bbox": [1.3 + k, 2.7, 10.1, 20.9], "iscrowd": 0, "file_name": f"COCO_train2014_{k:012d}_{k}.jpg"}
        for k in range(5)
    ]


def hub_repo(hf_home: Path, repo: str, files: dict[str, pa.Table], readme: str | None) -> Path:
    """A dataset repo in the hub cache's layout; returns its snapshot folder."""
    folder = hf_home / "hub" / f"datasets--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / COMMIT
    (snapshot / "data").mkdir(parents=True)
    for name, table in files.items():
        pq.write_table(table, snapshot / "data" / name, row_group_size=2)  # several batches per file
    if readme is not None:
        (snapshot / "README.md").write_text(readme)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def home(tmp_path: Path) -> dict:
    """HF_HOME with lmms-lab/RefCOCO (val, test) in its hub cache, and an empty groundtune cache."""
    hf_home = tmp_path / "hf"
    snapshot = hub_repo(hf_home, "lmms-lab/RefCOCO", {
        "val-00000-of-00001.parquet": pa.Table.from_pylist(rows("v"), schema=SCHEMA),
        "test-00000-of-00001.parquet": pa.Table.from_pylist(rows("t"), schema=SCHEMA),
    }, README)
    return {"hf_home": hf_home, "snapshot": snapshot, "cache": tmp_path / "groundtune-cache"}


def run(home: dict, code_or_args: list[str] | str, block_datasets: bool = False) -> subprocess.CompletedProcess:
    """``python -m groundtune ARGS`` (or ``python -c CODE``), offline, with the test's caches;
    ``block_datasets``: as where the datasets library is not installed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(home["hf_home"]), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               GROUNDTUNE_CACHE=str(home["cache"]))
    if isinstance(code_or_args, str):
        cmd = [sys.executable, "-c", code_or_args]
    elif block_datasets:
        cmd = [sys.executable, "-c", ("import sys; sys.modules['datasets'] = None; from groundtune.cli import main; "
                                      f"sys.exit(main({code_or_args!r}))")]
    else:
        cmd = [sys.executable, "-m", "groundtune", *code_or_args]
    return subprocess.run(cmd, env=env, check=False, capture_output=True, text=True, timeout=300)


def resolve(home: dict, spec: str = SPEC) -> Path:
    done = run(home, f"from groundtune.data.records import jsonl_file; print(jsonl_file({spec!r}))")
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip().splitlines()[-1])


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """A user's error: exit 2 and one line, nothing else on either stream."""
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --------------------------------------------------------------------------------------------


def test_hub_split_is_convert_parquet_record_for_record(home, tmp_path):
    parquet = home["snapshot"] / "data" / "val-00000-of-00001.parquet"
    converted = tmp_path / "converted" / "val.jsonl"
    assert main(["data", "convert", "--from", "parquet", "--path", str(parquet), "--images-out",
                 str(tmp_path / "converted" / "images"), "--out", str(converted)]) == 0
    expected = read(converted)

    from_hub = resolve(home)
    assert from_hub.is_relative_to(home["cache"])
    got = read(from_hub)
    assert len(got) == len(expected) == 10  # two phrases a row
    for mine, theirs in zip(got, expected):
        assert {**mine, "image": None} == {**theirs, "image": None}
        assert image_path(mine, from_hub).read_bytes() == image_path(theirs, converted).read_bytes()
    assert got[0]["split"] == "val" and got[0]["id"] == "v0-0" and got[1]["phrase"] == "the one on the left 0"
    # absolute: the records read the same whichever name (hf:..., or the cache file) a command holds
    assert all(Path(r["image"]).is_absolute() for r in got)


def test_data_check_as_a_user_runs_it_then_from_the_cache(home):
    first = run(home, ["data", "check", SPEC])
    assert first.returncode == 0, first.stdout + first.stderr
    assert "10 records, 0 with errors" in first.stdout and "converting" in first.stderr
    records = next(home["cache"].rglob("records.jsonl"))
    written = records.stat().st_mtime_ns

    # a second run converts nothing: it does not even need the datasets library
    second = run(home, ["data", "check", SPEC, "--json"], block_datasets=True)
    assert second.returncode == 0, second.stdout + second.stderr
    assert json.loads(second.stdout)["lines"] == 10 and "converting" not in second.stderr
    assert records.stat().st_mtime_ns == written


def test_offline_and_not_cached_is_one_line_before_any_model(tmp_path):
    home = {"hf_home": tmp_path / "empty-hf", "cache": tmp_path / "empty-cache"}
    message = one_line_error(run(home, ["data", "check", SPEC]))
    assert message == ("error: hf:lmms-lab/RefCOCO:val is not in the local cache and the hub cannot be reached: run "
                       "once with network, or `hf download lmms-lab/RefCOCO --repo-type dataset`")
    # eval reads its data before it loads a model, so the same line comes first
    assert one_line_error(run(home, ["eval", "--model", "tiny", "--data", SPEC])) == message


def test_wrong_split_lists_the_splits(home):
    message = one_line_error(run(home, ["data", "check", "hf:lmms-lab/RefCOCO:testA"]))
    assert message == "error: hf:lmms-lab/RefCOCO:testA: no split 'testA'; lmms-lab/RefCOCO has the splits val, test"
    message = one_line_error(run(home, ["data", "check", "hf:lmms-lab/RefCOCO"]))
    assert "has the splits val, test; name one, e.g. hf:lmms-lab/RefCOCO:val" in message


def test_one_split_needs_no_name_and_other_columns_are_refused_naming_the_repo(home):
    captions = pa.table({"image": [{"bytes": jpeg((8, 8), (0, 0, 0)), "path": None}], "text": ["a cat"]})
    hub_repo(home["hf_home"], "someone/captions", {"train-00000-of-00001.parquet": captions}, readme=None)
    done = run(home, ["data", "check", "hf:someone/captions"])
    # no README declaring its features: they are known once datasets has read the files, so its
    # progress comes first; the last line is the parquet converter's, naming the repo
    assert done.returncode == 2 and "converting" in done.stderr
    assert done.stderr.splitlines()[-1] == ("error: hf:someone/captions: no column bbox, answer; "
                                            "expected columns image, bbox, answer")
    # a README that declares them: refused before anything is read, in one line
    readme = ("---\ndataset_info:\n  features:\n  - name: image\n    dtype: image\n"
              "  - name: text\n    dtype: string\n---\n")
    hub_repo(home["hf_home"], "someone/described", {"train-00000-of-00001.parquet": captions}, readme)
    message = one_line_error(run(home, ["data", "check", "hf:someone/described:train"]))
    assert message == "error: hf:someone/described: no column bbox, answer; expected columns image, bbox, answer"


def test_without_the_datasets_library(home):
    message = one_line_error(run(home, ["data", "check", SPEC], block_datasets=True))
    assert message.endswith('pip install "groundtune[hf]"')


@pytest.mark.parametrize("spec, parsed", [
    ("hf:lmms-lab/RefCOCO:val", ("lmms-lab/RefCOCO", "val")),
    ("hf:lmms-lab/RefCOCOplus:testA", ("lmms-lab/RefCOCOplus", "testA")),
    ("hf:lmms-lab/RefCOCOg", ("lmms-lab/RefCOCOg", None)),
    ("hf:squad", ("squad", None)),
    ("hf:", None), ("hf:lmms-lab/RefCOCO:", None), ("hf:a/b/c:val", None), ("hf:lmms-lab/:val", None),
    ("hf:a/b:val:x", None),
])
def test_parse(spec, parsed):
    if parsed is None:
        with pytest.raises(DataError, match="write hf:ORG/NAME:SPLIT"):
            hub.parse(spec)
    else:
        assert hub.parse(spec) == parsed


# lmms-lab's repos and splits (their hub pages: data/<split>-0000k-of-0000n.parquet, README configs)
LMMS_LAB = {"lmms-lab/RefCOCO": ["val", "test", "testA", "testB"], "lmms-lab/RefCOCOplus": ["val", "testA", "testB"],
            "lmms-lab/RefCOCOg": ["val", "test"]}


def test_the_docs_hub_commands_name_lmms_labs_splits_and_resolve(tmp_path):
    """docs/data.md's "Straight from the Hub": its specs are lmms-lab's repos and splits, and each
    resolves (offline, on a one-row copy of each repo laid out as the hub's)."""
    docs = (Path(__file__).resolve().parent.parent / "docs" / "data.md").read_text()
    section = docs[docs.index("## Straight from the Hub"):docs.index("## Converters")]
    specs = sorted(set(re.findall(r"--data (hf:\S+)", section)))
    assert specs == sorted(f"hf:{repo}:{split}" for repo, splits in LMMS_LAB.items() for split in splits)
    home = {"hf_home": tmp_path / "hf", "cache": tmp_path / "cache"}
    for repo, splits in LMMS_LAB.items():
        configs = "".join(f"  - split: {s}\n    path: data/{s}-*\n" for s in splits)
        readme = README[:README.index("configs:")] + f"configs:\n- config_name: default\n  data_files:\n{configs}---\n"
        table = pa.Table.from_pylist(rows("q")[:1], schema=SCHEMA)
        hub_repo(home["hf_home"], repo, {f"{s}-00000-of-00001.parquet": table for s in splits}, readme)
    done = run(home, "import json; from groundtune.data.records import read_samples; "
                     f"print(json.dumps({{s: read_samples(s)[0]['split'] for s in {specs!r}}}))")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {spec: spec.rsplit(":", 1)[1] for spec in specs}
