"""Speed-ups of the training step that leave its results unchanged (installed by
``models.speedups.install``, with the attention of models/attention.py).

Always on, where they apply (``fuse_lora_layers``, ``pad_vision_mlp``):
- LoRA layers as one autograd function whose scale and sum run inside the matmuls (addmm's alpha
  and beta): peft's layer adds ``lora_B(lora_A(x)) * scaling`` to the base output as separate
  multiply and add kernels, forward, recomputation and backward, over every adapted activation.
- a vision MLP at an aligned width (the family record's ``padded_vision_mlp``: Qwen2.5-VL's 3,420-wide
  intermediate is no multiple of 8, so cuBLAS falls back to slower kernels for all three of its
  matmuls); zero-padded to 3,424 the arithmetic is the same (the four extra columns are 0 in, 0 out).

Optional, as settings of ``groundtune train`` (and ``--compile`` of eval, predict and serve); the
first two cut the launches and memory round trips of elementwise work (field-notes, "Speed";
docs/benchmarks-history.md), the third the matmuls' precision:

    kernels: none | liger | auto   # auto: liger-kernel when it is installed and the model is on a GPU;
                                   # its loss kernel also scores the answer tokens (fused_answer_nll)
    compile: false | true          # torch.compile each vision block, and each decoder layer where
                                   # liger-kernel does not run (the first steps are slower)
    fp8: false | true              # LoRA layers' frozen base products in float8 (FP8 below)

liger-kernel is an extra (``pip install 'groundtune[gpu]'``): its kernels are Triton, GPU only.
Without it, or on CPU, ``kernels=auto`` leaves transformers' modules as they are.
"""

from __future__ import annotations

import types
import typing

import torch
import torch.nn.functional as F

from groundtune.config import KERNEL_MODES
from groundtune.errors import MissingPackageError, TrainingError
from groundtune.models.adapt import base_model, decoder_layers
from groundtune.models.qwen import family_of

# --------------------------------------------------------------------------------------------
# LoRA: y = x W^T + b + s (x A^T) B^T, the scale s and the sum inside the matmuls


