"""The README's main job in one call: the built-in tiny model, pre-trained on shape scenes drawn on
light backgrounds, meets a variant it was never trained on (the same shapes on a dark background:
synth's dark palette), is evaluated, fine-tuned with LoRA, and evaluated again. CPU, offline,
minutes.

    groundtune quickstart                 # everything under ./quickstart
    groundtune quickstart max_steps=300   # any training setting can be overridden
"""

from __future__ import annotations

import json
from pathlib import Path

from groundtune.config import TrainConfig, load_config, preset_path
from groundtune.data import synth
from groundtune.data.records import atomic_write, read_samples

# The variant: the full task (1-3 shapes, every phrase form) on a background the model has not seen,
# on the smallest canvas it was pre-trained on (the fewest image tokens: the fastest on a CPU)
VARIANT = {"width": 112, "height": 112, "task": "full", "palette": "dark"}
# quickstart()'s defaults, and so its flags' (--out, --n-train, --n-eval): the command line reads
# them here, which is why this module imports torch only inside quickstart()
OUT = "quickstart"
N_TRAIN = 8000
N_EVAL = 200


def quickstart(out: str | Path = OUT, n_train: int = N_TRAIN, n_eval: int = N_EVAL,
               overrides: tuple[str, ...] = ()) -> dict:
    """Variant data -> eval the tiny model -> LoRA fine-tune -> eval again + gallery. Re-running
    resumes an unfinished run and re-evaluates a finished one. Returns {"before", "after", "gain"}."""
    from groundtune import evaluate, infer
    from groundtune.train import checkpoint as ckpt
    from groundtune.train.sft import train

    out = Path(out)
    data = out / "data"
    for split, n, seed in (("train", n_train, 1), ("val", n_eval, 2)):
        if not (data / f"{split}.jsonl").exists():
            synth.make_synthetic_set(data, n=n, seed=seed, split=split, width=VARIANT["width"],
                                     height=VARIANT["height"], task=VARIANT["task"],
                                     palette=synth.PALETTES[VARIANT["palette"]])
    cfg = load_config(TrainConfig, preset_path("quickstart"),
                      [f"train_data={data / 'train.jsonl'}", f"eval_data={data / 'val.jsonl'}",
                       f"out_dir={out / 'run'}", *overrides])
    val = read_samples(data / "val.jsonl")

    print(f"before: {cfg.model} on {n_eval} held-out samples of the variant (a {VARIANT['palette']} background, "
          f"{VARIANT['width']}x{VARIANT['height']} px)")
    before, _ = evaluate.evaluate(infer.load(cfg.model), val, data / "val.jsonl")
    print(f"before: Acc@0.5 {before['acc@0.5']:.3f}")

    run = Path(cfg.out_dir)
    checkpoints = ckpt.list_checkpoints(run)
    if not checkpoints:
        train(cfg)
    elif not ckpt.is_finished(checkpoints[-1]):
        train(resume=run)

    after, rows = evaluate.evaluate(infer.load(str(run)), val, data / "val.jsonl")
    gallery = evaluate.write_gallery(rows, data / "val.jsonl", out / "gallery")
    evaluate.print_table([before, after])
    result = {"before": before, "after": after, "gain": after["acc@0.5"] - before["acc@0.5"]}
    with atomic_write(out / "report.json") as f:
        f.write(json.dumps(result, indent=2) + "\n")
    print(f"\nAcc@0.5 on the variant: {before['acc@0.5']:.3f} before -> {after['acc@0.5']:.3f} after LoRA "
          f"({100 * result['gain']:+.1f} points)")
    print(f"report: {out / 'report.json'}\ngallery: {gallery}")
    return result
