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
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path

# as `groundtune train` runs (train/sft.py): set before torch's CUDA allocator starts, in this process
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from provenance import stamped, unstamped
from gpu_cap import cap_gpu_memory
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
    "tiny": [  # the CPU: fp32, attention through dense masks (models/attention.py); TINY_CHECK's are held out
        (dict(batch_size=4, max_pixels=200704), 3),
        (dict(batch_size=16, max_pixels=200704), 3),
        (dict(batch_size=8, max_pixels=50176), 3),
        (dict(batch_size=8, max_pixels=200704, gradient_checkpointing=0), 3),
        (dict(batch_size=8, max_pixels=200704, method="full"), 3),
        (dict(batch_size=8, max_pixels=200704, head="box"), 3),
        (dict(batch_size=8, max_pixels=200704, gradient_checkpointing=2), 3),
        (dict(batch_size=16, max_pixels=200704, packing=False), 3),
        (dict(batch_size=4, max_pixels=100352, gradient_checkpointing=0), 3),
        (dict(batch_size=8, max_pixels=200704), 3),
        (dict(batch_size=24, max_pixels=100352), 3),
        (dict(batch_size=12, max_pixels=200704, gradient_checkpointing=2), 3),
        (dict(batch_size=8, max_pixels=200704, packing=False), 3),
        (dict(batch_size=16, max_pixels=100352, head="box"), 3),
    ],
}
TINY_CHECK = range(9, 14)  # GRID["tiny"]'s rows the CPU fit does not see: its check
# measure_tiny.json's rows were measured on the first tiny model (shipped up to commit 90c2649),
# before rows carried the configuration of the model they measured
FIRST_TINY_CONFIG = Path(__file__).resolve().parent / "results" / "history" / "tiny_first_config.json"
# configurations off the grid, measured with `measure --held-out` and never fitted: the check of
# what the fit predicts for settings it did not see (another LoRA target set, ranks, pixel budgets,
# odd batches, part of the layers recomputed: the kinds of runs users reported it wrong on)
HELD_OUT = {
    "3b": [
        (dict(batch_size=48, lora_targets=["llm_attn"], max_pixels=602112), 4),
        (dict(batch_size=82), 4),
        (dict(batch_size=36), 4),
        (dict(batch_size=17, lora_r=64, lora_alpha=128, gradient_checkpointing=24), 4),
        (dict(batch_size=40, lora_targets=["llm_mlp"], max_pixels=802816), 4),
        (dict(batch_size=24, lora_r=8, lora_alpha=16, max_pixels=301056, head="box"), 4),
    ],
}
CAPS = (12, 16, 24, 40)
# what verify checks: (model, settings over BASE, caps); each 20-step run at the largest batch costs
# a minute at most (the 40 GiB cap's batches would take several: its peaks lie inside the uncapped grid's)
VERIFY = [("3b", {}, (12, 24)), ("3b", dict(method="qlora"), (12, 16)), ("3b", dict(head="box"), (12,)),
          ("7b", {}, (24,)), ("7b", dict(method="qlora"), (12, 16))]


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
    from groundtune.models import kernels
    from groundtune.models.adapt import base_model
    from groundtune.train.sft import train

    cuda = torch.cuda.is_available()
    values = {**BASE, **({} if cuda else dict(kernels="none", num_workers=0, precision="fp32")), **settings}
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
            # whether liger-kernel's kernels were installed on the model, fused loss with them (plan
            # counts its memory apart where its rule says the loss takes it: had_fused_loss)
            row["fused_loss"] = bool(kernels.FUSED_LOSS and getattr(base_model(trained), "_groundtune_fused_loss", False))
            if step == steps:
                raise _Done

        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
            cap_gpu_memory(cap_gib or 1e9)
            torch.cuda.reset_peak_memory_stats()
        cpu_peak = _CpuPeak() if not cuda else None
        try:
            with cpu_peak or contextlib.nullcontext():
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


