"""Will a training run fit a card, how fast will it go, and what to change if not (``groundtune plan``).

Predicted before any model loads, from four things groundtune knows without torch: the model's
architecture (its config.json, or the published shapes in groundtune.families), the run's settings
(method, batch, recomputed layers, packing, LoRA targets, pixel budget), the data's image sizes
(each record's width and height) and a card (assets/cards.json: memory, bf16 matmul rate and
memory bandwidth, each with its source).

Peak GPU memory (what torch's allocator holds at most) is a sum of terms, each a count this module
computes times a coefficient fitted from measured steps:

    weights      bf16 (or 4-bit NF4 for QLoRA's language model) parameters, counted exactly
    trained      trainable parameters in fp32 with their gradient and AdamW's two moments (16 bytes)
    fixed        what every run holds besides (cuBLAS workspaces, kernels' buffers)
    boundaries   each recomputed decoder layer keeps its input: tokens x hidden
    layer        a decoder layer's full activations (tokens x (7 hidden + 3 intermediate)), for every layer
                 kept and the one being recomputed
    logits       the LM head's scores on the answer tokens (answer tokens x vocabulary)
    fused_logits the same count where liger-kernel's fused loss makes them a chunk at a time
                 (``fused_loss``): fitted apart, from runs that had it
    vision       the frozen vision tower's pass (patches x its width)
    optimizer    full fine-tuning: the optimizer step's own peak once activations are gone (the larger of
                 it and the activations counts)
    on a CPU (fp32; attention through dense masks, models/attention.py): fixed_cpu, attention (the scores of
                 the layer being computed), attention_kept (those of layers not recomputed), mask (one for all)

The coefficients come from ``bench/plan_check.py fit``: real steps of the 3B and 7B on an H200 and
an H100 (and of the tiny model on a CPU for the CPU's terms), fitted by least squares and written
to assets/plan_model.json with the largest under-prediction seen (the margin added before saying
"fits") and the CUDA context a card loses to the driver. Speed is the measured step, in H200
terms, scaled to the card: matmul time by the ratio of bf16 rates, the 4-bit dequantisation,
activation traffic and the optimizer's sweep by the ratio of bandwidths, the per-step overhead
unchanged (the fit of 2026-12-05 gives traffic and the sweep next to no time: there, speed scales
with the card's bf16 rate).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from groundtune import families
from groundtune.boxes import ResizeError, smart_resize
from groundtune.config import TrainConfig
from groundtune.errors import ConfigError, MissingError
from groundtune.files import regular_file
from groundtune.runs import RunFolder

ASSETS = Path(__file__).resolve().parent / "assets"
CARDS_FILE = ASSETS / "cards.json"
MODEL_FILE = ASSETS / "plan_model.json"  # written by bench/plan_check.py fit
TINY_CONFIG = ASSETS / "tiny" / "config.json"
GIB = 2**30
DEFAULT_CARD = "rtx4090"  # groundtune plan without --gpu or --memory-gib: the 24 GB card the presets are sized for
# A config loads only with a train_data (TrainConfig checks it) and a plan needs only its settings:
# where neither the config file nor the command line names one, groundtune plan names this stream
# (so no file is read)
PLAN_TRAIN_DATA = "synth:full"
# bitsandbytes' NF4 with double quantization (QLoRA's base): two weights a byte, an 8-bit scale per 64
# weights, an fp32 scale per 256 of those
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
PEAK_BATCH_SIGMAS = 3.0  # a batch's tokens: its mean plus three standard deviations (the largest of ~1000 batches)
STATIC = ("weights", "trained", "fixed", "fixed_cpu")  # held for the whole step
ACTIVATIONS = ("boundaries", "layer", "logits", "fused_logits", "vision", "attention", "attention_kept", "mask",
               "head_cells")
COUNTED = {"head_cells": 1.0}  # activation terms in bytes as counted, with no fitted coefficient
# the box head's cells layout keeps ~10 (samples x image tokens x width) tensors for its backward:
# the gathered token projections, the product's two factors, the sums before and after each GELU
HEAD_CELL_TENSORS = 10
HEAD_WIDTH = 512  # the head's MLP width: models/box_head.py's WIDTH (a test holds them equal; plan loads no torch)
MEMORY_TERMS = (*STATIC, *ACTIVATIONS, "optimizer")
TIME_TERMS = ("floor", "llm_matmul", "vision_matmul", "traffic", "dequant", "optimizer_sweep")

__all__ = ["Shape", "Card", "Plan", "plan", "suggestions", "card", "shape_of", "data_tokens", "load_model_file"]


# --------------------------------------------------------------------------------------------
# the model's shape, from its config.json (no torch)


@dataclass(frozen=True)
class Shape:
    """The sizes a plan needs, read from a transformers config of a Qwen-VL model."""

    family: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    vision_width: int
    vision_params: int  # the whole vision tower, merger included
    merger_params: int = 0  # ... of which the mergers
    vision_linear_io: int = 0  # in + out summed over the vision blocks' linears (LoRA: r x this)
    merger_linear_io: int = 0  # ... over the mergers' linears
    attention_bias: bool = True  # q/k/v biases (Qwen2 and 2.5); Qwen3 has none ...
    qk_norm: bool = False  # ... and normalises q and k per head instead

    @property
    def layer_linear_params(self) -> int:
        """The weights of one decoder layer's seven linears (what LoRA adapts and NF4 quantizes)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def llm_params(self) -> int:
        """Language-model parameters: the layers (their linears, q/k/v biases or q/k norms, two
        norms), the embedding, the final norm and the LM head when it is not the embedding."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = (self.layer_linear_params + (q + 2 * kv if self.attention_bias else 0)
                     + (2 * self.head_dim if self.qk_norm else 0) + 2 * self.hidden)
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def lora_params(self, r: int, targets: list[str], last_n: int = 0) -> int:
        """Adapter parameters: r x (in + out) for each adapted linear."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        per_layer = 0
        if "llm_attn" in targets:
            per_layer += r * ((h + q) + 2 * (h + kv) + (q + h))
        if "llm_mlp" in targets:
            per_layer += r * 3 * (h + i)
        layers = min(last_n, self.layers) if last_n else self.layers
        merger = r * self.merger_linear_io if "merger" in targets else 0
        vision = r * self.vision_linear_io if "vision" in targets else 0
        return per_layer * layers + merger + vision


