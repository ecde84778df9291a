"""SFT speed and memory of Qwen2.5-VL-3B/7B (real architectures, random weights) on RefCOCO-like
batches: the naive transformers + PEFT stack against `groundtune train`'s own step, in one run.

    python bench/sft_speed.py --models 3b,7b --out bench/results/sft_speed.json
    python bench/sft_speed.py --models 3b --variants naive,preset:qwen2.5-vl-3b-lora-24gb --profile 1
    python bench/sft_speed.py --models tiny --steps 4 --loader-seconds 0.5   # CPU smoke test of this script
    python bench/sft_speed.py --models 3b --variants trl,preset:qwen2.5-vl-3b-lora-24gb     # against TRL
    python bench/sft_speed.py --models 3b --variants swift,trl,preset:qwen2.5-vl-3b-lora-24gb --peer-site /tmp/swift
    python bench/sft_speed.py --models 3b --variants P,P@ddp,P@fsdp2,P@zero2,P   # P: preset:qwen2.5-vl-3b-lora-24gb

Data: one image per sample, sizes drawn around COCO's 640x480 with varied aspect ratios, the
official grounding prompt and a JSON answer of ~30 tokens; the same samples, in the same order,
for every variant. Each variant starts from the same weights (same seed, same LoRA init), so the
first losses must agree within bf16 noise: the objective is the same, only the speed differs.

- naive: transformers + PEFT as the peers use them: LoRA r16 on every LLM linear, vision frozen,
  SDPA, padded batches, `gradient_checkpointing_enable()` + `enable_input_require_grads()`,
  fused AdamW, batch 4; inputs pre-built on the GPU (its data time is not counted).
- gt-*: `groundtune.train.sft.train` itself (the loop `groundtune train` runs, data loader
  included) with the settings in GT_VARIANTS; speed and memory read from its metrics.jsonl.
- trl, trl:BATCH: TRL's SFTTrainer by its documented VLM recipe at its best 24 GiB setting
  (batch 32, checkpointing, liger-kernel where installed; `trl_sft` says what it cannot do);
  needs trl, datasets and torchvision (transformers' Qwen-VL processor builds a video part).
- swift, swift:BATCH: ms-swift's `swift sft` (its own entry point; bench/peer_swift.py adds a step
  timer) by its documented Qwen2.5-VL LoRA recipe at BATCH (32 by default; `swift_sft` says what it
  cannot do); ms-swift pins datasets and trl releases other than groundtune's, so it runs with
  --peer-site DIR first on its PYTHONPATH (`pip install --no-deps --target DIR -r bench/peer_swift_requirements.txt`).
- preset:NAME: the same with a shipped preset's batch, recomputation, packing and kernel settings.
  A QLoRA preset first writes the random architecture to disk and trains from that folder: the
  4-bit base is made by from_pretrained, as from a user's weights (bitsandbytes needed).
- VARIANT+KEY=VALUE: the variant with one setting changed, e.g. preset:NAME+head=box or +fp8=true;
  and the bench's switches +rotary=unfused (the rotary embeddings as transformers computes them, not
  through liger-kernel's rope kernel: kernels.FUSED_ROTARY) and +loss=unfused (the answer tokens'
  logits whole, not liger-kernel's fused linear cross-entropy: kernels.FUSED_LOSS), to measure what
  each kernel gives.
- VARIANT@ENGINE: the same variant launched by `torchrun --nproc-per-node 1` with
  distributed=ENGINE (ddp, fsdp2, zero2, zero3): what one rank of a multi-GPU run costs against
  the plain command, in the same run.
- --profile N: torch.profiler over N steps of each groundtune variant (not counted in its speed):
  GPU kernel time by kind, launches, the top kernels; --ladder: the step one change at a time.

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
import dataclasses
import gc
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image

from groundtune.config import TrainConfig, preset_path
from groundtune.data.check import check_records
from groundtune.data.samples import ResumableBatches, open_samples
from groundtune.data.records import read_samples, write_samples
from groundtune.errors import DataError
from groundtune.models import adapt, kernels, qwen
from groundtune.models.loading import TINY_DIR, load_model
from groundtune.train.batches import GroundingDataset
from provenance import stamped, unstamped
from gpu_cap import cap_gpu_memory

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
    # packed rows with variable-length attention (models/attention.py)
    "gt-b16-packed-ckpt-all-liger": dict(batch_size=16, gradient_checkpointing=-1, packing=True, kernels="liger"),
    "gt-b32-packed-ckpt-all": dict(batch_size=32, gradient_checkpointing=-1, packing=True),
    "gt-b32-packed-ckpt-all-liger": dict(batch_size=32, gradient_checkpointing=-1, packing=True, kernels="liger"),
    "gt-b48-packed-ckpt-all-liger": dict(batch_size=48, gradient_checkpointing=-1, packing=True, kernels="liger"),
    "gt-b64-packed-ckpt-all-liger": dict(batch_size=64, gradient_checkpointing=-1, packing=True, kernels="liger"),
    "gt-b32-packed-ckpt-all-compile": dict(batch_size=32, gradient_checkpointing=-1, packing=True, compile=True),
    "gt-b64-packed-ckpt-all-compile": dict(batch_size=64, gradient_checkpointing=-1, packing=True, compile=True),
    "gt-b8-packed-ckpt-all-liger": dict(batch_size=8, gradient_checkpointing=-1, packing=True, kernels="liger"),
    # QLoRA (4-bit base) at the preset's batch, without and with liger-kernel
    "gt-qlora-b8x2-packed-ckpt-all": dict(method="qlora", batch_size=8, grad_accum=2, gradient_checkpointing=-1,
                                          packing=True),
    "gt-qlora-b8x2-packed-ckpt-all-liger": dict(method="qlora", batch_size=8, grad_accum=2,
                                                gradient_checkpointing=-1, packing=True, kernels="liger"),
}
# what a shipped preset (variant "preset:NAME") decides about speed and memory; the rest is the bench's
PRESET_SETTINGS = ("method", "lora_r", "lora_alpha", "lora_targets", "batch_size", "grad_accum", "gradient_checkpointing",
                   "packing", "kernels", "compile", "max_pixels", "min_pixels", "num_workers")
LR = 1e-4


# VARIANT+SWITCH=fused|unfused: the bench's, not TrainConfig settings; each sets a flag of models/kernels.py
BENCH_SWITCHES = {"rotary": "FUSED_ROTARY", "loss": "FUSED_LOSS"}


def variant_settings(variant: str) -> dict | None:
    """The TrainConfig settings of a variant: a name of GT_VARIANTS, or preset:NAME (configs/NAME.yaml),
    either followed by @ENGINE (the run's ``distributed`` setting, under torchrun)."""
    variant, *extras = variant.split("+")  # VARIANT+KEY=VALUE: a setting over the variant's (head=box)
    if extras:
        settings = variant_settings(variant)
        return None if settings is None else {**settings, **{k: yaml.safe_load(v) for k, v in
                                                             (extra.split("=", 1) for extra in extras)}}
    variant, _, engine = variant.partition("@")
    if engine:
        settings = variant_settings(variant)
        return None if settings is None else {**settings, "distributed": engine}
    if variant.startswith("preset:"):
        preset = yaml.safe_load(preset_path(variant.removeprefix("preset:")).read_text())
        return {k: v for k, v in preset.items() if k in PRESET_SETTINGS}
    return GT_VARIANTS.get(variant)
WORDS = ("man woman dog cat car bus chair table person bike umbrella horse cup bottle tree sign "
         "red blue white black green small large left right front back middle standing sitting").split()


def earlier_samples(value: str) -> Path:
    """The type of the benches' --data: a samples file an earlier run made; a path naming no file,
    a file with a line that is no sample, or a record whose image is missing or does not decode
    (``groundtune data check``'s own checks) is one line and exit 2 (argparse's), not a traceback
    from deep in the run."""
    path = Path(value)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{value}: no such file")
    try:
        read_samples(path)
        bad = check_records(path).bad
    except DataError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if bad:
        raise argparse.ArgumentTypeError(f"{path}:{bad[0]['line']}: {bad[0]['message']} ({len(bad)} such records; "
                                         f"`groundtune data check {path}` lists them)")
    return path


def make_refcoco_like(folder: Path, n: int, seed: int = 0, phrases_per_image: int = 1) -> Path:
    """n samples: JPEGs of COCO-like sizes (long side 640 or a bit less, aspect 0.5-2), one box, a
    phrase of 3-8 words; ``phrases_per_image`` consecutive samples share an image (RefCOCO's val
    split asks 7.2 phrases of each). Pixels are noise: speed does not depend on them."""
    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        if i % phrases_per_image == 0:  # a new image
            aspect = float(np.exp(rng.uniform(np.log(0.5), np.log(2.0))))
            long_side = int(rng.choice([640, 640, 640, 612, 500, 480]))
            w, h = (long_side, int(long_side / aspect)) if aspect >= 1 else (int(long_side * aspect), long_side)
            pixels = rng.integers(0, 256, size=(h // 8, w // 8, 3), dtype=np.uint8)
            image = f"images/{i // phrases_per_image:05d}.jpg"
            Image.fromarray(pixels).resize((w, h)).save(folder / image, quality=85)
        x1, y1 = rng.uniform(0, w * 0.6), rng.uniform(0, h * 0.6)
        box = [round(x1, 1), round(y1, 1), round(x1 + rng.uniform(20, w - x1), 1), round(y1 + rng.uniform(20, h - y1), 1)]
        phrase = "the " + " ".join(rng.choice(WORDS, size=int(rng.integers(3, 9))))
        records.append({"id": f"bench-{i}", "image": image, "width": w, "height": h,
                        "phrase": phrase, "bbox": box, "split": "train", "source": "bench"})
    path = folder / "train.jsonl"
    write_samples(path, records)
    return path


def parameter_counts(model) -> dict:
    """What the FLOP count needs: LLM parameters that multiply every token (the LM head too, even
    when tied to the embedding: its matmul still runs) and the vision tower's."""
    named = dict(model.named_parameters())
    numel = {n: getattr(p, "ds_numel", p.numel()) for n, p in named.items()}  # (ZeRO-3 leaves p.numel() 0)
    llm = sum(k for n, k in numel.items() if "visual" not in n and "embed_tokens" not in n)
    lm_head = model.get_output_embeddings()
    if lm_head is not None and not any(lm_head.weight is p for n, p in named.items() if "lm_head" in n):
        llm += lm_head.weight.numel()
    return {"llm": llm, "vision": sum(k for n, k in numel.items() if "visual" in n)}


def flops_per_sample(counts: dict, batches: list[dict]) -> float:
    tokens = sum(int(b["attention_mask"].sum()) for b in batches) / sum(len(b["input_ids"]) for b in batches)
    patches = sum(int(b["image_grid_thw"].prod(-1).sum()) for b in batches) / sum(len(b["input_ids"]) for b in batches)
    return 4 * counts["llm"] * tokens + 2 * counts["vision"] * patches


def _data_view(model_name: str):
    """Processor, family, pixel budget and prompt of ``model_name`` without building it: the random
    architectures speak the tiny model's tokenizer with their family's default pixel budget."""
    gm = load_model("tiny", device="cpu")
    if model_name.startswith("random:"):
        gm = dataclasses.replace(gm, resize=qwen.family(gm.family).default_resize(), prompt=qwen.DEFAULT_PROMPT)
    return gm


def _batches(gm, data: Path, batch_size: int, steps: int, seed: int = 0) -> list[dict]:
    """The batches `groundtune train` will see (same order, same encoding), padded."""
    dataset = GroundingDataset(open_samples(str(data), seed), gm.processor, gm.family, gm.resize, gm.prompt)
    order = iter(ResumableBatches(len(dataset), batch_size, seed))
    return [qwen.collate([dataset[key] for key in next(order)], gm.processor.pad_token_id) for _ in range(steps)]


def naive(model_name: str, data: Path, steps: int, batch_size: int = 4) -> dict:
    """transformers + PEFT as peers run them. Same initial weights as groundtune's run."""
    from peft import LoraConfig, get_peft_model

    gm = load_model(model_name)  # no speed-up installed: transformers' own attention, one call per window
    model = gm.model
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
    result = _result("naive", parameter_counts(adapt.base_model(model)), batches, batch_size, per_step, losses)
    del model, gm, optimizer
    return result


def _conversations(view, samples, indices) -> list[tuple[Image.Image, str, str]]:
    """Samples ``indices`` as a peer trains on them: (the image resized as groundtune resizes it, so
    the peer's processor leaves its size alone; the user's words; the answer groundtune trains on)."""
    from groundtune import boxes
    from groundtune.data.records import sample_boxes

    conversations = []
    for index in indices:
        image, sample = samples[index]
        resized, size = qwen.resize_image(image, view.resize)
        answer = qwen.PhraseText.written(
            lambda label: boxes.format_target(sample_boxes(sample), label, view.family, image.size, size), sample["phrase"])
        conversations.append((resized, view.prompt.format(phrase=sample["phrase"]), str(answer)))
    return conversations


def trl_sft(model_name: str, data: Path, steps: int, batch_size: int = 32) -> dict:
    """TRL's SFTTrainer by its documented VLM recipe, at its best setting measured in 24 GiB (batch 32;
    64 runs out of memory): prompt-completion conversations with the image, loss on the completion
    only, LoRA r16 on every LLM linear, gradient checkpointing, bf16, liger-kernel where installed,
    no packing (TRL's padding-free mode refuses Qwen-VL's multimodal rotary positions). The same
    samples, resized as groundtune resizes them (TRL's processor then leaves their size alone) and
    with the same answers; the same LoRA init seed. Needs trl, datasets and a processor transformers
    can build (AutoProcessor: torchvision for the video part)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoProcessor, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    gm, view, samples = load_model(model_name), _data_view(model_name), open_samples(str(data), 0)
    rows = [{"images": [resized],
             "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}],
             "completion": [{"role": "assistant", "content": [{"type": "text", "text": answer}]}]}
            for resized, prompt, answer in _conversations(view, samples, range(min(len(samples), batch_size * (steps + 1))))]
    processor = AutoProcessor.from_pretrained(TINY_DIR)  # the tokenizer the random architectures speak
    processor.image_processor.max_pixels = processor.image_processor.size["longest_edge"] = view.resize.max_pixels
    cuda = torch.cuda.is_available()
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            times.append(-_now())

        def on_step_end(self, *args, **kwargs):
            times[-1] += _now()

    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(output_dir=out, per_device_train_batch_size=batch_size, max_steps=steps, learning_rate=LR,
                           lr_scheduler_type="constant", warmup_steps=0, adam_beta2=0.95, max_grad_norm=1.0,
                           gradient_checkpointing=True, bf16=cuda, max_length=None, logging_steps=1,
                           save_strategy="no", report_to=[], dataloader_num_workers=8 if cuda else 0,
                           use_liger_kernel=cuda and importlib.util.find_spec("liger_kernel") is not None,
                           seed=0, data_seed=0)
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, bias="none",
                          target_modules=r".*language_model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj")
        torch.manual_seed(0)
        trainer = SFTTrainer(model=gm.model, args=config, train_dataset=Dataset.from_list(rows),
                             processing_class=processor, peft_config=lora, callbacks=[StepTimer()])
        _reset_peak()
        trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    batches = _batches(view, data, batch_size, min(steps, 4))
    settings = {"batch_size": batch_size, "gradient_checkpointing": "all (transformers)", "peer": "trl",
                "liger": config.use_liger_kernel}
    return _result("trl", parameter_counts(adapt.base_model(trainer.model)), batches, batch_size,
                   statistics.median(times[2:] or times), losses, settings)


def swift_sft(model_name: str, data: Path, steps: int, batch_size: int = 32, peer_site: str | None = None,
              cap_gib: float = 24.0) -> dict:
    """ms-swift's `swift sft` by its documented Qwen2.5-VL LoRA recipe (messages + images JSONL,
    `--freeze_vit true --target_modules all-linear`, gradient checkpointing, liger-kernel and bf16 on
    a GPU, its own data loader with 8 workers) at the batch given, with groundtune's LoRA rank and
    alpha, learning rate and clipping so the objective is the same. No packing or padding-free: ms-swift
    refuses both without a flash-attn build (`--attn_impl flash_attn`), which the measuring machine
    lacks; SDPA then. The prompt is groundtune's: no system turn (the tiny model's template, which the
    random architectures speak, has none; ms-swift's would add one). The random architecture is written to
    disk first (ms-swift loads a model by path); the same samples, resized as groundtune resizes them
    and saved as JPEG (quality 95), with the same answers. Runs bench/peer_swift.py in a process whose
    PYTHONPATH starts with ``peer_site`` (ms-swift and the datasets/trl it pins); it gives ms-swift's
    template the tokenizer's image-token ids (ms-swift writes Qwen's own in its class)."""
    import os

    view = _data_view(model_name)
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder, counts = _saved_weights(model_name, tmp / "run")
        folder = str(Path(folder) / "model")  # where a run keeps its model: config, weights, processor
        (tmp / "images").mkdir()
        lines = []
        # groundtune's order (seed 0), unshuffled by ms-swift: the same samples in each step as groundtune's
        samples = open_samples(str(data), 0)
        order = iter(ResumableBatches(len(samples), batch_size, 0))
        indices = [index for _ in range(steps) for index, _ in next(order)]
        for index, (resized, prompt, answer) in enumerate(_conversations(view, samples, indices)):
            image = tmp / "images" / f"{index:06d}.jpg"
            resized.convert("RGB").save(image, quality=95)
            lines.append(json.dumps({"messages": [{"role": "user", "content": "<image>" + prompt},
                                                  {"role": "assistant", "content": answer}], "images": [str(image)]}))
        (tmp / "train.jsonl").write_text("\n".join(lines) + "\n")
        liger = cuda and importlib.util.find_spec("liger_kernel") is not None
        # --system "": no system turn, as in the tiny model's chat template, which groundtune's runs use
        settings = ["--model", folder, "--model_type", "qwen2_5_vl", "--template", "qwen2_5_vl", "--system", "",
                    "--check_model", "false",
                    "--dataset", str(tmp / "train.jsonl"), "--split_dataset_ratio", "0", "--dataset_shuffle", "false",
                    "--train_dataloader_shuffle", "false",
                    "--tuner_type", "lora", "--target_modules", "all-linear", "--freeze_vit", "true",
                    "--lora_rank", "16", "--lora_alpha", "32", "--lora_dropout", "0",
                    "--per_device_train_batch_size", str(batch_size), "--gradient_accumulation_steps", "1",
                    "--gradient_checkpointing", "true", "--max_steps", str(steps), "--learning_rate", str(LR),
                    "--lr_scheduler_type", "constant", "--warmup_ratio", "0", "--adam_beta2", "0.95",
                    "--max_grad_norm", "1.0", "--torch_dtype", "bfloat16" if cuda else "float32",
                    "--attn_impl", "sdpa", "--use_liger_kernel", str(liger).lower(),
                    "--dataloader_num_workers", "8" if cuda else "0", "--logging_steps", "1", "--save_strategy", "no",
                    "--report_to", "none", "--seed", "0", "--data_seed", "0", "--output_dir", str(tmp / "out")]
        # ms-swift sizes images by these (qwen_vl_utils' smart_resize): groundtune's budget leaves them as made
        env = dict(os.environ, MAX_PIXELS=str(view.resize.max_pixels), MIN_PIXELS=str(view.resize.min_pixels),
                   PYTHONPATH=os.pathsep.join(p for p in (peer_site, os.environ.get("PYTHONPATH")) if p))
        times = tmp / "times.json"
        subprocess.run([sys.executable, str(Path(__file__).with_name("peer_swift.py")), "--out", str(times),
                        "--cap-gib", str(cap_gib), "--", *settings], env=env, check=True)
        measured = json.loads(times.read_text())
    batches = _batches(view, data, batch_size, min(steps, 4))
    settings = {"batch_size": batch_size, "gradient_checkpointing": "all (transformers)", "peer": "ms-swift",
                "liger": liger, "attention": "sdpa (padding-free and packing need flash-attn)",
                "peer_versions": measured["versions"]}
    step_s = measured["step_s"]
    return dict(_result("swift", counts, batches, batch_size, statistics.median(step_s[2:] or step_s),
                        measured["losses"], settings), peak_gib=measured["peak_gib"])


def groundtune_step(name: str, model_name: str, data: Path, steps: int, settings: dict,
                    profile_steps: int = 0) -> dict:
    """`groundtune train` itself; speed from its metrics.jsonl (samples/s of each logged step).
    ``profile_steps``: also profile that many steps after the warm-up (torch.profiler)."""
    from groundtune.train.sft import train

    seen: dict = {}
    profiler = _StepProfiler(start=max(steps - profile_steps - 1, 2), steps=profile_steps) if profile_steps else None

    def on_step(step, run, model):
        if "counts" not in seen:
            seen["counts"] = parameter_counts(adapt.base_model(model))
        if profiler is not None:
            profiler.on_step(step)

    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as weights:
        model = model_name
        if settings.get("method") == "qlora" and model_name.startswith("random:"):
            model, seen["counts"] = _saved_weights(model_name, Path(weights))
        values = dict(method="lora", lora_r=16, lora_alpha=32, lora_targets=["llm_attn", "llm_mlp"], num_workers=8,
                      precision="bf16" if torch.cuda.is_available() else "fp32")
        settings = dict(settings)
        # switches of the bench's, not settings: VARIANT+rotary=unfused computes the rotary embeddings
        # as transformers does, not through liger-kernel's rope kernel; +loss=unfused the answer
        # tokens' logits whole, not through its fused linear cross-entropy (what each kernel gives)
        for switch, flag in BENCH_SWITCHES.items():
            setattr(kernels, flag, settings.pop(switch, "fused") != "unfused")
        values.update(settings)  # a variant's or a preset's settings; the run's length and logging are the bench's
        cfg = TrainConfig(**values, model=model, train_data=str(data), out_dir=out, lr=LR, warmup_steps=0,
                          min_lr_ratio=1.0, max_steps=steps, log_every=1, save_every=0)
        _reset_peak()
        run = train(cfg, on_step=on_step)
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [r for r in rows if "loss" in r and "samples_per_s" in r]
    timed = [r for r in steps_logged[2:] if profiler is None or not profiler.covers(r["step"])] or steps_logged
    samples_per_s = statistics.median(r["samples_per_s"] for r in timed)
    batch_size = cfg.batch_size * cfg.grad_accum  # samples per optimizer step
    batches = _batches(_data_view(model_name), data, batch_size, min(steps, 4))
    result = _result(name, seen["counts"], batches, batch_size, batch_size / samples_per_s,
                     [r["loss"] for r in steps_logged], settings)
    result["peak_gib"] = round(peak, 2) if peak is not None else None
    result["losses"] = [round(r["loss"], 4) for r in steps_logged]  # the whole curve (fp8 against bf16: 200 steps)
    if profiler is not None and profiler.summary:
        result["profile"] = profiler.summary
    return result


def _saved_weights(model_name: str, folder: Path) -> tuple[str, dict]:
    """A random architecture written to disk as a model folder, so that it loads the way a user's
    weights do: through from_pretrained, in 4-bit for QLoRA (a model built in memory cannot be
    loaded in 4-bit). Returns the folder and the unquantized model's parameter counts (a 4-bit
    weight's numel is that of its packed bytes, half its own)."""
    from groundtune.train import checkpoint

    gm = load_model(model_name)
    counts = parameter_counts(gm.model)
    checkpoint.save_model(folder, gm, gm.model)
    del gm
    gc.collect()
    torch.cuda.empty_cache()  # the run that loads it must not see this copy's memory
    return str(folder), counts


class _StepProfiler:
    """torch.profiler over steps start+1 .. start+steps of a training run (driven by its on_step
    hook), summarised per step: wall time, GPU kernel time, kernel launches, the kernels that take
    the time grouped by kind, and the top kernels."""

    KINDS = (("gemm", r"gemm|cutlass|xmma|nvjet|cublas|matmul"), ("attention", r"flash|fmha|attention|sdpa"),
             ("triton (liger/compiled)", r"triton"), ("copy/index", r"copy|index|gather|scatter|cat|memcpy|memset"),
             ("elementwise", r"elementwise|vectorized|unrolled"), ("reduce/norm", r"reduce|norm|softmax"))

    def __init__(self, start: int, steps: int):
        self.start, self.steps, self.prof, self.t0, self.summary = start, steps, None, 0.0, None

    def covers(self, step: int) -> bool:
        return self.start < step <= self.start + self.steps

    def on_step(self, step: int) -> None:
        if step == self.start and torch.cuda.is_available():
            torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif self.prof is not None and step == self.start + self.steps:
            torch.cuda.synchronize()
            wall = (time.perf_counter() - self.t0) / self.steps
            self.prof.__exit__(None, None, None)
            self.summary = self._summarise(wall)
            self.prof = None

    def _summarise(self, wall: float) -> dict:
        import re

        kernels = [e for e in self.prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.device_time for e in kernels) / 1e6 / self.steps  # device_time is in microseconds
        by_kind, by_name = {}, {}
        for e in kernels:
            kind = next((k for k, pattern in self.KINDS if re.search(pattern, e.name, re.I)), "other")
            by_kind[kind] = by_kind.get(kind, 0.0) + e.device_time / 1e6 / self.steps
            entry = by_name.setdefault(e.name[:90], [0.0, 0])
            entry[0] += e.device_time / 1e6 / self.steps
            entry[1] += 1 / self.steps
        top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:15]
        return {"wall_s": round(wall, 4), "gpu_kernel_s": round(total, 4), "gpu_busy": round(total / wall, 3),
                "kernels_per_step": round(len(kernels) / self.steps),
                "by_kind_s": {k: round(v, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
                "top_kernels": [{"name": n, "s": round(v[0], 4), "calls": round(v[1])} for n, v in top]}


def step_ladder(model_name: str, data: Path, batch_size: int = 32) -> list[dict]:
    """groundtune's LoRA step (all LLM layers recomputed) timed one change at a time (step_ladder.py)."""
    from step_ladder import ladder

    gm = load_model(model_name)
    cfg = TrainConfig(train_data=str(data), method="lora", gradient_checkpointing=-1)
    model = adapt.prepare_for_training(gm.model, cfg)
    adapt.keep_trainable_fp32(model)
    model.train()
    dataset = GroundingDataset(open_samples(str(data), 0), gm.processor, gm.family, gm.resize, gm.prompt)
    rows = ladder(model, [dataset[(i, i)] for i in range(batch_size)], gm.processor.pad_token_id)
    del model, gm
    return [dict(r, variant="ladder: " + r["change"], settings={"batch_size": batch_size}) for r in rows]


def _result(variant: str, counts: dict, batches, batch_size: int, step_s: float, losses: list[float],
            settings: dict | None = None) -> dict:
    samples_per_s = batch_size / step_s
    tokens = sum(int(b["attention_mask"].sum()) for b in batches) / len(batches) / step_s
    return {
        "variant": variant,
        "settings": settings or {"batch_size": batch_size, "gradient_checkpointing": "all (transformers)"},
        "samples_per_s": round(samples_per_s, 3),
        "llm_tokens_per_s": round(tokens, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        "mfu": round(flops_per_sample(counts, batches) * samples_per_s / PEAK_FLOPS, 4),
        "first_losses": [round(v, 4) for v in losses[:6]],
    }


def _save(results: list[dict], out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(stamped(results), indent=1) + "\n")


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def measure(key: str, variant: str, data: Path, steps: int, profile_steps: int = 0, peer_site: str | None = None,
            cap_gib: float = 24.0) -> dict:
    """One variant, in this process; a failure is a result, not the end of the run."""
    import traceback

    print(f"== {key} {variant}", flush=True)
    model = MODELS.get(key, key)  # a key of MODELS, or a model folder
    try:
        if variant == "naive":
            r = naive(model, data, steps)
        elif variant.startswith("trl"):  # trl or trl:BATCH
            r = dict(trl_sft(model, data, steps, int(variant.partition(":")[2] or 32)), variant=variant)
        elif variant.startswith("swift"):  # swift or swift:BATCH
            r = dict(swift_sft(model, data, steps, int(variant.partition(":")[2] or 32), peer_site, cap_gib),
                     variant=variant)
        else:
            r = groundtune_step(variant, model, data, steps, variant_settings(variant), profile_steps)
    except torch.OutOfMemoryError:
        # where it ran out: a load-time shortage and an activation peak look the same from outside
        r = {"variant": variant, "settings": variant_settings(variant), "oom": True,
             "where": traceback.format_exc(limit=-6)[-1500:]}
    except Exception as e:  # an optional kernel that fails here must not cost the other variants
        r = {"variant": variant, "settings": variant_settings(variant), "error": repr(e)[:500],
             "where": traceback.format_exc(limit=-6)[-1500:]}
    return dict(r, model=key)


def measure_in_fresh_process(key: str, variant: str, data: Path, args) -> list[dict]:
    """One variant (or the ladder) in a process of its own: liger-kernel patches transformers'
    modules process-wide and compiled code stays cached, so neither may leak into the next variant;
    a crash or a hang costs that variant only."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        # VARIANT@ENGINE: one rank of torchrun
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"] if "@" in variant else [sys.executable]
        cmd = ([*launch, __file__, "--in-process", "--models", key, "--variants", variant,
               "--steps", str(args.steps), "--samples", str(args.samples), "--cap-gib", str(args.cap_gib),
               "--no-loader", "--data", str(data), "--out", str(out), "--profile", str(args.profile)]
               + (["--peer-site", args.peer_site] if args.peer_site else [])
               + (["--ladder"] if variant == "" else []))
        try:
            rc = subprocess.run(cmd, timeout=args.variant_timeout).returncode
            failure = None if out.exists() else f"the process ended (exit code {rc}) without a result"
        except subprocess.TimeoutExpired:
            failure = f"no result within --variant-timeout {args.variant_timeout:g} s"
        if failure:
            return [{"variant": variant or "ladder", "model": key, "settings": variant_settings(variant),
                     "error": failure}]
        return unstamped(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="3b,7b", help="comma-separated: 3b, 7b, tiny or a model folder")
    parser.add_argument("--variants", default="naive," + ",".join(GT_VARIANTS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--samples", type=int, default=256, help="RefCOCO-like samples to make")
    parser.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory cap (a 24 GB card)")
    parser.add_argument("--ladder", action="store_true", help="also time the step one change at a time")
    parser.add_argument("--no-loader", action="store_true", help="skip timing the data loader alone")
    parser.add_argument("--loader-seconds", type=float, default=5.0,
                        help="how long the data loader alone is timed, with each worker count")
    parser.add_argument("--variant-timeout", type=float, default=600, help="seconds allowed to each variant")
    parser.add_argument("--in-process", action="store_true", help="measure here, not one process per variant")
    parser.add_argument("--data", type=earlier_samples,
                        help="samples made by an earlier run (train.jsonl) instead of new ones")
    parser.add_argument("--profile", type=int, default=0, help="profile this many steps of each groundtune variant")
    parser.add_argument("--peer-site", help="a folder put first on the swift variant's PYTHONPATH: ms-swift with the "
                        "datasets and trl releases it pins, installed there (pip install --target)")
    parser.add_argument("--out")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for switch in BENCH_SWITCHES:
        switched = [v for v in variants if (variant_settings(v) or {}).get(switch, "fused") not in ("fused", "unfused")]
        if switched:
            parser.error(f"{switched[0]}: +{switch}= takes fused or unfused")
    if any(v.startswith("swift") for v in variants) and not (args.peer_site and (Path(args.peer_site) / "swift").is_dir()):
        parser.error(f"the swift variant needs --peer-site naming a folder that holds ms-swift (got {args.peer_site}); "
                     "bench/peer_swift_requirements.txt says how to make one")
    if args.in_process:  # only the measuring process touches the GPU
        cap_gpu_memory(args.cap_gib)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        # the same samples for every variant: made once, passed to each variant's process
        data = args.data or make_refcoco_like(Path(tmp), args.samples)
        for key in args.models.split(","):
            for variant in variants + ([""] if args.ladder else []):
                if not args.in_process:
                    rows = measure_in_fresh_process(key, variant, data, args)
                elif variant:
                    rows = [measure(key, variant, data, args.steps, args.profile, args.peer_site, args.cap_gib)]
                else:
                    rows = [dict(r, model=key) for r in step_ladder(MODELS.get(key, key), data)]
                results += rows
                print("\n".join(json.dumps(r) for r in rows), flush=True)
                _save(results, args.out)  # as it goes: a run cut short keeps what it measured
        # the data path must not be the bottleneck: what the loader alone delivers (JPEG decode,
        # resize, encode); last, as its pinned memory opens a CUDA context the variants must not share
        from tiny_step_profile import loader_rate

        gm = load_model("tiny", device="cpu")  # the random architectures speak its tokenizer and processor
        for workers in () if args.no_loader else (1, 8):
            rate = loader_rate(gm, 4, workers, args.loader_seconds, str(data))
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
    for r in results:  # where a profiled step's time goes
        if "profile" in r:
            p = r["profile"]
            kinds = ", ".join(f"{k} {v:.3f}" for k, v in p["by_kind_s"].items())
            print(f"profile {r['model']} {r['variant']}: step {p['wall_s']:.3f} s, GPU kernels {p['gpu_kernel_s']:.3f} s "
                  f"({p['gpu_busy']:.0%} busy), {p['kernels_per_step']} kernels; {kinds}")


if __name__ == "__main__":
    main()
