"""Typed settings, one dataclass per stage. The dataclass IS the config: each field holds its
default and its help (``setting``; ``groundtune train --help`` prints them, ``describe``); YAML
files and ``key=value`` overrides fill it; ``__post_init__`` refuses invalid combinations naming the
setting, before anything is loaded.

Each stage's class is assembled from the groups of settings it reads, each group defined once:

    TrainConfig = target + method + lora + optimisation + step + data + loop      (groundtune train)
    RLConfig    = target + lora + optimisation + rollouts + reward + update + loop (groundtune rl)

so RL has no setting it ignores, and a setting both read has one definition.

    cfg = load_config(TrainConfig, preset_path("quickstart"), ["lr=1e-3", "max_steps=50"])

``InferSettings`` are the settings of the commands that answer with a model (eval, predict, serve,
data refgen --filter-model): their flags and the defaults of infer/evaluate/serve's functions.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from groundtune.errors import ConfigError, MissingError, shown
from groundtune.files import not_utf8, path_problem, regular_file
from groundtune.runs import RunFolder

MODEL_PARTS = ("vision", "merger", "llm")
LORA_TARGETS = ("llm_attn", "llm_mlp", "merger", "vision")
KERNEL_MODES = ("auto", "liger", "none")
BAD_RECORD_POLICIES = ("refuse", "skip")
MAX_NEW_TOKENS = 64  # longest greedy answer by default: one box and its label is ~20-40 tokens
# export.py's weight dtypes (base: the one the base's weights are stored in) and its default: here,
# not there, because export.py imports torch and the command line builds its --help without it
EXPORT_DTYPES = ("base", "bf16", "fp16", "fp32")
EXPORT_DTYPE = "base"
ADVANTAGES = ("grpo", "ema")
LOSS_PER = ("token", "sample", "first")  # train/objective.py: what the text loss averages over
HEADS = ("text", "box")  # models/head.py
ENGINES = ("ddp", "fsdp2", "zero2", "zero3")  # train/parallel.py
TRACKERS = ("tensorboard", "wandb", "mlflow")  # report_to: train/monitor.py's WRITERS
PRESETS = Path(__file__).resolve().parent / "configs"  # shipped YAML presets (also at ./configs)
MAX_INT = 2**31 - 1  # the largest whole-number setting: more steps, pixels or samples than any run uses
# What a settings file (or a key=value) may hold, checked before YAML's aliases are expanded: a
# dozen lines of alias bomb expand to 9**9 values, printed as 2 GB. Settings are a flat mapping of
# values and short lists: a few KB, two levels, some dozens of values.
MAX_SETTINGS_BYTES = 2**20
MAX_YAML_DEPTH = 16
MAX_YAML_VALUES = 10_000  # values, aliases expanded; a scalar counts one more a KB of its text

__all__ = ["ConfigError", "TrainConfig", "RLConfig", "InferSettings", "load_config", "preset_path", "to_yaml",
           "describe", "settings_of", "setting"]


def setting(default, help: str = ""):
    """A settings field: its default and its help, one line of --help (``describe``; the CLI's
    flags built from InferSettings). A list default is copied for each instance."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


class _Settings:
    """What every group shares: types are checked, then each group's ``check`` runs, base first."""

    def __post_init__(self) -> None:
        _check_types(self)
        for klass in reversed(type(self).__mro__):
            check = klass.__dict__.get("check")
            if check is not None:
                check(self)


# --------------------------------------------------------------------------------------------
# the groups (listed in reverse in a class's bases: a dataclass orders fields from the last base on)


