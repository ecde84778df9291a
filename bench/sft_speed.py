"""SFT speed and memory of Qwen2.5-VL-3B/7B (real architectures, random weights) on RefCOCO-like
batches: the naive transformers + PEFT stack against `groundtune train`'s own step, in one run.

    python bench/sft_speed.py --models 3b,7b --out bench/results/sft_speed.json
    python bench/sft_speed.py --models tiny --steps 4          # CPU smoke test of this script

Data: one image per sample, sizes drawn around COCO's 640x480 with varied aspect ratios, the
official grounding prompt and a JSON answer of ~30 tokens; the same samples, in the same order,
for every variant. Each variant starts from the same weights (same seed, same LoRA init), so the
first losses must agree within bf16 noise: the objective is the same, only the speed differs.

- naive: transformers + PEFT as the peers use them: LoRA r16 on every LLM linear, vision frozen,
  SDPA, padded batches, `gradient_checkpointing_enable()` + `enable_input_require_grads()`,
  fused AdamW, batch 4; inputs pre-built on the GPU (its data time is not counted).
- gt-*: `groundtune.train.sft.train` itself (the loop `groundtune train` runs, data loader
  included) with the settings in GT_VARIANTS; speed and memory read from its metrics.jsonl.

Each variant (and the ladder) runs in a process of its own (liger-kernel patches transformers'
modules process-wide); a variant that runs out of memory, fails or exceeds --variant-timeout is
recorded as such and the run goes on. Results are written after every variant.

MFU = model FLOPs / time / 790e12 (a bf16 matmul's reach on an H200), model FLOPs per sample as
field-notes counts them: 4 x LLM parameters x LLM tokens (LoRA: forward + input gradients) +
2 x vision parameters x patches (frozen tower, forward only); recomputation is not counted.
The process is capped at --cap-gib of GPU memory to behave like a 24 GB card.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from groundtune.config import TrainConfig
from groundtune.data.dataset import GroundingDataset, ResumableBatches, open_samples
from groundtune.data.records import write_samples
from groundtune.models import adapt, qwen
from groundtune.models.loading import load_model

PEAK_FLOPS = 790e12
MODELS = {"3b": "random:qwen2.5-vl-3b", "7b": "random:qwen2.5-vl-7b", "tiny": "tiny"}
# name -> TrainConfig settings; the fastest that fit, and the ones that show each change
GT_VARIANTS = {
    "gt-b4-ckpt-all": dict(batch_size=4, gradient_checkpointing=-1),  # the naive stack's settings
    "gt-b8-ckpt-all": dict(batch_size=8, gradient_checkpointing=-1),
    "gt-b16-ckpt-all": dict(batch_size=16, gradient_checkpointing=-1),
    "gt-b8-ckpt-half": dict(batch_size=8, gradient_checkpointing=18),
    "gt-b4-no-ckpt": dict(batch_size=4, gradient_checkpointing=0),
    "gt-b8-no-ckpt": dict(batch_size=8, gradient_checkpointing=0),
    "gt-b4-packed-ckpt-all": dict(batch_size=4, gradient_checkpointing=-1, packing=True),
    "gt-b8-packed-ckpt-half": dict(batch_size=8, gradient_checkpointing=18, packing=True),
    "gt-b8-ckpt-half-liger": dict(batch_size=8, gradient_checkpointing=18, kernels="liger"),
    "gt-b8-ckpt-half-compile": dict(batch_size=8, gradient_checkpointing=18, compile=True),
    "gt-b16-ckpt-all-liger": dict(batch_size=16, gradient_checkpointing=-1, kernels="liger"),
    "gt-b16-ckpt-all-compile": dict(batch_size=16, gradient_checkpointing=-1, compile=True),
    "gt-b32-ckpt-all": dict(batch_size=32, gradient_checkpointing=-1),
    "gt-b32-ckpt-all-liger": dict(batch_size=32, gradient_checkpointing=-1, kernels="liger"),
    "gt-b8-ckpt-all-liger": dict(batch_size=8, gradient_checkpointing=-1, kernels="liger"),
    "gt-b2-ckpt-all": dict(batch_size=2, gradient_checkpointing=-1),
    "gt-b4-ckpt-all-liger": dict(batch_size=4, gradient_checkpointing=-1, kernels="liger"),
}
LR = 1e-4
WORDS = ("man woman dog cat car bus chair table person bike umbrella horse cup bottle tree sign "
         "red blue white black green small large left right front back middle standing sitting").split()


def make_refcoco_like(folder: Path, n: int, seed: int = 0) -> Path:
    """n samples: JPEGs of COCO-like sizes (long side 640 or a bit less, aspect 0.5-2), one box, a
    phrase of 3-8 words. Pixels are noise: speed does not depend on them."""
    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        aspect = float(np.exp(rng.uniform(np.log(0.5), np.log(2.0))))
        long_side = int(rng.choice([640, 640, 640, 612, 500, 480]))
        w, h = (long_side, int(long_side / aspect)) if aspect >= 1 else (int(long_side * aspect), long_side)
        pixels = rng.integers(0, 256, size=(h // 8, w // 8, 3), dtype=np.uint8)
        Image.fromarray(pixels).resize((w, h)).save(folder / "images" / f"{i:05d}.jpg", quality=85)
        x1, y1 = rng.uniform(0, w * 0.6), rng.uniform(0, h * 0.6)
        box = [round(x1, 1), round(y1, 1), round(x1 + rng.uniform(20, w - x1), 1), round(y1 + rng.uniform(20, h - y1), 1)]
        phrase = "the " + " ".join(rng.choice(WORDS, size=int(rng.integers(3, 9))))
        records.append({"id": f"bench-{i}", "image": f"images/{i:05d}.jpg", "width": w, "height": h,
                        "phrase": phrase, "bbox": box, "split": "train", "source": "bench"})
    path = folder / "train.jsonl"
    write_samples(path, records)
    return path


def flops_per_sample(model, batches: list[dict]) -> float:
    llm = sum(p.numel() for n, p in model.named_parameters() if "visual" not in n and "embed_tokens" not in n)
    lm_head = model.get_output_embeddings()
    if lm_head is not None and not any(lm_head.weight is p for n, p in model.named_parameters() if "lm_head" in n):
        llm += lm_head.weight.numel()  # tied to the embedding: its matmul still runs
    vision = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches) / sum(len(b["input_ids"]) for b in batches)
    patches = sum(int(b["image_grid_thw"].prod(-1).sum()) for b in batches) / sum(len(b["input_ids"]) for b in batches)
    return 4 * llm * tokens + 2 * vision * patches


def _batches(gm, data: Path, batch_size: int, steps: int, seed: int = 0) -> list[dict]:
    """The batches `groundtune train` will see (same order, same encoding), padded."""
    dataset = GroundingDataset(open_samples(str(data), seed), gm.processor, gm.family, gm.resize, gm.prompt)
    order = iter(ResumableBatches(len(dataset), batch_size, seed))
    return [qwen.collate([dataset[key] for key in next(order)], gm.processor.pad_token_id) for _ in range(steps)]


def naive(model_name: str, data: Path, steps: int, batch_size: int = 4) -> dict:
    """transformers + PEFT as peers run them. Same initial weights as groundtune's run."""
    from peft import LoraConfig, get_peft_model

    gm = load_model(model_name)
    model = gm.model
    for m in model.modules():  # transformers' own vision attention: one call per window
        m.__dict__.pop("forward", None)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, bias="none",
                      target_modules=r".*language_model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj")
    torch.manual_seed(0)  # the LoRA init groundtune uses for seed 0 (adapt.prepare_for_training)
    model = get_peft_model(model, lora)
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    model.train()
    batches = _batches(gm, data, batch_size, steps)
    device = next(model.parameters()).device
    adapt.keep_trainable_fp32(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=(0.9, 0.95),
                                  fused=device.type == "cuda")
    losses, times = [], []
    _reset_peak()
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items() if k != "position_ids"}  # the model computes them
        t0 = _now()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(**batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(_now() - t0)
    per_step = statistics.median(times[2:] or times)
    result = _result("naive", model, batches, batch_size, per_step, losses)
    del model, gm, optimizer
    return result


def groundtune_step(name: str, model_name: str, data: Path, steps: int, settings: dict) -> dict:
    """`groundtune train` itself; speed from its metrics.jsonl (samples/s of each logged step)."""
    from groundtune.train.sft import train

    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(model=model_name, train_data=str(data), out_dir=out, method="lora", lora_r=16,
                          lora_alpha=32, lora_targets=["llm_attn", "llm_mlp"], lr=LR, warmup_steps=0,
                          min_lr_ratio=1.0, max_steps=steps, log_every=1, save_every=0, num_workers=8,
                          precision="bf16" if torch.cuda.is_available() else "fp32", **settings)
        _reset_peak()
        run = train(cfg)
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [r for r in rows if "loss" in r and "samples_per_s" in r]
    samples_per_s = statistics.median(r["samples_per_s"] for r in steps_logged[2:] or steps_logged)
    batch_size = settings["batch_size"]
    gm = load_model(model_name)  # for the FLOP count and the token statistics only
    batches = _batches(gm, data, batch_size, min(steps, 4))
    result = _result(name, gm.model, batches, batch_size, batch_size / samples_per_s,
                     [r["loss"] for r in steps_logged], settings)
    result["peak_gib"] = round(peak, 2) if peak is not None else None  # of the training run, not this reload
    del gm
    return result


def step_ladder(model_name: str, data: Path, batch_size: int = 4) -> list[dict]:
    """groundtune's LoRA step (all LLM layers recomputed) timed one change at a time (step_ladder.py)."""
    from step_ladder import ladder

    gm = load_model(model_name)
    cfg = TrainConfig(train_data=str(data), method="lora", gradient_checkpointing=-1)
    model = adapt.prepare_for_training(gm.model, cfg)
    adapt.keep_trainable_fp32(model)
    model.train()
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in _batches(gm, data, batch_size, 1)[0].items()}
    rows = ladder(model, batch, steps=8)
    del model, gm
    return [dict(r, variant="ladder: " + r["change"]) for r in rows]