class _CpuPeak:
    """The most bytes torch's CPU allocator held at once while inside: torch.profiler's memory
    accounting (each op's own allocations less its frees), summed in the order the ops started.
    The CPU's max_memory_allocated, which torch does not keep itself."""

    def __enter__(self):
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self.prof.__exit__(None, None, None)
        held = peak = 0
        for e in sorted(self.prof.profiler.function_events, key=lambda e: e.time_range.start):
            held += e.self_cpu_memory_usage
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
    from groundtune import plan

    rows: list[dict] = []
    context = cuda_context_gib()
    weights: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = make_refcoco_like(Path(tmp), args.samples)
        stats = [data_stats(data, p) for p in (PRESET_PIXELS, SMALL_PIXELS, 200704, 50176)]
        for key in args.models.split(","):
            grid = HELD_OUT.get(key, []) if args.held_out else GRID[key]
            for i, (settings, steps) in enumerate(grid[:args.limit]):
                held_out = args.held_out or (key == "tiny" and i in TINY_CHECK)
                row = dict(run_config(key, settings, steps, data, weights), role="check" if held_out else "fit")
                if key == "tiny":  # "tiny" names whichever model is shipped: keep the one measured
                    row["model_config"] = json.loads(plan.TINY_CONFIG.read_text())
                rows.append(row)
                _save({"cuda_context_gib": context, "data": stats, "rows": rows}, args.out)
    _table(rows)


# ---------------------------------------------------------------------------------------------
# fit: the planner's coefficients from measured rows

FITTED_MEMORY = ("fixed", "boundaries", "layer", "logits", "fused_logits", "vision")  # the rest are exact byte counts
EXACT = {"weights": 1.0, "trained": 1.0}


def bench_sizes(samples: int = 256) -> list[tuple[int, int]]:
    """The image sizes of the bench's samples (make_refcoco_like is seeded: the same on every machine)."""
    from groundtune.data.records import read_samples

    with tempfile.TemporaryDirectory() as tmp:
        return [(r["width"], r["height"]) for r in read_samples(make_refcoco_like(Path(tmp), samples))]


def answer_tokens_per_box() -> int:
    """How many tokens one more box adds to an answer, in the tokenizer the bench's models speak."""
    from groundtune import boxes
    from groundtune.models.loading import load_model

    gm = load_model("tiny", device="cpu")
    one = boxes.format_target([[10, 20, 300, 400]], "the man", gm.family, (640, 480), (644, 476))
    two = boxes.format_target([[10, 20, 300, 400], [320, 20, 600, 400]], "the man", gm.family, (640, 480), (644, 476))
    return len(gm.processor.tokenize(two)) - len(gm.processor.tokenize(one))


def row_counts(row: dict, model_file: dict, sizes) -> tuple:
    from groundtune import plan
    from groundtune.config import TrainConfig

    if "model_config" in row:  # what was measured (rows of the tiny model carry it)
        shape = plan.shape_from_config(row["model_config"])
    elif row["model"] == "tiny":  # measured before rows carried it: the first tiny model
        shape = plan.shape_from_config(json.loads(FIRST_TINY_CONFIG.read_text()))
    else:
        shape = plan.shape_of(MODELS[row["model"]])
    cfg = TrainConfig(**{k: v for k, v in row["settings"].items() if k != "precision"}, train_data="synth:full")
    device = "cpu" if row["model"] == "tiny" else "cuda"
    setting = dataclasses.replace(plan.Setting.of(cfg, shape.family, device=device),
                                  fused_loss=had_fused_loss(row, cfg, device))
    tokens = plan.data_tokens(sizes, [1] * len(sizes), shape.family, setting.min_pixels, setting.max_pixels,
                              model_file, "the bench's samples")
    return shape, setting, tokens, plan.counts(shape, setting, tokens)


# The answers' loss went through liger-kernel's fused kernel from this commit on (c1b15a9): rows
# measured before it say nothing of it and had the plain loss
FUSED_LOSS_LANDED = "2026-12-03T12:01:39+00:00"