@dataclass
class _Target(_Settings):
    # --- what to train on
    model: str = setting("tiny", "tiny | a training run folder | a local HF folder | a hub id "
                         "(Qwen/Qwen2.5-VL-3B-Instruct)")
    train_data: str = setting("", "canonical JSONL (groundtune data convert / synth), or synth:TASK drawn on the fly "
                              "(full, single, attribute, multi, every: sets and no target; TASK+TASK alternates)")
    eval_data: str = setting("", 'canonical JSONL for generation eval during training; "" = none')
    out_dir: str = setting("runs/sft", "the run folder: model/, checkpoints/, metrics.jsonl, tb/")
    overwrite: bool = setting(False, "a new run may replace a finished one in out_dir (its model/, checkpoints/, logs)")
    bad_records: str = setting("refuse", "records `groundtune data check` finds unusable: refuse (list them, stop "
                               "before loading the model) | skip (train without them; listed in "
                               "RUN/bad_records.jsonl)")
    max_bad_fraction: float = setting(0.5, "stop when more than this share of a batch fails to load during the run (an "
                                      "image deleted or damaged since the check); fewer are skipped and counted")

    def check(self) -> None:
        if not self.train_data:
            raise ConfigError("train_data is not set: give a canonical JSONL file (train_data=FILE.jsonl) "
                              "or a synthetic stream (train_data=synth:full)")
        for name in ("model", "train_data", "eval_data", "out_dir"):  # each names a file or folder (model: or not)
            problem = path_problem(getattr(self, name))
            if problem:
                raise ConfigError(f"{name}: {problem}")
        if self.bad_records not in BAD_RECORD_POLICIES:
            raise ConfigError(f"bad_records={shown(self.bad_records)}: expected one of "
                              f"{', '.join(BAD_RECORD_POLICIES)}")
        if not 0 <= self.max_bad_fraction < 1:
            raise ConfigError(f"max_bad_fraction={self.max_bad_fraction} must be in [0, 1): a batch with nothing "
                              "left to train on stops the run")


@dataclass
class _Method(_Settings):
    # --- what to adapt
    method: str = setting("lora", "lora | qlora (4-bit base, GPU + bitsandbytes) | full")
    freeze_vision: bool = setting(True, "method=full: keep the vision tower fixed")
    freeze_merger: bool = setting(True, "method=full: keep the vision->LLM merger fixed")
    freeze_llm: bool = setting(False, "method=full: keep the language model fixed")
    head: str = setting("text", "text: the box written as the answer | box: a head reads it off the hidden states, the "
                        "prompt's last (which ends with the answer's opening) attending over the image's tokens; one "
                        "forward pass (models/head.py)")
    head_l1_weight: float = setting(2.0, "head=box: loss = 1 - GIoU + this x L1 (mean over the coordinates, as "
                                    "fractions of the image)")
    head_text_loss_weight: float = setting(0.0, "head=box: > 0 also trains the text answer (joint mode): its token "
                                           "loss times this is added")
    head_slots: int = setting(8, "head=box: K learned query slots, each a box and an objectness score (one target per "
                              "phrase: the better boxes) | 0: a candidate per cell of the image's token grid (sets: "
                              "quickstart-every's); matched to the true boxes (Hungarian)")
    head_threshold: float = setting(0.5, "head=box: an answer keeps the candidates whose objectness is at least this; "
                                    "with eval_data, each eval chooses the one of best F1@0.5 there instead; saved "
                                    "with the head")

    def check(self) -> None:
        if self.head not in HEADS:
            raise ConfigError(f"head={shown(self.head)}: expected one of {', '.join(HEADS)}")
        if self.head_l1_weight < 0 or self.head_text_loss_weight < 0:
            raise ConfigError("head_l1_weight and head_text_loss_weight must be >= 0")
        _at_least_zero(self, "head_slots")
        _fraction(self, "head_threshold")
        if self.method not in ("lora", "qlora", "full"):
            raise ConfigError(f"method={shown(self.method)}: expected lora, qlora or full")
        if self.method == "qlora" and getattr(self, "distributed", "ddp") in ("fsdp2", "zero3"):
            raise ConfigError(f"method=qlora with distributed={self.distributed}: bitsandbytes' 4-bit weights cannot "
                              "be sharded; use distributed=ddp or zero2 (the 4-bit base is small enough to copy)")
        # (lora_targets' items are checked after this: any may still be other than a name)
        trains_vision = (any(t in ("vision", "merger") for t in self.lora_targets if isinstance(t, str))
                         if self.method in ("lora", "qlora") else not (self.freeze_vision and self.freeze_merger))
        if trains_vision and getattr(self, "distributed", "ddp") in ("zero2", "zero3"):
            # measured: DeepSpeed keeps no optimizer state for the vision tower's weights here, and
            # the run fails at its first checkpoint, after its steps are spent
            raise ConfigError(f"distributed={self.distributed} cannot train the vision tower or merger yet (lora_targets "
                              "vision/merger, or method=full with freeze_vision/freeze_merger false): DeepSpeed keeps "
                              "no optimizer state for them to checkpoint; use distributed=ddp or fsdp2, or leave "
                              "them frozen")
        if self.method in ("lora", "qlora") and not self.lora_targets:
            raise ConfigError(f"lora_targets is empty: method={self.method} would train nothing")
        if self.method == "full" and self.freeze_vision and self.freeze_merger and self.freeze_llm and self.head != "box":
            raise ConfigError("method=full with freeze_vision, freeze_merger and freeze_llm all true trains nothing "
                              "(with head=box: the head alone)")


