"""A run folder's layout, in one place: every module that reads or writes a run (training, resume,
loading, export, plan, the settings' checks) asks ``RunFolder`` for its paths instead of spelling
them, so the layout cannot differ between the writer and its readers.

    RUN/config.yaml                 the resolved settings; --resume reads them back
    RUN/data.json                   the training records' count and ids: what a resumed run must find again
    RUN/metrics.jsonl, RUN/tb/      logs (train/monitor.py)
    RUN/eval/step-000100.json       each training-time eval's whole report
    RUN/eval/step-000100.samples.jsonl  ... and its answers, one line a sample (the studio's best and worst)
    RUN/trackers.json               the W&B and MLflow run ids a resumed run goes on with
    RUN/mlflow.db, RUN/mlartifacts/ MLflow's store in the run, when no tracking server is set
    RUN/bad_records.jsonl           records left out (bad_records=skip) or that failed to load
    RUN/checkpoints/step-000100/    trainable weights, optimizer, scheduler, RNG, loop state
                                    (train/checkpoint.py)
    RUN/model/                      the model to use: best by Acc@0.5 when evaluating (by F1@0.5 or
                                    set_acc@0.5 where Acc@0.5 counts no eval sample: evaluate.headline),
                                    else the last (a LoRA adapter or full weights, + processor +
                                    groundtune.json)
    RUN/STOP                        made by the user: the run saves a checkpoint and stops
    RUN/.lock                       the process writing the run (pid, host), while it runs

No torch and no groundtune import: the settings' checks and ``groundtune plan`` read runs too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["METADATA_FILE", "STEP_PREFIX", "RunFolder", "is_run", "step_name", "step_of"]

# what groundtune writes into every model folder it makes (RUN/model/, an export): family, box
# convention, pixel budget, prompt, head; models/loading.py reads it back
METADATA_FILE = "groundtune.json"
STEP_PREFIX = "step-"  # a checkpoint's folder and an eval's report are named by their step


def step_name(step: int) -> str:
    """step-000100: zero-padded, so that names sort as steps do."""
    return f"{STEP_PREFIX}{step:06d}"


def step_of(path: Path) -> int:
    """The step a file or folder of ``step_name`` is named by (RUN/eval/step-000100.json,
    step-000100.samples.jsonl, checkpoints/step-000100); 0 for a name that holds none."""
    try:
        return int(path.name.split(".", 1)[0].removeprefix(STEP_PREFIX))
    except ValueError:
        return 0


@dataclass(frozen=True)
class RunFolder:
    """The paths of the run folder ``path`` (a str is taken as a path); nothing is read or made."""

    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def data(self) -> Path:
        return self.path / "data.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def tb(self) -> Path:
        return self.path / "tb"

    @property
    def eval_reports(self) -> Path:
        return self.path / "eval"

    def eval_report(self, step: int) -> Path:
        return self.eval_reports / f"{step_name(step)}.json"

    def eval_samples(self, step: int) -> Path:
        """The answers of the eval at ``step``, one JSON line a sample (evaluate.write_rows)."""
        return self.eval_reports / f"{step_name(step)}.samples.jsonl"

    @property
    def trackers(self) -> Path:
        return self.path / "trackers.json"

    @property
    def mlflow_db(self) -> Path:
        return self.path / "mlflow.db"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.path / "mlartifacts"

    @property
    def bad_records(self) -> Path:
        return self.path / "bad_records.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_name(step)

    @property
    def model(self) -> Path:
        return self.path / "model"

    @property
    def stop(self) -> Path:
        return self.path / "STOP"

    @property
    def lock(self) -> Path:
        return self.path / ".lock"

    @property
    def has_model(self) -> bool:
        """Whether the run has written its model (RUN/model/groundtune.json, written last)."""
        return (self.model / METADATA_FILE).exists()

    @property
    def replaced_by_a_new_run(self) -> tuple[Path, ...]:
        """What a new run in this folder removes first (overwrite=true), so that nothing of the old
        run is read as the new one's; config.yaml and data.json are written anew, and MLflow's store
        keeps every run."""
        return (self.metrics, self.tb, self.eval_reports, self.trackers, self.model, self.checkpoints,
                self.bad_records)


def is_run(path: str | Path) -> bool:
    """Whether ``path`` holds a groundtune run, finished or not: its settings, or its checkpoints."""
    run = RunFolder(path)
    return run.config.exists() or run.checkpoints.is_dir()
