"""groundtune's attention computes what transformers computes: the vision tower's replacement equals
transformers' per-window loop (outputs and gradients, windows of several lengths in one batch:
Qwen2.5-VL windows, Qwen2-VL and Qwen3-VL whole images); the language model's equals transformers'
SDPA on unpacked batches and keeps packed samples apart (test_objective.py: packed loss == padded).
On a GPU the variable-length flash kernel is checked against those exact paths."""

import pytest
import torch

from groundtune.models import attention, qwen, speedups
from groundtune.models.loading import load_model

SIZES = [(200, 100), (90, 180), (112, 112), (300, 60)]  # several window lengths, edge windows included


def _vision_inputs(gm):
    from PIL import Image

    encoded = []
    for i, size in enumerate(SIZES):
        image = Image.effect_noise(size, 40 + 10 * i).convert("RGB")
        resized, _ = qwen.resize_image(image, gm.resize)
        encoded.append(qwen.encode(gm.processor, resized, qwen.prompt_text(gm.processor, "x", gm.prompt)))
    batch = qwen.collate(encoded, gm.processor.pad_token_id)
    return batch["pixel_values"], batch["image_grid_thw"]


def _vision_output_and_grads(gm, pixels, grid):
    visual = gm.model.model.visual
    visual.zero_grad()
    out = visual(pixels, grid_thw=grid)
    out = out.pooler_output if hasattr(out, "pooler_output") else out
    out = torch.cat(list(out)) if isinstance(out, (list, tuple)) else out
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in visual.named_parameters() if p.grad is not None}


def test_grouped_attention_equals_the_per_window_loop(any_family_model):
    torch.manual_seed(0)
    gm = load_model(any_family_model, device="cpu", dtype="fp32")
    vision_attention = qwen.family(gm.family).vision_attention
    layers = [m for m in gm.model.modules() if type(m).__name__ == vision_attention]
    assert layers and not any("forward" in vars(m) for m in layers)  # loading installs nothing
    speedups.install(gm.model)
    assert all("forward" in vars(m) for m in layers)  # installed on every vision layer
    pixels, grid = _vision_inputs(gm)
    grouped, grouped_grads = _vision_output_and_grads(gm, pixels, grid)
    for m in layers:
        del m.forward  # back to transformers' own forward: one attention call per window
    looped, looped_grads = _vision_output_and_grads(gm, pixels, grid)
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-6)
    assert grouped_grads.keys() == looped_grads.keys() and grouped_grads
    for name in looped_grads:
        torch.testing.assert_close(grouped_grads[name], looped_grads[name], rtol=1e-4, atol=1e-6)


def test_windows_are_grouped_by_length():
    cu = torch.tensor([0, 64, 128, 176, 240, 288, 288])  # lengths 64, 64, 48, 64, 48 and an empty one
    groups = attention._windows_by_length(cu)
    assert sorted(g.shape for g in groups) == [(2, 48), (3, 64)]
    covered = torch.cat([g.flatten() for g in groups]).sort().values
    assert torch.equal(covered, torch.arange(288))  # every token once, none twice


