"""Batched generation: image + phrase -> box in ORIGINAL pixels.

This is the one generation path: eval, predict, training-time eval and serve call ``predict``
(greedy), RL rollouts call ``encode_prompts`` + ``generate`` (sampled), so the prompt, the resize
and the box parsing can never drift apart between stages.

    groundtune predict --model tiny --image cat.jpg --phrase "the cat on the left"
    groundtune predict --model runs/sft --jsonl val.jsonl --out predictions.jsonl

Batching pads on the LEFT so every prompt ends where its answer starts; the attention mask and
``mm_token_type_ids`` are padded with it, and transformers derives the M-RoPE positions (and the
rope deltas the KV cache continues from) from that mask. tests/test_infer.py checks that a batch of
different-length prompts generates exactly what one-at-a-time generation does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from groundtune import boxes
from groundtune.data.images import load_image, to_rgb
from groundtune.data.records import DataError, atomic_write, image_path, iter_jsonl
from groundtune.models import qwen
from groundtune.progress import track


@dataclass
class Prediction:
    """One answer. ``bbox`` is the first box, xyxy in pixels of the ORIGINAL image, or None when
    the answer held no usable box: then ``error`` says why. Boxes are never guessed."""

    bbox: list[float] | None
    boxes: list[list[float]]
    label: str | None
    raw: str
    error: str | None

    def to_json(self) -> dict:
        """The printed form: the box rounded to 0.1 px (finer is noise), raw text kept whole."""
        bbox = [round(v, 1) for v in self.bbox] if self.bbox is not None else None
        return {"bbox": bbox, "label": self.label, "raw": self.raw, "error": self.error}


def read_answer(
    token_ids: list[int],
    processor: qwen.Processor,
    family: str,
    original_size: boxes.Size,
    resized_size: boxes.Size,
) -> Prediction:
    """Generated token ids (the answer only, no prompt) -> Prediction in original pixels.

    Everything from the first end-of-turn, end-of-text or pad token on is dropped (a finished row
    of a batch is padded until the longest row ends). Other special tokens are KEPT: the Qwen2-VL
    answer is written with <|box_start|>(x1,y1),(x2,y2)<|box_end|> and the parser reads them.
    """
    ids = list(token_ids)
    raw = processor.tokenizer.decode(ids[: _answer_length(ids, processor)], skip_special_tokens=False)
    parsed = boxes.parse_answer(raw, family, original_size, resized_size)
    return Prediction(
        bbox=parsed.box,
        boxes=parsed.boxes,
        label=parsed.labels[0] if parsed.labels else None,
        raw=raw,
        error=parsed.error,
    )


def predict(
    gm,
    images: list[Image.Image],
    phrases: list[str],
    batch_size: int = 16,
    max_new_tokens: int = 64,
    progress: bool = False,
) -> list[Prediction]:
    """Ground each phrase in its image with greedy decoding, ``batch_size`` samples per generate.

    ``gm`` is a loaded GroundingModel; images are resized with ITS ResizeSpec and prompted with ITS
    prompt, as in training. The model is put in eval mode and given back in the mode it was in,
    because training calls this in the middle of a run.
    """
    if len(images) != len(phrases):
        raise ValueError(f"got {len(images)} images but {len(phrases)} phrases")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    starts = range(0, len(images), batch_size)
    if progress:
        starts = track(starts, f"predict ({batch_size}/batch)")
    was_training = gm.model.training
    gm.model.eval()
    predictions = []
    try:
        for start in starts:
            chunk = zip(images[start : start + batch_size], phrases[start : start + batch_size])
            predictions += _generate(gm, list(chunk), max_new_tokens)
    finally:
        gm.model.train(was_training)
    return predictions


def _generate(gm, chunk: list[tuple[Image.Image, str]], max_new_tokens: int) -> list[Prediction]:
    encoded, sizes = encode_prompts(gm, chunk)
    return [prediction for _, prediction in generate(gm, encoded, sizes, max_new_tokens)]


def encode_prompts(gm, chunk: list[tuple[Image.Image, str]]) -> tuple[list[dict], list[tuple]]:
    """(image, phrase) pairs -> the encoded prompts (image resized with the model's ResizeSpec, the
    model's prompt) and each image's (original size, resized size) for reading the answers back."""
    sizes, encoded = [], []
    for image, phrase in chunk:
        image = to_rgb(image)
        resized, resized_size = qwen.resize_image(image, gm.resize)
        prompt = qwen.prompt_text(gm.processor, phrase, gm.prompt)
        encoded.append(qwen.encode(gm.processor, resized, prompt))
        sizes.append((image.size, resized_size))
    return encoded, sizes


def generate(gm, encoded: list[dict], sizes: list[tuple], max_new_tokens: int, num_samples: int = 1,
             temperature: float = 0.0, top_p: float = 1.0) -> list[tuple[list[int], Prediction]]:
    """Answer encoded prompts in one batch: greedy (temperature 0), or ``num_samples`` sampled
    answers per prompt (RL rollouts). Returns, prompt by prompt and sample by sample, the answer's
    token ids (up to and including its end-of-turn token, exactly as generated) and what they say."""
    batch = qwen.collate(encoded, gm.processor.pad_token_id, padding_side="left")
    # generate derives the positions itself, with the offsets its KV cache continues from
    batch.pop("position_ids")
    batch = {k: v.to(gm.device) for k, v in batch.items()}
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)
    with torch.inference_mode():
        out = gm.model.generate(
            **batch,
            **sampling,
            num_return_sequences=num_samples,
            max_new_tokens=max_new_tokens,
            eos_token_id=gm.processor.eos_token_ids,
            pad_token_id=gm.processor.pad_token_id,
            use_cache=True,
        )
    # generate returns prompt + answer; with left padding every prompt ends at the same column.
    # The rows come prompt by prompt, num_samples rows each.
    answers = out[:, batch["input_ids"].shape[1] :].tolist()
    results = []
    for row, ids in enumerate(answers):
        original, resized = sizes[row // num_samples]
        end = _answer_length(ids, gm.processor)
        results.append((ids[: end + 1], read_answer(ids, gm.processor, gm.family, original, resized)))  # + its stop token
    return results


def _answer_length(ids: list[int], processor: qwen.Processor) -> int:
    """Tokens before the first end-of-turn, end-of-text or pad token (a finished row of a batch is
    padded until the longest row ends); all of them when the answer was cut off."""
    stop = set(processor.eos_token_ids) | {processor.pad_token_id}
    return next((i for i, t in enumerate(ids) if t in stop), len(ids))


def predict_jsonl(gm, in_path: str | Path, out_path: str | Path, batch_size: int = 16, progress: bool = True) -> int:
    """Predict every line of a JSONL file (canonical, or just ``image`` + ``phrase``) and write
    each input record with a ``prediction`` object added; returns the number of lines written.

    The prediction goes in its own field so a canonical file's true ``bbox`` is kept beside it.
    Images are opened one batch at a time, so a large file never sits in memory at once.
    """
    records = []
    for line in iter_jsonl(in_path):
        if line.error:
            raise DataError(f"{in_path}:{line.number}: {line.error}")
        missing = [k for k in ("image", "phrase") if k not in line.record]
        if missing:
            raise DataError(f"{in_path}:{line.number}: missing field(s) {', '.join(missing)}")
        records.append(line.record)
    starts = range(0, len(records), batch_size)
    if progress:
        starts = track(starts, f"predict ({batch_size}/batch)")
    with atomic_write(out_path) as f:
        for start in starts:
            chunk = records[start : start + batch_size]
            images = [load_image(image_path(r, in_path), _recorded_size(r)) for r in chunk]
            preds = predict(gm, images, [str(r["phrase"]) for r in chunk], batch_size=batch_size)
            for record, pred in zip(chunk, preds):
                f.write(json.dumps({**record, "prediction": pred.to_json()}, ensure_ascii=False) + "\n")
    return len(records)


def _recorded_size(record: dict) -> tuple[int, int] | None:
    if "width" in record and "height" in record:
        return int(record["width"]), int(record["height"])
    return None
