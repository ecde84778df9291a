"""Optional speed-ups of the training step that leave its results unchanged: liger-kernel's fused
RMSNorm, SwiGLU and M-RoPE kernels, and torch.compile of the language model's decoder layers.

On one GPU the step of a Qwen-VL model with LoRA is launch-bound: thousands of small kernels, the
GPU idle between them (field-notes, "Speed"; BENCHMARKS.md). Fused kernels and compiled layers cut
the number of launches. Both are settings of ``groundtune train``:

    kernels: none | liger | auto   # auto: liger-kernel when it is installed and the model is on a GPU
    compile: false | true          # torch.compile each decoder layer (the first steps are slower)

liger-kernel is an extra (``pip install 'groundtune[gpu]'``): its kernels are Triton, GPU only.
Without it, or on CPU, ``kernels=auto`` leaves transformers' modules as they are. The default is
``none`` until the GPU benchmark (bench/sft_speed.py --ladder) has measured both on every family.
"""

from __future__ import annotations

from groundtune.config import KERNEL_MODES
from groundtune.models.adapt import base_model, decoder_layers


def _liger_patch(model):
    """liger-kernel's patch for this model's family, or None (not installed, or no such patch)."""
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        return None
    # qwen2_vl, qwen2_5_vl, qwen3_vl: liger names its patches after the model type
    return getattr(liger, f"apply_liger_kernel_to_{base_model(model).config.model_type}", None)


def liger_usable(model) -> bool:
    """Whether liger-kernel can run this model here: installed, with a patch for its family, on a GPU."""
    return _liger_patch(model) is not None and base_model(model).device.type == "cuda"


def apply_fused_kernels(model, mode: str) -> bool:
    """Swap in liger-kernel's RMSNorm, SwiGLU and M-RoPE for the model's own (``mode`` of
    KERNEL_MODES: ``auto`` where usable, ``liger`` or an error saying what is missing). Returns
    whether it did. The loss stays groundtune's (``train/objective.py``: the LM head runs on the
    answer tokens only, so there are no full-sequence logits left to fuse). liger-kernel patches
    transformers' modeling module as well as this model: models built later in the same process
    get its kernels too (one training run per process is what `groundtune train` does)."""
    assert mode in KERNEL_MODES, mode  # TrainConfig checks it
    if mode == "none" or (mode == "auto" and not liger_usable(model)):
        return False
    patch = _liger_patch(model)
    if patch is None:
        raise ImportError(f"kernels=liger needs liger-kernel with kernels for {base_model(model).config.model_type}: "
                          "pip install 'groundtune[gpu]' (or kernels=auto to use it only where it can run)")
    if base_model(model).device.type != "cuda":
        raise ValueError("kernels=liger needs the model on a CUDA GPU (liger-kernel is Triton); "
                         "use kernels=auto or kernels=none")
    # swiglu keeps liger's per-family default (on for Qwen2/2.5-VL, off for Qwen3-VL)
    patch(rope=True, rms_norm=True, cross_entropy=False, fused_linear_cross_entropy=False, model=base_model(model))
    return True


def compile_decoder_layers(model, backend: str = "inductor") -> int:
    """torch.compile every decoder layer of the language model, with dynamic shapes (sequence
    lengths vary from batch to batch). Returns the number of layers compiled."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True, backend=backend)
    return len(layers)


def apply_settings(model, cfg) -> None:
    """The ``kernels`` and ``compile`` settings of a training run, said on the way."""
    if apply_fused_kernels(model, cfg.kernels):
        print("kernels: liger-kernel's fused RMSNorm, SwiGLU and M-RoPE")
    if cfg.compile:
        print(f"kernels: {compile_decoder_layers(model)} decoder layers compiled (the first steps are slower)")
