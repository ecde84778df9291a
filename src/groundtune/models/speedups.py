"""Every speed-up that replaces part of transformers' or peft's code, installed by ONE explicit call
on a model (nothing is patched when a groundtune module is imported or a model is loaded):

    speedups.install(model, "auto", compile=compile, compile_layers=False)  # eval, predict, serve
    speedups.install(model, cfg.kernels, compile=cfg.compile)               # training, after LoRA is added

What it installs (each tested equal to the library's own computation):
- models/attention.py: the vision tower's attention as one variable-length call per layer, and the
  language model's attention within each sample of a packed row;
- models/kernels.py: the vision MLP at an aligned width (the families that need it), LoRA layers
  as one fused function, and optionally liger-kernel's fused kernels and torch.compile.

These replace the forward of classes transformers defines, so they depend on those classes' names,
fields and signatures. ``install`` refuses a transformers version outside TESTED_TRANSFORMERS, and
checks that each class it replaces is where and as the family record says, so a renamed class or a
changed signature stops here with a message instead of silently computing something else.
"""

from __future__ import annotations

import importlib
import inspect

from groundtune.errors import UnsupportedVersionError
from groundtune.models import attention, kernels
from groundtune.models.qwen import family_of

# transformers versions the speed-ups are tested on: >= the first, < the second (5.17 on the GPU
# machine the benchmarks run on, the newest 5.x release on the CPU machines the tests run on)
TESTED_TRANSFORMERS = ("5.17", "6")
# the arguments our vision attention forward takes from the families' vision blocks
VISION_ATTENTION_ARGS = ("hidden_states", "cu_seqlens", "position_embeddings")


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers version the speed-ups were not tested on, saying what to install."""
    from packaging.version import Version

    import transformers

    version = version or transformers.__version__
    low, high = TESTED_TRANSFORMERS
    if not Version(low) <= Version(version) < Version(high):
        raise UnsupportedVersionError(
            f"transformers {version}: groundtune replaces parts of transformers' Qwen-VL code and is tested "
            f"on transformers >= {low}, < {high}; install one of those: pip install 'transformers>={low},<{high}'")


def check_family_code(family) -> None:
    """Check that the classes and function ``family``'s speed-ups replace or call exist in its
    modeling module, with the signature our replacements assume."""
    try:
        module = importlib.import_module(family.modeling_module)
    except ImportError as e:
        raise UnsupportedVersionError(f"{family.name}: transformers has no {family.modeling_module} ({e})") from None
    missing = [name for name in (family.vision_attention, family.vision_rotary, family.text_rotary,
                                 family.padded_vision_mlp)
               if name is not None and not hasattr(module, name)]
    if missing:
        raise UnsupportedVersionError(f"{family.name}: {family.modeling_module} has no {', '.join(missing)}; "
                                      "this transformers release renamed what groundtune's speed-ups replace")
    params = inspect.signature(getattr(module, family.vision_attention).forward).parameters
    if not all(arg in params for arg in VISION_ATTENTION_ARGS):
        raise UnsupportedVersionError(
            f"{family.name}: {family.vision_attention}.forward{inspect.signature(getattr(module, family.vision_attention).forward)} "
            f"no longer takes {', '.join(VISION_ATTENTION_ARGS)}; groundtune's vision attention cannot replace it")


def install(model, kernels_mode: str = "none", compile: bool = False, compile_layers: bool = True,
            say=None, fp8: bool = False) -> dict[str, int]:
    """Install the speed-ups on ``model`` (a Qwen-VL model, or the PEFT model to train); returns
    how many layers each replaced. ``kernels_mode``/``compile``: the training settings of the
    same names: ``compile`` compiles the vision blocks, and the decoder layers where liger-kernel
    does not run and ``compile_layers`` (generation keeps them as they are: its decode step
    attends through the engine's cache by layer index, which compiled layers would recompile
    for). ``fp8``: the training setting (LoRA layers' frozen base products in float8). ``say``
    reports the optional ones (liger-kernel, compile, fp8) when given."""
    check_transformers()
    family = family_of(model)
    check_family_code(family)
    counts = {
        "vision_attention": attention.install(model, family),
        "padded_vision_mlp": kernels.pad_vision_mlp(model, family.padded_vision_mlp),
        "fused_lora": kernels.fuse_lora_layers(model),
    }
    fused = kernels.apply_fused_kernels(model, kernels_mode)
    if fused and say is not None:
        say("kernels: liger-kernel's fused RMSNorm, SwiGLU and rotary embeddings (vision tower and language model)")
    if fp8:  # before compiling: compiled layers trace the float8 casts with the rest
        counts["fp8_layers"] = kernels.fp8_matmuls(model)
        if say is not None:
            say(f"kernels: {counts['fp8_layers']} LoRA layers with their base products in float8")
    if compile:
        counts["compiled_vision_blocks"] = kernels.compile_vision_blocks(model)
        # liger-kernel 0.8.5's Triton kernels do not build inside torch 2.11's compile: where they run,
        # they fuse the language model's elementwise work, and its layers stay uncompiled
        if compile_layers and not fused:
            counts["compiled_layers"] = kernels.compile_decoder_layers(model)
        if say is not None:
            say(f"kernels: {counts['compiled_vision_blocks']} vision blocks"
                + (f" and {counts['compiled_layers']} decoder layers" if "compiled_layers" in counts else "")
                + " compiled (the first steps are slower)")
    return counts