def _result(variant: str, model, batches, batch_size: int, step_s: float, losses: list[float],
            settings: dict | None = None) -> dict:
    samples_per_s = batch_size / step_s
    tokens = sum(int(b["attention_mask"].sum()) for b in batches) / len(batches) / step_s
    return {
        "variant": variant,
        "settings": settings or {"batch_size": batch_size, "gradient_checkpointing": "all (transformers)"},
        "samples_per_s": round(samples_per_s, 3),
        "llm_tokens_per_s": round(tokens, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        "mfu": round(flops_per_sample(model, batches) * samples_per_s / PEAK_FLOPS, 4),
        "first_losses": [round(v, 4) for v in losses[:6]],
    }


def _save(results: list[dict], out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(results, indent=1) + "\n")


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def measure(key: str, variant: str, data: Path, steps: int) -> dict:
    """One variant, in this process; a failure is a result, not the end of the run."""
    print(f"== {key} {variant}", flush=True)
    try:
        if variant == "naive":
            r = naive(MODELS[key], data, steps)
        else:
            r = groundtune_step(variant, MODELS[key], data, steps, GT_VARIANTS[variant])
    except torch.OutOfMemoryError:
        r = {"variant": variant, "settings": GT_VARIANTS.get(variant), "oom": True}
    except Exception as e:  # an optional kernel that fails here must not cost the other variants
        r = {"variant": variant, "settings": GT_VARIANTS.get(variant), "error": repr(e)[:500]}
    return dict(r, model=key)


def measure_in_fresh_process(key: str, variant: str, data: Path, args) -> list[dict]:
    """One variant (or the ladder) in a process of its own: liger-kernel patches transformers'
    modules process-wide and compiled code stays cached, so neither may leak into the next variant;
    a crash or a hang costs that variant only."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, __file__, "--in-process", "--models", key, "--variants", variant,
               "--steps", str(args.steps), "--samples", str(args.samples), "--cap-gib", str(args.cap_gib),
               "--no-loader", "--data", str(data), "--out", str(out)] + (["--ladder"] if variant == "" else [])
        try:
            rc = subprocess.run(cmd, timeout=args.variant_timeout).returncode
            failure = None if out.exists() else f"the process ended (exit code {rc}) without a result"
        except subprocess.TimeoutExpired:
            failure = f"no result within --variant-timeout {args.variant_timeout:g} s"
        if failure:
            return [{"variant": variant or "ladder", "model": key, "settings": GT_VARIANTS.get(variant),
                     "error": failure}]
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="3b,7b", help="comma-separated: 3b, 7b, tiny")
    parser.add_argument("--variants", default="naive," + ",".join(GT_VARIANTS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--samples", type=int, default=256, help="RefCOCO-like samples to make")
    parser.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory cap (a 24 GB card)")
    parser.add_argument("--ladder", action="store_true", help="also time the step one change at a time")
    parser.add_argument("--no-loader", action="store_true", help="skip timing the data loader alone")
    parser.add_argument("--variant-timeout", type=float, default=600, help="seconds allowed to each variant")
    parser.add_argument("--in-process", action="store_true", help="measure here, not one process per variant")
    parser.add_argument("--data", help="samples made by an earlier run (train.jsonl) instead of new ones")
    parser.add_argument("--out")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if args.in_process and torch.cuda.is_available():  # only the measuring process touches the GPU
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        # the same samples for every variant: made once, passed to each variant's process
        data = Path(args.data) if args.data else make_refcoco_like(Path(tmp), args.samples)
        for key in args.models.split(","):
            for variant in variants + ([""] if args.ladder else []):
                if not args.in_process:
                    rows = measure_in_fresh_process(key, variant, data, args)
                elif variant:
                    rows = [measure(key, variant, data, args.steps)]
                else:
                    rows = [dict(r, model=key) for r in step_ladder(MODELS[key], data)]
                results += rows
                print("\n".join(json.dumps(r) for r in rows), flush=True)
                _save(results, args.out)  # as it goes: a run cut short keeps what it measured
        # the data path must not be the bottleneck: what the loader alone delivers (JPEG decode,
        # resize, encode); last, as its pinned memory opens a CUDA context the variants must not share
        from tiny_step_profile import loader_rate

        gm = load_model("tiny", device="cpu")  # the random architectures speak its tokenizer and processor
        for workers in () if args.no_loader else (1, 8):
            rate = loader_rate(gm, 4, workers, 5.0, str(data))
            results.append({"variant": f"loader-{workers}-workers", "model": "-", "samples_per_s": round(rate, 1)})
            print(f"loader alone, {workers} worker(s): {rate:.0f} samples/s", flush=True)
        _save(results, args.out)
    base = {r["model"]: r for r in results if r["variant"] == "naive" and "samples_per_s" in r}
    print(f"\n{'model':6s}{'variant':20s}{'samples/s':>11s}{'x naive':>9s}{'tokens/s':>10s}{'peak GiB':>10s}{'MFU':>8s}  first losses")
    for r in results:
        if r["variant"].startswith(("loader", "ladder")):
            continue
        if r.get("oom"):
            print(f"{r['model']:6s}{r['variant']:20s}   out of memory at {args.cap_gib:g} GiB")
            continue
        if "error" in r:
            print(f"{r['model']:6s}{r['variant']:20s}   failed: {r['error'][:80]}")
            continue
        ratio = r["samples_per_s"] / base[r["model"]]["samples_per_s"] if r["model"] in base else float("nan")
        print(f"{r['model']:6s}{r['variant']:20s}{r['samples_per_s']:11.2f}{ratio:9.2f}{r['llm_tokens_per_s']:10.0f}"
              f"{r['peak_gib'] or 0:10.2f}{r['mfu']:8.3f}  {r['first_losses'][:3]}")


if __name__ == "__main__":
    main()
