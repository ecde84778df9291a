"""The data `groundtune plan` is fitted from, and the check of what it predicts: real training steps
of Qwen2.5-VL-3B/7B (random weights: memory and speed do not depend on their values) on COCO-sized
RefCOCO-like samples, with peak GPU memory and samples/s recorded for each configuration.

    python bench/plan_check.py measure --models 3b --out m3b.json     # the grid: one row per configuration
    python bench/plan_check.py measure --models 7b --out m7b.json
    python bench/plan_check.py fit m3b.json m7b.json                  # -> bench/results/plan_check.json and
                                                                      #    src/groundtune/assets/plan_model.json
    python bench/plan_check.py verify --out v.json                    # under caps of 12/16/24/40 GiB: the batch
                                                                      #    the plan says fits, and twice it
    python bench/plan_check.py fit m3b.json m7b.json --verified v.json
    python bench/plan_check.py measure --models tiny --out t.json     # CPU form: the tiny model, peak from
                                                                      #    torch's CPU allocator profile

measure: `groundtune.train.sft.train` itself (data loader, packing, recomputation, kernels as the
presets set them), a few steps per configuration, in one process per model (each configuration
loads its model anew; a QLoRA one from a folder written once). Peak = torch.cuda.max_memory_allocated
over the run; samples/s = the median of the logged steps after the first two. Each run stops right
after its last step (no final save: nothing measured happens there).

fit: least squares of the planner's memory and time terms (groundtune/plan.py, ``TERMS``) against
those rows, each row weighted by 1 / its measurement (the error that matters is relative); the
coefficients, the safety margin (the largest under-prediction seen) and the CUDA context go to
src/groundtune/assets/plan_model.json, which the planner reads: no constant of it is typed in.

verify: for each model and method under each cap, the largest batch the plan says fits trains 20
steps under that cap (set_per_process_memory_fraction), and twice that batch is tried too (it should
run out of memory: the plan's largest batch is then within a power of two of the real one).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from provenance import stamped, unstamped
from sft_speed import MODELS, _saved_weights, make_refcoco_like

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "plan_check.json"
PRESET_PIXELS = 1003520  # the presets' max_pixels
SMALL_PIXELS = 401408  # a second budget: 512 x 784

# (model, settings over BASE, steps): the most telling first, so a run cut short keeps them
BASE = dict(method="lora", lora_r=16, lora_alpha=32, lora_targets=["llm_attn", "llm_mlp"], gradient_checkpointing=-1,
            packing=True, kernels="auto", num_workers=8, max_pixels=PRESET_PIXELS, grad_accum=1)
GRID = {
    "3b": [
        (dict(batch_size=64), 6),  # the 3B preset
        (dict(batch_size=16), 4),
        (dict(batch_size=32), 4),
        (dict(batch_size=128), 4),
        (dict(batch_size=32, max_pixels=SMALL_PIXELS), 4),
        (dict(batch_size=96, max_pixels=SMALL_PIXELS), 4),
        (dict(batch_size=8, gradient_checkpointing=18), 4),
        (dict(batch_size=4, gradient_checkpointing=0), 4),
        (dict(batch_size=64, lora_targets=["llm_attn"]), 4),
        (dict(batch_size=16, head="box"), 4),
        (dict(batch_size=64, head="box"), 4),
        (dict(batch_size=16, method="qlora"), 4),
        (dict(batch_size=64, method="qlora"), 4),
        (dict(batch_size=8, method="full"), 4),
        (dict(batch_size=16, method="full", max_pixels=SMALL_PIXELS), 4),
    ],
    "7b": [
        (dict(batch_size=16), 6),  # the 7B preset
        (dict(batch_size=8, grad_accum=2, method="qlora"), 6),  # the 7B QLoRA preset
        (dict(batch_size=4), 4),
        (dict(batch_size=32), 4),
        (dict(batch_size=32, max_pixels=SMALL_PIXELS), 4),
        (dict(batch_size=16, head="box"), 4),
        (dict(batch_size=32, method="qlora"), 4),
        (dict(batch_size=4, method="qlora", max_pixels=SMALL_PIXELS), 4),
        (dict(batch_size=4, gradient_checkpointing=14), 4),
    ],
    "tiny": [
        (dict(batch_size=4, kernels="none", num_workers=0, max_pixels=200704), 3),
        (dict(batch_size=16, kernels="none", num_workers=0, max_pixels=200704), 3),
        (dict(batch_size=16, kernels="none", num_workers=0, max_pixels=50176), 3),
        (dict(batch_size=8, kernels="none", num_workers=0, max_pixels=200704, gradient_checkpointing=0), 3),
        (dict(batch_size=8, kernels="none", num_workers=0, max_pixels=200704, method="full"), 3),
        (dict(batch_size=8, kernels="none", num_workers=0, max_pixels=200704, head="box"), 3),
    ],
}
CAPS = (12, 16, 24, 40)
# what verify checks under each cap: (model, settings over BASE)
VERIFY = [("3b", {}), ("3b", dict(method="qlora")), ("3b", dict(head="box")), ("7b", {}), ("7b", dict(method="qlora"))]


class _Done(Exception):
    """Raised from the last step's hook: the run stops there, before its final save."""