@dataclass
class _Lora(_Settings):
    # --- the LoRA adapter
    lora_r: int = setting(16, "the adapter's rank")
    lora_alpha: int = setting(32, "the adapter's scale: its update is multiplied by lora_alpha / lora_r")
    lora_dropout: float = setting(0.0, "dropout on the adapter's input")
    lora_targets: list[str] = setting(["llm_attn", "llm_mlp"], f"the parts adapted, some of {', '.join(LORA_TARGETS)}")
    lora_last_n_layers: int = setting(0, "adapt only the last N LLM layers; 0 = all")

    def check(self) -> None:
        bad = [t for t in self.lora_targets if not isinstance(t, str) or t not in LORA_TARGETS]
        if bad:
            raise ConfigError(f"lora_targets: unknown {shown(bad)}; expected some of {list(LORA_TARGETS)}")
        _positive(self, "lora_r", "lora_alpha")
        _at_least_zero(self, "lora_last_n_layers")
        _fraction(self, "lora_dropout")


@dataclass
class _Optimisation(_Settings):
    # --- optimisation
    lr: float = setting(2e-4, "peak learning rate")
    lr_vision: float = setting(0.0, "per-part peak learning rates; 0 = use lr")
    lr_merger: float = setting(0.0, "0 = use lr")
    lr_llm: float = setting(0.0, "0 = use lr")
    weight_decay: float = setting(0.0, "never applied to norms, biases, embeddings or the LM head")
    warmup_steps: int = setting(0, "linear warmup, then cosine decay to min_lr_ratio * lr")
    min_lr_ratio: float = setting(0.1, "where the cosine decay ends, as a share of each peak learning rate")
    max_steps: int = setting(1000, "optimizer steps; the data is cycled as needed")
    batch_size: int | str = setting(8, "samples per micro-batch; groundtune train takes auto: the largest batch "
                                    "`groundtune plan` says fits the GPU it finds (written to the run's config.yaml)")
    max_grad_norm: float = setting(1.0, "gradient clipping; 0 = off")
    precision: str = setting("auto", "auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32")
    gradient_checkpointing: int = setting(0, "recompute the last N LLM layers in backward (-1 = all, 0 = off)")
    kernels: str = setting("none", "fused RMSNorm/SwiGLU/M-RoPE: none | liger (GPU, liger-kernel) | auto (liger where "
                           "it can)")
    seed: int = setting(0, "random seed: data order, augmentations, new weights, sampled answers")

    def check(self) -> None:
        if self.batch_size != "auto" or not isinstance(self, _Step):  # auto: SFT's alone (train/sft.py)
            if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int):
                raise ConfigError(f"batch_size={shown(self.batch_size)}: expected a whole number"
                                  + (" or auto" if isinstance(self, _Step) else ""))
            _check_range("batch_size", self.batch_size)
            _positive(self, "batch_size")
        _positive(self, "lr", "max_steps")
        _at_least_zero(self, "seed")
        _at_least_zero(self, "lr_vision", "lr_merger", "lr_llm", "weight_decay", "warmup_steps", "max_grad_norm")
        _fraction(self, "min_lr_ratio")
        if self.kernels not in KERNEL_MODES:
            raise ConfigError(f"kernels={shown(self.kernels)}: expected one of {', '.join(KERNEL_MODES)}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ConfigError(f"precision={shown(self.precision)}: expected auto, bf16 or fp32")
        if self.gradient_checkpointing < -1:
            raise ConfigError(f"gradient_checkpointing={self.gradient_checkpointing}: expected -1 (all layers), "
                              "0 (off) or the number of last layers")

    def part_lr(self, part: str) -> float:
        return getattr(self, f"lr_{part}") or self.lr


@dataclass
class _Step(_Settings):
    # --- the SFT step
    grad_accum: int = setting(1, "micro-batches per optimizer step")
    loss_per: str = setting("token", "how the text loss weighs the update's answers: token (the mean over all answer "
                            "tokens: a six-box answer weighs ~25x a none) | sample (each answer's own mean, averaged "
                            "over the samples: a none, whose first token decides it, weighs what a six-box answer "
                            "does) | first (the token mean, with half of each answer's weight on its first token, "
                            "which says none or boxes); head=box weighs samples alike already")
    packing: bool = setting(False, "a micro-batch in one row, no padding, attention within each sample: on a GPU one "
                            "variable-length flash call per layer (the fast setting); on a CPU a dense mask (slow)")
    compile: bool = setting(False, "torch.compile the vision blocks, and the LLM decoder layers where liger-kernel "
                            "does not run (it fuses those itself): fewer kernels, slower first steps")
    fp8: bool = setting(False, "float8 matmuls for the frozen base weights of LoRA layers (method=lora; a GPU of "
                        "compute capability 8.9 or later: Ada, Hopper). Slower than bf16 on the 3B preset today "
                        "(0.86x, BENCHMARKS.md): its casts cost more than the faster matmuls give")

    def check(self) -> None:
        _positive(self, "grad_accum")
        if self.loss_per not in LOSS_PER:
            raise ConfigError(f"loss_per={shown(self.loss_per)}: expected one of {', '.join(LOSS_PER)}")
        if self.fp8 and getattr(self, "method", "lora") != "lora":
            raise ConfigError(f"fp8=true with method={self.method}: FP8 matmuls are for a LoRA run's frozen bf16 base "
                              "(a 4-bit base is quantized already; full fine-tuning in FP8 is not measured)")
        if self.fp8 and getattr(self, "distributed", "ddp") != "ddp":
            raise ConfigError(f"fp8=true with distributed={self.distributed}: FP8 matmuls with sharded weights are "
                              "not measured; use distributed=ddp")


@dataclass
class _Data(_Settings):
    # --- data
    min_pixels: int = setting(0, "pixel budget; 0 = the model's own (its groundtune.json, else its "
                              "preprocessor_config.json)")
    max_pixels: int = setting(0, "0 = the model's own, as min_pixels")
    prompt: str = setting("", "\"\" = the model's saved prompt or the official grounding prompt; must hold {phrase}")
    answer_label: bool = setting(True, "the answer repeats the phrase as \"label\" (Qwen's format); false: boxes only "
                                 "(always so with head=box)")
    hflip_prob: float = setting(0.0, "horizontal flip that also swaps left/right in the phrase")
    scale_crop_prob: float = setting(0.0, "crop that keeps the target inside and moves the box")
    num_workers: int = setting(0, "data loader worker processes")

    def check(self) -> None:
        _at_least_zero(self, "min_pixels", "max_pixels", "num_workers")
        _fraction(self, "hflip_prob", "scale_crop_prob")
        if self.max_pixels and self.min_pixels and self.min_pixels > self.max_pixels:
            raise ConfigError(f"min_pixels={self.min_pixels} > max_pixels={self.max_pixels}")
        if self.prompt and "{phrase}" not in self.prompt:
            raise ConfigError("prompt must contain {phrase}, where the referring expression goes")


@dataclass
class _Loop(_Settings):
    # --- eval, checkpoints, monitoring
    log_every: int = setting(10, "steps between metrics.jsonl lines")
    eval_every: int = setting(0, "steps between generation evals (0 = only at the end, when eval_data is set)")
    eval_samples: int = setting(200, "fixed subset of eval_data used during training")
    eval_batch_size: int = setting(32, "samples answered together in those evals")
    eval_max_new_tokens: int = setting(MAX_NEW_TOKENS, "longest eval answer (greedy decoding, as groundtune eval)")
    save_every: int = setting(200, "steps between resumable checkpoints (0 = only at the end)")
    keep_last: int = setting(2, "resumable checkpoints kept")
    max_bad_steps: int = setting(5, "stop after this many non-finite losses in a row (each one is skipped)")
    thermal_pause_c: int = setting(0, "wait while the GPU is at or above this temperature (°C); 0 = off; read only")
    thermal_resume_c: int = setting(75, "... until it is back at or below this")
    device: str = setting("auto", "auto (a CUDA GPU when there is one) | cpu | cuda | cuda:N")
    distributed: str = setting("ddp", "under torchrun / accelerate launch: ddp (a whole copy per rank) | fsdp2 "
                               "(parameters sharded per decoder layer) | zero2 | zero3 (DeepSpeed ZeRO; pip install "
                               "deepspeed); see docs/scaling.md")
    deepspeed_config: str = setting("", "zero2/zero3: a DeepSpeed JSON whose options go over groundtune's (e.g. "
                                    "configs/deepspeed/zero3-offload.json)")
    # a list, also given as report_to=wandb,mlflow (made a list by check)
    report_to: list[str] | str = setting(["tensorboard"], f"where metrics.jsonl is mirrored, with the config and "
                                         f"eval reports: some of {', '.join(TRACKERS)} (W&B, MLflow: pip install "
                                         "\"groundtune[wandb]\" / \"groundtune[mlflow]\"); [] or none: "
                                         "metrics.jsonl alone")

    def check(self) -> None:
        given = self.report_to.split(",") if isinstance(self.report_to, str) else self.report_to or []
        if not all(isinstance(name, str) for name in given):  # str() of a nested list would print it whole
            raise ConfigError(f"report_to={shown(self.report_to)}: expected names, some of {', '.join(TRACKERS)}")
        names = [name.strip() for name in given if name.strip() not in ("", "none")]
        unknown = [name for name in names if name not in TRACKERS]
        if unknown:
            raise ConfigError(f"report_to: unknown {shown(unknown).strip('[]')}; expected some of "
                              f"{', '.join(TRACKERS)}, or none (metrics.jsonl alone)")
        self.report_to = list(dict.fromkeys(names))  # a tracker named twice is one run
        if self.distributed not in ENGINES:
            raise ConfigError(f"distributed={shown(self.distributed)}: expected one of {', '.join(ENGINES)}")
        if path_problem(self.deepspeed_config):
            raise ConfigError(f"deepspeed_config: {path_problem(self.deepspeed_config)}")
        if self.deepspeed_config and self.distributed not in ("zero2", "zero3"):
            raise ConfigError(f"deepspeed_config is set but distributed={self.distributed}: it configures "
                              "distributed=zero2 or zero3")
        _positive(self, "log_every", "eval_samples", "eval_batch_size", "eval_max_new_tokens", "keep_last",
                  "max_bad_steps")
        _at_least_zero(self, "eval_every", "save_every", "thermal_pause_c", "thermal_resume_c")
        if self.thermal_pause_c and self.thermal_resume_c >= self.thermal_pause_c:
            raise ConfigError("thermal_resume_c must be below thermal_pause_c")


@dataclass
class _Rollouts(_Settings):
    # --- rollouts: the answers sampled for each prompt
    group_size: int = setting(8, "sampled answers per prompt (GRPO's G)")
    temperature: float = setting(1.0, "sampling temperature of the answers")
    top_p: float = setting(1.0, "nucleus sampling; 1 = off")
    top_k: int = setting(0, "sample among the k most likely tokens; 0 = off (never the checkpoint's own top_k)")
    max_new_tokens: int = setting(48, "longer answers are cut (and usually unparsable: reward 0)")

    def check(self) -> None:
        _positive(self, "group_size", "max_new_tokens")
        _at_least_zero(self, "top_k")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"temperature={self.temperature}, top_p={self.top_p}: need temperature > 0 "
                              "and 0 < top_p <= 1 (rollouts are sampled)")


