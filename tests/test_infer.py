"""Batched greedy generation on a small Qwen2.5-VL that speaks as the tiny model does: batches equal
one-at-a-time, the KV cache equals a full forward per token, and answers come back in ORIGINAL
pixels."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from groundtune import infer
from groundtune.boxes import ResizeSpec
from groundtune.cli import main
from groundtune.models import qwen
from groundtune.models.loading import load_model

# Different sizes give prompts of different lengths (16, 15 and 18 image tokens), so a batch is
# really left-padded; different phrase lengths add to that.
SIZES = [(112, 112), (140, 84), (84, 168)]
PHRASES = ["the red square", "the small blue square on the left of the other one", "green"]


def _image(size: tuple[int, int], colour: str) -> Image.Image:
    image = Image.new("RGB", size, "white")
    w, h = size
    image.paste(Image.new("RGB", (w // 3, h // 3), colour), (w // 4, h // 5))
    return image


@pytest.fixture(scope="module")
def gm(loud_model):
    """The small model with large random weights (conftest's loud_model): any mix-up between the
    rows of a batch shows. (The trained tiny model answers these plain pictures with near-identical
    boxes; tests/test_tiny_model.py checks its answers against the truth.)"""
    return load_model(loud_model, device="cpu")


@pytest.fixture(scope="module")
def images():
    return [_image(s, c) for s, c in zip(SIZES, ["red", "blue", "green"])]


def _prompt_lengths(gm, images, phrases) -> list[int]:
    return [
        len(qwen.encode(gm.processor, qwen.resize_image(im, gm.resize)[0],
                        qwen.prompt_text(gm.processor, ph, gm.prompt))["input_ids"])
        for im, ph in zip(images, phrases)
    ]


def test_batched_equals_one_at_a_time(gm, images):
    assert len(set(_prompt_lengths(gm, images, PHRASES))) == 3  # the batch is really padded
    batched = infer.predict(gm, images, PHRASES, batch_size=3, max_new_tokens=24)
    single = infer.predict(gm, images, PHRASES, batch_size=1, max_new_tokens=24)
    assert [p.raw for p in batched] == [p.raw for p in single]
    assert batched == single
    assert len({p.raw for p in single}) == 3  # the answers depend on the input: the check has teeth
    for pred, image in zip(batched, images):
        assert (pred.bbox is None) == (pred.error is not None)
        if pred.bbox is not None:  # random weights rarely write a box; when they do, it is in the image
            x1, y1, x2, y2 = pred.bbox
            assert 0 <= x1 < x2 <= image.width and 0 <= y1 < y2 <= image.height


def test_kv_cache_matches_full_forward(gm, images):
    """Greedy decoding by hand, recomputing the whole sequence every token (no cache), gives the
    cached generate's answer. The shortest prompt is the one padded most in a batch."""
    lengths = _prompt_lengths(gm, images, PHRASES)
    i = lengths.index(min(lengths))
    image, phrase, n_new = images[i], PHRASES[i], 16
    resized, resized_size = qwen.resize_image(image, gm.resize)
    enc = qwen.encode(gm.processor, resized, qwen.prompt_text(gm.processor, phrase, gm.prompt))
    ids, types = enc["input_ids"][None], enc["mm_token_type_ids"][None]
    new = []
    with torch.no_grad():
        for _ in range(n_new):
            logits = gm.model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                              pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                              use_cache=False).logits
            token = int(logits[0, -1].argmax())
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            types = torch.cat([types, torch.zeros((1, 1), dtype=types.dtype)], dim=1)
    expected = infer.read_answer(new, gm.processor, gm.family, image.size, resized_size)
    batched = infer.predict(gm, images, PHRASES, batch_size=3, max_new_tokens=n_new)
    assert batched[i].raw == expected.raw


