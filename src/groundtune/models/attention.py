"""Attention without padding or per-window loops, for the vision tower and the language model.

Both parts of a Qwen-VL model attend within variable-length pieces of one long row of tokens: the
vision tower within each image or 112-pixel window, the language model (in a packed training batch,
``packing=true``) within each sample. Without flash-attention installed, transformers runs the
first as one ``scaled_dot_product_attention`` call per window (a batch of 32 photos: ~800 calls per
layer, the step bound by launching them) and the second as SDPA over the whole row with a dense
block-diagonal mask, whose cost grows with the square of the row (a row of 32 samples of the 3B:
almost as many FLOPs as all the layer's linear maps, nearly all of them on masked-out pairs).

Here both run as ONE variable-length flash-attention call per layer where PyTorch has one
(``torch.nn.attention.varlen``, CUDA, bf16/fp16): each piece attends to itself only, nothing is
padded or masked, and the arithmetic is that of the per-piece loop. Elsewhere (CPU, fp32, older
PyTorch) the same results come from exact fallbacks: the vision windows batched into one SDPA call
per window LENGTH, the packed row through SDPA with its block-diagonal causal mask.
tests/test_attention.py checks both fallbacks against transformers' own computation and, on a
GPU, the kernel against the fallbacks; bench/sft_speed.py shows equal first losses on the 3B/7B.

The language model's attention is registered with transformers as ``groundtune`` (its
AttentionInterface). A batch that carries ``cu_seq_lens_q`` (qwen.collate_packed: the names
transformers' flash-attention path reads) is attended per sample; while the generation engine
runs the model (``attached``, models/engine.py) its own KV cache is read and written; any other
batch (padded training, transformers' ``generate``) goes to transformers' own SDPA function with the
SDPA mask, unchanged. With flash-attention installed and selected, transformers' own paths already do all of
this and nothing is replaced.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
from collections import OrderedDict

import torch
import torch.nn.functional as F


@functools.cache
def _varlen_kernel() -> tuple:
    """(PyTorch's variable-length flash kernel or None before 2.10, its parameters). Imported on
    first use, on a GPU: its module imports torch._dynamo, ~1.3 s of a 2-core machine that a
    command loading no model (a refusal, `data`, `plan`) would otherwise pay at start (loading a
    model, transformers imports torch._dynamo itself)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # PyTorch < 2.10
        return None, {}
    return varlen_attn, inspect.signature(varlen_attn).parameters


TEXT_ATTENTION = "groundtune"  # the name our language-model attention is registered under
VARLEN_ENABLED = True  # the benchmarks switch the kernel off to measure what it gives (bench/step_ladder.py)
_attached_cache = None  # the generation engine's KV cache while it runs the model (``attached``)


def install(model: torch.nn.Module, family) -> int:
    """Use this module's attention in ``model``'s vision tower and language model; returns how many
    vision layers were replaced. ``family`` is the model's ``qwen.Family``: the vision attention
    class of each family has the same fields (qkv, proj, num_heads, scaling), the same forward
    signature, and its modeling module a ``family.vision_rotary`` function (models/speedups.py
    checks all of it before anything is replaced)."""
    config = model.config
    text_config = config.get_text_config()
    if "flash" not in str(text_config._attn_implementation):
        _register_text_attention()
        text_config._attn_implementation = TEXT_ATTENTION
    vision_config = getattr(config, "vision_config", None)
    if "flash" in str(getattr(vision_config, "_attn_implementation", "")):
        return 0
    count = 0
    for module in model.modules():
        if type(module).__name__ == family.vision_attention and not getattr(module, "_groundtune_varlen", False):
            module._groundtune_rotary = getattr(sys.modules[type(module).__module__], family.vision_rotary)
            module.forward = types.MethodType(vision_forward, module)
            module._groundtune_varlen = True
            count += 1
    return count


def keeps_packed_samples_apart(model) -> bool:
    """Whether ``model``'s language model attends within each sample of a packed row: this module's
    attention (``install``) or transformers' flash-attention, which read ``cu_seq_lens_q``. Its
    SDPA and eager paths do not: they would attend across the samples of the row, silently."""
    implementation = str(model.config.get_text_config()._attn_implementation)
    return implementation == TEXT_ATTENTION or "flash" in implementation


def varlen_usable(t: torch.Tensor) -> bool:
    """Whether the variable-length flash kernel can take ``t`` (q, k or v) here."""
    return (VARLEN_ENABLED and t.is_cuda and t.dtype in (torch.float16, torch.bfloat16)
            and _varlen_kernel()[0] is not None)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                     causal: bool, scale: float, cu_seqlens_k: torch.Tensor | None = None,
                     max_len_k: int | None = None) -> torch.Tensor:
    """q (tokens, heads, dim), k/v (tokens, kv_heads, dim), the pieces one after another as
    ``cu_seqlens`` (int32, starts and the end) says -> (tokens, heads, dim): attention within each
    piece. ``cu_seqlens_k``/``max_len_k``: the keys' pieces where they differ from the queries'
    (a piece with more keys than queries: its queries are the LAST ones, causal masking aligned
    to the end, as flash-attention aligns it). Written against the two signatures PyTorch has had
    (2.10: ``is_causal``; 2.11 on: ``window_size``) and with or without ``enable_gqa``."""
    varlen_attn, parameters = _varlen_kernel()
    extra = {}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in parameters:
            extra["enable_gqa"] = True
        else:  # each key/value head serves a block of consecutive query heads (transformers' repeat_kv)
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if causal:
        extra.update({"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True})
    cu_seqlens = cu_seqlens.to(torch.int32)
    cu_seqlens_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k.to(torch.int32)
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens_k, max_len, max_len if max_len_k is None else max_len_k,
                        scale=scale, **extra)


# --------------------------------------------------------------------------------------------
# vision tower


def vision_forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
    """Drop-in forward for a vision attention layer: (tokens, dim) -> (tokens, dim); tokens are the
    windows one after another, window i spanning cu_seqlens[i]:cu_seqlens[i+1]."""
    apply_rotary = self._groundtune_rotary  # the family's own function (install found it)
    n = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    q, k = apply_rotary(q, k, cos, sin)
    if varlen_usable(q):
        out = varlen_attention(q, k, v, cu_seqlens, _longest_piece(cu_seqlens), causal=False, scale=self.scaling)
    else:
        out = torch.empty_like(q)  # (tokens, heads, head_dim)
        for index in _windows_by_length(cu_seqlens):  # (windows, length) token indices
            # (windows, length, heads, head_dim) -> (windows, heads, length, head_dim) for SDPA
            q_g, k_g, v_g = (t[index].transpose(1, 2) for t in (q, k, v))
            out[index] = F.scaled_dot_product_attention(q_g, k_g, v_g, scale=self.scaling).transpose(1, 2)
    return self.proj(out.reshape(n, -1))


def _longest_piece(cu_seqlens: torch.Tensor) -> int:
    # The kernel sizes its grid by the longest piece, so it must be exact, which costs a device->host
    # copy. The vision tower passes the same two tensors (windows, whole images) to all its layers:
    # the answer is kept on the tensor, one copy per tensor instead of one per layer.
    longest = getattr(cu_seqlens, "_groundtune_longest", None)
    if longest is None:
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        cu_seqlens._groundtune_longest = longest
    return longest


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


# --------------------------------------------------------------------------------------------
# language model


def text_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                   cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None, **kwargs):
    """transformers' attention-function signature: query (batch, heads, length, dim), key/value
    (batch, kv_heads, length, dim) -> ((batch, length, heads, dim), None). A packed row (batch 1,
    ``cu_seq_lens_q`` given) is attended causally within each sample; anything else is
    transformers' SDPA attention, unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("cu_seq_lens_k", None)  # training rows attend to themselves: the same as _q
    kwargs.pop("max_length_k", None)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if _attached_cache is not None:  # generation (models/engine.py): its cache, in place of transformers'
        return _attached_cache.attend(module.layer_idx, query, key, value, scale, cu_seq_lens_q, max_length_q)
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"a packed batch is one row; got {query.shape[0]} rows with cu_seq_lens_q")
    if varlen_usable(query) and dropout == 0.0:
        return packed_attention(query, key, value, cu_seq_lens_q, max_length_q, scale), None
    return sdpa_attention_forward(module, query, key, value, _block_causal_mask(cu_seq_lens_q, query.shape[2]),
                                  dropout=dropout, scaling=scaling, is_causal=False, **kwargs)


def packed_attention(query, key, value, cu_seqlens: torch.Tensor, max_length: int, scale: float) -> torch.Tensor:
    """One packed row, query (1, heads, tokens, dim), key/value (1, kv_heads, tokens, dim) ->
    (1, tokens, heads, dim): causal attention within each sample. Without the variable-length
    kernel (CPU, fp32), one SDPA call per sample: a block-diagonal mask over a row of 64 prompts
    would cost 64x the arithmetic of the samples, and the row squared in memory."""
    if varlen_usable(query):
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, dim)
        return varlen_attention(q, k, v, cu_seqlens, int(max_length), causal=True, scale=scale)[None]
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        piece = slice(start, end)
        out[:, :, piece] = F.scaled_dot_product_attention(
            query[:, :, piece], key[:, :, piece], value[:, :, piece], is_causal=True, scale=scale,
            enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2)


class SharedPrefixes:
    """The attention of a packed row in which prompts that begin alike share those tokens: the
    phrases asked of one image (``qwen.collate_shared``). The row is a run of pieces; each piece
    attends causally to its keys, which are the row positions ``key_index[key_bounds[i]:
    key_bounds[i + 1]]``: a prompt's shared beginning, or a whole prompt, to itself; the rest of
    a prompt that shares its beginning, to that beginning and then itself. Each prompt gets the
    attention it would get alone; the shared tokens (an image's hundreds) are computed once.
    Attached for one forward pass (``attached``), in place of ``cu_seq_lens_q``."""

    def __init__(self, query_bounds: list[int], key_index: list[int], key_bounds: list[int]):
        self.shares = key_bounds != query_bounds  # else each piece attends to itself: a plain packed row
        self.query_bounds, self.key_bounds = torch.tensor(query_bounds), torch.tensor(key_bounds)
        self.key_index = torch.tensor(key_index) if self.shares else None  # (a plain row needs none)
        self.longest_query = max(b - a for a, b in zip(query_bounds[:-1], query_bounds[1:]))
        self.longest_key = max(b - a for a, b in zip(key_bounds[:-1], key_bounds[1:]))

    def to(self, device) -> "SharedPrefixes":
        self.query_bounds, self.key_bounds = self.query_bounds.to(device), self.key_bounds.to(device)
        if self.key_index is not None:
            self.key_index = self.key_index.to(device)
        return self

    def attend(self, layer: int, query, key, value, scale: float, cu_seqlens=None, max_length=None):
        """As ``text_attention``: query (1, heads, tokens, dim), key/value (1, kv_heads, tokens, dim)
        -> ((1, tokens, heads, dim), None)."""
        if not self.shares:
            return packed_attention(query, key, value, self.query_bounds, self.longest_query, scale), None
        if varlen_usable(query):
            q = query[0].transpose(0, 1)  # (tokens, heads, dim)
            k, v = (t[0].transpose(0, 1)[self.key_index] for t in (key, value))
            out = varlen_attention(q, k, v, self.query_bounds, self.longest_query, causal=True, scale=scale,
                                   cu_seqlens_k=self.key_bounds, max_len_k=self.longest_key)
            return out[None], None
        out = torch.empty_like(query)  # CPU, fp32: one SDPA call per piece, its mask aligned to the end
        queries, keys = self.query_bounds.tolist(), self.key_bounds.tolist()
        for i in range(len(queries) - 1):
            piece = slice(queries[i], queries[i + 1])
            index = self.key_index[keys[i]:keys[i + 1]]
            n_query, n_key = queries[i + 1] - queries[i], keys[i + 1] - keys[i]
            mask = torch.ones(n_query, n_key, dtype=torch.bool, device=query.device).tril(diagonal=n_key - n_query)
            out[:, :, piece] = F.scaled_dot_product_attention(
                query[:, :, piece], key[:, :, index], value[:, :, index], attn_mask=mask, scale=scale,
                enable_gqa=key.shape[1] != query.shape[1])
        return out.transpose(1, 2), None


def shares_prefixes(model) -> bool:
    """Whether ``model``'s language model runs this module's attention, which can attend a row
    of prompts that share their beginnings (``SharedPrefixes``)."""
    return str(model.config.get_text_config()._attn_implementation) == TEXT_ATTENTION


@contextlib.contextmanager
def attached(cache):
    """Our language-model attention goes to ``cache.attend`` while the engine runs the model
    (``models.engine.KVCache``, read and written instead of transformers' cache objects) or for
    one forward pass over prompts that share their beginnings (``SharedPrefixes``: inference's
    phrases of one image, an RL update's answers to one prompt)."""
    global _attached_cache
    previous, _attached_cache = _attached_cache, cache
    try:
        yield cache
    finally:
        _attached_cache = previous


def recompute_contexts():
    """``torch.utils.checkpoint``'s ``context_fn`` for a recomputed layer: the backward pass
    recomputes it after ``attached`` has ended, so whatever the forward saw attached (a row of RL
    answers that share their prompts, ``SharedPrefixes``) is attached again for the recomputation."""
    return contextlib.nullcontext(), attached(_attached_cache)


def _block_causal_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """(1, 1, length, length) bool: token i sees token j when both are in one sample and j <= i.
    Every layer gets the batch's same ``cu_seqlens`` tensor: the mask is kept on it, made once."""
    mask = getattr(cu_seqlens, "_groundtune_mask", None)
    if mask is None or mask.shape[-1] != length:
        sample = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=cu_seqlens.device),
                                         (cu_seqlens[1:] - cu_seqlens[:-1]).long(), output_size=length)
        same = sample[:, None] == sample[None, :]
        mask = (same & torch.ones(length, length, dtype=torch.bool, device=cu_seqlens.device).tril())[None, None]
        cu_seqlens._groundtune_mask = mask
    return mask


def _register_text_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(TEXT_ATTENTION, text_attention)
    AttentionMaskInterface.register(TEXT_ATTENTION, sdpa_mask)  # unpacked batches get SDPA's mask, as before
