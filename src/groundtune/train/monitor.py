"""What a training loop reports and listens to: metrics.jsonl and its trackers (TensorBoard, W&B,
MLflow), GPU memory, temperature and clocks (read only), a STOP file and SIGINT/SIGTERM, and the
thermal pause."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import time
from pathlib import Path

import torch

from groundtune.data.records import atomic_write
from groundtune.errors import MissingPackageError
from groundtune.runs import STEP_PREFIX, RunFolder, step_of


class MetricsLog:
    """One JSON object per line in RUN/metrics.jsonl, mirrored to the trackers of ``report_to``
    (``WRITERS``: TensorBoard event files in RUN/tb, W&B, MLflow) with the same steps, and the eval
    reports written to RUN/eval/step-N.json and handed to the trackers as artifacts. A new run's
    trackers start new runs and their ids go to RUN/trackers.json; a resumed run (``resume_step``:
    its checkpoint's step) goes on with those ids, and drops what was logged after that step,
    which it replays, so each step is in the log once however often the run was resumed."""

    def __init__(self, run: Path, resume_step: int | None = None, report_to=("tensorboard",),
                 config: dict | None = None):
        self.run, self.path = run, RunFolder(run).metrics
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text(encoding="utf-8").splitlines(keepends=True)
                    if _logged_step(line) <= resume_step]
            with atomic_write(self.path) as f:
                f.writelines(kept)
            for report in RunFolder(run).eval_reports.glob(f"{STEP_PREFIX}*"):  # reports and their answers
                if step_of(report) > resume_step:
                    report.unlink()
        self.file = open(self.path, "a", encoding="utf-8")
        ids = _read_ids(run) if resume_step is not None else {}
        self.writers = [WRITERS[name](run, resume_step, config or {}, ids.get(name)) for name in report_to]
        ids = {w.name: w.id for w in self.writers if w.id is not None}
        if ids:
            with atomic_write(RunFolder(run).trackers) as f:
                f.write(json.dumps(ids, indent=2) + "\n")

    def log(self, step: int, values: dict) -> None:
        # strict JSON (what other readers than Python's take): a NaN or infinite value is written as
        # null and its name listed under "nonfinite"; the trackers get the value itself
        nonfinite = [k for k, v in values.items() if isinstance(v, float) and not math.isfinite(v)]
        record = {"step": step, "time": round(time.time(), 3),
                  **{k: None if k in nonfinite else v for k, v in values.items()},
                  **({"nonfinite": nonfinite} if nonfinite else {})}
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()
        # the numbers only: the decoding settings and which metric keeps the best model stay in the log
        scalars = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if scalars:
            for writer in self.writers:
                writer.log(step, scalars)

    def report(self, step: int, report: dict, rows: list[dict] | None = None) -> Path:
        """Write an eval's whole report (by split and source too) to RUN/eval/step-N.json and hand
        it to the trackers; the log has its headline numbers. ``rows``: its answers, one a sample
        (evaluate.write_rows), to RUN/eval/step-N.samples.jsonl; the trackers get the report alone."""
        if rows is not None:
            from groundtune.evaluate import write_rows

            write_rows(rows, report["data"], RunFolder(self.run).eval_samples(step))
        path = RunFolder(self.run).eval_report(step)
        with atomic_write(path) as f:
            f.write(json.dumps(report, indent=2) + "\n")
        for writer in self.writers:
            writer.artifact(step, path)
        return path

    def close(self) -> None:
        self.file.close()
        for writer in self.writers:
            writer.close()


class TensorBoard:
    """RUN/tb. An eval report shows as text at its step."""

    name = "tensorboard"

    @staticmethod
    def needs() -> tuple[str, ...]:
        return ()  # a dependency of groundtune itself

    def __init__(self, run: Path, resume_step: int | None, config: dict, run_id: str | None):
        self.id = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard drops the events past the checkpoint too
            self.tb = SummaryWriter(str(RunFolder(run).tb), purge_step=None if resume_step is None else resume_step + 1)
        except ImportError:  # tensorboard is a dependency, but a broken install must not stop training
            self.tb = None

    def log(self, step: int, scalars: dict) -> None:
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)

    def artifact(self, step: int, path: Path) -> None:
        if self.tb is not None:  # indented: TensorBoard renders text as Markdown, and this makes it a code block
            self.tb.add_text("eval/report", "    " + path.read_text(encoding="utf-8").replace("\n", "\n    "), step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


class WandB:
    """A W&B run in project $WANDB_PROJECT (else "groundtune"), its files in RUN/wandb. W&B's own
    environment variables apply (WANDB_MODE=offline: nothing leaves the machine until `wandb sync`)."""

    name = "wandb"

    @staticmethod
    def needs() -> tuple[str, ...]:
        return ("wandb",)

    def __init__(self, run: Path, resume_step: int | None, config: dict, run_id: str | None):
        import wandb

        # allow_val_change: a resumed run may name a corrected train_data/eval_data file
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "groundtune", dir=str(run), config=config,
                              id=run_id, resume="allow", allow_val_change=run_id is not None)
        self.id = self.run.id

    def log(self, step: int, scalars: dict) -> None:
        # W&B's steps only go forward: a step replayed after a crash keeps its first values there
        self.run.log(scalars, step=step)

    def artifact(self, step: int, path: Path) -> None:
        self.run.log_artifact(str(path), name=f"eval-report-{self.id}", type="eval-report", aliases=[f"step-{step}"])

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run in experiment $MLFLOW_EXPERIMENT_NAME (else "groundtune") of the server at
    $MLFLOW_TRACKING_URI, else of a store inside the run folder: RUN/mlflow.db, artifacts in
    RUN/mlartifacts (`mlflow ui --backend-store-uri sqlite:///RUN/mlflow.db` shows it)."""

    name = "mlflow"

    @staticmethod
    def needs() -> tuple[str, ...]:
        # sqlalchemy and alembic: the local SQLite store (a server's client does without them)
        return ("mlflow",) if os.environ.get("MLFLOW_TRACKING_URI") else ("mlflow", "sqlalchemy", "alembic")

    def __init__(self, run: Path, resume_step: int | None, config: dict, run_id: str | None):
        from mlflow.entities import Param, RunStatus
        from mlflow.tracking import MlflowClient

        # SQLite, not a file store (file:RUN/mlruns): MLflow 3 keeps the file store in maintenance,
        # and 3.18 refuses to open one unless MLFLOW_ALLOW_FILE_STORE=true
        local = not os.environ.get("MLFLOW_TRACKING_URI")
        self.client = MlflowClient(f"sqlite:///{RunFolder(run).mlflow_db.resolve()}" if local else None)
        if run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "groundtune"
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
                name, artifact_location=RunFolder(run).mlflow_artifacts.resolve().as_uri() if local else None)
            run_id = self.client.create_run(experiment_id, run_name=run.name).info.run_id
        else:
            self.client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        self.id = run_id
        # MLflow never changes a logged parameter: a resumed run adds only those not there yet (a
        # corrected train_data keeps the first file's name)
        logged = self.client.get_run(run_id).data.params
        params = [Param(k, str(v)) for k, v in config.items() if k not in logged]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(run_id, params=params[i : i + 100])

    def log(self, step: int, scalars: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(_mlflow_key(k), float(v), now, step)
                                                for k, v in scalars.items()])

    def artifact(self, step: int, path: Path) -> None:
        self.client.log_artifact(self.id, str(path), path.parent.name)  # RUN/eval/step-N.json: under eval/ there too

    def close(self) -> None:
        self.client.set_terminated(self.id)