@dataclass
class _Reward(_Settings):
    # --- reward (train/rewards.py)
    reward_box: float = setting(1.0, "weight of the box term: the answer's boxes matched one to one with the true set, "
                                "summed IoU / max(#answered, #true) (one box against one: its IoU; [] to a phrase "
                                "naming nothing: 1; an unread answer: 0)")
    reward_format: float = setting(0.1, 'weight of "the answer was read: boxes that lie inside the image, or []"')
    reward_giou: bool = setting(False, "GIoU instead of IoU (a box missed or extra then scores -1): disjoint boxes "
                                "still get a signal")
    reward_missed: float = setting(0.0, "subtracted x the share of the true boxes the answer does not find at IoU >= "
                                   "0.5: above 0, a missed box costs more than an extra one (a model that lists "
                                   "too few)")

    def check(self) -> None:
        _at_least_zero(self, "reward_box", "reward_format", "reward_missed")


@dataclass
class _Update(_Settings):
    # --- policy update
    advantage: str = setting("grpo", "grpo: (reward - group mean) / group std | ema: reward - moving-average baseline "
                             "per prompt")
    ema_decay: float = setting(0.9, "advantage=ema: weight of a prompt's previous baseline")
    inner_updates: int = setting(1, "gradient steps per batch of answers; the clipped ratio acts from the second on")
    clip: float = setting(0.2, "policy-ratio clip range, PPO's epsilon")
    kl_coef: float = setting(0.0, "KL penalty to the starting policy (the SFT model); 0 = none, no reference pass")
    micro_batch: int = setting(32, "answers per forward/backward pass of the update (memory, not results; the "
                               "answers to a prompt share one row: its tokens count once)")
    curriculum: bool = setting(False, "a prompt whose last group was all solved or all hopeless sits out its next turn")

    def check(self) -> None:
        _positive(self, "inner_updates", "micro_batch")
        if self.advantage not in ADVANTAGES:
            raise ConfigError(f"advantage={shown(self.advantage)}: expected one of {', '.join(ADVANTAGES)}")
        if self.kl_coef < 0 or self.clip <= 0 or not 0 <= self.ema_decay < 1:
            raise ConfigError("need kl_coef >= 0, clip > 0 and 0 <= ema_decay < 1")