def gib(n: float) -> float:
    return round(n / 2**30, 3)


def cuda_context_gib() -> float | None:
    """What the CUDA context holds outside torch's allocator (the card's memory a run cannot use)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    return gib(total - free - torch.cuda.memory_reserved())


def run_config(key: str, settings: dict, steps: int, data: Path, weights: dict, cap_gib: float | None = None) -> dict:
    """``steps`` steps of ``groundtune train`` with ``settings`` over BASE; a failure is a row too."""
    from groundtune.config import TrainConfig
    from groundtune.train.sft import train

    values = {**BASE, **settings}
    cuda = torch.cuda.is_available()
    if not cuda:
        values.update(precision="fp32")
    model = MODELS[key]
    if values["method"] == "qlora" and model.startswith("random:"):
        if key not in weights:  # written once per model: the 4-bit base is made by from_pretrained
            weights[key] = _saved_weights(model, Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir()
                                                                       else None)))[0]
        model = weights[key]
    row = {"model": key, "settings": {k: v for k, v in values.items() if k != "num_workers"}, "steps": steps,
           "cap_gib": cap_gib}
    print(f"== {key} {settings} cap {cap_gib}", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(**values, model=model, train_data=str(data), out_dir=out, lr=1e-4, warmup_steps=0,
                          min_lr_ratio=1.0, max_steps=steps + 1, log_every=1, save_every=0, report_to=[])

        def on_step(step, run, trained):
            if step == steps:
                raise _Done

        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, (cap_gib or 1e9) * 2**30 / total))
            torch.cuda.reset_peak_memory_stats()
        cpu_peak = _CpuPeak() if not cuda else None
        try:
            with cpu_peak or _nothing():
                train(cfg, on_step=on_step)
            row["status"] = "finished"  # (never: _Done stops it first)
        except _Done:
            row["status"] = "ok"
        except torch.OutOfMemoryError:
            row["status"] = "oom"
            row["where"] = traceback.format_exc(limit=-3)[-600:]
        except Exception as e:  # noqa: BLE001 - a row, the run goes on
            row["status"] = "error"
            row["error"] = repr(e)[:400]
            row["where"] = traceback.format_exc(limit=-4)[-1200:]
        lines = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()] \
            if (Path(out) / "metrics.jsonl").exists() else []
    logged = [r for r in lines if "loss" in r and "samples_per_s" in r]
    if logged:
        timed = logged[2:] or logged
        row["samples_per_s"] = round(statistics.median(r["samples_per_s"] for r in timed), 3)
        row["tokens_per_sample"] = round(statistics.median(r["tokens_per_s"] / r["samples_per_s"] for r in timed), 1)
        row["first_losses"] = [round(r["loss"], 4) for r in logged[:3]]
    if cuda:
        row["peak_gib"] = gib(torch.cuda.max_memory_allocated())
        row["peak_reserved_gib"] = gib(torch.cuda.max_memory_reserved())
        gc.collect()
        torch.cuda.empty_cache()
    elif cpu_peak is not None:
        row["peak_gib"] = gib(cpu_peak.peak)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({k: v for k, v in row.items() if k != "where"}), flush=True)
    return row


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CpuPeak:
    """The most bytes torch's CPU allocator held at once while inside (torch.profiler's allocation
    events, summed in order): the CPU's max_memory_allocated, which torch does not keep itself."""

    def __enter__(self):
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self.prof.__exit__(None, None, None)
        events = sorted((e for e in self.prof.profiler.function_events if e.name == "[memory]"),
                        key=lambda e: e.time_range.start)
        held = peak = 0
        for e in events:
            held += e.cpu_memory_usage
            peak = max(peak, held)
        self.peak = peak
        return False