def _vision_params(facts: families.Facts, v: dict, out_hidden: int) -> tuple[int, int, int, int, int]:
    """(width, parameters, the mergers' parameters, the summed in + out sizes of the blocks' linears,
    of the mergers' linears) of a family's vision tower, from its vision_config and the family's
    architecture facts: what full fine-tuning and LoRA on "vision" and "merger" train."""
    patch, temporal = v.get("patch_size", 14), v.get("temporal_patch_size", 2)
    if facts.vision_sizes == families.EMBED_DIM_MLP_RATIO:
        e = v.get("embed_dim", facts.default_vision_width)
        m = int(e * v.get("mlp_ratio", 4))
    else:
        e, m = v.get("hidden_size", facts.default_vision_width), v.get("intermediate_size", 3420)
    norm = 1 if facts.vision_norm == families.RMS_NORM else 2  # a norm's parameters per width: weight (and bias)
    gated = facts.vision_mlp == families.SWIGLU_MLP
    mlp = 2 * (e * m + m) + (m * e + e) if gated else (e * m + m) + (m * e + e)
    block = 2 * norm * e + (3 * e * e + 3 * e) + (e * e + e) + mlp
    block_io = (e + 3 * e) + (e + e) + ((3 if gated else 2) * (e + m))
    projection = (4 * e) * (4 * e) + 4 * e + 4 * e * out_hidden + out_hidden
    projection_io = (4 * e + 4 * e) + (4 * e + out_hidden)
    deepstack = len(v.get("deepstack_visual_indexes", [])) if facts.deepstack else 0
    # the merger normalises each patch; DeepStack's mergers the 4 merged patches
    merger = (norm * e + projection) + deepstack * (norm * 4 * e + projection)
    embed = 3 * temporal * patch * patch * e
    if facts.patch_bias:
        embed += e
    if facts.learned_positions:
        embed += v.get("num_position_embeddings", 0) * e
    depth = v.get("depth", 32)
    return e, depth * block + merger + embed, merger, depth * block_io, (1 + deepstack) * projection_io


def shape_from_config(config: dict) -> Shape:
    """A Shape from a Qwen-VL config.json's contents (text_config and vision_config)."""
    facts = families.family(families.family_of_model_type(config.get("model_type", "")))
    text = config.get("text_config") or config
    vision = config.get("vision_config") or {}
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    width, vparams, mparams, vision_io, merger_io = _vision_params(facts, vision, vision.get("out_hidden_size", hidden))
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return Shape(family=facts.name, hidden=hidden, intermediate=text["intermediate_size"],
                 layers=text["num_hidden_layers"], heads=heads, kv_heads=text.get("num_key_value_heads", heads),
                 head_dim=text.get("head_dim") or hidden // heads, vocab=text["vocab_size"], tied=bool(tied),
                 vision_width=width, vision_params=vparams, merger_params=mparams, vision_linear_io=vision_io, merger_linear_io=merger_io,
                 attention_bias=text.get("attention_bias", facts.attention_bias), qk_norm=facts.qk_norm)


def shape_of(model: str) -> Shape:
    """The Shape of what ``model=`` names: tiny, random:ARCH or a published hub id
    (groundtune.families.ARCHITECTURES), a folder with a config.json (a run's model/, an export),
    an adapter folder (its base), or a hub id whose config.json is in the local hub cache."""
    if model == "tiny":
        return shape_from_config(json.loads(TINY_CONFIG.read_text()))
    arch = families.architecture(model.removeprefix("random:"))
    if arch is not None:
        return shape_from_config(arch.config())
    folder = Path(model)
    for candidate in (folder, RunFolder(folder).model):  # a model folder, or a run's
        if (candidate / "config.json").is_file():
            return shape_from_config(json.loads((candidate / "config.json").read_text()))
        if (candidate / "adapter_config.json").is_file():
            base = json.loads((candidate / "adapter_config.json").read_text()).get("base_model_name_or_path")
            if base:
                return shape_of(base)
    if folder.exists():
        raise MissingError(f"{model}: no config.json (nor an adapter's base) in this folder, so its size is unknown")
    cached = _hub_cached_config(model)
    if cached is not None:
        return shape_from_config(json.loads(cached.read_text()))
    known = ", ".join(a.hub_id for a in families.ARCHITECTURES.values())
    raise MissingError(f"model={model}: not a folder, and its config.json is not in the local hub cache; "
                       f"planned without downloading: {known}, tiny, or a folder with a config.json")