# --------------------------------------------------------------------------------------------
# the stages


@dataclass
class TrainConfig(_Loop, _Data, _Step, _Optimisation, _Lora, _Method, _Target):
    """Supervised fine-tuning (``groundtune train``)."""

    command: typing.ClassVar[str] = "train"  # the CLI command these settings belong to


@dataclass
class RLConfig(_Loop, _Update, _Reward, _Rollouts, _Optimisation, _Lora, _Target):
    """Reinforcement learning with the boxes' IoU as reward (``groundtune rl``). It trains a LoRA
    adapter: an SFT run's (which trains on) or a new one on any other model."""

    command: typing.ClassVar[str] = "rl"

    model: str = setting("tiny", "an SFT run folder (its LoRA adapter trains on; the lora_* settings must stay as they "
                         "are), or a model as for train (a new LoRA)")
    train_data: str = setting("", "the prompts: canonical JSONL (boxes are the truth rewards are scored on) or "
                              "synth:TASK")
    out_dir: str = setting("runs/rl")  # its help is train's (describe)
    max_steps: int = setting(200, "policy updates (each on batch_size x group_size fresh answers)")
    batch_size: int = setting(8, "prompts per step")

    # train's settings that rl has not, and why (load_config says it for a setting given anyway)
    not_settings: typing.ClassVar[dict[str, str]] = {
        "method": "rl always trains a LoRA adapter (the reference policy for kl_coef is the same weights with "
                  "the adapter off)",
        "grad_accum": "micro_batch bounds the update's memory",
        "packing": "the update puts the answers to a prompt in one row itself (the prompt once, then each answer)",
        "compile": "rollouts and updates with compiled layers are not measured yet",
        "fp8": "rollouts and updates with FP8 matmuls are not measured yet",
        "hflip_prob": "augmentations would change the truth rewards are scored on",
        "scale_crop_prob": "augmentations would change the truth rewards are scored on",
        "min_pixels": "the pixel budget is the starting model's, as it was trained",
        "max_pixels": "the pixel budget is the starting model's, as it was trained",
        "prompt": "the prompt is the starting model's, as it was trained",
        "answer_label": "rollouts are sampled answers, not targets",
        "num_workers": "prompts are read in the main process between generations",
        "freeze_vision": "rl trains a LoRA adapter only", "freeze_merger": "rl trains a LoRA adapter only",
        "freeze_llm": "rl trains a LoRA adapter only",
    }

    def check(self) -> None:
        if self.group_size < 2 and self.advantage == "grpo":
            raise ConfigError("group_size=1 with advantage=grpo: a group of one answer has no spread to learn from")
        if self.curriculum and self.train_data.startswith("synth:"):
            raise ConfigError(f"curriculum=true with train_data={self.train_data}: a synthetic stream never repeats "
                              "a prompt, so none has a last turn to judge; write the prompts to a file "
                              "(groundtune data synth) or set curriculum=false")
        if _adapter_folder(self.model) is not None:
            lora = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(_Lora)}
            changed = [name for name, default in lora.items() if getattr(self, name) != default]
            if changed:
                raise ConfigError(f"{', '.join(changed)}: model={self.model} is an SFT run whose LoRA adapter "
                                  "trains on as it was made; leave the lora_* settings out, or start a new adapter "
                                  "from that run's base model")