def data_stats(data: Path, max_pixels: int, n: int = 256) -> dict:
    """Tokens per sample of the bench's samples at a pixel budget, as the training batches hold them."""
    from groundtune.models.loading import load_model
    from groundtune.models import qwen
    from groundtune.data.samples import open_samples
    from groundtune.train.batches import GroundingDataset
    from groundtune.boxes import ResizeSpec
    import dataclasses

    gm = load_model("tiny", device="cpu")
    family = qwen.family(gm.family)
    resize = ResizeSpec(factor=family.factor, min_pixels=family.min_pixels, max_pixels=max_pixels)
    gm = dataclasses.replace(gm, resize=resize, prompt=qwen.DEFAULT_PROMPT)
    dataset = GroundingDataset(open_samples(str(data), 0), gm.processor, gm.family, gm.resize, gm.prompt)
    total, image, answer = [], [], []
    for i in range(min(n, len(dataset))):
        s = dataset[(i, i)]
        total.append(int(s["input_ids"].numel()))
        image.append(int(s["image_grid_thw"].prod()) // family.merge_size**2)
        answer.append(int((s["labels"] != qwen.IGNORE_INDEX).sum()))
    return {"max_pixels": max_pixels, "tokens": statistics.mean(total), "image_tokens": statistics.mean(image),
            "answer_tokens": statistics.mean(answer)}


def measure(args) -> None:
    rows: list[dict] = []
    context = cuda_context_gib()
    weights: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = make_refcoco_like(Path(tmp), args.samples)
        stats = [data_stats(data, p) for p in (PRESET_PIXELS, SMALL_PIXELS, 200704, 50176)]
        for key in args.models.split(","):
            for settings, steps in GRID[key]:
                rows.append(run_config(key, settings, steps, data, weights))
                _save({"cuda_context_gib": context, "data": stats, "rows": rows}, args.out)
    _table(rows)


def _table(rows: list[dict]) -> None:
    print(f"\n{'model':6s}{'settings':60s}{'cap':>5s}{'status':>8s}{'peak GiB':>10s}{'samples/s':>11s}{'wall s':>8s}")
    for r in rows:
        shown = {k: v for k, v in r["settings"].items() if BASE.get(k, None) != v and k != "precision"}
        print(f"{r['model']:6s}{str(shown)[:60]:60s}{str(r.get('cap_gib') or '-'):>5s}{r['status']:>8s}"
              f"{r.get('peak_gib') or 0:10.2f}{r.get('samples_per_s') or 0:11.2f}{r['wall_s']:8.1f}")


def _save(result: dict, out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(stamped(result), indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("measure", help="the grid of configurations, uncapped")
    m.add_argument("--models", default="3b,7b")
    m.add_argument("--samples", type=int, default=256)
    m.add_argument("--out")
    args = parser.parse_args()
    if args.mode == "measure":
        measure(args)


if __name__ == "__main__":
    main()