def _hub_cached_config(repo: str) -> Path | None:
    """The config.json of hub repo ``repo`` in the local hub cache (its main revision), else None."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    if repo.count("/") != 1:
        return None
    try:
        found = try_to_load_from_cache(repo, "config.json")
    except HFValidationError:  # not a repo id a hub could hold
        return None
    return Path(found) if isinstance(found, str) else None


# --------------------------------------------------------------------------------------------
# cards


@dataclass(frozen=True)
class Card:
    """A GPU: its memory (GiB, what the driver reports) and rates. ``emulated``: a cap on one
    process's allocator (bench/plan_check.py's caps), which the CUDA context does not count against."""

    key: str
    name: str
    memory_gib: float
    bf16_tflops: float | None  # None: no bf16 tensor cores
    bandwidth_gbs: float | None
    emulated: bool = False
    fp16_tflops: float | None = None  # the rate such a card's speed is predicted with


def _cards() -> dict:
    return json.loads(CARDS_FILE.read_text())


def _table_card(key: str, memory_gib: float | None = None) -> Card:
    """The card ``key`` of the table, with ``memory_gib`` instead of its own memory when given."""
    c = _cards()["cards"][key]
    return Card(key, c["name"], memory_gib if memory_gib is not None else c["memory_gib"], c.get("bf16_tflops"),
                c.get("bandwidth_gbs"), fp16_tflops=c.get("fp16_tflops"))


def card(name: str | None = None, memory_gib: float | None = None) -> Card:
    """The card ``--gpu NAME`` names (or an alias), or a card of ``memory_gib`` with the speeds of
    the reference card (``--memory-gib N``); both: that card with that memory."""
    table = _cards()
    if memory_gib is not None and not (0 < memory_gib < 1e6):
        raise ConfigError(f"--memory-gib {memory_gib:g}: expected a positive number of GiB")
    if name is None:
        if memory_gib is None:
            raise ConfigError("name a card (--gpu rtx4090) or its memory (--memory-gib 24)")
        ref = table["cards"][load_model_file()["reference_card"]]
        return Card(f"{memory_gib:g}gib", f"a card of {memory_gib:g} GiB (speeds of the {ref['name']})", memory_gib,
                    ref["bf16_tflops"], ref["bandwidth_gbs"])
    key = name.strip().lower().replace(" ", "").replace("_", "-").removeprefix("nvidia-")
    key = table["aliases"].get(key, key)
    if key == "cpu":  # a CPU run (fp32, dense attention): its memory is the host's; no speed is predicted
        import os

        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
        return Card("cpu", "CPU (host memory)", memory_gib if memory_gib is not None else host, None, None,
                    emulated=True)
    if key not in table["cards"]:
        raise ConfigError(f"--gpu {name}: unknown card; known: {', '.join(sorted(table['cards']))}, cpu "
                          "(or give --memory-gib N)")
    return _table_card(key, memory_gib)


def card_from_device(name: str, total_bytes: int) -> Card:
    """The card torch sees (``torch.cuda.get_device_properties``): its memory as it reports it; its
    rates from the table when its name is there, else the reference card's."""
    table = _cards()
    key = name.strip().lower().replace(" ", "-").removeprefix("nvidia-").replace("geforce-", "")
    key = table["aliases"].get(key, key)  # "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090", "Tesla T4"
    if key in table["cards"]:
        return _table_card(key, total_bytes / GIB)
    simple = name.lower().replace("nvidia", "").replace("geforce", "").strip().replace(" ", "")
    for key, c in table["cards"].items():
        if c["name"].lower().replace("nvidia", "").replace("geforce", "").replace(" ", "").startswith(simple):
            return _table_card(key, total_bytes / GIB)
    ref = table["cards"][load_model_file()["reference_card"]]
    return Card(simple or "gpu", name, total_bytes / GIB, ref["bf16_tflops"], ref["bandwidth_gbs"])


# --------------------------------------------------------------------------------------------
# the data: tokens per sample


@dataclass(frozen=True)
class Tokens:
    """Tokens per sample of a data set at a pixel budget: the mean and spread of the whole
    sequence, and the mean image tokens (4 patches each) and answer tokens."""

    mean: float
    std: float
    largest: float
    image: float
    answer: float
    source: str

    def batch(self, samples: int, packing: bool) -> float:
        """The tokens of the largest of a run's batches: packed, their sum (mean + 3 sigma of a
        sum of ``samples``); padded, every row as long as the longest."""
        if packing:
            return min(samples * self.largest, samples * self.mean + PEAK_BATCH_SIGMAS * self.std * math.sqrt(samples))
        return samples * min(self.largest, self.mean + PEAK_BATCH_SIGMAS * self.std)