def test_predict_restores_training_mode(gm, images):
    """Training calls predict mid-run: the mode comes back, and a training forward of another
    batch size still works after generate left its rope deltas on the model."""
    gm.model.train()
    infer.predict(gm, images, PHRASES, max_new_tokens=2)
    assert gm.model.training
    resized, _ = qwen.resize_image(images[0], gm.resize)
    enc = qwen.encode(gm.processor, resized, qwen.prompt_text(gm.processor, PHRASES[0], gm.prompt), answer="[]")
    loss = gm.model(**qwen.collate([enc], gm.processor.pad_token_id)).loss
    assert torch.isfinite(loss)
    gm.model.eval()
    infer.predict(gm, images[:1], PHRASES[:1], max_new_tokens=2)
    assert not gm.model.training


def test_predict_refuses_mismatched_lists(gm, images):
    with pytest.raises(ValueError, match="2 images but 1 phrases"):
        infer.predict(gm, images[:2], PHRASES[:1])


# --------------------------------------------------------------------------------------------
# Decoding and parsing: known answers on a NON-SQUARE image


TINY_RESIZE = ResizeSpec(factor=28, min_pixels=3136, max_pixels=224 * 224)
ORIGINAL = (200, 100)


def _answer_ids(gm, text: str) -> list[int]:
    """Token ids as generate returns them for a finished row of a batch: answer, <|im_end|>, pads."""
    ids = gm.processor.tokenizer(text + qwen.TOKENS.im_end, add_special_tokens=False)["input_ids"]
    return ids + [gm.processor.pad_token_id] * 3


def test_answer_in_resized_pixels_maps_to_original(gm):
    assert gm.resize == TINY_RESIZE
    resized = TINY_RESIZE.resized_size(ORIGINAL)
    assert resized == (196, 112)  # x scaled by 200/196, y by 100/112: different on each axis
    text = '[{"bbox_2d": [49, 28, 98, 56], "label": "the red square"}]'
    pred = infer.read_answer(_answer_ids(gm, text), gm.processor, "qwen2.5-vl", ORIGINAL, resized)
    assert pred.raw == text  # <|im_end|> and pads stripped
    assert pred.bbox == pytest.approx([50.0, 25.0, 100.0, 50.0])
    assert pred.boxes == [pred.bbox]
    assert pred.label == "the red square"
    assert pred.error is None
    assert pred.to_json() == {"bbox": [50.0, 25.0, 100.0, 50.0], "boxes": [[50.0, 25.0, 100.0, 50.0]],
                              "no_target": False, "label": "the red square", "raw": text, "error": None}


def test_qwen2_special_tokens_are_kept_for_the_parser(gm):
    text = "<|object_ref_start|>the cat<|object_ref_end|><|box_start|>(100,200),(500,800)<|box_end|>"
    resized = TINY_RESIZE.resized_size(ORIGINAL)
    pred = infer.read_answer(_answer_ids(gm, text), gm.processor, "qwen2-vl", ORIGINAL, resized)
    assert pred.raw == text
    assert pred.bbox == pytest.approx([20.0, 20.0, 100.0, 80.0])  # 0-1000 of the 200 x 100 image
    assert pred.label == "the cat"


def test_an_empty_answer_is_no_target(gm):
    pred = infer.read_answer(_answer_ids(gm, "[]"), gm.processor, "qwen2.5-vl", ORIGINAL, (196, 112))
    assert pred.no_target and pred.bbox is None and pred.boxes == [] and pred.error is None
    assert pred.to_json() == {"bbox": None, "boxes": [], "no_target": True, "label": None, "raw": "[]", "error": None}


def test_unparseable_answer_is_an_error_not_a_box(gm):
    pred = infer.read_answer(_answer_ids(gm, "the cat is here"), gm.processor, "qwen2.5-vl", ORIGINAL, (196, 112))
    assert pred.bbox is None and pred.boxes == [] and pred.label is None
    assert pred.error == "no box found in the answer"
    assert pred.to_json()["bbox"] is None


# --------------------------------------------------------------------------------------------
# The predict command