def test_block_causal_mask_keeps_attention_within_each_sample():
    mask = attention._block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32), 5)[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [0, 0, 1, 0, 0],
                             [0, 0, 1, 1, 0],
                             [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_language_model_attention_is_ours_and_falls_back_to_sdpa(small_model):
    gm = load_model(small_model, device="cpu", dtype="fp32")
    assert gm.model.config.get_text_config()._attn_implementation == "sdpa"  # transformers' own until installed
    speedups.install(gm.model)
    assert gm.model.config.get_text_config()._attn_implementation == attention.TEXT_ATTENTION
    q, k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8)
    layer = next(m for n, m in gm.model.named_modules() if n.endswith("self_attn"))
    ours, _ = attention.text_attention(layer, q, k, v, None, scaling=0.3, is_causal=True)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    theirs, _ = sdpa_attention_forward(layer, q, k, v, None, scaling=0.3, is_causal=True)
    assert torch.equal(ours, theirs)


cuda_only = pytest.mark.skipif(not torch.cuda.is_available() or attention._varlen_kernel()[0] is None,
                               reason="the variable-length flash kernel runs on CUDA only (PyTorch >= 2.10)")


@cuda_only
def test_varlen_kernel_equals_the_fallbacks_on_the_gpu(small_model):
    """The GPU path (one variable-length flash call per layer) against the exact CPU-side paths,
    in bf16: vision windows of several lengths, and packed causal text with grouped key/value heads."""
    torch.manual_seed(0)
    cu = torch.tensor([0, 64, 128, 176, 240, 288], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(288, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    got = attention.varlen_attention(q, k, v, cu, 64, causal=False, scale=0.125)
    want = torch.empty_like(q)
    for index in attention._windows_by_length(cu):
        q_g, k_g, v_g = (t[index].transpose(1, 2) for t in (q, k, v))
        want[index] = torch.nn.functional.scaled_dot_product_attention(q_g, k_g, v_g, scale=0.125).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)

    layer = next(m for n, m in load_model(small_model, device="cuda").model.named_modules() if n.endswith("self_attn"))
    query = torch.randn(1, 2, 288, 64, device="cuda", dtype=torch.bfloat16)  # 2 query heads share 1 key/value head
    key, value = (torch.randn(1, 1, 288, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    got, _ = attention.text_attention(layer, query, key, value, None, scaling=0.088, cu_seq_lens_q=cu, max_length_q=64)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    want, _ = sdpa_attention_forward(layer, query, key, value, attention._block_causal_mask(cu, 288),
                                     scaling=0.088, is_causal=False)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def _shared_prefix_layout() -> attention.SharedPrefixes:
    # a row of: prompt A's 40 shared tokens, the rests of three prompts of A (5, 9, 1 tokens), a
    # prompt that shares nothing (30), B's 20 shared tokens, the rests of two prompts of B (7, 3)
    pieces = [(40, None), (5, 0), (9, 0), (1, 0), (30, None), (20, None), (7, 5), (3, 5)]
    queries, keys, key_bounds = [0], [], [0]
    for length, shares_with in pieces:
        start = queries[-1]
        prefix = list(range(queries[shares_with], queries[shares_with + 1])) if shares_with is not None else []
        queries.append(start + length)
        keys += prefix + list(range(start, start + length))
        key_bounds.append(len(keys))
    return attention.SharedPrefixes(queries, keys, key_bounds)


def test_shared_prefixes_attend_as_each_prompt_alone():
    """A prompt's rest, placed after other prompts' rests, attends to its shared beginning and then
    to itself exactly as the whole prompt alone would (causal SDPA over its own tokens)."""
    torch.manual_seed(0)
    layout = _shared_prefix_layout()
    query = torch.randn(1, 4, 115, 16)
    key, value = (torch.randn(1, 2, 115, 16) for _ in range(2))
    got, _ = layout.attend(0, query, key, value, scale=0.25)
    prompts = ([*range(0, 40), *range(45, 54)], [*range(0, 40), 54], [*range(55, 85)], [*range(85, 105), *range(112, 115)])
    for prompt in prompts:
        alone = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, prompt], key[:, :, prompt], value[:, :, prompt], is_causal=True, scale=0.25, enable_gqa=True)
        torch.testing.assert_close(got[0, prompt], alone[0].transpose(0, 1))


@cuda_only
def test_shared_prefixes_kernel_equals_the_fallback_on_the_gpu():
    """The flash kernel with more keys than queries aligns its causal mask to the END of a piece's
    keys (a prompt's rest sees all of its shared beginning), as the CPU fallback does."""
    torch.manual_seed(0)
    layout = _shared_prefix_layout()
    query = torch.randn(1, 4, 115, 64, dtype=torch.bfloat16)
    key, value = (torch.randn(1, 2, 115, 64, dtype=torch.bfloat16) for _ in range(2))
    want, _ = layout.attend(0, query.float(), key.float(), value.float(), scale=0.125)
    got, _ = layout.to("cuda").attend(0, query.cuda(), key.cuda(), value.cuda(), scale=0.125)
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2)


@cuda_only
def test_shared_prefixes_kernel_gradients_equal_the_fallbacks_on_the_gpu():
    """An RL update's row of answers sharing their prompt (qwen.collate_answers) trains through the
    kernel: its gradients reach the shared keys and values from every piece that reads them, as
    the CPU fallback's do."""
    torch.manual_seed(0)
    layout = _shared_prefix_layout()
    tensors = [torch.randn(1, 4, 115, 64), torch.randn(1, 2, 115, 64), torch.randn(1, 2, 115, 64)]
    weight = torch.randn(1, 115, 4, 64)

    def grads(device, dtype):
        q, k, v = (t.to(device, dtype).requires_grad_() for t in tensors)
        out, _ = layout.to(device).attend(0, q, k, v, scale=0.125)
        (out.float() * weight.to(device)).sum().backward()
        return [t.grad.float().cpu() for t in (q, k, v)]

    for got, want in zip(grads("cuda", torch.bfloat16), grads("cpu", torch.float32)):
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


@cuda_only
def test_packed_training_loss_equals_the_padded_loss_on_the_gpu(any_family_model):
    from groundtune.config import TrainConfig
    from groundtune.data import synth
    from groundtune.train.batches import encode_sample, to_device
    from groundtune.models import adapt
    from groundtune.train.objective import answer_loss

    gm = load_model(any_family_model, device="cuda", dtype="bf16")
    model = adapt.prepare_for_training(gm.model, TrainConfig(train_data="x", method="lora"))
    speedups.install(model)
    encoded = []
    for i, size in enumerate([(112, 112), (168, 84), (84, 140)]):
        image, record = synth.make_sample(4, i, width=size[0], height=size[1])
        encoded.append(encode_sample(gm.processor, gm.family, gm.resize, gm.prompt, image, record))
    padded = to_device(qwen.collate(encoded, gm.processor.pad_token_id), "cuda")
    packed = to_device(qwen.collate_packed(encoded), "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        torch.testing.assert_close(answer_loss(model, packed), answer_loss(model, padded), rtol=2e-2, atol=2e-2)
