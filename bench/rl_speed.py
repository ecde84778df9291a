"""RL step speed on Qwen2.5-VL-3B (real architecture, random weights): groundtune's step against
a plain transformers `generate` + PEFT implementation of the same step, in one run.

    python bench/rl_speed.py --model 3b --out bench/results/rl_speed.json
    python bench/rl_speed.py --model tiny --steps 2 --prompts 2 --group 4 --new-tokens 16   # CPU smoke test

One step: P prompts (RefCOCO-like images and phrases, as in sft_speed.py) x G = 8 sampled answers
of up to --new-tokens tokens (random weights rarely stop early, so every answer is full length:
the same work for both), IoU rewards, group-normalised advantages, one policy-gradient update.
Reported per implementation: rollouts/s, and the step split into generation / reward / update.

- plain: PEFT LoRA r16 on every LLM linear; transformers' own vision attention (one call per
  window) and M-RoPE positions; `generate(num_return_sequences=G)`; the update runs the model on
  the G copies of each prompt + answer with `gradient_checkpointing_enable()` and takes the
  log-probabilities from the full logits (every position x the vocabulary), as the public GRPO
  trainers do.
- groundtune: `train/rl.py`'s own rollouts / advantages / update (grouped vision attention,
  positions from the encoder, LM head on the answer tokens only), rollouts by the generation
  engine kept for the run (each prompt prefilled once for its G answers, CUDA-graph decode);
- groundtune-before: the same with rollouts by transformers' `generate`, as before the engine;
- groundtune-vision-per-row: the engine's rollouts, but the update runs the vision tower once per
  row (each of the G copies of an image), as before the update shared it per prompt;
- groundtune-padded-update: the engine's rollouts, the update on padded rows that share only the
  vision pass, as before the answers to a prompt shared it in one row (``qwen.collate_answers``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from sft_speed import MODELS, make_refcoco_like
from provenance import stamped, unstamped
from gpu_cap import cap_gpu_memory

from groundtune import infer
from groundtune.boxes import iou, parse_answer
from groundtune.config import RLConfig
from groundtune.data.records import sample_boxes
from groundtune.data.samples import open_samples
from groundtune.models import adapt, qwen, speedups
from groundtune.models.loading import load_model
from groundtune.train import rl
from groundtune.train.distributed import Ranks
from groundtune.train.parallel import Parallel
from groundtune.train.rewards import RewardWeights

shared_images = qwen.shared_image_inputs


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _now() -> float:
    _sync()
    return time.perf_counter()


def groundtune_step(gm, model, pairs, cfg, engine=None) -> dict:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.cuda.is_available())
    t0 = _now()
    batch = rl.rollouts(gm, pairs, list(range(len(pairs))), cfg.group_size, rl.rollout_decoding(cfg), RewardWeights(),
                        engine)
    t1 = _now()  # rollouts() scores as it goes: its reward time is inside generation, and tiny
    adv = rl.advantages(batch.rewards, batch.prompt_keys, cfg, None)
    rl.update(Parallel(model, Ranks()), model.disable_adapter, batch, adv, optimizer, cfg, autocast,
              gm.processor.pad_token_id)
    t2 = _now()
    return {"generate_s": t1 - t0, "reward_s": 0.0, "update_s": t2 - t1, "reward_mean": float(batch.rewards.mean())}


def plain_step(gm, model, pairs, cfg) -> dict:
    """The same step written the plain way (see the module docstring)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    device = next(model.parameters()).device
    encoded, sizes = infer.encode_prompts(gm, [(image, sample["phrase"]) for image, sample in pairs])
    batch = qwen.collate(encoded, gm.processor.pad_token_id, padding_side="left")
    batch.pop("position_ids")  # the model computes them
    batch = {k: v.to(device) for k, v in batch.items()}
    t0 = _now()
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = model.generate(**batch, do_sample=True, temperature=cfg.temperature, num_return_sequences=cfg.group_size,
                             max_new_tokens=cfg.max_new_tokens, pad_token_id=gm.processor.pad_token_id)
    t1 = _now()
    prompt_len = batch["input_ids"].shape[1]
    rewards = []
    for row, ids in enumerate(out[:, prompt_len:].tolist()):
        (original, resized), (_, sample) = sizes[row // cfg.group_size], pairs[row // cfg.group_size]
        text = gm.processor.tokenizer.decode(ids, skip_special_tokens=True)
        box = parse_answer(text, gm.family, original, resized).box
        rewards.append(max(iou(box, t) for t in sample_boxes(sample)) if box else 0.0)
    r = torch.tensor(rewards).view(len(pairs), cfg.group_size)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten().to(device)
    t2 = _now()
    model.train()
    expand = {k: v.repeat_interleave(cfg.group_size, dim=0) for k, v in batch.items()
              if k in ("attention_mask", "mm_token_type_ids")}
    answer_mask = (out[:, prompt_len:] != gm.processor.pad_token_id).long()
    inputs = {"input_ids": out, "attention_mask": torch.cat([expand["attention_mask"], answer_mask], 1),
              "mm_token_type_ids": torch.cat([expand["mm_token_type_ids"], torch.zeros_like(answer_mask)], 1),
              "pixel_values": torch.cat([v.repeat(cfg.group_size, 1) for v in
                                         batch["pixel_values"].split([int(g.prod()) for g in batch["image_grid_thw"]])]),
              "image_grid_thw": batch["image_grid_thw"].repeat_interleave(cfg.group_size, dim=0)}
    for start in range(0, len(out), cfg.micro_batch):
        part = slice(start, start + cfg.micro_batch)
        micro = {k: v[part] for k, v in inputs.items() if k not in ("pixel_values", "image_grid_thw")}
        grids = inputs["image_grid_thw"][part]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), inputs["image_grid_thw"].prod(-1).cumsum(0).cpu()])
        micro["pixel_values"] = inputs["pixel_values"][offsets[start]: offsets[min(start + cfg.micro_batch, len(out))]]
        micro["image_grid_thw"] = grids
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(**micro, use_cache=False).logits[:, prompt_len - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, micro["input_ids"][:, prompt_len:, None]).squeeze(-1)
        mask = answer_mask[part].float()
        loss = -(logp * adv[part, None] * mask).sum() / answer_mask.sum()
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t3 = _now()
    return {"generate_s": t1 - t0, "reward_s": t2 - t1, "update_s": t3 - t2, "reward_mean": float(r.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="3b", help="3b, 7b, tiny or a model folder")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--impls", default="plain,groundtune-padded-update,groundtune",
                        help="plain, groundtune-before (rollouts by transformers' generate), groundtune (the engine), "
                             "groundtune-vision-per-row (the update without its shared vision pass), "
                             "groundtune-padded-update (the update on padded rows, as before the shared row)")
    parser.add_argument("--micro-batch", type=int, default=RLConfig.micro_batch,
                        help="answers per forward/backward pass of the update (groundtune rl's default)")
    parser.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory cap (a 24 GB card)")
    parser.add_argument("--out")
    args = parser.parse_args()
    cfg = RLConfig(train_data="x", batch_size=args.prompts, group_size=args.group, max_new_tokens=args.new_tokens,
                   micro_batch=args.micro_batch, temperature=1.0)
    impls = args.impls.split(",")
    if len(impls) > 1:  # each in a process of its own: what one leaves on the GPU slowed the next by a third
        results = [in_fresh_process(impl, args) for impl in impls]
    else:
        cap_gpu_memory(args.cap_gib)  # only the measuring process touches the GPU
        results = [measure(impls[0], args, cfg)]
    base = results[0]["step_s"]
    print(f"\n{'impl':12s}{'rollouts/s':>11s}{'generate':>10s}{'reward':>8s}{'update':>8s}{'x plain':>9s}")
    for r in results:
        print(f"{r['impl']:12s}{r['rollouts_per_s']:11.2f}{r['generate_s']:10.3f}{r['reward_s']:8.3f}"
              f"{r['update_s']:8.3f}{base / r['step_s']:9.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(stamped(results), indent=1) + "\n")


def in_fresh_process(impl: str, args) -> dict:
    """One implementation's row, measured by a new process of this script with the same settings."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        subprocess.run([sys.executable, __file__, "--model", args.model, "--prompts", str(args.prompts),
                        "--group", str(args.group), "--new-tokens", str(args.new_tokens), "--steps", str(args.steps),
                        "--micro-batch", str(args.micro_batch), "--cap-gib", str(args.cap_gib), "--impls", impl,
                        "--out", str(out)])
        if not out.exists():
            return {"impl": impl, "error": "no result", **dict.fromkeys(
                ("step_s", "rollouts_per_s", "generate_s", "reward_s", "update_s"), float("nan"))}
        return unstamped(json.loads(out.read_text()))[0]


def measure(impl: str, args, cfg: RLConfig) -> dict:
    """One implementation's mean step over --steps steps (after one to warm up), in this process."""
    with tempfile.TemporaryDirectory() as tmp:
        data = make_refcoco_like(Path(tmp), args.prompts * (args.steps + 1))
        samples = open_samples(str(data), 0)
        gm = load_model(MODELS.get(args.model, args.model))  # no speed-up installed: transformers' own attention
        model = adapt.add_lora(gm.model, cfg)
        if impl == "plain":
            model.gradient_checkpointing_enable()
            model.enable_input_require_grads()
        else:
            adapt.checkpoint_last_layers(model, -1)
            speedups.install(model)
        adapt.keep_trainable_fp32(model)
        gm = dataclasses.replace(gm, model=model)
        if impl == "plain":
            step = plain_step
        elif impl == "groundtune-before":  # rollouts through transformers' generate, as before the engine
            step = groundtune_step
        else:  # the run's engine, as train/rl.py keeps it: prefill shared by each group, graph decode
            step = functools.partial(groundtune_step, engine=infer.engine_for(gm))
        # the update's vision pass once per row: the shared pass switched off for this variant only
        qwen.shared_image_inputs = ((lambda core, inputs, image_of_row: inputs)
                                    if impl == "groundtune-vision-per-row" else shared_images)
        # the padded update (the vision-per-row variant's too): each answer's row carries its prompt
        rl.SHARED_ANSWER_ROWS = impl not in ("groundtune-vision-per-row", "groundtune-padded-update")
        times = []
        for s in range(args.steps + 1):  # the first step warms up
            pairs = [samples[i] for i in range(s * args.prompts, (s + 1) * args.prompts)]
            t = step(gm, model, pairs, cfg)
            if s:
                times.append(t)
        mean = {k: sum(t[k] for t in times) / len(times) for k in times[0]}
        total = mean["generate_s"] + mean["reward_s"] + mean["update_s"]
        row = {"impl": impl, "model": args.model, "prompts": args.prompts, "group": args.group,
               "micro_batch": args.micro_batch,
               "new_tokens": args.new_tokens, **{k: round(v, 4) for k, v in mean.items()},
               "step_s": round(total, 4), "rollouts_per_s": round(args.prompts * args.group / total, 2),
               "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None}
        print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