class _LoraLinear(torch.autograd.Function):
    """The adapted linear layer, forward and backward, for a frozen base weight. Computes in the
    input's dtype (under autocast: bf16, as peft's layer does); the adapters' gradients come back
    in their own dtype (fp32). ``base``: how the base weight's two products are made (``BF16``,
    ``FP8``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float, base: "_BaseProducts"):
        a, b = lora_a.to(x.dtype), lora_b.to(x.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ a.t()  # (tokens, r)
        out = base.forward(x2, weight, bias).addmm_(h, b.t(), alpha=scaling)
        ctx.save_for_backward(x2, weight, a, b, h)
        ctx.scaling, ctx.dtypes, ctx.shape, ctx.base = scaling, (lora_a.dtype, lora_b.dtype), x.shape, base
        return out.reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, a, b, h = ctx.saved_tensors
        s = ctx.scaling
        g = grad.reshape(-1, grad.shape[-1])
        gh = g @ b  # (tokens, r): the gradient at the adapter's bottleneck, unscaled
        grad_x = (ctx.base.input_grad(g, weight).addmm_(gh, a, alpha=s).reshape(ctx.shape)
                  if ctx.needs_input_grad[0] else None)
        grad_a = (gh.t() @ x2).mul_(s).to(ctx.dtypes[0])
        grad_b = (g.t() @ h).mul_(s).to(ctx.dtypes[1])
        return grad_x, None, None, grad_a, grad_b, None, None


class _BaseProducts(typing.NamedTuple):
    forward: typing.Callable  # (x2, weight, bias) -> x2 W^T + b
    input_grad: typing.Callable  # (g, weight) -> g W


BF16 = _BaseProducts(F.linear, torch.matmul)  # in the input's dtype, as peft's layer computes them


def _lora_forward(self, x, *args, **kwargs):
    """Forward of a peft ``lora.Linear``: the fused function where it computes exactly what peft
    does (training, one plain LoRA adapter, no dropout, a frozen base in the input's dtype);
    peft's own forward everywhere else (generation, dropout, DoRA, quantized bases, several adapters)."""
    names = self.active_adapters
    name = names[0] if len(names) == 1 else None
    base = self.base_layer
    if (torch.is_grad_enabled() and not args and not kwargs and name in self.lora_A and not self.merged
            and not self.disable_adapters and name not in self.lora_variant
            and isinstance(self.lora_dropout[name], torch.nn.Identity) and self.lora_B[name].bias is None
            and type(base) is torch.nn.Linear and not base.weight.requires_grad and x.dtype == base.weight.dtype):
        return _LoraLinear.apply(x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight,
                                 self.scaling[name], FP8 if getattr(self, "_groundtune_fp8", False) else BF16)
    return type(self).forward(self, x, *args, **kwargs)


def _lora_layers(model) -> list:
    """The peft LoRA linear layers of ``model`` (none where peft is not installed)."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:
        return []
    return [module for module in model.modules() if type(module) is LoraLinear]


def fuse_lora_layers(model) -> int:
    """Give every peft LoRA linear layer of ``model`` the fused forward; returns how many."""
    layers = _lora_layers(model)
    for module in layers:
        module.forward = types.MethodType(_lora_forward, module)
    return len(layers)


# --------------------------------------------------------------------------------------------
# a vision MLP at an aligned width

ALIGN = 8  # bf16 matmuls take cuBLAS's fast kernels when every dimension is a multiple of 8


def pad_vision_mlp(model, mlp_class: str | None) -> int:
    """Run the vision MLPs of class ``mlp_class`` (the family record's ``padded_vision_mlp``) whose
    width is no multiple of ALIGN on zero-padded copies of their weights, when on a GPU and frozen
    (a tower being trained keeps its own forward). The copies are made on first use and remade
    when the weights change. Returns the number of layers."""
    count = 0
    for module in model.modules():
        if type(module).__name__ == mlp_class and module.gate_proj.out_features % ALIGN:
            module.forward = types.MethodType(_padded_mlp_forward, module)
            count += 1
    return count


def _padded_mlp_forward(self, hidden_state):
    trained = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
    if not hidden_state.is_cuda or trained:  # CPUs have no alignment to gain; training needs the parameters
        return type(self).forward(self, hidden_state)
    gate_w, gate_b, up_w, up_b, down_w = _padded_weights(self)
    inner = self.act_fn(F.linear(hidden_state, gate_w, gate_b)) * F.linear(hidden_state, up_w, up_b)
    return F.linear(inner, down_w, self.down_proj.bias)


def _padded_weights(mlp) -> tuple:
    """gate/up weights and biases with ALIGN-padded rows of zeros, down weight with zero columns;
    cached, and remade when a parameter changed (a new tensor, or written in place)."""
    key = tuple((p.data_ptr(), p._version) for p in mlp.parameters())
    cached = getattr(mlp, "_groundtune_padded", None)
    if cached is None or cached[0] != key:
        pad = -mlp.gate_proj.out_features % ALIGN
        with torch.no_grad():
            padded = (F.pad(mlp.gate_proj.weight, (0, 0, 0, pad)), _pad_bias(mlp.gate_proj.bias, pad),
                      F.pad(mlp.up_proj.weight, (0, 0, 0, pad)), _pad_bias(mlp.up_proj.bias, pad),
                      F.pad(mlp.down_proj.weight, (0, pad)))
        cached = mlp._groundtune_padded = (key, padded)
    return cached[1]


def _pad_bias(bias, pad: int):
    return None if bias is None else F.pad(bias, (0, pad))


# --------------------------------------------------------------------------------------------
# optional: liger-kernel, torch.compile


def _liger_patch(model):
    """liger-kernel's patch for this model's family, or None (not installed, or no such patch)."""
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        return None
    # liger names its patches after the model type (qwen2_vl, qwen2_5_vl, qwen3_vl)
    return getattr(liger, f"apply_liger_kernel_to_{family_of(model).model_type}", None)


def liger_usable(model) -> bool:
    """Whether liger-kernel can run this model here: installed, with a patch for its family, on a GPU."""
    return _liger_patch(model) is not None and base_model(model).device.type == "cuda"


def apply_fused_kernels(model, mode: str) -> bool:
    """Swap in liger-kernel's RMSNorm, SwiGLU and rope kernels for the model's own (``mode`` of
    KERNEL_MODES: ``auto`` where usable, ``liger`` or an error saying what is missing). Returns
    whether it did. liger-kernel's own loss patch is left off (it fuses transformers' loss over every
    position; groundtune's runs on the answer tokens only, ``train/objective.py``, and marks the
    model to score them with ``fused_answer_nll``). liger-kernel patches
    transformers' modeling module as well as this model: models built later in the same process
    get its kernels too (one training run per process is what `groundtune train` does)."""
    assert mode in KERNEL_MODES, mode  # TrainConfig checks it
    if mode == "none" or (mode == "auto" and not liger_usable(model)):
        return False
    patch = _liger_patch(model)
    if patch is None:
        raise MissingPackageError(f"kernels=liger needs liger-kernel with kernels for {family_of(model).model_type}: "
                                  "pip install 'groundtune[gpu]' (or kernels=auto to use it only where it can run)")
    if base_model(model).device.type != "cuda":
        raise TrainingError("kernels=liger needs the model on a CUDA GPU (liger-kernel is Triton); "
                            "use kernels=auto or kernels=none")
    # swiglu keeps liger's per-family default (on for Qwen2/2.5-VL, off for Qwen3-VL)
    patch(rope=True, rms_norm=True, cross_entropy=False, fused_linear_cross_entropy=False, model=base_model(model))
    fuse_rotary(model)
    base_model(model)._groundtune_fused_loss = True  # train/objective.py scores the answers with fused_answer_nll
    return True


# The answer tokens' loss through liger-kernel's fused linear cross-entropy: the LM head's product and
# the cross-entropy in chunks, so the logits of the answer tokens (tokens x 151,936, and their fp32
# copy, softmax and gradient) are never whole in memory, and the input's gradient is made in the
# forward pass. liger-kernel's patch would fuse transformers' loss over every position; ours runs on
# the answer tokens only (train/objective.py), so it calls the function itself.
FUSED_LOSS = True  # bench/sft_speed.py switches it off to measure what it gives


def fused_answer_nll(model, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
    """The summed negative log-likelihood of ``targets`` (tokens,) under ``hidden`` (tokens, width)
    projected by the LM head's ``weight``, through liger-kernel's fused kernel where
    ``apply_fused_kernels`` installed it on ``model`` and it can run here; else None (the caller
    computes it as before)."""
    if not (FUSED_LOSS and getattr(model, "_groundtune_fused_loss", False) and hidden.is_cuda and len(targets)):
        return None
    # the kernel reads the weight itself, outside the LM head's forward: where an engine shards it
    # (FSDP2's DTensor, ZeRO-3's empty partition, gathered only around that forward) it cannot
    if type(weight.data) is not torch.Tensor or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        return None
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    # the matmul in the autocast dtype, as the LM head computes it; the softmax in fp32 inside the kernel.
    # chunk_mem_const 16: liger's default cuts ~1,000 answer tokens into chunks of 16 rows (a thin
    # matmul each) to keep the transient logits near the hidden states' size; 16x that is chunks of
    # 256-512 rows, ~150-300 MB of logits at a time
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else weight.dtype
    return liger_fused_linear_cross_entropy(hidden.to(dtype), weight.to(dtype), targets, reduction="sum",
                                            chunk_mem_const=16)


# FP8 matmuls (fp8: true) for LoRA layers: the frozen base weight's two products of a step (the
# forward, recomputed or not, and the input's gradient) in float8 through torch._scaled_mm, with one
# scale a tensor (amax / the format's largest value, made fresh each call): e4m3 for activations and
# weights, e5m2 (more range) for gradients, as torchao's float8 training does. Not torchao's
# Float8Linear: it computes the weight's gradient too (for a frozen base, a third more matmul work
# thrown away) and that product needs a token count that is a multiple of 16, which a packed row is
# not. The adapters' small products stay in the input's dtype.
FP8_ACTIVATIONS, FP8_GRADIENTS = torch.float8_e4m3fn, torch.float8_e5m2


def _to_fp8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in float8 ``dtype`` and the fp32 scale that multiplies it back (``t`` ~ result x scale)."""
    largest = torch.finfo(dtype).max
    scale = t.abs().amax().float().clamp(min=1e-12) / largest
    return t.mul((1 / scale).to(t.dtype)).clamp_(-largest, largest).to(dtype), scale


def _fp8_forward(x2, weight, bias):
    (xq, xs), (wq, ws) = _to_fp8(x2, FP8_ACTIVATIONS), _to_fp8(weight, FP8_ACTIVATIONS)
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, bias=bias, out_dtype=x2.dtype)