# report_to's trackers (config.TRACKERS names them, for settings checked without torch)
WRITERS = {writer.name: writer for writer in (TensorBoard, WandB, MLflow)}


def check_trackers(report_to) -> None:
    """Refuse, before any model loads, a tracker whose package is not installed."""
    for name in report_to:
        missing = [module for module in WRITERS[name].needs() if importlib.util.find_spec(module) is None]
        if missing:
            raise MissingPackageError(f"report_to={name} needs {' and '.join(missing)} (not installed): "
                                      f'pip install "groundtune[{name}]"')


def _mlflow_key(key: str) -> str:
    """MLflow's metric names take letters, digits and _ - . / : and spaces: eval/acc@0.5 -> eval/acc_0.5."""
    return re.sub(r"[^\w\-./: ]", "_", key)


def _read_ids(run: Path) -> dict:
    path = RunFolder(run).trackers
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _logged_step(line: str) -> float:
    """The step of a metrics.jsonl line; a line cut off by a kill is past any checkpoint."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def gpu_stats(device: torch.device) -> dict:
    """Allocated/peak memory, and temperature/clocks through NVML when present. Reads only."""
    if device.type != "cuda":
        return {}
    gib = 1024**3
    stats = {
        "gpu_mem_alloc_gib": round(torch.cuda.memory_allocated(device) / gib, 3),
        "gpu_mem_peak_gib": round(torch.cuda.max_memory_allocated(device) / gib, 3),
    }
    temp = gpu_temperature(device)
    if temp is not None:
        stats["gpu_temp_c"] = temp
    try:
        stats["gpu_clock_mhz"] = torch.cuda.clock_rate(device)
    except Exception:  # NVML missing or not permitted: the numbers are optional
        pass
    return stats


def gpu_temperature(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.temperature(device))
    except Exception:  # NVML missing or not permitted
        return None


def thermal_pause(device: torch.device, pause_c: int, resume_c: int, log=print, poll_s: float = 10.0,
                  read_temperature=gpu_temperature) -> float:
    """Wait while the GPU is at or above ``pause_c`` until it cools to ``resume_c``. Never touches
    fans, clocks or power limits; returns the seconds waited. ``read_temperature(device)`` gives
    °C or None (NVML by default)."""
    if not pause_c:
        return 0.0
    temp = read_temperature(device)
    if temp is None or temp < pause_c:
        return 0.0
    start = time.time()
    log(f"GPU at {temp} °C >= {pause_c} °C: pausing until it is at or below {resume_c} °C")
    while temp is not None and temp > resume_c:
        time.sleep(poll_s)
        temp = read_temperature(device)
    return time.time() - start


class StopRequest:
    """True once RUN/STOP exists or SIGINT/SIGTERM arrived; the loop then saves and exits cleanly.
    A second Ctrl-C falls through to Python's default and interrupts at once."""

    def __init__(self, run: Path):
        self.stop_file = RunFolder(run).stop
        self.signalled: str | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: rely on the STOP file alone
                pass
        return self

    def _handle(self, signum, frame):
        self.signalled = signal.Signals(signum).name
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def reason(self) -> str | None:
        if self.signalled:
            return self.signalled
        if self.stop_file.exists():
            return f"{self.stop_file} exists"
        return None
