"""How the ranks of a torchrun (or accelerate launch) run train one model together: the run's
``distributed`` setting.

    ddp    every rank holds the whole model; the gradients are all-reduced in buckets while the
           backward still runs (torch's DistributedDataParallel). The default: right for LoRA and
           QLoRA, whose gradients are a few tens of MB.
    fsdp2  parameters sharded over the ranks (torch's ``fully_shard``): one group per decoder
           layer, the vision tower one more, the rest (embeddings, LM head) at the root. A frozen
           part gets no gradient, so no reduce-scatter and no gradient memory: freezing the vision
           tower still saves what it saves on one GPU (FSDP1's flat parameters lost that).
    zero2  DeepSpeed ZeRO stage 2: optimizer state and gradients sharded, parameters whole.
    zero3  DeepSpeed ZeRO stage 3: parameters sharded as well (``deepspeed_config`` may add
           offloading).

Each engine wraps ``Objective(model)`` (train/objective.py), so that its hooks run around what
the loop computes, not around the model's own forward. The loops see one interface: call
``objective``, then ``backward`` each micro-batch and ``step`` once per update. Checkpoints are
written by rank 0 in the one-process format (``full_weights``, ``full_optimizer_state``: every
sharded tensor gathered whole), so a run resumes on any number of ranks, one included.
Generation (training-time eval, RL rollouts) needs whole weights: ``gathered()`` gathers them
once for the whole batch of answers, never once per token (ZeRO-3's slow path elsewhere).

Every engine AVERAGES gradients over the ranks, while the loops' loss is a rank's sum over its
answer tokens divided by the answer tokens of the GLOBAL batch; ``backward`` scales it by the
number of ranks first, so that the average is the sum one process with the global batch computes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from pathlib import Path

import torch

from groundtune.errors import ConfigError, MissingPackageError, TrainingError
from groundtune.models import adapt, qwen
from groundtune.train.distributed import Ranks
from groundtune.train.objective import Objective

SHARDED = ("fsdp2", "zero3")  # whose parameters are not whole on any rank between steps


def check_launch(kind: str, deepspeed_config: str = "") -> None:
    """What would otherwise fail only once the model loads (DeepSpeed not installed, its config
    file unreadable), or not at all: a launcher configured for another engine than the run's
    setting (accelerate launch with a DeepSpeed or FSDP config, which groundtune does not read)."""
    if kind in ("zero2", "zero3"):
        if importlib.util.find_spec("deepspeed") is None:
            raise MissingPackageError(f"distributed={kind} needs DeepSpeed: pip install deepspeed")
        deepspeed_settings(int(kind[-1]), 0.0, deepspeed_config)
    said = {"ACCELERATE_USE_DEEPSPEED": ("zero2", "zero3"), "ACCELERATE_USE_FSDP": ("fsdp2",)}
    for variable, kinds in said.items():
        if os.environ.get(variable, "").lower() == "true" and kind not in kinds:
            raise ConfigError(f"the launcher asks for {variable.removeprefix('ACCELERATE_USE_').lower()} but the run's "
                              f"distributed={kind}: the engine is the run's setting (distributed={'|'.join(kinds)}); "
                              "launch with configs/accelerate/multi-gpu.yaml or torchrun")


class Parallel:
    """The model as several ranks train it (or, on one process, as it is: nothing wrapped)."""

    def __init__(self, model, ranks: Ranks, kind: str = "ddp", compute_dtype: torch.dtype | None = None,
                 objective: torch.nn.Module | None = None):
        # a launcher's single rank runs its engine too (``torchrun --nproc-per-node 1`` is measured so)
        self.model, self.ranks, self.kind = model, ranks, kind if ranks.launched else "none"
        self.objective = objective if objective is not None else Objective(model)  # (box head: BoxObjective)
        self.deepspeed = None  # the DeepSpeed engine, once ``start`` made it
        if self.kind == "ddp":
            device = next(p for p in model.parameters() if p.requires_grad).device
            self.objective = torch.nn.parallel.DistributedDataParallel(
                self.objective, device_ids=[device.index] if device.type == "cuda" else None)
        elif self.kind == "fsdp2":
            _shard(self.objective, model, compute_dtype)

    @property
    def sharded(self) -> bool:
        return self.kind in SHARDED

    def start(self, optimizer: torch.optim.Optimizer, deepspeed_config: str = "", max_grad_norm: float = 0.0):
        """Hand the optimizer to the engine (DeepSpeed owns the update from here on)."""
        if self.kind not in ("zero2", "zero3"):
            return
        import deepspeed

        config = deepspeed_settings(int(self.kind[-1]), max_grad_norm, deepspeed_config)
        # DeepSpeed puts flat shards in the optimizer's groups: keep the parameters in their order
        optimizer._groundtune_params = [list(group["params"]) for group in optimizer.param_groups]
        self.deepspeed, *_ = deepspeed.initialize(model=self.objective, optimizer=optimizer, config=config,
                                                  dist_init_required=False)
        self.objective = self.deepspeed

    @contextlib.contextmanager
    def accumulating(self, last: bool):
        """One micro-batch's forward and backward; the gradients are reduced across the ranks on
        the ``last`` micro-batch of an update only (DDP and FSDP2: the others add up locally)."""
        if self.kind == "ddp" and not last:
            with self.objective.no_sync():
                yield
            return
        if self.kind == "fsdp2":
            self.objective.set_requires_gradient_sync(last)
        elif self.deepspeed is not None:
            self.deepspeed.set_gradient_accumulation_boundary(last)
        yield

    def backward(self, loss: torch.Tensor) -> None:
        scaled = loss * self.ranks.world  # the engines average over ranks; the loop's loss sums (module docstring)
        if self.deepspeed is not None:
            self.deepspeed.backward(scaled)
        else:
            scaled.backward()

    def step(self, optimizer, max_grad_norm: float) -> float | None:
        """Clip and apply the update; returns the gradient norm before clipping, or None (nothing
        applied, the gradients dropped) when it is not finite."""
        if self.deepspeed is not None:
            self.deepspeed.step()  # clips (gradient_clipping) and applies
            norm = self.deepspeed.get_global_grad_norm()
            norm = float(norm) if norm is not None else 0.0
            if not torch.isfinite(torch.tensor(norm)):
                raise TrainingError("a non-finite gradient under DeepSpeed, whose engine has applied it: lower lr, "
                                    "check the data, and resume from the last checkpoint")
            return norm
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = (torch.nn.utils.clip_grad_norm_(params, max_grad_norm) if max_grad_norm else torch.tensor(0.0))
        norm = float(_whole(norm))  # FSDP2: a DTensor whose value every rank reads the same
        if not torch.isfinite(torch.tensor(norm)):
            optimizer.zero_grad(set_to_none=True)
            return None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    def drop_gradients(self, optimizer) -> None:
        """An update given up before its step (a non-finite loss): its gradients go."""
        if self.deepspeed is not None:
            raise TrainingError("a non-finite loss under DeepSpeed, whose engine cannot drop an update it has "
                                "begun: lower lr, check the data (groundtune data check), and resume from the last "
                                "checkpoint")
        optimizer.zero_grad(set_to_none=True)

    # ---- whole weights for generation, and checkpoints in the one-process format

    @contextlib.contextmanager
    def gathered(self):
        """The model with whole weights on every rank while generating: one all-gather for the
        batch of answers, kept until it is done (a sharded engine would otherwise gather every
        layer again for every new token)."""
        if self.kind == "fsdp2":
            # FSDP2 sets its groups up on the root's first forward; generation calls the layers
            # directly (RL samples before its first update), which would make each its own root
            self.objective._get_fsdp_state()._lazy_init()
            modules = [m for m in self.objective.modules() if hasattr(m, "unshard") and hasattr(m, "reshard")]
            for m in modules:
                m.set_reshard_after_forward(False)
                m.unshard()
            try:
                yield
            finally:
                for m in modules:
                    m.reshard()
                    m.set_reshard_after_forward(True)
        elif self.kind == "zero3":
            # DeepSpeed's own: the weights gathered, and its hooks (which would fetch them again for
            # every module call, in step with the other ranks) off until the answers are in
            from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

            with unwrap_model_for_generation(self.deepspeed):
                yield
        else:
            yield

    @property
    def collective(self) -> bool:
        """Whether gathering whole weights takes every rank (else rank 0 holds them: one process, DDP)."""
        return self.kind not in ("none", "ddp")

    def full_weights(self, everything: bool = False) -> dict[str, torch.Tensor]:
        """Every trainable weight (``everything``: every weight), whole and on the CPU. A collective
        where ``collective``: every rank calls it, and all get them."""
        weights = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad or everything:
                weights[name] = self._whole_weight(p).detach().contiguous().cpu()
        return weights

    def model_weights(self) -> dict[str, torch.Tensor] | None:
        """What RUN/model is written from where no rank holds it whole (a collective then): the
        trained adapter's weights, or all of them for full fine-tuning; None where rank 0 holds them."""
        if not self.collective:
            return None
        return self.full_weights(everything=not hasattr(self.model, "peft_config"))

    def full_optimizer_state(self, optimizer) -> dict:
        """The optimizer's state dict as one process would have it (every rank takes part)."""
        if self.deepspeed is not None:
            from deepspeed.utils import safe_get_full_optimizer_state

            state, step = {}, _deepspeed_step(self.deepspeed)
            for index, p in enumerate(_params_in_order(optimizer)):
                state[index] = {"step": torch.tensor(float(step)),
                                **{k: safe_get_full_optimizer_state(p, k).cpu() for k in ("exp_avg", "exp_avg_sq")}}
            return {"state": state, "param_groups": _groups_by_index(optimizer)}
        saved = optimizer.state_dict()
        return {**saved, "state": {i: {k: _whole(v).cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                                   for i, s in saved["state"].items()}}

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Whole trainable weights (a checkpoint's) into this rank's part of the model."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in weights.items():
                p = params[name]
                if self.deepspeed is not None:
                    from deepspeed.utils import safe_set_full_fp32_param

                    safe_set_full_fp32_param(p, t.to(torch.float32))
                else:  # this rank's shard where the weight is sharded (FSDP2), else the whole of it
                    p.copy_(_like(t.to(p.dtype), p))

    def load_optimizer_state(self, optimizer, saved: dict) -> None:
        """A one-process optimizer state dict into this rank's optimizer (its shards of it)."""
        params = _params_in_order(optimizer)
        if self.deepspeed is not None:
            from deepspeed.utils import safe_set_full_optimizer_state

            _make_adam_state(self.deepspeed)
            for index, p in enumerate(params):
                for k in ("exp_avg", "exp_avg_sq"):
                    safe_set_full_optimizer_state(p, saved["state"][index][k].to(torch.float32), k)
            _set_deepspeed_step(self.deepspeed, int(next(iter(saved["state"].values()))["step"]))
            for group, hyper in zip(optimizer.param_groups, saved["param_groups"]):  # lr where the run was
                group.update({k: v for k, v in hyper.items() if k != "params"})
            return
        state = {i: {k: _like(v, params[i]) if torch.is_tensor(v) and v.dim() else v for k, v in s.items()}
                 for i, s in saved["state"].items()}
        optimizer.load_state_dict({**saved, "state": state})

    def _whole_weight(self, p: torch.Tensor) -> torch.Tensor:
        if self.deepspeed is not None and p.requires_grad:
            from deepspeed.utils import safe_get_full_fp32_param

            return safe_get_full_fp32_param(p)  # the fp32 weight DeepSpeed updates
        if self.kind == "zero3":
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                return p.detach().clone()
        return _whole(p)


def deepspeed_settings(stage: int, max_grad_norm: float, extra_file: str = "") -> dict:
    """DeepSpeed's config for ZeRO ``stage``, from the run's own settings: the loop keeps its
    precision (autocast; trainable weights fp32, as on one GPU), its optimizer (torch's AdamW over
    groundtune's parameter groups) and its accumulation (the loop marks each update's last
    micro-batch). ``extra_file``: a JSON whose options go over these (offloading, buckets)."""
    config = {
        "train_micro_batch_size_per_gpu": 1,  # bookkeeping only: the loop draws the batches
        "gradient_accumulation_steps": 1,  # the loop sets each boundary (Parallel.accumulating)
        "gradient_clipping": max_grad_norm,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # torch's AdamW: no compiled DeepSpeed op needed
        "bf16": {"enabled": False},  # autocast computes in bf16 where the run does
        "steps_per_print": 2**31 - 1,  # the loop logs
    }
    if extra_file:
        try:
            extra = json.loads(Path(extra_file).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"deepspeed_config={extra_file}: {e}") from None
        for key, value in extra.items():
            config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


# --------------------------------------------------------------------------------------------
# FSDP2 and DTensors


def _shard(objective: torch.nn.Module, model, compute_dtype) -> None:
    """``fully_shard`` the decoder layers, the vision tower, then the root (what is left).
    Parameters are gathered in the compute dtype (fp32 LoRA weights beside a bf16 base would
    otherwise be two dtypes in one all-gather) and gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in adapt.decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    vision = getattr(adapt.base_model(model).model, qwen.family_of(model).vision_tower, None)
    if vision is not None:
        fully_shard(vision, mp_policy=policy)
    fully_shard(objective, mp_policy=policy)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective: every rank calls it), any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A whole tensor placed as ``param`` is: this rank's shard of it where ``param`` is a DTensor."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements)
    return value.to(param.device)


def _params_in_order(optimizer) -> list[torch.Tensor]:
    """The parameters as the optimizer's state dict numbers them (under DeepSpeed, as they were
    before it put flat shards in their place: ``Parallel.start``)."""
    groups = getattr(optimizer, "_groundtune_params", None) or [g["params"] for g in optimizer.param_groups]
    return [p for params in groups for p in params]


def _groups_by_index(optimizer) -> list[dict]:
    """The groups' settings, their parameters numbered as ``_params_in_order`` lists them."""
    groups, index = [], 0
    for group, params in zip(optimizer.param_groups, optimizer._groundtune_params):
        settings = {k: v for k, v in group.items() if k != "params"}
        groups.append({**settings, "params": list(range(index, index + len(params)))})
        index += len(params)
    return groups


def _deepspeed_step(engine) -> int:
    states = [s for s in engine.optimizer.optimizer.state.values() if "step" in s]
    return int(states[0]["step"]) if states else 0


def _set_deepspeed_step(engine, step: int) -> None:
    for s in engine.optimizer.optimizer.state.values():
        s["step"].fill_(step)


def _make_adam_state(engine) -> None:
    """torch's AdamW makes its state at its first step, and a resumed run's moments go in before
    that: make it now, zeros in AdamW's own layout, for the flat fp32 shards ZeRO steps (stage 2:
    ``single_partition_of_fp32_groups``, stage 3: ``fp32_partitioned_groups_flat``), and have
    ZeRO-2 link its per-parameter views to it, as it does after a first step."""
    zero = engine.optimizer
    shards = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
    inner = zero.optimizer
    for group, shard in zip(inner.param_groups, shards):
        on_device = group.get("fused") or group.get("capturable")  # where AdamW keeps ``step`` then
        if not inner.state[shard]:
            inner.state[shard] = {"step": torch.zeros((), device=shard.device if on_device else "cpu"),
                                  "exp_avg": torch.zeros_like(shard), "exp_avg_sq": torch.zeros_like(shard)}
    link = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()