def _fp8_input_grad(g, weight):
    (gq, gs), (wq, ws) = _to_fp8(g, FP8_GRADIENTS), _to_fp8(weight, FP8_ACTIVATIONS)
    # the second operand column-major, as the float8 matmul takes it: the weight transposed in memory
    return torch._scaled_mm(gq, wq.t().contiguous().t(), scale_a=gs, scale_b=ws, out_dtype=g.dtype)


FP8 = _BaseProducts(_fp8_forward, _fp8_input_grad)


def fp8_matmuls(model) -> int:
    """Put the base products of ``model``'s LoRA linear layers in float8 (those whose widths are
    multiples of 16, as float8 matmuls need; every projection of Qwen-VL's language model). Needs
    a GPU with FP8 matmuls (compute capability 8.9: Ada, Hopper and later). Returns the number of
    layers."""
    if not fp8_usable(model):
        raise TrainingError(f"fp8=true needs a GPU with FP8 matmuls (compute capability 8.9 or later: Ada, "
                            f"Hopper); this model is on {base_model(model).device}. Use fp8=false")
    fuse_lora_layers(model)  # the fused forward is where the float8 function runs
    count = 0
    for module in _lora_layers(model):
        base = module.base_layer
        if type(base) is torch.nn.Linear and base.in_features % 16 == 0 and base.out_features % 16 == 0:
            module._groundtune_fp8 = True
            count += 1
    return count