def had_fused_loss(row: dict, cfg, device: str) -> bool:
    """Whether a measured row's loss was fused: plan's rule for its settings, on the machine it ran
    on, where the kernel was there: as the row says (measure records whether liger-kernel was
    installed on the model), else if it was measured after the fused loss landed (every GPU row
    ran with liger-kernel)."""
    from groundtune import plan

    if "fused_loss" in row:
        installed = bool(row["fused_loss"])
    else:
        installed = row.get("provenance", {}).get("date", "") >= FUSED_LOSS_LANDED
    return installed and plan.fused_loss(cfg, device, liger=True)


def latest_rows(measured: list[dict]) -> list[dict]:
    """Every measure file's rows with its provenance, a configuration measured more than once by
    its latest measurement only (the code it measured is the one the plan speaks for)."""
    rows = [dict(r, provenance=m["provenance"]) for m in measured for r in m["rows"]]

    def key(r: dict) -> tuple:
        return r["model"], json.dumps(r["settings"], sort_keys=True), r.get("cap_gib"), r.get("role", "fit")

    newest: dict = {}
    for r in rows:
        if r["status"] == "ok":
            newest[key(r)] = max(newest.get(key(r), ""), r["provenance"]["date"])
    return [r for r in rows if r["status"] != "ok" or r["provenance"]["date"] == newest[key(r)]]


