"""Experiment trackers (report_to): W&B (offline) and MLflow (its store in the run folder) hold
what metrics.jsonl holds at the same steps, with the config and the eval reports, and a resumed
run goes on in the same tracker runs; a tracker unknown or not installed is one line and exit 2,
before the model loads (a fresh process, where the tracker's import is blocked)."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from groundtune.cli import main
from groundtune.config import TRACKERS, TrainConfig, load_config, preset_path
from groundtune.errors import MissingPackageError
from groundtune.runs import RunFolder
from groundtune.train.monitor import WRITERS, MetricsLog, check_trackers


def test_every_tracker_setting_has_a_writer():
    assert tuple(WRITERS) == TRACKERS


@pytest.mark.parametrize("given, names", [
    ("report_to=wandb,mlflow", ["wandb", "mlflow"]),
    ("report_to=[tensorboard, wandb]", ["tensorboard", "wandb"]),
    ("report_to=mlflow", ["mlflow"]),
    ("report_to=none", []),
    ("report_to=[]", []),
    ("report_to=", []),
    ("report_to=wandb,wandb", ["wandb"]),
])
def test_report_to_on_the_command_line(given, names):
    assert load_config(TrainConfig, preset_path("quickstart"), [given]).report_to == names


def test_report_to_in_yaml_and_its_default(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train_data: x.jsonl\nreport_to: [mlflow, tensorboard]\n")
    assert load_config(TrainConfig, path).report_to == ["mlflow", "tensorboard"]
    assert TrainConfig(train_data="x").report_to == ["tensorboard"]


def test_no_tracker_writes_metrics_jsonl_alone(tmp_path):
    log = MetricsLog(tmp_path, report_to=[])
    log.log(1, {"loss": 0.5})
    log.close()
    assert not (tmp_path / "tb").exists() and not RunFolder(tmp_path).trackers.exists()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 0.5


def _train_args(data: Path, run: Path, *more: str) -> list[str]:
    return ["train", "quickstart", f"train_data={data / 'train.jsonl'}", f"out_dir={run}", "max_steps=2",
            "num_workers=0", "batch_size=2", *more]


def test_unknown_tracker_is_one_line_exit_2(synth_single, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_train_args(synth_single, run, "report_to=wandb,comet")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: report_to: unknown 'comet'") and "mlflow" in err
    assert not run.exists()


@pytest.mark.parametrize("blocked, extra", [("wandb", "wandb"), ("mlflow", "mlflow"), ("sqlalchemy", "mlflow")])
def test_missing_tracker_package_is_one_line_exit_2_before_the_model_loads(synth_single, tmp_path, blocked, extra):
    """The real command line in a Python where ``blocked`` cannot be imported."""
    run = tmp_path / "run"
    code = (f"import sys; sys.modules[{blocked!r}] = None\n"
            "from groundtune.cli import main\n"
            f"sys.exit(main({_train_args(synth_single, run, f'report_to=tensorboard,{extra}')!r}))")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    pip = f'pip install "groundtune[{extra}]"'
    assert done.stderr == f"error: report_to={extra} needs {blocked} (not installed): {pip}\n"
    assert not run.exists()  # refused before the run folder, the data check and the model


def test_an_mlflow_server_needs_no_local_store(monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # what the SQLite store in the run folder needs
    with pytest.raises(MissingPackageError, match="needs sqlalchemy"):
        check_trackers(["mlflow"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    check_trackers(["mlflow"])


# --------------------------------------------------------------------------------------------
# a run and its resume, read back from both trackers' own stores


def _wandb_records(path: Path):
    """The records of W&B's run file (RUN/wandb/offline-run-*/run-ID.wandb): LevelDB's log format
    (32 KiB blocks of checksum, length, type, payload) after a 7-byte header, each record one
    protobuf ``Record``. wandb 0.31 ships no Python reader for it any more."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, payload = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            yield record
            payload = b""