def test_predict_cli_prints_one_json_line(small_model, tmp_path, capsys):
    path = tmp_path / "wide.png"
    _image((200, 100), "red").save(path)
    drawn = tmp_path / "drawn.png"
    # random weights write junk up to --max-new-tokens: a few are enough
    assert main(["predict", "--model", small_model, "--image", str(path), "--phrase", "the red square",
                 "--draw", str(drawn), "--device", "cpu", "--max-new-tokens", "8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out) == {"bbox", "boxes", "no_target", "label", "raw", "error"}
    if out["bbox"] is None:
        assert out["error"]
    else:
        assert len(out["bbox"]) == 4 and all(isinstance(v, (int, float)) for v in out["bbox"])
    assert Image.open(drawn).size[0] >= 200


def test_predict_cli_jsonl_writes_one_line_per_input(small_model, tmp_path):
    for name, size in [("a.png", (112, 112)), ("b.png", (140, 84))]:
        _image(size, "blue").save(tmp_path / name)
    records = [
        {"id": "c0", "image": "a.png", "width": 112, "height": 112, "phrase": "the blue square",
         "bbox": [28.0, 22.0, 65.0, 59.0], "split": "val", "source": "test", "extra": 7},
        {"image": "b.png", "phrase": "the blue square"},
        {"image": str(tmp_path / "a.png"), "phrase": "anything"},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    dst = tmp_path / "out" / "pred.jsonl"
    assert main(["predict", "--model", small_model, "--jsonl", str(src), "--out", str(dst),
                 "--batch-size", "2", "--device", "cpu", "--max-new-tokens", "8"]) == 0
    lines = [json.loads(x) for x in dst.read_text().splitlines()]
    assert len(lines) == 3
    for record, line in zip(records, lines):
        assert {k: line[k] for k in record} == record  # input kept as it was, true bbox included
        assert set(line["prediction"]) == {"bbox", "boxes", "no_target", "label", "raw", "error"}


def test_predict_cli_needs_image_and_phrase_or_jsonl(capsys):
    assert main(["predict", "--model", "tiny", "--image", "x.png"]) == 2
    assert "error: groundtune predict: give --image and --phrase" in capsys.readouterr().err
    assert main(["predict", "--model", "tiny", "--jsonl", "in.jsonl"]) == 2
    assert "needs --out" in capsys.readouterr().err


def test_answer_batches_reads_ahead_and_answers_as_generate_does(gm, images):
    """THE path of eval and the server: batch after batch, read ahead or not, each answered as one
    ``generate`` call answers it, each with its caller's tag."""
    encoded, sizes = infer.encode_prompts(gm, list(zip(images, PHRASES)))
    decoding = infer.Decoding.greedy(12)
    alone = [p for _, p in infer.generate(gm, encoded, sizes, decoding, engine=infer.engine_for(gm))]
    batches = [(encoded[:2], sizes[:2], "first"), (encoded[2:], sizes[2:], "second")]
    for read_ahead in (False, True):
        answered = list(infer.answer_batches(gm, iter(batches), decoding, read_ahead=read_ahead))
        assert [tag for tag, _ in answered] == ["first", "second"]
        assert [p.raw for _, answers in answered for _, p in answers] == [p.raw for p in alone]


def test_answer_batches_keeps_going_past_a_failed_batch_only_when_asked(gm, images):
    encoded, sizes = infer.encode_prompts(gm, list(zip(images, PHRASES)))
    broken = [{**encoded[0], "input_ids": encoded[0]["input_ids"][:0]}]  # no tokens: the prefill cannot run
    batches = [(broken, sizes[:1], "broken"), (encoded[1:2], sizes[1:2], "fine")]
    decoding = infer.Decoding.greedy(4)
    answered = list(infer.answer_batches(gm, iter(batches), decoding, read_ahead=True, keep_going=True))
    assert [tag for tag, _ in answered] == ["broken", "fine"]
    assert isinstance(answered[0][1], Exception) and not isinstance(answered[1][1], Exception)
    with pytest.raises(Exception):  # noqa: B017 - whatever the model raises, eval stops with it
        list(infer.answer_batches(gm, iter(batches), decoding, read_ahead=True))
