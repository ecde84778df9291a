"""Tiny randomly initialised Qwen2-VL and Qwen3-VL models saved as local Hugging Face folders:
only Qwen2.5-VL ships as a tiny model, and the other families must go through the same paths.
Each speaks the tiny model's tokenizer, is built by its family record's config builder, and has
its family's own image processor settings (patch 14 -> resize factor 28 for Qwen2-VL, patch 16 ->
factor 32 for Qwen3-VL) with a small pixel budget of its own in preprocessor_config.json."""

from __future__ import annotations

import torch

from groundtune.models import qwen
from groundtune.models.loading import TINY_DIR, load_processor

FAMILIES = ("qwen2-vl", "qwen3-vl")
PATCH = {"qwen2-vl": 14, "qwen3-vl": 16}
# the budget each test folder's preprocessor_config.json sets (not the family's shipped one)
MIN_PIXELS, MAX_PIXELS = 3136, 224 * 224


def build_family_folder(family: str, out):
    """A tiny randomly initialised model of ``family`` saved as a local HF folder."""
    from transformers import Qwen2VLImageProcessorPil

    record = qwen.family(family)
    processor = load_processor(TINY_DIR)
    text = dict(vocab_size=max(len(processor.tokenizer), 512), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
    if family == "qwen2-vl":
        # head_dim = 64 / 2 = 32: mrope_section sums to head_dim / 2
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 20.0, "mrope_section": [4, 6, 6]}
        vision = dict(depth=1, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, temporal_patch_size=2)
    else:
        # Qwen3-VL: explicit head_dim, interleaved M-RoPE (like the real [24, 20, 20] of 64),
        # learned vision position embeddings, and DeepStack features from vision layer 0.
        text.update(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 20.0,
                                                  "mrope_section": [6, 5, 5], "mrope_interleaved": True})
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      temporal_patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=[0])
    config = record.build_config(processor.config_token_ids(), text, vision, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = record.transformers_class()._from_config(config)
    model.save_pretrained(out)
    processor.tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(patch_size=PATCH[family], merge_size=2, temporal_patch_size=2,
                             min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(out)
    return out
