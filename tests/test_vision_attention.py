"""The vision attention replacement computes what transformers' per-window loop computes: same
outputs and same gradients, for windows of several lengths in one batch (Qwen2.5-VL windows,
Qwen2-VL and Qwen3-VL whole images)."""

import torch

from groundtune.models import qwen, vision_attention
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
    gm = load_model(any_family_model, device="cpu", dtype="fp32")  # load_model installs the grouped attention
    layers = [m for m in gm.model.modules() if type(m).__name__ in vision_attention.ATTENTION_CLASSES]
    assert layers and all("forward" in vars(m) for m in layers)  # installed on every vision layer
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
    groups = vision_attention._windows_by_length(cu)
    assert sorted(g.shape for g in groups) == [(2, 48), (3, 64)]
    covered = torch.cat([g.flatten() for g in groups]).sort().values
    assert torch.equal(covered, torch.arange(288))  # every token once, none twice
