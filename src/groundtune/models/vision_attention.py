"""The Qwen-VL vision tower's attention as one SDPA call per window LENGTH instead of one per window.

transformers runs the vision attention (Qwen2-VL, Qwen2.5-VL and Qwen3-VL alike) as one
``scaled_dot_product_attention`` call per image or per 112-pixel window unless flash-attention is
installed. A batch of 128 synthetic images is 512 kernel calls per layer pass and the step is
bound by launching them (bench/tiny_step_profile.py: the GPU busy ~10% of the step). Windows of
one length are independent attention problems of one shape, so they stack into one batched call:
a batch of equal images becomes one call per layer, and a batch of photos of different sizes a
handful (full windows plus the few edge-window lengths). No padding, no mask: the same arithmetic
as the per-window loop (tests/test_vision_attention.py checks outputs and gradients against it).

With flash-attention installed transformers already runs one variable-length kernel per layer, and
this replacement is not installed.
"""

from __future__ import annotations

import sys
import types
from collections import OrderedDict

import torch
import torch.nn.functional as F

# The vision attention classes of the three families: same fields (qkv, proj, num_heads,
# scaling), same forward signature, and a module-level apply_rotary_pos_emb_vision.
ATTENTION_CLASSES = ("Qwen2_5_VLVisionAttention", "VisionAttention", "Qwen3VLVisionAttention")


def install(model: torch.nn.Module) -> int:
    """Replace the forward of every vision attention layer of ``model``; returns how many."""
    config = getattr(model, "config", None)
    vision_config = getattr(config, "vision_config", None)
    if "flash" in str(getattr(vision_config, "_attn_implementation", "")):
        return 0
    count = 0
    for module in model.modules():
        if type(module).__name__ in ATTENTION_CLASSES and hasattr(module, "qkv"):
            module.forward = types.MethodType(grouped_forward, module)
            count += 1
    return count


def grouped_forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
    """Drop-in forward for a vision attention layer: (tokens, dim) -> (tokens, dim); tokens are the
    windows one after another, window i spanning cu_seqlens[i]:cu_seqlens[i+1]."""
    apply_rotary = sys.modules[type(self).__module__].apply_rotary_pos_emb_vision
    n = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    q, k = apply_rotary(q, k, cos, sin)
    out = torch.empty_like(q)  # (tokens, heads, head_dim)
    for index in _windows_by_length(cu_seqlens):  # (windows, length) token indices
        # (windows, length, heads, head_dim) -> (windows, heads, length, head_dim) for SDPA
        q_g, k_g, v_g = (t[index].transpose(1, 2) for t in (q, k, v))
        out[index] = F.scaled_dot_product_attention(q_g, k_g, v_g, scale=self.scaling).transpose(1, 2)
    return self.proj(out.reshape(n, -1))


_GROUPS: OrderedDict = OrderedDict()  # recent window layouts -> index tensors (2 per forward: full, windowed)


def _windows_by_length(cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    # One small device->host copy per layer, as in the loop this replaces (it calls .tolist() too).
    bounds = tuple(cu_seqlens.tolist())
    key = (bounds, cu_seqlens.device)
    if key not in _GROUPS:
        starts_by_length: dict[int, list[int]] = {}
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                starts_by_length.setdefault(end - start, []).append(start)
        # Made outside inference mode even during generation: cached, they are reused by training
        # steps, which cannot take inference tensors.
        with torch.inference_mode(False):
            _GROUPS[key] = [
                (torch.tensor(starts)[:, None] + torch.arange(length)).to(cu_seqlens.device)
                for length, starts in starts_by_length.items()
            ]
        if len(_GROUPS) > 8:
            _GROUPS.popitem(last=False)
    return _GROUPS[key]