def fp8_usable(model) -> bool:
    """Whether float8 matmuls can run this model here: on a GPU of compute capability 8.9 or later."""
    device = base_model(model).device
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


# Rotary embeddings through liger-kernel's rope kernel. liger-kernel 0.8.5's patches for Qwen2-VL and
# Qwen2.5-VL replace apply_multimodal_rotary_pos_emb, transformers 4's name: transformers 5 merges the
# M-RoPE sections into cos/sin in its rotary module and rotates with apply_rotary_pos_emb, so the
# language model kept its unfused rotation (4 kernels a tensor: two products, a concatenation, a sum).
# And no patch fuses the vision tower's, which rotates in fp32 (casts, products, concatenations,
# sums, casts back): ~0.14 s of a 0.37 s vision pass over 64 photos on the 3B (H200, bf16).
FUSED_ROTARY = True  # bench/eval_speed.py switches it off to measure what it gives


def fuse_rotary(model) -> None:
    """liger-kernel's rope kernel for the rotation of the language model's attention (the family
    record's ``text_rotary`` in its modeling module, process-wide as liger-kernel's own patches)
    and of the vision attention our attention module installed (``_groundtune_rotary``, per
    layer). Each falls back to the function it replaces off the GPU, inside compiled code, or
    with FUSED_ROTARY off."""
    import importlib

    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    family = family_of(model)
    modeling = importlib.import_module(family.modeling_module)
    original = getattr(modeling, family.text_rotary)
    if getattr(original, "_groundtune_fused", None) is None and original is not liger_rotary_pos_emb:
        setattr(modeling, family.text_rotary, _fused_text_rotary(liger_rotary_pos_emb, original))
    for module in model.modules():
        rotary = getattr(module, "_groundtune_rotary", None)
        if rotary is not None and getattr(rotary, "_groundtune_fused", None) is None:
            module._groundtune_rotary = _fused_vision_rotary(liger_rotary_pos_emb, rotary)


def _fusable(q: torch.Tensor) -> bool:
    # inside torch.compile (compiled vision blocks) the original is traced and fused by inductor
    return FUSED_ROTARY and q.is_cuda and not torch.compiler.is_compiling()


def _fused_text_rotary(rope, original):
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (q, k: (batch, heads,
    length, dim); cos, sin: (batch, length, dim)) through ``rope``, liger's function of the same
    signature and layout."""
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not _fusable(q):
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    apply_rotary_pos_emb._groundtune_fused = original
    return apply_rotary_pos_emb


def _fused_vision_rotary(rope, original):
    """The vision attention's rotation, ``original(q, k, cos, sin)`` (q, k: (tokens, heads, dim);
    cos, sin: (tokens, dim), fp32), through ``rope`` (liger's layout: (1, heads, tokens, dim)).
    The kernel computes in cos's dtype and rounds once to q's: the original's arithmetic, which
    casts q and k to fp32 and their rotation back. It rotates a contiguous copy of q and k (ours
    are strided views of the qkv projection), in place."""
    def rotate(q, k, cos, sin):
        return rotate_vision_as_text(rope, q, k, cos, sin) if _fusable(q) else original(q, k, cos, sin)

    rotate._groundtune_fused = original
    return rotate


def rotate_vision_as_text(rope, q, k, cos, sin):
    """The vision layout (q, k: (tokens, heads, dim); cos, sin: (tokens, dim)) through ``rope``, a
    function of the text layout (``apply_rotary_pos_emb``: (1, heads, tokens, dim), (1, tokens, dim))."""
    q, k = rope(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), cos.float()[None], sin.float()[None])
    return q.transpose(1, 2)[0], k.transpose(1, 2)[0]


def compile_vision_blocks(model, backend: str = "inductor") -> int:
    """torch.compile every block of the vision tower, with dynamic shapes (patch counts vary from
    batch to batch): its norms and rotary embedding (computed in fp32, as transformers writes them),
    casts and residual adds fuse into a few kernels around the matmuls, which they outweighed in
    the prefill's profile. Returns the number of blocks compiled."""
    blocks = family_of(model).vision_block_list(model)
    for block in blocks:
        block.compile(dynamic=True, backend=backend)
    return len(blocks)


def compile_decoder_layers(model, backend: str = "inductor") -> int:
    """torch.compile every decoder layer of the language model, with dynamic shapes (sequence
    lengths vary from batch to batch). Returns the number of layers compiled."""
    layers = decoder_layers(model)
    for layer in layers:
        if getattr(layer, "_groundtune_checkpointed", False):
            # a recomputed layer: compile what the checkpoint runs, forward and recomputation alike,
            # and keep the checkpoint itself outside the compiled code
            layer._groundtune_inner = torch.compile(layer._groundtune_inner, dynamic=True, backend=backend)
        else:
            layer.compile(dynamic=True, backend=backend)
    return len(layers)