# --------------------------------------------------------------------------------------------
# answering with a model: eval, predict, serve, data refgen --filter-model


@dataclass(frozen=True)
class InferSettings:
    """The settings every command that answers with a model shares, each defined once: a field is
    their flag (batch_size: ``--batch-size``, with this default and help; cli/flags.py) and the default of
    the functions they call (``def predict(..., batch_size=InferSettings.batch_size)``: a dataclass
    keeps a field's default as the class attribute). Here, not in infer.py: ``--help`` builds the
    flags without importing torch. Training's own evals have theirs (eval_batch_size: 32,
    eval_max_new_tokens); the pixel-budget overrides are eval's alone (``--max-pixels``)."""

    batch_size: int = setting(16, "phrases answered together (64 is faster on a GPU with the memory; 1: one at "
                                  "a time)")
    max_new_tokens: int = setting(MAX_NEW_TOKENS, "longest answer in tokens (greedy decoding; a longer one is cut "
                                                  "and usually unparsable)")
    device: str = setting("auto", "auto, cpu, cuda, cuda:1, ...")
    compile: bool = setting(False, "torch.compile the vision tower on a GPU (nothing on a CPU): seconds more on the "
                                   "first batch, then faster prefills where liger-kernel is not installed (with it, "
                                   "none on the 3B: docs/eval-and-inference.md)")


