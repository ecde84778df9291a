"""Qwen2-VL and Qwen3-VL go through the same public path as the shipped tiny Qwen2.5-VL: loading,
training targets, LoRA training, saving, loading back and parsing answers.

Only Qwen2.5-VL ships as a tiny model, so each test session builds a local Hugging Face folder per
family (tests/family_models.py, fixture ``family_folder`` in conftest.py).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from family_models import MAX_PIXELS, MIN_PIXELS, PATCH
from PIL import Image

from groundtune import boxes, families, infer
from groundtune.config import TrainConfig
from groundtune.data import synth
from groundtune.models import qwen
from groundtune.models.loading import load_model
from groundtune.train.batches import encode_sample
from groundtune.train.sft import train

FACTOR = {"qwen2-vl": 28, "qwen3-vl": 32}

# A non-square image and a box on it, in ORIGINAL pixels, and the same box in 0-1000.
SIZE = (200, 100)  # (width, height)
BOX = [20.0, 30.0, 120.0, 80.0]
BOX_1000 = [100, 300, 600, 800]
PHRASE = "the red circle"
# The answer each family writes for BOX, by hand (not through groundtune.boxes).
ANSWER = {
    "qwen2-vl": "<|object_ref_start|>the red circle<|object_ref_end|><|box_start|>(100,300),(600,800)<|box_end|>",
    "qwen3-vl": '[{"bbox_2d": [100, 300, 600, 800], "label": "the red circle"}]',
}


@pytest.fixture(scope="session")
def synth_small(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth_families")
    synth.make_synthetic_set(out, n=8, seed=3, task="single", workers=1)
    return out


def _image() -> Image.Image:
    image = Image.new("RGB", SIZE, "white")
    image.paste(Image.new("RGB", (100, 50), "red"), (20, 30))
    return image


def test_load_reports_family_and_resize(family_folder):
    family, folder = family_folder
    gm = load_model(str(folder), device="cpu")
    assert gm.family == family and qwen.family_of(gm.model) is qwen.family(family)
    # no groundtune.json: the budget of the folder's own preprocessor_config.json, at the family's factor
    assert gm.resize == boxes.ResizeSpec(FACTOR[family], MIN_PIXELS, MAX_PIXELS)
    assert gm.resize_source == "preprocessor_config.json"
    assert type(gm.model).__name__ == qwen.family(family).model_class
    assert gm.processor.image_processor.patch_size == PATCH[family]
    assert sum(p.numel() for p in gm.model.parameters()) < 1_000_000


def test_training_target_is_the_family_convention(family_folder):
    family, folder = family_folder
    gm = load_model(str(folder), device="cpu")
    sample = {"phrase": PHRASE, "bbox": BOX, "width": SIZE[0], "height": SIZE[1]}
    enc = encode_sample(gm.processor, gm.family, gm.resize, gm.prompt, _image(), sample)

    labelled = enc["labels"] != qwen.IGNORE_INDEX
    tok = gm.processor.tokenizer
    answer = tok.decode(enc["input_ids"][labelled])
    assert answer == ANSWER[family] + "<|im_end|>\n"
    if family == "qwen2-vl":  # the markers are single special tokens, not text spelled in pieces
        markers = ["<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>"]
        assert [t for t in enc["labels"][labelled].tolist() if t in map(gm.processor.token_id, markers)] == [
            gm.processor.token_id(m) for m in markers]
    else:
        assert json.loads(answer.removesuffix("<|im_end|>\n")) == [{"bbox_2d": BOX_1000, "label": PHRASE}]
    # the mask covers exactly the answer: the last n tokens, nothing before them
    n = int(labelled.sum())
    assert labelled[-n:].all() and not labelled[:-n].any()
    assert torch.equal(enc["labels"][labelled], enc["input_ids"][labelled])
    # the image is cut with the family's patch: 200x100 -> 196x112 (factor 28) or 192x96 (factor 32)
    rw, rh = gm.resize.resized_size(SIZE)
    assert (rw % FACTOR[family], rh % FACTOR[family]) == (0, 0)
    assert enc["image_grid_thw"].tolist() == [[1, rh // PATCH[family], rw // PATCH[family]]]
    image_tokens = enc["input_ids"] == gm.processor.image_token_id
    assert int(image_tokens.sum()) == int(enc["image_grid_thw"].prod()) // 4
    assert torch.equal(enc["mm_token_type_ids"].bool(), image_tokens)
    assert not (labelled & image_tokens).any()
    # M-RoPE sees the image as a grid: its tokens get (row, column) positions of the merged patches
    batch = qwen.collate([enc], gm.processor.pad_token_id)
    positions, _ = gm.model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                                 batch["image_grid_thw"], attention_mask=batch["attention_mask"])
    rows, cols = positions[1, 0, image_tokens], positions[2, 0, image_tokens]
    assert (len(rows.unique()), len(cols.unique())) == (rh // FACTOR[family], rw // FACTOR[family])
    # one forward with these inputs gives a finite loss (vision tower, DeepStack, M-RoPE)
    with torch.no_grad():
        assert torch.isfinite(gm.model(**batch).loss)


def test_positions_from_the_workers_equal_the_models_own(family_folder):
    """Training passes the M-RoPE positions computed per sample (qwen.mrope_positions) so the
    model skips its per-batch Python loop: they must be exactly what the model computes itself."""
    _, folder = family_folder
    gm = load_model(str(folder), device="cpu")
    encoded = []
    for i, size in enumerate([(200, 100), (90, 180), (64, 64)]):
        sample = {"phrase": PHRASE * (i + 1), "bbox": [5, 5, 30, 30], "width": size[0], "height": size[1]}
        encoded.append(encode_sample(gm.processor, gm.family, gm.resize, gm.prompt, _image().resize(size), sample))
    batch = qwen.collate(encoded, gm.processor.pad_token_id)  # right-padded: lengths differ
    theirs, _ = gm.model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                              batch["image_grid_thw"], attention_mask=batch["attention_mask"])
    real = batch["attention_mask"].bool()
    assert torch.equal(batch["position_ids"][:, real], theirs[:, real])
    without = {k: v for k, v in batch.items() if k != "position_ids"}
    with torch.no_grad():  # padding's logits are noise either way and carry no loss
        assert torch.equal(gm.model(**batch).logits[real], gm.model(**without).logits[real])


def test_lora_training_run_saves_and_loads_back(family_folder, synth_small, tmp_path):
    family, folder = family_folder
    cfg = TrainConfig(model=str(folder), train_data=str(synth_small / "train.jsonl"), out_dir=str(tmp_path / "run"),
                      method="lora", lora_r=4, lora_targets=["llm_attn", "llm_mlp", "merger"], lr=1e-2,
                      batch_size=4, max_steps=3, log_every=1, save_every=0, warmup_steps=0, device="cpu")
    run = train(cfg)
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 3 and all(map(math.isfinite, losses))
    assert (run / "model" / "adapter_config.json").exists()
    assert not (run / "model" / "model.safetensors").exists()
    meta = json.loads((run / "model" / "groundtune.json").read_text())
    assert meta["family"] == family and meta["resize"]["factor"] == FACTOR[family]

    gm = load_model(str(run), device="cpu")
    assert gm.family == family and gm.resize.factor == FACTOR[family]
    trained = {n: p for n, p in gm.model.named_parameters() if "lora_B" in n}
    assert trained and any(p.abs().sum() > 0 for p in trained.values())  # lora_B starts at zero
    adapted = [n for n in trained if ".visual." in n]  # the merger was adapted too, not the tower
    assert adapted and all(qwen.family(family).part_of(n) == "merger" for n in adapted)
    if family == "qwen3-vl":  # DeepStack's mergers count as merger
        assert any("deepstack" in n for n in adapted)
    preds = infer.predict(gm, [_image()], [PHRASE], max_new_tokens=8)
    assert len(preds) == 1 and (preds[0].bbox is None) == (preds[0].error is not None)


def test_answers_map_back_to_original_pixels(family_folder):
    family, folder = family_folder
    gm = load_model(str(folder), device="cpu")
    image = _image()
    _, resized_size = qwen.resize_image(image, gm.resize)
    assert resized_size != image.size  # the resize really happens, so a wrong mapping would show
    tok = gm.processor.tokenizer
    ids = tok(ANSWER[family], add_special_tokens=False)["input_ids"]
    ids += [gm.processor.token_id(qwen.TOKENS.im_end)] + [gm.processor.pad_token_id] * 3  # a finished batch row
    pred = infer.read_answer(ids, gm.processor, family, image.size, resized_size)
    assert pred.error is None and pred.label == PHRASE
    assert pred.bbox == pytest.approx(BOX)
    # read as Qwen2.5-VL (resized pixels) the same text would be a different box: the check has teeth
    wrong = infer.read_answer(ids, gm.processor, "qwen2.5-vl", image.size, resized_size)
    assert wrong.bbox != pytest.approx(BOX)

    # and generation runs end to end on the random model, batched, on different-size images
    images = [image, Image.new("RGB", (90, 150), "gray")]
    preds = infer.predict(gm, images, [PHRASE, "the blue square"], batch_size=2, max_new_tokens=12)
    assert len(preds) == 2
    for pred, im in zip(preds, images):
        assert (pred.bbox is None) == (pred.error is not None)
        if pred.bbox is not None:
            x1, y1, x2, y2 = pred.bbox
            assert 0 <= x1 < x2 <= im.width and 0 <= y1 < y2 <= im.height


# --------------------------------------------------------------------------------------------
# the family table (groundtune/families.py) and the transformers records (models/qwen.py)


def test_the_family_table_holds_what_qwen_publishes_and_transformers_builds():
    import transformers

    # each family's box convention (design.md) and the budget of the processor Qwen ships
    # (field-notes: preprocessor_config.json of each family), written out by hand
    published = {
        "qwen2.5-vl": (families.RESIZED_PIXELS, families.JSON, 28, 3_136, 12_845_056),
        "qwen2-vl": (families.NORM_1000, families.SPECIAL_TOKENS, 28, 3_136, 12_845_056),
        "qwen3-vl": (families.NORM_1000, families.JSON, 32, 65_536, 16_777_216),
    }
    assert {name: (f.coordinates, f.answer, f.factor, f.min_pixels, f.max_pixels)
            for name, f in families.FAMILIES.items()} == published
    for name, facts in families.FAMILIES.items():
        record = qwen.family(name)  # every family has its transformers record, which reads the table
        assert record.facts is facts and (record.name, record.factor) == (name, facts.factor)
        assert record.default_resize() == boxes.ResizeSpec(*published[name][2:])
        config = getattr(transformers, record.config_class)()  # the vision tower transformers builds
        assert (config.vision_config.patch_size, config.vision_config.spatial_merge_size) == (
            facts.patch_size, facts.merge_size)
        assert config.model_type == record.model_type and qwen.family_of(config) is record
        assert record.transformers_class().config_class is type(config)
        # the answer form is the one boxes writes
        assert boxes.answer_opening(name).startswith("<|box_start|>") == (facts.answer == families.SPECIAL_TOKENS)
    with pytest.raises(ValueError, match="not a Qwen-VL model"):
        qwen.family_of(transformers.LlamaConfig())
    with pytest.raises(ValueError, match="unknown model family 'llava'"):
        families.family("llava")
    with pytest.raises(ValueError, match="neither"):  # a misspelt convention is refused when the table is read
        dataclasses.replace(families.family("qwen3-vl"), name="qwen9-vl", coordinates="pixels")
    with pytest.raises(ValueError, match="neither"):
        dataclasses.replace(families.family("qwen3-vl"), name="qwen9-vl", vision_norm="BatchNorm")


@pytest.mark.parametrize("name, part, layer", [
    ("model.visual.blocks.3.attn.qkv.weight", "vision", None),
    ("base_model.model.model.visual.merger.mlp.0.lora_A.default.weight", "merger", None),
    ("model.visual.deepstack_merger_list.0.linear_fc1.weight", "merger", None),  # Qwen3-VL's DeepStack
    ("model.visual.mergers.weight", "vision", None),  # a prefix match is not the merger
    ("model.language_model.layers.11.self_attn.q_proj.weight", "llm", (11, "attn")),
    ("base_model.model.model.language_model.layers.0.mlp.down_proj.lora_B.default.weight", "llm", (0, "mlp")),
    ("lm_head.weight", "llm", None),
])
def test_parts_are_told_apart_by_name(name, part, layer):
    family = qwen.family("qwen3-vl")
    assert family.part_of(name) == part and family.llm_layer(name) == layer
