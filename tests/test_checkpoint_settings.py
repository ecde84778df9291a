"""What a checkpoint ships must not change groundtune's behaviour behind its back: its decoding
settings (generation_config.json: Qwen2.5-VL ships top_k=1 and repetition_penalty 1.05) are set
aside, and its pixel budget (preprocessor_config.json) is the one a base model is resized with.

The checkpoints here are copies of a small random Qwen2.5-VL's folder (the ``small_model`` fixture,
which speaks as the tiny model does) with the files as Qwen ships them: nothing here depends on
what the weights learnt."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from groundtune import boxes, infer
from groundtune.data import synth
from groundtune.models import qwen
from groundtune.models.loading import RESIZE_FAMILY, RESIZE_PROCESSOR, RESIZE_SAVED, load_model

# Qwen2.5-VL-*-Instruct's generation_config.json (QwenLM/Qwen2.5-VL issues 722, 884), with a
# repetition penalty strong enough to change a model's greedy answers
SHIPPED_DECODING = {"do_sample": True, "top_k": 1, "top_p": 0.001, "temperature": 0.1, "repetition_penalty": 5.0}


def _copy(model: str, tmp_path, name: str, generation: dict | None = None, keep_metadata: bool = True):
    folder = tmp_path / name
    shutil.copytree(model, folder)
    if not keep_metadata:
        (folder / "groundtune.json").unlink()
    if generation is not None:
        config = json.loads((folder / "generation_config.json").read_text())
        (folder / "generation_config.json").write_text(json.dumps({**config, **generation}))
    return folder


def _prompts(gm, n: int = 2):
    pairs = [synth.make_sample(5, i, task="full") for i in range(n)]
    return infer.encode_prompts(gm, [(image, sample["phrase"]) for image, sample in pairs])


def test_sampled_answers_differ_although_the_checkpoint_ships_top_k_1(small_model, tmp_path):
    gm = load_model(str(_copy(small_model, tmp_path, "shipped", SHIPPED_DECODING)))
    encoded, sizes = _prompts(gm)
    group = 6
    torch.manual_seed(0)
    answers = infer.generate(gm, encoded, sizes, infer.Decoding.sampled(24, temperature=1.5), num_samples=group)
    for prompt in range(2):
        distinct = {tuple(ids) for ids, _ in answers[prompt * group:(prompt + 1) * group]}
        assert len(distinct) > 1, "every sampled answer of the group is the same: RL would learn nothing"

    # the hazard itself: transformers' generate, given only what a sampler usually passes, takes
    # top_k=1 from the checkpoint and answers the same every time
    from transformers import GenerationConfig

    gm.model.generation_config = GenerationConfig.from_pretrained(tmp_path / "shipped")
    batch = qwen.collate(encoded, gm.processor.pad_token_id, padding_side="left")
    batch.pop("position_ids")
    torch.manual_seed(0)
    with torch.inference_mode():
        out = gm.model.generate(**batch, do_sample=True, temperature=1.5, num_return_sequences=group,
                                max_new_tokens=24, pad_token_id=gm.processor.pad_token_id)
    assert len({tuple(row) for row in out[:group].tolist()}) == 1


def test_greedy_answers_ignore_the_checkpoints_repetition_penalty(small_model, tmp_path):
    clean = load_model(small_model)
    shipped = load_model(str(_copy(small_model, tmp_path, "shipped", SHIPPED_DECODING)))
    pairs = [synth.make_sample(6, i, task="full") for i in range(4)]
    images, phrases = [image for image, _ in pairs], [sample["phrase"] for _, sample in pairs]
    ours = [p.raw for p in infer.predict(shipped, images, phrases, max_new_tokens=40)]
    assert ours == [p.raw for p in infer.predict(clean, images, phrases, max_new_tokens=40)]
    # with the checkpoint's own settings the answers would differ (the penalty bites on repeated tokens)
    from transformers import GenerationConfig

    shipped.model.generation_config = GenerationConfig.from_pretrained(tmp_path / "shipped")
    encoded, sizes = infer.encode_prompts(shipped, list(zip(images, phrases)))
    batch = qwen.collate(encoded, shipped.processor.pad_token_id, padding_side="left")
    batch.pop("position_ids")
    with torch.inference_mode():
        out = shipped.model.generate(**batch, do_sample=False, max_new_tokens=40,
                                     eos_token_id=shipped.processor.eos_token_ids,
                                     pad_token_id=shipped.processor.pad_token_id)
    theirs = [infer.read_answer(ids, shipped.processor, shipped.family, *size).raw
              for ids, size in zip(out[:, batch["input_ids"].shape[1]:].tolist(), sizes)]
    assert theirs != ours


def test_decoding_is_complete_and_recorded(small_model):
    greedy = infer.Decoding.greedy(32)
    assert greedy.to_dict() == {"max_new_tokens": 32, "do_sample": False, "repetition_penalty": 1.0}
    kwargs = infer.Decoding.sampled(48, temperature=0.7, top_p=0.9).generate_kwargs()
    # every field generate would otherwise take from the checkpoint is given
    assert {"do_sample", "temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens"} <= set(kwargs)
    assert kwargs["top_k"] == 0 and kwargs["repetition_penalty"] == 1.0
    with pytest.raises(ValueError, match="temperature > 0"):
        infer.Decoding.sampled(8, temperature=0.0)
    with pytest.raises(ValueError, match="need sampling"):
        infer.generate(load_model(small_model), [], [], greedy, num_samples=2)


# --------------------------------------------------------------------------------------------
# pixel budgets


def _rewrite_preprocessor(folder, **fields):
    """preprocessor_config.json as Qwen ships it: the budget as min/max_pixels (Qwen2.5-VL) or
    size.shortest/longest_edge (Qwen3-VL), or none at all."""
    path = folder / "preprocessor_config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("size", "min_pixels", "max_pixels")}
    path.write_text(json.dumps({**config, **fields}))


def test_a_base_checkpoint_is_resized_with_its_own_preprocessor_budget(small_model, tmp_path):
    qwen25_style = _copy(small_model, tmp_path, "min-max", keep_metadata=False)
    _rewrite_preprocessor(qwen25_style, min_pixels=3136, max_pixels=12845056)
    gm = load_model(str(qwen25_style))
    assert gm.resize == boxes.ResizeSpec(28, 3136, 12845056) and gm.resize_source == RESIZE_PROCESSOR

    newer_style = _copy(small_model, tmp_path, "size", keep_metadata=False)
    _rewrite_preprocessor(newer_style, size={"shortest_edge": 4 * 28 * 28, "longest_edge": 256 * 28 * 28})
    assert load_model(str(newer_style)).resize == boxes.ResizeSpec(28, 4 * 28 * 28, 256 * 28 * 28)

    # none at all: the family's shipped budget, not transformers' class default (1,003,520)
    bare = _copy(small_model, tmp_path, "bare", keep_metadata=False)
    _rewrite_preprocessor(bare)
    gm = load_model(str(bare))
    assert gm.resize == qwen.family("qwen2.5-vl").default_resize() and gm.resize_source == RESIZE_FAMILY
    assert gm.resize.max_pixels == 12845056

    # groundtune.json, when there, wins: a trained model runs at its training budget
    assert load_model(small_model).resize_source == RESIZE_SAVED


def test_qwen3_defaults_are_qwen3s(family_folder, tmp_path):
    family, folder = family_folder
    copy = tmp_path / family
    shutil.copytree(folder, copy)
    _rewrite_preprocessor(copy)
    gm = load_model(str(copy), device="cpu")
    expected = {"qwen2-vl": (28, 3136, 12845056), "qwen3-vl": (32, 65536, 16777216)}[family]
    assert gm.resize == boxes.ResizeSpec(*expected) and gm.resize_source == RESIZE_FAMILY


def test_training_over_a_saved_budget_warns_and_saves_what_it_used(small_model, tmp_path):
    from groundtune.config import TrainConfig
    from groundtune.train.sft import train

    synth.make_synthetic_set(tmp_path / "data", n=4, seed=1, task="single", workers=1)
    cfg = TrainConfig(model=small_model, train_data=str(tmp_path / "data" / "train.jsonl"),
                      out_dir=str(tmp_path / "run"), max_pixels=28 * 28 * 9, max_steps=1, batch_size=2, save_every=0)
    with pytest.warns(UserWarning, match=f"train: {re.escape(small_model)} has its pixel budget in groundtune.json .* "
                                         "runs with"):
        run = train(cfg)
    saved = json.loads((run / "model" / "groundtune.json").read_text())["resize"]
    assert saved == {"factor": 28, "min_pixels": 3136, "max_pixels": 28 * 28 * 9}


def test_an_image_the_resize_cannot_take_is_named(small_model, tmp_path):
    from PIL import Image

    from groundtune import evaluate
    from groundtune.data.samples import open_samples
    from groundtune.errors import DataError
    from groundtune.train.batches import GroundingDataset

    Image.new("RGB", (1000, 4), "white").save(tmp_path / "sliver.png")  # aspect ratio 250
    record = {"id": "s0", "image": "sliver.png", "width": 1000, "height": 4, "phrase": "the line",
              "bbox": [10.0, 0.0, 500.0, 4.0]}
    data = tmp_path / "sliver.jsonl"
    data.write_text(json.dumps(record) + "\n")
    gm = load_model(small_model)
    with pytest.raises(DataError, match=r"sliver\.png .*aspect ratio 250.0 is above 200"):
        evaluate.evaluate(gm, [record], data, progress=False)
    # in a training batch it is left out and said why (the run counts it: test_reliability.py)
    dataset = GroundingDataset(open_samples(str(data), 0), gm.processor, gm.family, gm.resize, gm.prompt)
    assert re.search(r"sample 's0' \(.*sliver\.png\): aspect ratio 250.0", dataset[0, 0]["failed"])