def _adapter_folder(model: str) -> Path | None:
    """The adapter folder of a model setting that names one (an SFT run with LoRA, or the adapter
    itself), else None. Read from the file system only: no model is loaded to judge settings."""
    for folder in (RunFolder(model).model, Path(model)):
        if (folder / "adapter_config.json").is_file():
            return folder
    return None


def _positive(cfg, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be positive")


def _at_least_zero(cfg, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be 0 or more")


def _fraction(cfg, *names: str) -> None:
    for name in names:
        if not 0 <= getattr(cfg, name) <= 1:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be in [0, 1]")


def preset_path(name_or_path: str) -> Path:
    """A YAML path as given, or the name of a preset shipped with groundtune (configs/NAME.yaml)."""
    path = Path(name_or_path)
    if path.exists() and not path.is_dir():  # not a folder: `groundtune quickstart` makes one named quickstart
        return regular_file(path, "YAML file")
    shipped = PRESETS / f"{name_or_path}.yaml"
    if shipped.exists():
        return shipped
    names = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
    what = "a folder, not a YAML file" if path.is_dir() else "no such file"
    raise MissingError(f"{name_or_path}: {what}, and not a shipped preset ({names})")


# --------------------------------------------------------------------------------------------
# YAML + key=value


def file_settings(path: str | Path) -> dict:
    """The settings a YAML file gives, as written (not yet checked against a settings class)."""
    if Path(path).is_dir():
        raise ConfigError(f"{path} is a folder; give a YAML file or a preset name")
    loaded = _yaml(_settings_text(Path(path)), str(path)) or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(loaded).__name__}")
    return loaded


def load_config(cls, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()):
    """Build ``cls`` from a YAML file and ``key=value`` overrides (values parsed as YAML). An unknown
    setting is named with where it was given: the file, or the command line."""
    from_file = file_settings(path) if path else {}
    given: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {shown(item)} on the command line: expected key=value")
        key, raw = item.split("=", 1)
        given[key.strip()] = _yaml(raw, f"override {shown(item)} on the command line") if raw.strip() else ""
    known = {f.name for f in dataclasses.fields(cls)}
    reasons = getattr(cls, "not_settings", {})
    for where, values in ((f"in {path}", from_file), ("on the command line", given)):
        unknown = sorted((name for name in values if name not in known), key=str)  # YAML keys may be numbers
        if unknown:
            why = "".join(f"; {name}: {reasons[name]}" for name in unknown if name in reasons)
            names = ", ".join(name if isinstance(name, str) and len(name) <= 60 else shown(name)
                              for name in unknown[:10]) + (f" (+{len(unknown) - 10} more)" if len(unknown) > 10 else "")
            raise ConfigError(f"unknown setting(s) {where}: {names}{why}; see `groundtune {cls.command} --help`")
    return cls(**{**from_file, **given})


def _settings_text(path: Path) -> str:
    """A settings file's text: at most MAX_SETTINGS_BYTES, UTF-8 (else the line and byte offset)."""
    with open(regular_file(path, "YAML file"), "rb") as f:
        data = f.read(MAX_SETTINGS_BYTES + 1)
    if len(data) > MAX_SETTINGS_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_SETTINGS_BYTES:,} bytes; a settings file is a few KB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise not_utf8(path, ConfigError) from None