def _wandb_run(path: Path) -> dict:
    """What one W&B offline run file holds: its id, project, config, history by step, artifacts."""
    found = {"history": {}, "artifacts": []}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            found.update(id=record.run.run_id, project=record.run.project,
                         config={i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            found["history"].setdefault(record.history.step.num, {}).update(
                {k: v for k, v in items.items() if not k.startswith("_")})
        elif kind == "artifact":
            found["artifacts"] += [m.path for m in record.artifact.manifest.contents]
    return found


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """W&B offline, its caches and settings in the test's folder; MLflow with no server named."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("CONFIG", "CACHE", "DATA", "ARTIFACT"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / f"wandb-{name.lower()}"))
    for name in ("WANDB_PROJECT", "WANDB_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.slow
def test_wandb_and_mlflow_hold_the_log_and_a_resumed_run_goes_on_in_the_same_runs(synth_single, tmp_path, offline,
                                                                                    small_model):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from groundtune.train.sft import train

    run = tmp_path / "run"
    overrides = [f"model={small_model}", f"train_data={synth_single / 'train.jsonl'}",
                 f"eval_data={synth_single / 'val.jsonl'}", f"out_dir={run}", "max_steps=4", "log_every=1",
                 "eval_every=2", "eval_samples=4", "eval_batch_size=4", "eval_max_new_tokens=8", "save_every=2",
                 "num_workers=0", "batch_size=2", "report_to=wandb,mlflow"]

    def stop_at_2(step, run, model):
        if step == 2:
            (run / "STOP").touch()

    train(load_config(TrainConfig, preset_path("quickstart"), overrides), on_step=stop_at_2)
    first = json.loads(RunFolder(run).trackers.read_text())
    assert main(["train", "--resume", str(run)]) == 0
    assert json.loads(RunFolder(run).trackers.read_text()) == first

    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = sorted({line["step"] for line in lines})
    assert steps == [0, 1, 2, 3, 4]
    losses = {line["step"]: line["loss"] for line in lines if "loss" in line}
    reports = ["step-000002.json", "step-000004.json"]
    answers = ["step-000002.samples.jsonl", "step-000004.samples.jsonl"]  # what the studio shows; no tracker's
    assert sorted(p.name for p in (run / "eval").iterdir()) == sorted(reports + answers)

    # W&B: one offline run file per process, both of the one run id
    runs = [_wandb_run(p) for p in sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))]
    assert [r["id"] for r in runs] == [first["wandb"]] * 2 and {r["project"] for r in runs} == {"groundtune"}
    history = {step: values for r in runs for step, values in r["history"].items()}
    assert sorted(history) == steps and sorted(runs[0]["history"]) == [0, 1, 2]  # no step twice
    assert {step: values["loss"] for step, values in history.items() if "loss" in values} == losses
    assert runs[0]["config"]["lr"] == 2e-3 and runs[0]["config"]["report_to"] == ["wandb", "mlflow"]
    assert sorted(a for r in runs for a in r["artifacts"]) == reports

    # MLflow: the one run in the store inside the run folder, finished, with the same steps
    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("groundtune")
    [found] = client.search_runs([experiment.experiment_id])
    assert found.info.run_id == first["mlflow"] and found.info.status == "FINISHED"
    history = {key: client.get_metric_history(found.info.run_id, key) for key in found.data.metrics}
    assert sorted({m.step for metrics in history.values() for m in metrics}) == steps
    assert {m.step: m.value for m in history["loss"]} == losses and len(history["loss"]) == len(losses)
    assert {m.step for m in history["eval/acc_0.5"]} == {2, 4}  # eval/acc@0.5: MLflow takes no @
    assert found.data.params["lr"] == "0.002" and found.data.params["max_steps"] == "4"
    assert sorted(a.path for a in client.list_artifacts(found.info.run_id, "eval")) == [f"eval/{r}" for r in reports]
