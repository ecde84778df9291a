"""What to train: LoRA adapters or full weights per model part, per-part learning rates, and
selective gradient checkpointing.

Parts are told apart by parameter name, as the model's family record says
(``qwen.Family.part_of``): the merger (vision -> LLM projection), the vision tower, and everything
else (language model and LM head).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from groundtune.config import TrainConfig
from groundtune.errors import ConfigError
from groundtune.models import attention, head
from groundtune.models.qwen import family_of


def base_model(model):
    """The transformers model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model) -> torch.nn.ModuleList:
    return family_of(model).decoder_layer_list(model)


def lora_target_modules(model, targets: list[str], last_n_layers: int = 0) -> list[str]:
    """Names of every Linear layer in the targeted parts (peft's ``target_modules``)."""
    family = family_of(model)
    first = len(family.decoder_layer_list(model)) - last_n_layers if last_n_layers else 0
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        layer = family.llm_layer(name)
        if layer is not None:
            index, kind = layer
            wanted = f"llm_{kind}" in targets and index >= first
        else:
            wanted = family.part_of(name) in targets  # "merger" / "vision"; the LM head is never adapted
        if wanted:
            names.append(name)
    return names


def add_lora(model, cfg):
    """A new LoRA adapter on the parts ``cfg.lora_targets`` names (initialised to change nothing),
    everything else frozen. ``cfg`` is a TrainConfig or an RLConfig: both carry the lora_* settings."""
    torch.manual_seed(cfg.seed)  # the adapters' initial weights: a function of the seed alone
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=lora_target_modules(model, cfg.lora_targets, cfg.lora_last_n_layers),
        bias="none",
    )
    return get_peft_model(model, lora)


def prepare_for_training(model, cfg: TrainConfig):
    """Freeze, wrap with LoRA or unfreeze parts, per the config. Returns the model to train."""
    if cfg.method in ("lora", "qlora"):
        model = add_lora(model, cfg)
    else:
        frozen = {"vision": cfg.freeze_vision, "merger": cfg.freeze_merger, "llm": cfg.freeze_llm}
        family = family_of(model)
        for name, p in model.named_parameters():
            p.requires_grad_(not frozen[family.part_of(name)])
    if cfg.gradient_checkpointing:
        checkpoint_last_layers(model, cfg.gradient_checkpointing)
    return model


def keep_trainable_fp32(model) -> None:
    """Trainable weights (and so their optimizer state) in fp32, whatever the frozen base is in:
    bf16 updates of small LoRA weights would round away.

    With one of the vision tower and the merger trained in full and the other frozen, the two are
    in different dtypes, and nothing casts between them (transformers casts only the language
    model's input): outside autocast, as in the evals during training, a bf16 tower's output would
    meet an fp32 merger's weights or the reverse. Each merger reads its input in its own dtype."""
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    for merger in family_of(model).mergers(model):
        if not getattr(merger, "_groundtune_reads_own_dtype", False):
            merger.register_forward_pre_hook(_input_in_own_dtype)
            merger._groundtune_reads_own_dtype = True


def _input_in_own_dtype(module, args):
    dtype = next(module.parameters()).dtype
    return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def lora_inputs_uncast(model):
    """A context in which LoRA layers take their input as it comes. peft casts a LoRA layer's input
    to its weights' dtype: with fp32 adapters on a bf16 model, every adapted linear copies its input
    to fp32, and autocast copies it straight back to bf16 for the matmul (bf16 -> fp32 -> bf16 is
    exact, so only the copies go). Under autocast the result is the same. Outside autocast (eval,
    generation) the cast is needed, so this covers the training forward and backward only (the
    backward recomputes checkpointed layers)."""
    from peft.helpers import disable_input_dtype_casting

    return disable_input_dtype_casting(model)


def checkpoint_last_layers(model, n: int) -> int:
    """Recompute the last ``n`` decoder layers (all when n < 0) in backward instead of keeping their
    activations. Only LLM layers: the frozen vision tower keeps no activations for backward at all,
    so checkpointing it would only add a second forward (the naive stack's mistake)."""
    layers = decoder_layers(model)
    chosen = list(layers) if n < 0 else list(layers)[-n:]
    for layer in chosen:
        if getattr(layer, "_groundtune_checkpointed", False):
            continue
        layer._groundtune_inner = layer.forward  # what checkpoint runs (kernels.compile_decoder_layers compiles it)

        @functools.wraps(layer.forward)
        def forward(*args, _layer=layer, **kwargs):
            if _layer.training and torch.is_grad_enabled():
                # context_fn: the recomputation attends as the forward did (attention.recompute_contexts)
                return checkpoint(_layer._groundtune_inner, *args, use_reentrant=False,
                                  context_fn=attention.recompute_contexts, **kwargs)
            return _layer._groundtune_inner(*args, **kwargs)

        layer.forward = forward
        layer._groundtune_checkpointed = True
    return len(chosen)


def param_groups(model, cfg) -> list[dict]:
    """Trainable parameters grouped by (part, decay): each part has its own learning rate.
    ``cfg``: a TrainConfig or an RLConfig (``part_lr`` and ``weight_decay``).

    Decay shrinks weights toward zero: right for matrices (convolution kernels included), wrong for
    norm gains, biases, the token embedding table and the LM head (tied to it in small models)."""
    family = family_of(model)
    core = base_model(model)
    tables = {id(core.get_input_embeddings().weight), id(core.get_output_embeddings().weight)}
    groups: dict[tuple[str, bool], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            if name.startswith(f"{head.ATTRIBUTE}.") or f".{head.ATTRIBUTE}." in name:  # a box head: no decay
                groups.setdefault(("head", True), []).append(p)
                continue
            no_decay = p.ndim < 2 or "norm" in name or name.endswith(".bias") or id(p) in tables
            groups.setdefault((family.part_of(name), no_decay), []).append(p)
    if not groups:
        raise ConfigError("no trainable parameters: check method, lora_targets and freeze_* settings")
    return [
        {
            "params": params,
            "lr": cfg.lr if part == "head" else cfg.part_lr(part),
            "weight_decay": 0.0 if no_decay else cfg.weight_decay,
            "part": part,
        }
        for (part, no_decay), params in sorted(groups.items())
    ]


def attach_box_head(model, text_loss: bool, slots: int, threshold: float, start: Path | None = None) -> str:
    """``head: box``: a box head of ``slots`` slots answering at ``threshold`` on ``model``
    (models/head.py), trained fully: the one saved in ``start`` where it has that layout, else a
    new one. Returns which, in words. Without the text loss (``text_loss``) the LM head computes
    nothing, so a trainable, untied one is frozen (an unused trainable weight would also stall
    DDP, which waits for its gradient)."""
    core = base_model(model)
    started = start is not None and head.attach_from(model, start, hidden_size(core), slots, threshold) is not None
    if not started:
        head.attach(model, hidden_size(core), slots, threshold)
    lm_head = core.get_output_embeddings().weight
    if not text_loss and lm_head is not core.get_input_embeddings().weight:
        lm_head.requires_grad_(False)
    layout = f"{slots} slots" if slots else "a candidate per image cell"
    if started:
        return f"box head: starting from {start} ({layout})"
    if start is not None:
        return f"box head: a new one ({layout}; the one in {start} has another layout)"
    return f"box head: a new one ({layout})"


def hidden_size(core) -> int:
    return getattr(core.config, "text_config", core.config).hidden_size


def count_parameters(model) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable}
