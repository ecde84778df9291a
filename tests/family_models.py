"""Small randomly initialised Qwen-VL models saved as local Hugging Face folders. Qwen2-VL and
Qwen3-VL: only Qwen2.5-VL ships as a tiny model, and the other families must go through the same
paths. Qwen2.5-VL: ``build_small_model``, the built-in tiny model's tokenizer, image processor and
prompt around far fewer weights, for every test whose assertions do not depend on what the model
learnt (the built-in model is pre-trained to show the task and costs a CPU more per step).
Each speaks the tiny model's tokenizer, is built by its family record's config builder, and has
its family's own image processor settings (patch 14 -> resize factor 28 for Qwen2-VL, patch 16 ->
factor 32 for Qwen3-VL) with a small pixel budget of its own in preprocessor_config.json."""

from __future__ import annotations

import shutil

import torch

from groundtune.models import qwen
from groundtune.models.loading import TINY_DIR, load_processor, read_metadata, write_metadata

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


def build_small_model(out):
    """A small randomly initialised Qwen2.5-VL saved as a local HF folder that speaks and sees as the
    built-in tiny model does (its tokenizer, chat template, image processor and groundtune.json: the
    same prompt, pixel budget and box convention), with a 64-wide, 2-layer language model and a
    2-layer vision tower."""
    record = qwen.family("qwen2.5-vl")
    processor = load_processor(TINY_DIR)
    # head_dim 32: mrope_section sums to head_dim / 2
    text = dict(vocab_size=max(len(processor.tokenizer), 512), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 300.0, "mrope_section": [4, 6, 6]})
    # layer 0 attends within windows, layer 1 across the image: both of Qwen2.5-VL's attentions
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[1], window_size=112, temporal_patch_size=2)
    config = record.build_config(processor.config_token_ids(), text, vision, tie_word_embeddings=True)
    torch.manual_seed(0)
    record.transformers_class()._from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"):
        shutil.copy(TINY_DIR / name, out)
    # the tiny model's prompt and pixel budget; it is no fine-tune of the tiny model, so no base_model
    write_metadata(out, {key: value for key, value in read_metadata(TINY_DIR).items() if key != "base_model"})
    return out


def build_loud_model(small, out):
    """``small`` (a build_small_model folder) copied to ``out`` with large random weights (each
    matrix ~N(0, 1/fan_in)): answers that differ from one input to the next, where the small
    model's own small random weights write the same newlines whatever they see. An answer equal
    to another code path's then shows that the right image and phrase were read, and a mix-up
    between the rows of a batch shows."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(small, out, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(1)
    weights = {name: (torch.randn(w.shape, generator=g) / w.shape[-1] ** 0.5).to(w.dtype) if w.dim() >= 2 else w
               for name, w in load_file(out / "model.safetensors").items()}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out
