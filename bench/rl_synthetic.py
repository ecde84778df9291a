"""Does RL help where SFT left off? The shipped tiny model, a deliberately short LoRA SFT run on the
quickstart's variant (168 px canvases), then, for the same wall time from that same checkpoint:
`groundtune rl` (preset quickstart-rl) against more SFT (the control). Held-out Acc@0.5 of the
start, RL and control models on the variant's test set and on an out-of-distribution set (224 px
canvases, always 2-3 shapes: the `multi` task).

    python bench/rl_synthetic.py --out bench/results/rl_synthetic.json     # ~35 min on 2 cores

    python bench/rl_synthetic.py --variants 'curriculum=true' '' --out bench/results/rl_synthetic.json
                                    # then: RL variants from the same start, side by side

RL and the control run side by side, one CPU thread each, so both get the same machine for the
same wall time. Each keeps its best model by Acc@0.5 on the validation set (200 samples, seed 2)
it evaluates during training; the table is on other samples (test: seed 3; OOD: seed 4).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import sys
import time
from pathlib import Path

from provenance import stamped

VARIANT = {"width": 168, "height": 168, "task": "full"}
OOD = {"width": 224, "height": 224, "task": "multi"}


def _stop_after(seconds: float):
    """on_step callback: drop a STOP file once the run has had its wall time."""
    start = time.time()

    def on_step(step, run, model):
        if time.time() - start > seconds:
            (run / "STOP").touch()

    return on_step


def _arm(kind: str, work: str, seconds: float, overrides: list[str], name: str = "rl") -> None:
    """One arm in its own process, one thread: RL from the start model (into WORK/name), or SFT resumed."""
    import torch

    torch.set_num_threads(1)
    from groundtune.config import RLConfig, load_config
    from groundtune.config import preset_path
    from groundtune.train.rl import rl
    from groundtune.train.sft import train

    work = Path(work)
    log = open(work / f"{name if kind == 'rl' else kind}.log", "w")
    sys.stdout = sys.stderr = log
    t0 = time.time()
    if kind == "rl":
        cfg = load_config(RLConfig, preset_path("quickstart-rl"),
                          [f"model={work / 'start'}", f"train_data={work / 'data' / 'train.jsonl'}",
                           f"eval_data={work / 'data' / 'val.jsonl'}", f"out_dir={work / name}",
                           "max_steps=100000", *overrides])
        rl(cfg, on_step=_stop_after(seconds))
    else:
        train(resume=work / "control", on_step=_stop_after(seconds))
    (work / f"{name if kind == 'rl' else kind}.wall").write_text(f"{time.time() - t0:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=".cache/rl_synthetic")
    parser.add_argument("--start-steps", type=int, default=100, help="SFT steps of the starting checkpoint")
    parser.add_argument("--seconds", type=float, default=900, help="wall time of each arm")
    parser.add_argument("--n-test", type=int, default=500)
    parser.add_argument("--out")
    parser.add_argument("--variants", nargs="+", metavar="SETTINGS",
                        help="instead: RL arms only, side by side, from the start a previous run left in --work; "
                             "each a quoted string of key=value settings ('' = the preset as is); added to "
                             "--out's rl_variants")
    parser.add_argument("rl_overrides", nargs="*", help="key=value settings for the RL arm")
    args = parser.parse_args()
    if args.variants:
        return rl_variants(args)

    from groundtune.config import TrainConfig, load_config
    from groundtune.data import synth
    from groundtune.config import preset_path
    from groundtune.train.sft import train

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    data = work / "data"
    t_start = time.time()
    synth.make_synthetic_set(data, n=8000, seed=1, split="train", **VARIANT)
    synth.make_synthetic_set(data, n=200, seed=2, split="val", **VARIANT)
    synth.make_synthetic_set(data, n=args.n_test, seed=3, split="test", **VARIANT)
    synth.make_synthetic_set(work / "ood", n=args.n_test, seed=4, split="test", **OOD)

    # the start: the quickstart's SFT, stopped early in a schedule planned for 2,000 steps, so
    # that the control continues it at the learning rate it was at
    start_cfg = load_config(TrainConfig, preset_path("quickstart"),
                            [f"train_data={data / 'train.jsonl'}", f"eval_data={data / 'val.jsonl'}",
                             f"out_dir={work / 'start'}", "max_steps=2000", f"eval_every={args.start_steps}",
                             f"save_every={args.start_steps}"])

    def stop_at_start(step, run, model):
        if step == args.start_steps:
            (run / "STOP").touch()

    train(start_cfg, on_step=stop_at_start)
    shutil.copytree(work / "start", work / "control")
    (work / "control" / "config.yaml").write_text(
        (work / "control" / "config.yaml").read_text().replace(str(work / "start"), str(work / "control")))

    ctx = mp.get_context("spawn")
    arms = [ctx.Process(target=_arm, args=(kind, str(work), args.seconds, args.rl_overrides))
            for kind in ("rl", "sft")]
    for p in arms:
        p.start()
    for p in arms:
        p.join()
        if p.exitcode:
            raise SystemExit(f"an arm failed (exit {p.exitcode}): see {work}/rl.log and {work}/sft.log")

    table = {}
    for name, model in (("start", work / "start"), ("rl", work / "rl"), ("sft_control", work / "control")):
        for split, acc in _accuracies(model, work).items():
            table[(name, split)] = acc
    result = {
        "start_acc": table[("start", "test")], "rl_acc": table[("rl", "test")],
        "sft_control_acc": table[("sft_control", "test")],
        "ood": {"start_acc": table[("start", "ood")], "rl_acc": table[("rl", "ood")],
                "sft_control_acc": table[("sft_control", "ood")]},
        "wall_s": {"rl": float((work / "rl.wall").read_text()), "sft_control": float((work / "sft.wall").read_text()),
                   "all": round(time.time() - t_start, 1)},
        "start_steps": args.start_steps, "arm_seconds": args.seconds, "test_n": args.n_test,
        "rl_steps": _last_step(work / "rl"), "sft_control_steps": _last_step(work / "control"),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(stamped(result), indent=1) + "\n")


def rl_variants(args) -> None:
    """RL arms side by side from the existing start, evaluated like the main arm."""
    work = Path(args.work)
    names = [f"rl-variant{i}" for i in range(len(args.variants))]
    ctx = mp.get_context("spawn")
    arms = [ctx.Process(target=_arm, args=("rl", str(work), args.seconds, settings.split(), name))
            for name, settings in zip(names, args.variants)]
    for name, p in zip(names, arms):
        shutil.rmtree(work / name, ignore_errors=True)
        p.start()
    for p in arms:
        p.join()
        if p.exitcode:
            raise SystemExit(f"an arm failed (exit {p.exitcode}): see {work}/rl-variant*.log")
    rows = []
    for name, settings in zip(names, args.variants):
        accs = _accuracies(work / name, work)
        rows.append({"overrides": settings, "steps": _last_step(work / name), "arm_seconds": args.seconds,
                     "wall_s": float((work / f"{name}.wall").read_text()),
                     "test_acc": accs["test"], "ood_acc": accs["ood"]})
    print(json.dumps(rows, indent=1))
    if args.out:
        out = Path(args.out)
        result = json.loads(out.read_text()) if out.exists() else {}
        result.setdefault("rl_variants", []).extend(rows)
        result["rl_variants_command"] = "python bench/rl_synthetic.py " + " ".join(
            f"'{a}'" if " " in a or not a else a for a in sys.argv[1:])
        out.write_text(json.dumps(result, indent=1) + "\n")


def _accuracies(model: Path, work: Path) -> dict[str, float]:
    """Acc@0.5 of a run's model on the variant's test set and on the out-of-distribution one."""
    from groundtune import evaluate
    from groundtune.data.records import read_samples
    from groundtune.models.loading import load_model

    gm = load_model(str(model))
    accs = {}
    for split, path in (("test", work / "data" / "test.jsonl"), ("ood", work / "ood" / "test.jsonl")):
        report, _ = evaluate.evaluate(gm, read_samples(path), path)
        accs[split] = report["acc@0.5"]
        print(f"{model.name:14s} {split:5s} Acc@0.5 {report['acc@0.5']:.3f}", flush=True)
    return accs


def _last_step(run: Path) -> int:
    from groundtune.train import checkpoint as ckpt

    return json.loads((ckpt.list_checkpoints(run)[-1] / "state.json").read_text())["step"]


if __name__ == "__main__":
    main()
