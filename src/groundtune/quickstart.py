"""The README's main job in one call: make the synthetic set, train the tiny model on it, evaluate
it and write a gallery. CPU, offline, minutes.

    groundtune quickstart                 # everything under ./quickstart
    groundtune quickstart max_steps=500   # any training setting can be overridden
"""

from __future__ import annotations

from pathlib import Path

from groundtune.config import TrainConfig, load_config
from groundtune.data import synth
from groundtune.train import checkpoint as ckpt

PRESETS = Path(__file__).resolve().parent / "configs"


def preset_path(name_or_path: str) -> Path:
    """A YAML path as given, or the name of a preset shipped with groundtune (configs/NAME.yaml)."""
    path = Path(name_or_path)
    if path.is_file():  # not is_dir: `groundtune quickstart` itself makes a folder named quickstart
        return path
    shipped = PRESETS / f"{name_or_path}.yaml"
    if shipped.exists():
        return shipped
    names = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
    raise FileNotFoundError(f"{name_or_path}: no such file, and not a shipped preset ({names})")


def quickstart(out: str | Path = "quickstart", n_train: int = 30000, n_eval: int = 200,
               overrides: tuple[str, ...] = ()) -> dict:
    """Synthetic data -> train -> eval + gallery. Re-running resumes an unfinished run and only
    re-evaluates a finished one. Returns the evaluation report."""
    from groundtune import evaluate
    from groundtune.train.sft import train

    out = Path(out)
    data = out / "data"
    for split, n, seed in (("train", n_train, 1), ("val", n_eval, 2)):
        if not (data / f"{split}.jsonl").exists():
            synth.make_synthetic_set(data, n=n, seed=seed, task="single", split=split)
    cfg = load_config(TrainConfig, preset_path("quickstart"),
                      [f"train_data={data / 'train.jsonl'}", f"eval_data={data / 'val.jsonl'}",
                       f"out_dir={out / 'run'}", *overrides])
    run = Path(cfg.out_dir)
    checkpoints = ckpt.list_checkpoints(run)
    if not checkpoints:
        train(cfg)
    elif not ckpt.is_finished(checkpoints[-1]):
        train(resume=run)
    report = evaluate.run_eval(str(run), str(data / "val.jsonl"), out=str(out / "report.json"),
                               gallery=str(out / "gallery"))
    print(f"\ngallery: {out / 'gallery' / 'index.html'}")
    return report
