"""Tiny randomly initialised Qwen2-VL and Qwen3-VL models saved as local Hugging Face folders:
only Qwen2.5-VL ships as a tiny model, and the other families must go through the same paths.
Each speaks the tiny model's tokenizer and has its family's own image processor settings (patch
14 -> resize factor 28 for Qwen2-VL, patch 16 -> factor 32 for Qwen3-VL)."""

from __future__ import annotations

import torch

from groundtune import boxes
from groundtune.models import qwen
from groundtune.models.tiny import TINY_DIR

FAMILIES = ("qwen2-vl", "qwen3-vl")
PATCH = {"qwen2-vl": 14, "qwen3-vl": 16}


def build_family_folder(family: str, out):
    """A tiny randomly initialised model of ``family`` saved as a local HF folder."""
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLImageProcessorPil, Qwen3VLConfig

    tokenizer = AutoTokenizer.from_pretrained(TINY_DIR)
    tid = tokenizer.convert_tokens_to_ids
    specials = dict(bos_token_id=tid("<|endoftext|>"), eos_token_id=tid("<|im_end|>"),
                    pad_token_id=tid("<|endoftext|>"))
    top = dict(image_token_id=tid("<|image_pad|>"), video_token_id=tid("<|video_pad|>"),
               vision_start_token_id=tid("<|vision_start|>"), vision_end_token_id=tid("<|vision_end|>"),
               tie_word_embeddings=True)
    text = dict(vocab_size=max(len(tokenizer), 512), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                tie_word_embeddings=True, **specials)
    if family == "qwen2-vl":
        # head_dim = 64 / 2 = 32: mrope_section sums to head_dim / 2
        rope = {"rope_type": "default", "rope_theta": 20.0, "mrope_section": [4, 6, 6]}
        config = Qwen2VLConfig(
            text_config=dict(text, rope_parameters=rope),
            vision_config=dict(depth=1, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
            **top,
        )
    else:
        # Qwen3-VL: explicit head_dim, interleaved M-RoPE (like the real [24, 20, 20] of 64),
        # learned vision position embeddings, and DeepStack features from vision layer 0.
        rope = {"rope_type": "default", "rope_theta": 20.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True}
        config = Qwen3VLConfig(
            text_config=dict(text, head_dim=32, rope_parameters=rope),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                               num_position_embeddings=64, deepstack_visual_indexes=[0]),
            **top,
        )
    torch.manual_seed(0)
    model = qwen.model_class(family)._from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(patch_size=PATCH[family], merge_size=2, temporal_patch_size=2,
                             min_pixels=boxes.MIN_PIXELS, max_pixels=224 * 224).save_pretrained(out)
    return out