def _nonnegative_least_squares(a, b):
    """min |a x - b| with x >= 0: least squares, dropping the columns that come out negative."""
    import numpy as np

    active = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        x[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        negative = [i for i in active if x[i] < 0]
        if not negative:
            return x
        active.remove(min(negative, key=lambda i: x[i]))


def fit(measured: list[dict], with_time: bool = True) -> tuple[dict, list[dict]]:
    """Fit the planner's constants (plan_model.json) from measure files' contents; returns the model
    and every row with its prediction."""
    import numpy as np

    from groundtune import plan

    first = measured[0]
    stats = {d["max_pixels"]: d for d in first["data"]}[PRESET_PIXELS]
    sizes = bench_sizes()
    model_file = {"reference_card": "h200",
                  "cuda_context_gib": max(m["cuda_context_gib"] for m in measured if m.get("cuda_context_gib")),
                  "text_tokens": round(stats["tokens"] - stats["image_tokens"] - stats["answer_tokens"], 2),
                  "answer_tokens": round(stats["answer_tokens"], 2), "answer_tokens_per_box": answer_tokens_per_box(),
                  "memory": {**EXACT, **{k: 0.0 for k in FITTED_MEMORY}, "optimizer": 0.0},
                  "time": {k: 0.0 for k in plan.TIME_TERMS}, "margin": 0.0}
    rows = latest_rows(measured)
    ok = [r for r in rows if r["status"] == "ok" and r.get("peak_gib") and r["model"] != "tiny"]
    counted = [(r, row_counts(r, model_file, sizes)) for r in ok]
    gpu_fitted = [(r, c) for r, c in counted if r.get("role") != "check"]  # the held-out rows are predicted only
    tiny = [r for r in rows if r["status"] == "ok" and r.get("peak_gib") and r["model"] == "tiny"]

    # memory: activations' coefficients from the adapter runs, where they decide the peak
    adapters = [(r, c) for r, (_, s, _, c) in gpu_fitted if s.method != "full"]
    a = np.array([[c[k] for k in FITTED_MEMORY] for _, c in adapters])
    y = np.array([r["peak_gib"] * plan.GIB - sum(c[k] * v for k, v in EXACT.items()) for r, c in adapters])
    w = 1 / np.array([r["peak_gib"] * plan.GIB for r, _ in adapters])  # relative error
    fitted = [k for k in FITTED_MEMORY if a[:, FITTED_MEMORY.index(k)].any()]  # a term no row has stays 0
    x = _nonnegative_least_squares((a * w[:, None])[:, [FITTED_MEMORY.index(k) for k in fitted]], y * w)
    model_file["memory"].update({k: float(v) for k, v in zip(fitted, x)})
    if "fused_logits" not in fitted:  # no fitted run had the fused loss: it holds no more than the plain one
        model_file["memory"]["fused_logits"] = model_file["memory"]["logits"]
    # full fine-tuning: the optimizer step's own peak, the largest any full run showed
    for r, (_, s, _, c) in gpu_fitted:
        if s.method == "full":
            static = sum(c[k] * model_file["memory"][k] for k in ("weights", "trained", "fixed"))
            model_file["memory"]["optimizer"] = max(model_file["memory"]["optimizer"],
                                                    (r["peak_gib"] * plan.GIB - static) / c["optimizer"])
    # the CPU (the tiny model, fp32, dense attention): its own fixed bytes and the attention scores'
    # coefficients, from the rows not held out; every other term as on the GPU
    if tiny:
        cpu = [(r, row_counts(r, model_file, sizes)[3]) for r in tiny]
        fitting = [(r, c) for r, c in cpu if r.get("role") != "check"]
        cpu_terms = ("fixed_cpu", "attention", "attention_kept", "mask")
        a = np.array([[c[k] for k in cpu_terms] for _, c in fitting])
        known = [sum(c[k] * model_file["memory"][k] for k in ("weights", "trained", "boundaries", "layer", "logits",
                                                              "vision")) for _, c in fitting]
        y = np.array([r["peak_gib"] * plan.GIB - k for (r, _), k in zip(fitting, known)])
        w = 1 / np.array([r["peak_gib"] * plan.GIB for r, _ in fitting])
        x = _nonnegative_least_squares(a * w[:, None], y * w)
        model_file["memory"].update({k: float(v) for k, v in zip(cpu_terms, x)})
        counted += [(r, row_counts(r, model_file, sizes)) for r in tiny]
    if with_time:
        model_file["time"] = fit_time(gpu_fitted)
    else:  # (verify needs memory alone)
        model_file["time"] = {k: 1e-30 for k in plan.TIME_TERMS}

    # every row predicted; the margin: the largest under-prediction of a peak
    predicted = []
    for r, (shape, s, tokens, c) in counted:
        peak, _ = plan.peak_bytes(c, model_file["memory"])
        step = plan.step_seconds(c, model_file["time"], s.grad_accum, measured_on(r))
        gpu = r["model"] != "tiny"  # (a CPU's speed is not predicted)
        predicted.append(dict(r, predicted_peak_gib=round(peak / plan.GIB, 4),
                              peak_error=round(peak / plan.GIB / r["peak_gib"] - 1, 4),
                              predicted_samples_per_s=round(s.batch_size * s.grad_accum / step, 3) if gpu else None,
                              speed_error=round(s.batch_size * s.grad_accum / step / r["samples_per_s"] - 1, 4)
                              if gpu and r.get("samples_per_s") else None))
    model_file["margin"] = round(max(0.0, max(-p["peak_error"] / (1 + p["peak_error"]) for p in predicted
                                              if p["model"] != "tiny" and p.get("role") != "check")), 4)
    model_file["default_images"] = [list(size) for size in sizes]
    return model_file, predicted


def measured_on(row: dict):
    """The speed of the card a row was measured on, relative to the reference card's (rows of a
    CPU, whose speed is not predicted: the reference's)."""
    from groundtune import plan

    device = row.get("provenance", {}).get("device", "")
    if not device.startswith("NVIDIA"):
        return plan.CardSpeed(1.0, 1.0)
    return plan.card_speed(plan.card_from_device(device.rsplit(" (", 1)[0], 0), {"reference_card": "h200"})


def fit_time(counted) -> dict:
    """Seconds per optimizer step against plan.step_seconds's terms: the log of predicted over
    measured, least squares with a soft L1 loss (a few short runs are noisy: one slow step in four
    must not pull every coefficient), coefficients kept positive through their logarithms."""
    import numpy as np
    from scipy.optimize import least_squares

    from groundtune import plan

    timed = [(r, s, c) for r, (_, s, _, c) in counted if r.get("samples_per_s")]
    # each coefficient in units that make it ~1 (seconds per PFLOP, per TB, per GB), so the fit is well scaled
    units = {"floor": 1.0, "llm_matmul": 1e-15, "vision_matmul": 1e-15, "traffic": 1e-12, "dequant": 1e-9,
             "optimizer_sweep": 1e-9}

    def residuals(x):
        coef = {k: float(np.exp(v)) * units[k] for k, v in zip(plan.TIME_TERMS, x)}
        return [np.log(plan.step_seconds(c, coef, s.grad_accum, measured_on(r))
                       * r["samples_per_s"] / (s.batch_size * s.grad_accum)) for r, s, c in timed]

    solution = least_squares(residuals, np.zeros(len(plan.TIME_TERMS)), loss="soft_l1", f_scale=0.05)
    return {k: float(np.exp(v)) * units[k] for k, v in zip(plan.TIME_TERMS, solution.x)}


def do_fit(args) -> None:
    from groundtune import plan

    measured = [json.loads(Path(f).read_text()) for f in args.files]
    model_file, predicted = fit(measured)
    model_file = {"about": "groundtune plan's constants, fitted by bench/plan_check.py fit from the rows of "
                           "bench/results/plan_check.json (real steps on the reference card); do not edit by hand",
                  **model_file}
    verified = unstamped(json.loads(Path(args.verified).read_text()))["rows"] if args.verified else []
    plan.MODEL_FILE.write_text(json.dumps(model_file, indent=1) + "\n")
    result = {"measured_in": [m["provenance"] for m in measured], "model": {k: v for k, v in model_file.items()
                                                                           if k != "default_images"},
              "rows": predicted, "verified": verified, "summary": summary(predicted, verified)}
    Path(args.out).write_text(json.dumps(stamped(result), indent=1) + "\n")
    draw(predicted, REPO / "docs" / "plan-check.png")
    _table(predicted)
    print(json.dumps(result["summary"], indent=1))


def draw(predicted: list[dict], out: Path) -> None:
    """Predicted against measured peak memory, one dot per configuration (colour: method), the
    diagonal and the +-10% band: docs/plan.md's picture."""
    from PIL import Image, ImageDraw

    size, pad, top = 560, 60, 60.0  # pixels; the axes run 0..top GiB
    image = Image.new("RGB", (size, size), "white")
    d = ImageDraw.Draw(image)

    def at(measured: float, pred: float) -> tuple[float, float]:
        span = size - 2 * pad
        return pad + measured / top * span, size - pad - pred / top * span

    d.polygon([at(0, 0), at(top / 1.1, top), at(top, top), at(top, top * 0.9)], fill=(225, 225, 225))
    d.line([at(0, 0), at(top, top)], fill=(150, 150, 150), width=1)
    for tick in range(0, int(top) + 1, 10):
        d.line([at(tick, 0), (at(tick, 0)[0], at(tick, 0)[1] + 5)], fill="black")
        d.text((at(tick, 0)[0] - 6, at(tick, 0)[1] + 8), str(tick), fill="black")
        d.line([at(0, tick), (at(0, tick)[0] - 5, at(0, tick)[1])], fill="black")
        d.text((at(0, tick)[0] - 26, at(0, tick)[1] - 6), str(tick), fill="black")
    d.line([at(0, 0), at(top, 0)], fill="black")
    d.line([at(0, 0), at(0, top)], fill="black")
    d.text((size / 2 - 90, size - 25), "measured peak, GiB (H200)", fill="black")
    d.text((8, 12), "predicted peak, GiB (groundtune plan)", fill="black")
    colours = {"lora": (31, 119, 180), "qlora": (44, 160, 44), "full": (214, 39, 40), "box": (255, 127, 14)}
    for p in (p for p in predicted if p["model"] != "tiny"):  # (the CPU's tiny peaks would sit at 0)
        kind = "box" if p["settings"].get("head") == "box" else p["settings"]["method"]
        x, y = at(p["peak_gib"], p["predicted_peak_gib"])
        d.ellipse([x - 4, y - 4, x + 4, y + 4], fill=colours[kind])
    for i, (kind, colour) in enumerate(colours.items()):
        d.ellipse([pad + 10, pad + 8 + 18 * i, pad + 18, pad + 16 + 18 * i], fill=colour)
        d.text((pad + 24, pad + 5 + 18 * i), "box head" if kind == "box" else kind, fill="black")
    d.text((pad + 10, pad + 8 + 18 * 4), "grey band: within 10%", fill="black")
    image.save(out)


def summary(predicted: list[dict], verified: list[dict]) -> dict:
    presets = [p for p in predicted if _is_preset(p)]
    held_out = [p for p in predicted if p["model"] == "tiny" and p.get("role") == "check"]
    gpu_held_out = [p for p in predicted if p["model"] != "tiny" and p.get("role") == "check"]
    predicted = [p for p in predicted if p["model"] != "tiny" and p.get("role") != "check"]
    return {"configurations": len(predicted),
            "largest_peak_error": max((abs(p["peak_error"]) for p in predicted), default=None),
            "within_10_percent": sum(abs(p["peak_error"]) <= 0.10 for p in predicted),
            "cpu_held_out": len(held_out),
            "cpu_largest_held_out_error": max((abs(p["peak_error"]) for p in held_out), default=None),
            "gpu_held_out": len(gpu_held_out),
            "gpu_largest_held_out_error": max((abs(p["peak_error"]) for p in gpu_held_out), default=None),
            "gpu_largest_held_out_speed_error": max((abs(p["speed_error"]) for p in gpu_held_out
                                                     if p["speed_error"] is not None), default=None),
            "largest_preset_speed_error": max((abs(p["speed_error"]) for p in presets), default=None),
            "verified_fits": sum(v["status"] == "ok" for v in verified if v.get("role") == "predicted largest"),
            "false_fits": sum(v["status"] != "ok" for v in verified if v.get("role") == "predicted largest"),
            "twice_fits": sum(v["status"] == "ok" for v in verified if v.get("role") == "twice that")}


def _is_preset(row: dict) -> bool:
    """The shipped presets' own settings (configs/qwen2.5-vl-3b-lora-24gb, -7b-lora-24gb, -7b-qlora)."""
    s = row["settings"]
    return ((row["model"], s["method"], s["batch_size"], s["grad_accum"], s.get("head", "text"), len(s["lora_targets"]),
             s["max_pixels"], s["gradient_checkpointing"]) in
            {("3b", "lora", 64, 1, "text", 2, PRESET_PIXELS, -1), ("7b", "lora", 16, 1, "text", 2, PRESET_PIXELS, -1),
             ("7b", "qlora", 32, 1, "text", 2, PRESET_PIXELS, -1)})


# ---------------------------------------------------------------------------------------------
# verify: the plan's "fits" under caps


def verify(args) -> None:
    """Extra grid rows (--extra), a fit of everything, then each (model, method) under each cap: the
    largest batch the fitted plan says fits, 20 steps; twice that, a few steps."""
    from groundtune import plan

    measured = [json.loads(Path(f).read_text()) for f in args.files]
    rows: list[dict] = []
    weights: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = make_refcoco_like(Path(tmp), args.samples)
        if args.extra:
            context = cuda_context_gib()
            stats = [data_stats(data, p) for p in (PRESET_PIXELS, SMALL_PIXELS, 200704, 50176)]
            extra = {"cuda_context_gib": context, "data": stats, "rows": []}
            for key, settings, steps in EXTRA:
                extra["rows"].append(run_config(key, settings, steps, data, weights))
                _save(extra, args.extra)
            measured.append(json.loads(Path(args.extra).read_text()))
        model_file, _ = fit(measured, with_time=False)
        sizes = bench_sizes()
        for key, settings, caps in VERIFY:
            for cap in args.caps or caps:
                row = {"model": key, "settings": {**BASE, **settings, "batch_size": 1}}
                shape, setting, tokens, _ = row_counts(row, model_file, sizes)
                capped = plan.Card("cap", f"{cap} GiB cap", cap, None, None, emulated=True)
                best = plan.max_batch(shape, setting, capped, tokens, model_file)
                if best == 0:
                    rows.append({"model": key, "settings": {**BASE, **settings}, "cap_gib": cap, "status": "not run",
                                 "role": "predicted none fits"})
                    continue
                for role, batch, steps in (("predicted largest", best, args.steps), ("twice that", 2 * best, 2)):
                    r = run_config(key, {**settings, "batch_size": batch}, steps, data, weights, cap_gib=cap)
                    rows.append(dict(r, role=role, predicted_largest=best))
                    _save({"rows": rows}, args.out)
    _table(rows)


EXTRA = [  # pixel budgets below COCO's sizes (the presets' 1,003,520 and 401,408 leave them as they are)
    ("3b", dict(batch_size=64, max_pixels=200704), 4),
    ("3b", dict(batch_size=128, max_pixels=100352), 4),
    ("7b", dict(batch_size=32, max_pixels=200704), 4),
    ("7b", dict(batch_size=16, method="qlora", max_pixels=200704), 4),
    ("3b", dict(batch_size=32, method="qlora", max_pixels=100352), 4),
]


def _table(rows: list[dict]) -> None:
    print(f"\n{'model':6s}{'settings':56s}{'cap':>5s}{'status':>8s}{'peak GiB':>9s}{'plan':>7s}{'samples/s':>10s}"
          f"{'plan':>7s}{'wall s':>7s}")
    for r in rows:
        shown = {k: v for k, v in r["settings"].items() if BASE.get(k, None) != v and k != "precision"}
        print(f"{r['model']:6s}{str(shown)[:56]:56s}{str(r.get('cap_gib') or '-'):>5s}{r['status']:>8s}"
              f"{r.get('peak_gib') or 0:9.2f}{r.get('predicted_peak_gib') or 0:7.2f}{r.get('samples_per_s') or 0:10.2f}"
              f"{r.get('predicted_samples_per_s') or 0:7.1f}{r.get('wall_s') or 0:7.1f}"
              + (f"  {r['role']} ({r.get('predicted_largest')})" if r.get("role") else ""))


def _save(result: dict, out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(stamped(result), indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("measure", help="the grid of configurations, uncapped")
    m.add_argument("--models", default="3b,7b")
    m.add_argument("--samples", type=int, default=256)
    m.add_argument("--limit", type=int, help="only the first N configurations of each model (a smoke test)")
    m.add_argument("--held-out", action="store_true",
                   help="measure HELD_OUT's configurations (off the grid, never fitted: the fit's check) instead of GRID's")
    m.add_argument("--out")
    f = sub.add_parser("fit", help="fit the planner's constants from measure files")
    f.add_argument("files", nargs="+")
    f.add_argument("--verified", help="a verify run's file, recorded beside the fit")
    f.add_argument("--out", default=str(RESULTS))
    v = sub.add_parser("verify", help="fit, then train under caps at the batch the plan says fits")
    v.add_argument("files", nargs="+", help="measure files")
    v.add_argument("--extra", help="measure EXTRA's rows first, into this file, and fit with them")
    v.add_argument("--caps", type=lambda t: [float(c) for c in t.split(",")], help="instead of VERIFY's own")
    v.add_argument("--steps", type=int, default=20)
    v.add_argument("--samples", type=int, default=256)
    v.add_argument("--out")
    args = parser.parse_args()
    {"measure": measure, "fit": do_fit, "verify": verify}[args.mode](args)


if __name__ == "__main__":
    main()