class _TooBig(yaml.YAMLError):
    """YAML that is valid but more than settings can be: too deep, or too many values expanded."""

    def __init__(self, problem: str, mark):
        self.problem, self.problem_mark = problem, mark


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last one
    silently, and a setting would then not be what its first line says. And refusing, before a
    value is made, nesting deeper than MAX_YAML_DEPTH (its composer recurses: 100,000 levels were a
    RecursionError) and aliases that expand past MAX_YAML_VALUES (the alias bomb)."""

    depth = 0

    def compose_node(self, parent, index):
        if self.depth >= MAX_YAML_DEPTH:
            raise _TooBig(f"nested deeper than {MAX_YAML_DEPTH} levels; settings are values and lists of them",
                          self.peek_event().start_mark)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_document(self, node):
        where = []
        if _expanded(node, {}, where) > MAX_YAML_VALUES:
            raise _TooBig(f"expands to more than {MAX_YAML_VALUES:,} values (YAML aliases repeat what they name: an "
                          "alias bomb?); settings are a few dozen", where[0])
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice (first on line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def _expanded(node, memo: dict, where: list) -> int:
    """How many values ``node`` makes once its aliases are expanded, each node counted once
    (``memo``): a few lines of nested aliases are counted in microseconds, not expanded. The mark of
    the first (innermost) node over the limit is put in ``where``; a node that holds itself counts
    as over it."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = MAX_YAML_VALUES + 1  # while counting it: an alias to it inside it never ends
    if isinstance(node, yaml.ScalarNode):
        count = 1 + len(node.value) // 1024
    elif isinstance(node, yaml.SequenceNode):
        count = 1 + sum(_expanded(child, memo, where) for child in node.value)
    else:
        count = 1 + sum(_expanded(k, memo, where) + _expanded(v, memo, where) for k, v in node.value)
    if count > MAX_YAML_VALUES and not where:
        where.append(node.start_mark)
    memo[id(node)] = count
    return count


def _yaml(text: str, where: str):
    """YAML parsed, or a ConfigError naming ``where`` (a file: with line and column)."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except (yaml.YAMLError, TypeError, ValueError) as e:  # TypeError: an unhashable key ({[a]: 1}); ValueError:
        mark = getattr(e, "problem_mark", None)           # an integer of 5,000 digits
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None and not where.startswith("override") else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0][:200]
        if isinstance(e, ValueError) and "digits" in problem:  # Python reads at most 4,300 digits into an int
            problem = "a number of more digits than a number has"
        if isinstance(e, _TooBig):
            raise ConfigError(f"{where}{at}: {problem}") from None
        raise ConfigError(f"{where}{at}: not valid YAML ({problem})") from None


def to_yaml(cfg) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


def settings_of(cls) -> list[tuple[str, object, str]]:
    """(name, default, help) of every setting of ``cls``, in its order: what --help lists and the
    studio's launch form is built from. A setting a stage redefines without a help of its own
    (RLConfig's out_dir: another default) keeps its group's."""
    groups = [klass for klass in cls.__mro__ if dataclasses.is_dataclass(klass)]  # the stage first
    found = []
    for f in dataclasses.fields(cls):
        help = next((g.metadata["help"] for klass in groups for g in dataclasses.fields(klass)
                     if g.name == f.name and g.metadata.get("help")), "")
        found.append((f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory(), help))
    return found


def describe(cls) -> str:
    """One line per setting with its default and help, for --help."""
    return "\n".join(f"  {name} = {default!r}" + (f"  # {help}" if help else "")
                     for name, default, help in settings_of(cls))


def _check_types(cfg) -> None:
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        expected = hints[f.name]
        origin = typing.get_origin(expected)
        if origin in (list, tuple):
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"{f.name}={shown(value)}: expected a list")
            setattr(cfg, f.name, list(value))
            continue
        if isinstance(expected, types.UnionType) or origin is typing.Union:
            continue
        if expected is float and not isinstance(value, bool) and isinstance(value, (int, str)):
            try:  # YAML 1.1 reads 2e-3 (no dot) as a string
                setattr(cfg, f.name, float(value))
            except (ValueError, OverflowError):
                raise ConfigError(f"{f.name}={shown(value)}: expected a number") from None
            _check_range(f.name, getattr(cfg, f.name), given=value)
            continue
        if expected is str and value is None:
            setattr(cfg, f.name, "")
            continue
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ConfigError(f"{f.name}={shown(value)}: expected {expected.__name__}")
        _check_range(f.name, getattr(cfg, f.name))


def _check_range(name: str, value, given=None) -> None:
    """A number every setting can use: finite (a NaN learning rate would only show as NaN losses
    once the run had started) and, for a count, within what a 32-bit integer holds. ``given``: the
    value as written, where it was converted (1e400 -> inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}={value if given is None else shown(given).strip(chr(39))}: expected a finite number")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise ConfigError(f"{name}={value}: out of range (at most {MAX_INT:,})")