def image_tokens(size: tuple[int, int], shape_family: str, min_pixels: int, max_pixels: int) -> int:
    facts = families.family(shape_family)
    try:
        h, w = smart_resize(size[1], size[0], facts.factor, min_pixels, max_pixels)
    except ResizeError:
        return 0
    return (h // facts.factor) * (w // facts.factor)


def data_tokens(sizes: list[tuple[int, int]], boxes: list[int], family: str, min_pixels: int, max_pixels: int,
                model_file: dict, source: str) -> Tokens:
    """Tokens per sample of images of ``sizes`` with ``boxes`` targets each: image tokens from the
    family's resize, the prompt's and a one-box answer's tokens as measured (plan_model.json), an
    answer's box repeated per target."""
    text, answer = model_file["text_tokens"], model_file["answer_tokens"]
    per_box = model_file["answer_tokens_per_box"]
    image = [image_tokens(s, family, min_pixels, max_pixels) for s in sizes]
    answers = [answer + per_box * (max(n, 1) - 1) for n in boxes]
    total = [i + text + a for i, a in zip(image, answers)]
    return Tokens(mean=statistics.fmean(total), std=statistics.pstdev(total) if len(total) > 1 else 0.0,
                  largest=max(total), image=statistics.fmean(image), answer=statistics.fmean(answers), source=source)


def read_data(path: str | Path) -> tuple[list[tuple[int, int]], list[int]]:
    """(width, height) and the number of target boxes of each record of a canonical JSONL file."""
    from groundtune.data.records import iter_jsonl, record_size

    path = regular_file(Path(path), "data file")
    sizes, boxes = [], []
    for line in iter_jsonl(path):
        size = record_size(line.record) if line.record is not None else None
        if size is None:  # a line data check refuses: no size to plan with
            continue
        sizes.append(size)
        targets = line.record.get("bboxes")  # a set (or none: one answer's worth of tokens); else "bbox"
        boxes.append(len(targets) if isinstance(targets, list) else 1)
    if not sizes:
        raise MissingError(f"{path}: no record with a width and height (run `groundtune data check {path} --fix "
                           "OUT.jsonl` to add them)")
    return sizes, boxes


# --------------------------------------------------------------------------------------------
# the fitted model


def load_model_file() -> dict:
    if not MODEL_FILE.is_file():
        raise MissingError(f"{MODEL_FILE}: the planner's fitted constants are missing (bench/plan_check.py fit)")
    return json.loads(MODEL_FILE.read_text())


@dataclass(frozen=True)
class Setting:
    """The settings a plan reads, from a TrainConfig (``of``) or changed by a suggestion."""

    method: str
    head: str
    batch_size: int
    grad_accum: int
    gradient_checkpointing: int
    packing: bool
    lora_r: int
    lora_targets: tuple[str, ...]
    lora_last_n_layers: int
    min_pixels: int
    max_pixels: int
    freeze_vision: bool
    freeze_merger: bool
    freeze_llm: bool
    head_text_loss_weight: float
    head_slots: int
    distributed: str
    gpus: int
    device: str = "cuda"  # cpu: fp32, attention through dense masks (models/attention.py's fallbacks)
    precision: str = "bf16"
    fused_loss: bool = False  # the answers' loss through liger-kernel's fused kernel (``fused_loss``)

    @classmethod
    def of(cls, cfg: TrainConfig, family: str, gpus: int = 1, device: str = "cuda") -> "Setting":
        facts = families.family(family)
        precision = cfg.precision if cfg.precision != "auto" else ("bf16" if device == "cuda" else "fp32")
        return cls(method=cfg.method, head=cfg.head, batch_size=int(cfg.batch_size) if cfg.batch_size != "auto"
                   else 1, grad_accum=cfg.grad_accum, gradient_checkpointing=cfg.gradient_checkpointing,
                   packing=cfg.packing, lora_r=cfg.lora_r, lora_targets=tuple(cfg.lora_targets),
                   lora_last_n_layers=cfg.lora_last_n_layers, min_pixels=cfg.min_pixels or facts.min_pixels,
                   max_pixels=cfg.max_pixels or facts.max_pixels, freeze_vision=cfg.freeze_vision,
                   freeze_merger=cfg.freeze_merger, freeze_llm=cfg.freeze_llm,
                   head_text_loss_weight=cfg.head_text_loss_weight, head_slots=cfg.head_slots,
                   distributed=cfg.distributed, gpus=gpus, device=device, precision=precision,
                   fused_loss=fused_loss(cfg, device))

    def recomputed(self, layers: int) -> int:
        return layers if self.gradient_checkpointing < 0 else min(self.gradient_checkpointing, layers)


def fused_loss(cfg: TrainConfig, device: str, liger: bool | None = None) -> bool:
    """Whether training scores the answers through liger-kernel's fused linear cross-entropy
    (models/kernels.py ``fused_answer_nll``): text answers on a GPU with kernels=liger, or auto
    where liger-kernel is installed (``liger``: whether it is where the run trains; None: here);
    the token mean (weighted answers take the plain loss); an LM head that FSDP2 or ZeRO-3 does
    not shard."""
    if device != "cuda" or cfg.head != "text" or cfg.kernels == "none" or cfg.loss_per != "token":
        return False
    if cfg.distributed in ("fsdp2", "zero3"):
        return False
    if liger is None:
        liger = importlib.util.find_spec("liger_kernel") is not None
    return cfg.kernels == "liger" or liger


def counts(shape: Shape, s: Setting, tokens: Tokens) -> dict[str, float]:
    """The quantities each memory and time term multiplies (bytes, or FLOPs for matmul), for one
    GPU's micro-batch: the terms of ``MEMORY_TERMS`` and ``TIME_TERMS``."""
    value = 4 if s.precision == "fp32" else 2  # bytes of a weight or an activation
    vision_bytes = shape.vision_params * value
    llm_linear = shape.layers * shape.layer_linear_params
    llm_rest = shape.llm_params - llm_linear
    if s.method == "full":
        parts = {"llm": (shape.llm_params, s.freeze_llm), "merger": (shape.merger_params, s.freeze_merger),
                 "vision": (shape.vision_params - shape.merger_params, s.freeze_vision)}
        trained = sum(n for n, frozen in parts.values() if not frozen)
        frozen_bytes = value * sum(n for n, frozen in parts.values() if frozen)
    else:
        trained = shape.lora_params(s.lora_r, list(s.lora_targets), s.lora_last_n_layers)
        frozen_bytes = vision_bytes + (2 * llm_rest + NF4_BYTES * llm_linear if s.method == "qlora"
                                       else value * shape.llm_params)
    if s.head == "box":  # the head's own weights, counted as 8 hidden^2 (above its few million: the
        trained += 8 * shape.hidden * shape.hidden  # fit took the box-head rows with this count)
    # sharding per GPU: fsdp2 and zero3 split weights, gradients and optimizer state; zero2 the latter two
    world = max(1, s.gpus)
    shard_weights = world if s.distributed in ("fsdp2", "zero3") else 1
    shard_state = world if s.distributed in ("fsdp2", "zero2", "zero3") else 1
    batch_tokens = tokens.batch(s.batch_size, s.packing)
    text_answer = s.head == "text" or s.head_text_loss_weight > 0
    answer_tokens = s.batch_size * tokens.answer if text_answer else 0.0
    patches = s.batch_size * tokens.image * 4
    recomputed = s.recomputed(shape.layers)
    passes = 2 + recomputed / shape.layers + (1 if s.method == "full" else 0)  # forward, input grads, recompute, weight grads
    cpu = s.device == "cpu"
    # a CPU attends through dense (row x row) scores: a packed batch is one row; a layer not
    # recomputed keeps its own for the backward
    rows, row = (1, batch_tokens) if s.packing else (s.batch_size, batch_tokens / s.batch_size)
    return {
        "weights": frozen_bytes / shard_weights,
        "trained": trained * 16 / shard_state,
        "fixed": 0.0 if cpu else 1.0,
        "fixed_cpu": 1.0 if cpu else 0.0,
        "boundaries": batch_tokens * shape.hidden * value * recomputed,
        # every layer kept, and the one being recomputed in the backward (when any is)
        "layer": batch_tokens * (7 * shape.hidden + 3 * shape.intermediate) * value
                 * (shape.layers - recomputed + (1 if recomputed else 0)),
        "logits": 0.0 if s.fused_loss else answer_tokens * shape.vocab * 4,
        "fused_logits": answer_tokens * shape.vocab * 4 if s.fused_loss else 0.0,
        "vision": patches * shape.vision_width * value,
        "attention": rows * shape.heads * row * row * value if cpu else 0.0,  # the layer being computed
        "mask": rows * row * row * (1 if s.packing else value) if cpu else 0.0,  # one for all layers: bool or additive
        "attention_kept": rows * shape.heads * row * row * value * (shape.layers - recomputed) if cpu else 0.0,
        # the box head's cells layout: its MLP's activations, a (samples x image tokens x width)
        # tensor each, counted (not fitted: the fit's box-head runs had slots, whose are negligible)
        "head_cells": (s.batch_size * tokens.image * HEAD_WIDTH * value * HEAD_CELL_TENSORS
                       if s.head == "box" and s.head_slots == 0 else 0.0),
        "optimizer": trained * 4 / shard_state if s.method == "full" else 0.0,
        # time terms: per micro-batch (FLOPs of the matmuls, bytes of the activations' traffic and of
        # QLoRA's dequantisation), per optimizer step (bytes of the optimizer's sweep)
        "llm_matmul": 2 * llm_linear * batch_tokens * passes + 2 * shape.vocab * shape.hidden * answer_tokens * 3,
        "vision_matmul": 2 * shape.vision_params * patches,
        "traffic": batch_tokens * (7 * shape.hidden + 3 * shape.intermediate) * 2 * shape.layers * passes,
        "dequant": llm_linear * NF4_BYTES * (2 + recomputed / shape.layers) if s.method == "qlora" else 0.0,
        "optimizer_sweep": trained * 16 / shard_state,
    }


def peak_bytes(c: dict[str, float], coef: dict[str, float]) -> tuple[float, dict[str, float]]:
    """Peak allocated bytes and its parts: the static terms, plus the larger of the activations and
    (full fine-tuning) the optimizer step's own peak."""
    coef = {**COUNTED, **coef}
    parts = {k: c[k] * coef.get(k, 0.0) for k in (*STATIC, *ACTIVATIONS)}
    activations = sum(parts[k] for k in ACTIVATIONS)
    optimizer = c["optimizer"] * coef["optimizer"]
    parts["optimizer"] = max(0.0, optimizer - activations)
    return sum(parts.values()), parts


def step_seconds(c: dict[str, float], coef: dict[str, float], grad_accum: int, speed: "CardSpeed") -> float:
    """One optimizer step: per micro-batch, the larger of a floor (the host's launches, the loader)
    and the GPU's work: matmuls by the card's bf16 rate, activation traffic and QLoRA's
    dequantisation by its bandwidth; then the optimizer's sweep, by bandwidth."""
    gpu = ((c["llm_matmul"] * coef["llm_matmul"] + c["vision_matmul"] * coef["vision_matmul"]) / speed.compute
           + (c["traffic"] * coef["traffic"] + c["dequant"] * coef["dequant"]) / speed.bandwidth)
    return grad_accum * max(coef["floor"], gpu) + c["optimizer_sweep"] * coef["optimizer_sweep"] / speed.bandwidth


@dataclass(frozen=True)
class CardSpeed:
    """A card's rates relative to the reference card the constants were measured on."""

    compute: float
    bandwidth: float


def card_speed(c: Card, model_file: dict) -> CardSpeed:
    ref = _cards()["cards"][model_file["reference_card"]]
    tflops = c.bf16_tflops or c.fp16_tflops or ref["bf16_tflops"]
    return CardSpeed(compute=tflops / ref["bf16_tflops"], bandwidth=(c.bandwidth_gbs or ref["bandwidth_gbs"]) /
                     ref["bandwidth_gbs"])


# --------------------------------------------------------------------------------------------
# the plan


@dataclass
class Plan:
    """What ``groundtune plan`` prints (``to_json`` for --json)."""

    card: Card
    setting: Setting
    tokens: Tokens
    peak_gib: float
    parts_gib: dict[str, float]
    usable_gib: float
    margin: float
    fits: bool
    max_batch_size: int
    samples_per_s: float | None  # None: not predicted (a CPU)
    epoch_s: float | None
    samples: int | None
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        per = f" per GPU ({self.setting.gpus} GPUs, {self.setting.distributed})" if self.setting.gpus > 1 else ""
        speed = f"; ~{self.samples_per_s:.1f} samples/s" if self.samples_per_s else ""
        return (f"plan: peak {self.peak_gib:.1f} GiB{per} of {self.usable_gib:.1f} usable on {self.card.name}: "
                f"{verdict}; largest batch_size that fits: {self.max_batch_size}{speed}")

    def to_json(self) -> dict:
        return {"peak_gib": round(self.peak_gib, 2), "fits": self.fits, "max_batch_size": self.max_batch_size,
                "samples_per_s": None if self.samples_per_s is None else round(self.samples_per_s, 2),
                "epoch_s": None if self.epoch_s is None else round(self.epoch_s, 1),
                "usable_gib": round(self.usable_gib, 2), "margin": round(self.margin, 3),
                "parts_gib": {k: round(v, 3) for k, v in self.parts_gib.items()},
                "card": dataclasses.asdict(self.card), "setting": dataclasses.asdict(self.setting),
                "tokens_per_sample": round(self.tokens.mean, 1), "tokens_source": self.tokens.source,
                "samples": self.samples, "notes": self.notes}


def usable_gib(c: Card, model_file: dict) -> float:
    """What the allocator may use: a capped process all of its cap; a real card its memory less the
    CUDA context (measured on the reference card)."""
    return c.memory_gib if c.emulated else c.memory_gib - model_file["cuda_context_gib"]


def plan(shape: Shape, s: Setting, c: Card, tokens: Tokens, samples: int | None = None,
         model_file: dict | None = None) -> Plan:
    mf = model_file or load_model_file()
    coef, margin = mf["memory"], mf["margin"]
    counted = counts(shape, s, tokens)
    peak, parts = peak_bytes(counted, coef)
    room = usable_gib(c, mf)
    fits = peak / GIB * (1 + margin) <= room
    rate, notes = None, []
    if s.device != "cpu":  # the step's time was measured on a GPU; a CPU's is not predicted
        step = step_seconds(counted, mf["time"], s.grad_accum, card_speed(c, mf))
        rate = s.batch_size * s.grad_accum * max(1, s.gpus) / step
    if c.bf16_tflops is None and s.device != "cpu":
        notes.append(f"{c.name} has no bf16 tensor cores: its speed is predicted from its fp16 rate; bf16 runs "
                     "there far slower, if at all")
    return Plan(card=c, setting=s, tokens=tokens, peak_gib=peak / GIB, parts_gib={k: v / GIB for k, v in parts.items()},
                usable_gib=room, margin=margin, fits=fits, max_batch_size=max_batch(shape, s, c, tokens, mf),
                samples_per_s=rate, epoch_s=samples / rate if samples and rate else None, samples=samples, notes=notes)


def max_batch(shape: Shape, s: Setting, c: Card, tokens: Tokens, model_file: dict, limit: int = 4096) -> int:
    """The largest batch_size that fits (0: not even one sample). Memory grows with the batch, so a
    binary search."""
    room = usable_gib(c, model_file) * GIB
    coef, margin = model_file["memory"], model_file["margin"]

    def fits(b: int) -> bool:
        return peak_bytes(counts(shape, dataclasses.replace(s, batch_size=b), tokens), coef)[0] * (1 + margin) <= room

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@dataclass
class Suggestion:
    change: str  # as key=value settings a user types
    plan: Plan


def suggestions(shape: Shape, s: Setting, c: Card, tokens_at, samples: int | None = None,
                model_file: dict | None = None, limit: int = 5) -> list[Suggestion]:
    """The changes that make a run fit, ranked by predicted speed: the fastest of each kind (a smaller
    batch with more accumulation, recomputation, a smaller pixel budget, QLoRA, fewer LoRA targets),
    each alone or with the batch it needs. ``tokens_at(min_pixels, max_pixels)`` gives the data's
    tokens at another pixel budget."""
    mf = model_file or load_model_file()
    options: list[tuple[str, Setting]] = []
    steps = s.batch_size * s.grad_accum  # samples per optimizer step, kept where the batch shrinks
    smaller = [b for b in (s.batch_size // 2, s.batch_size // 4, s.batch_size // 8, s.batch_size // 16, 1) if b >= 1]
    for b in dict.fromkeys(smaller):
        if b < s.batch_size:
            accum = max(1, math.ceil(steps / b))
            options.append((f"batch_size={b} grad_accum={accum}", dataclasses.replace(s, batch_size=b, grad_accum=accum)))
    if s.gradient_checkpointing != -1:
        options.append(("gradient_checkpointing=-1", dataclasses.replace(s, gradient_checkpointing=-1)))
    base_tokens = tokens_at(s.min_pixels, s.max_pixels).mean
    for pixels in (802816, 602112, 401408, 200704):  # only budgets that shrink this data's images (5% fewer tokens)
        if pixels < s.max_pixels and tokens_at(s.min_pixels, pixels).mean < 0.95 * base_tokens:
            options.append((f"max_pixels={pixels}", dataclasses.replace(s, max_pixels=pixels)))
    if s.method == "lora":
        options.append(("method=qlora", dataclasses.replace(s, method="qlora")))
    if s.method != "full" and set(s.lora_targets) > {"llm_attn"}:
        options.append(("lora_targets=[llm_attn]", dataclasses.replace(s, lora_targets=("llm_attn",))))
    # one change, then each with a smaller batch
    combined = list(options)
    for change, setting in options:
        if change.startswith("batch_size"):
            continue
        for b in dict.fromkeys(smaller):
            if b < setting.batch_size:
                accum = max(1, math.ceil(steps / b))
                combined.append((f"{change} batch_size={b} grad_accum={accum}",
                                 dataclasses.replace(setting, batch_size=b, grad_accum=accum)))
    found = []
    for change, setting in combined:
        tokens = tokens_at(setting.min_pixels, setting.max_pixels)
        p = plan(shape, setting, c, tokens, samples, mf)
        if p.fits:
            found.append(Suggestion(change, p))
    found.sort(key=lambda x: (-(x.plan.samples_per_s or 0), x.plan.peak_gib, len(x.change)))
    best: dict[str, Suggestion] = {}  # the fastest of each kind of change (with whatever batch it needs)
    for x in found:
        best.setdefault(x.change.split(" batch_size=")[0] if not x.change.startswith("batch_size") else "batch", x)
    return list(best.values())[:limit]


# --------------------------------------------------------------------------------------------
# a run's plan: what `groundtune plan` and `groundtune train` ask


@dataclass
class RunPlan:
    shape: Shape
    model: str
    plan: Plan
    suggestions: list[Suggestion]
    model_file: dict


def plan_run(cfg: TrainConfig, c: Card, data: str | None = None, gpus: int = 1) -> RunPlan:
    """The plan of ``cfg`` on card ``c``: its data's image sizes from ``data`` (else cfg.train_data
    when that is a file, else, or while that file is not there, the COCO-sized images the constants
    were measured on), and the changes that make it fit when it does not. batch_size=auto is
    planned with the largest batch that fits (``plan.setting.batch_size``)."""
    mf = load_model_file()
    shape = shape_of(cfg.model)
    setting = Setting.of(cfg, shape.family, gpus, device="cpu" if c.key == "cpu" else "cuda")
    path = data or (cfg.train_data if cfg.train_data and ":" not in cfg.train_data else None)
    # a preset's or a config's file not made yet (quickstart's, on a fresh clone) is planned as the
    # default images, and said so; a --data file that is not there is the caller's error
    unmade = None
    if path and data is None and not Path(path).exists():
        path, unmade = None, path
    if path:
        sizes, boxes = read_data(path)
        source = f"{path} ({len(sizes):,} samples)"
    else:
        sizes, boxes = [tuple(s) for s in mf["default_images"]], [1] * len(mf["default_images"])
        source = "COCO-sized images (long side 480-640 px, one box each; " + (
            f"train_data {unmade} is not there yet" if unmade else "--data FILE for yours") + ")"

    def tokens_at(min_pixels: int, max_pixels: int) -> Tokens:
        return data_tokens(sizes, boxes, shape.family, min_pixels, max_pixels, mf, source)

    tokens, samples = tokens_at(setting.min_pixels, setting.max_pixels), len(sizes) if path else None
    p = plan(shape, setting, c, tokens, samples, mf)
    if cfg.batch_size == "auto":  # (planned at batch 1 above) the largest that fits, at least 1
        p = plan(shape, dataclasses.replace(setting, batch_size=max(1, p.max_batch_size)), c, tokens, samples, mf)
    return RunPlan(shape, cfg.model, p, [] if p.fits else suggestions(shape, p.setting, c, tokens_at, samples, mf), mf)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def render(r: RunPlan, explain: bool = False) -> str:
    """The plan as a person reads it at a glance."""
    p, s, mf = r.plan, r.plan.setting, r.model_file
    recompute = ("all" if s.gradient_checkpointing < 0 else s.gradient_checkpointing) if s.gradient_checkpointing \
        else "no"
    lines = [f"{r.model} ({r.shape.family}), method={s.method}, head={s.head}: batch_size={s.batch_size} x "
             f"grad_accum={s.grad_accum}, {recompute} layers recomputed, {'packed' if s.packing else 'padded'}, "
             f"max_pixels={s.max_pixels:,}" + (f", {s.gpus} GPUs ({s.distributed})" if s.gpus > 1 else ""),
             f"card: {p.card.name}: {p.card.memory_gib:.1f} GiB, {p.usable_gib:.1f} usable"
             + ("" if p.card.emulated else f" (CUDA context {mf['cuda_context_gib']:.1f})"),
             f"data: {p.tokens.source}: {p.tokens.mean:.0f} tokens a sample ({p.tokens.image:.0f} image)", "",
             "peak GPU memory" + (" per GPU" if s.gpus > 1 else "") + ", GiB"]
    names = {"weights": f"weights ({s.precision}" + (", LLM linears NF4)" if s.method == "qlora" else ")"),
             "trained": "trained params + grads + AdamW", "fixed": "CUDA workspaces, buffers",
             "fixed_cpu": "buffers", "attention": "attention scores (dense, CPU)",
             "attention_kept": "attention scores kept (layers not recomputed)", "mask": "attention mask (CPU)",
             "boundaries": "recomputed layers' inputs", "layer": "layer activations", "logits": "answer logits",
             "fused_logits": "answer loss (fused, liger-kernel)", "vision": "vision tower pass",
             "head_cells": "box head's cells", "optimizer": "optimizer step (over activations)"}
    for key, gib in p.parts_gib.items():
        if gib >= 0.005:
            lines.append(f"  {names[key]:36s}{gib:8.2f}")
    verdict = "FITS" if p.fits else "DOES NOT FIT"
    lines += [f"  {'peak':36s}{p.peak_gib:8.2f}   + {p.margin:.0%} margin = {p.peak_gib * (1 + p.margin):.2f} "
              f"of {p.usable_gib:.2f}: {verdict}",
              f"largest batch_size that fits: {p.max_batch_size}" + ("  (none: see below)" if not p.max_batch_size
                                                                      else ""),
              (f"speed: ~{p.samples_per_s:.1f} samples/s" + (f", an epoch of {p.samples:,} samples in "
                                                           f"{_duration(p.epoch_s)}" if p.epoch_s else ""))
              if p.samples_per_s else "speed: not predicted on a CPU"]
    lines += [f"note: {n}" for n in p.notes]
    if r.suggestions:
        lines += ["", "changes that make it fit, fastest first:",
                  f"  {'change':58s}{'peak GiB':>9s}{'samples/s':>11s}"]
        lines += [f"  {x.change:58s}{x.plan.peak_gib:9.2f}{x.plan.samples_per_s or float('nan'):11.1f}"
                  for x in r.suggestions]
    elif not p.fits:
        lines += ["", "no change groundtune tries makes it fit this card (smaller batches with accumulation, "
                  "recomputation, smaller pixel budgets, QLoRA, fewer LoRA targets)"]
    if explain:
        lines += ["", *explanation(r)]
    return "\n".join(lines)


def explanation(r: RunPlan) -> list[str]:
    """The model's assumptions, for --explain."""
    mf, p = r.model_file, r.plan
    ref = _cards()["cards"][mf["reference_card"]]
    cards = _cards()["cards"]
    lines = ["how this was predicted:",
             f"  constants: {MODEL_FILE.name}, fitted by bench/plan_check.py from real steps of Qwen2.5-VL-3B/7B on "
             f"an {ref['name']} (bench/results/plan_check.json)",
             "  peak = weights + trained x 16 B + fixed + the larger of the activations "
             "(recomputed layers' inputs, layer activations, answer logits, vision pass) and full fine-tuning's "
             "optimizer step; each term a count of this model and batch times a fitted coefficient:"]
    lines += [f"    {k}: {v:.4g}" for k, v in mf["memory"].items()]
    lines += [f"  margin {mf['margin']:.1%}: the largest under-prediction among the measured configurations; "
              f"fits = peak x (1 + margin) <= usable",
              f"  CUDA context {mf['cuda_context_gib']:.2f} GiB (measured on the {ref['name']}) is not usable by "
              "the allocator on a real card",
              f"  a batch's tokens: its mean plus {PEAK_BATCH_SIGMAS:g} standard deviations (packed); "
              f"text {mf['text_tokens']:.0f} and answer {mf['answer_tokens']:.0f} tokens a sample as measured "
              f"(+{mf['answer_tokens_per_box']} per extra box), image tokens from each image's resize",
              "  speed: the measured step's terms (floor, matmuls, activation traffic, NF4 dequantisation, "
              f"optimizer sweep) scaled from the {ref['name']} ({ref['bf16_tflops']:g} TFLOP/s, "
              f"{ref['bandwidth_gbs']:g} GB/s) by bf16 rate for matmuls and bandwidth for the rest"]
    key = p.card.key if p.card.key in cards else None
    if key:
        for what, url in cards[key].get("sources", {}).items():
            lines.append(f"  {p.card.name} {what}: {url}")
    return lines


def auto_batch_size(cfg: TrainConfig, c: Card, gpus: int = 1) -> int:
    """batch_size=auto: the largest batch the plan says fits ``c`` (at least 1)."""
    return plan_run(dataclasses.replace(cfg, batch_size="auto"), c, gpus=gpus).plan.setting.batch_size
