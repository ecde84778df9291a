"""Batched generation: image + phrase -> box in ORIGINAL pixels.

This is the one generation path: eval, predict, training-time eval and serve call ``predict``
(greedy), RL rollouts call ``encode_prompts`` + ``generate`` (sampled), so the prompt, the resize
and the box parsing can never drift apart between stages. Every call decodes with a complete
``Decoding``: nothing is taken from a checkpoint's generation_config.json (models/loading.py).

    groundtune predict --model tiny --image cat.jpg --phrase "the cat on the left"
    groundtune predict --model runs/sft --jsonl val.jsonl --out predictions.jsonl

Batching pads on the LEFT so every prompt ends where its answer starts; the attention mask and
``mm_token_type_ids`` are padded with it, and transformers derives the M-RoPE positions (and the
rope deltas the KV cache continues from) from that mask. tests/test_infer.py checks that a batch of
different-length prompts generates exactly what one-at-a-time generation does.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from PIL import Image

from groundtune import boxes
from groundtune.config import MAX_NEW_TOKENS
from groundtune.data.images import load_image, to_rgb
from groundtune.data.records import atomic_write, image_path, iter_jsonl, missing_fields, record_size
from groundtune.errors import DataError
from groundtune.models import qwen
from groundtune.progress import track

DEFAULT_MAX_NEW_TOKENS = MAX_NEW_TOKENS  # defined with the settings (config.py)


@dataclass(frozen=True)
class Decoding:
    """Every setting ``generate`` decodes with, all passed on each call. transformers takes any
    field a call leaves unset from the checkpoint's generation_config.json, and Qwen's differ from
    what grounding needs (Qwen2.5-VL: top_k=1, repetition_penalty 1.05; Qwen3-VL: top_k=20,
    top_p=0.8), so none is left unset. Reports and metrics record it (``to_dict``)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # longer answers are cut (and usually unparsable)
    do_sample: bool = False  # False: greedy, deterministic
    temperature: float = 1.0  # sampling only
    top_p: float = 1.0  # sampling only; 1 = off
    top_k: int = 0  # sampling only; 0 = off
    repetition_penalty: float = 1.0  # 1 = off: a box may repeat a digit

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.do_sample and (self.temperature <= 0 or not 0 < self.top_p <= 1 or self.top_k < 0):
            raise ValueError(f"sampling needs temperature > 0, 0 < top_p <= 1 and top_k >= 0; got {self}")

    @classmethod
    def greedy(cls, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> "Decoding":
        return cls(max_new_tokens=max_new_tokens)

    @classmethod
    def sampled(cls, max_new_tokens: int, temperature: float, top_p: float = 1.0, top_k: int = 0) -> "Decoding":
        return cls(max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)

    def to_dict(self) -> dict:
        """What was used, for reports: greedy decoding has no temperature, top_p or top_k."""
        values = asdict(self)
        if not self.do_sample:
            for name in ("temperature", "top_p", "top_k"):
                values.pop(name)
        return values

    def generate_kwargs(self) -> dict:
        return {**asdict(self), "num_beams": 1}


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


def load(name: str, device: str = "auto", min_pixels: int | None = None, max_pixels: int | None = None,
         who: str = "predict"):
    """A model ready for inference: loaded (``models.loading.load_model``) with its own pixel budget,
    overridden where ``min_pixels``/``max_pixels`` are given (``who`` warns: it is not what the
    model was trained at), and the speed-ups installed."""
    from groundtune.models import speedups
    from groundtune.models.loading import load_model, with_resize

    gm = with_resize(load_model(name, device=device), min_pixels, max_pixels, who)
    speedups.install(gm.model)
    return gm


def predict(
    gm,
    images: list[Image.Image],
    phrases: list[str],
    batch_size: int = 16,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    progress: bool = False,
    names: list[str] | None = None,
) -> list[Prediction]:
    """Ground each phrase in its image with greedy decoding (``Decoding.greedy``), ``batch_size``
    samples per generate.

    ``gm`` is a loaded GroundingModel; images are resized with ITS ResizeSpec and prompted with ITS
    prompt, as in training. The model is put in eval mode and given back in the mode it was in,
    because training calls this in the middle of a run. ``names`` (each image's file) go into
    the error about an image the model cannot take.
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
            chunk = list(zip(images[start : start + batch_size], phrases[start : start + batch_size]))
            chunk_names = names[start : start + batch_size] if names is not None else None
            encoded, sizes = encode_prompts(gm, chunk, chunk_names)
            predictions += [p for _, p in generate(gm, encoded, sizes, Decoding.greedy(max_new_tokens))]
    finally:
        gm.model.train(was_training)
    return predictions


def encode_prompts(gm, chunk: list[tuple[Image.Image, str]],
                   names: list[str] | None = None) -> tuple[list[dict], list[tuple]]:
    """(image, phrase) pairs -> the encoded prompts (image resized with the model's ResizeSpec, the
    model's prompt) and each image's (original size, resized size) for reading the answers back.
    An image the resize cannot take is a DataError naming it (``names[i]``, or its place)."""
    sizes, encoded = [], []
    for i, (image, phrase) in enumerate(chunk):
        image = to_rgb(image)
        try:
            resized, resized_size = qwen.resize_image(image, gm.resize)
        except boxes.ResizeError as e:
            where = names[i] if names is not None else f"image {i + 1} of the batch"
            raise DataError(f"{where} ({image.width}x{image.height}): {e}") from None
        prompt = qwen.prompt_text(gm.processor, phrase, gm.prompt)
        encoded.append(qwen.encode(gm.processor, resized, prompt))
        sizes.append((image.size, resized_size))
    return encoded, sizes


def generate(gm, encoded: list[dict], sizes: list[tuple], decoding: Decoding,
             num_samples: int = 1) -> list[tuple[list[int], Prediction]]:
    """Answer encoded prompts in one batch with ``decoding``: greedy, or ``num_samples`` sampled
    answers per prompt (RL rollouts). Returns, prompt by prompt and sample by sample, the answer's
    token ids (up to and including its end-of-turn token, exactly as generated) and what they say."""
    if num_samples > 1 and not decoding.do_sample:
        raise ValueError(f"{num_samples} answers per prompt need sampling: greedy gives the same one each time")
    batch = qwen.collate(encoded, gm.processor.pad_token_id, padding_side="left")
    # generate derives the positions itself, with the offsets its KV cache continues from
    batch.pop("position_ids")
    batch = {k: v.to(gm.device) for k, v in batch.items()}
    with torch.inference_mode():
        out = gm.model.generate(
            **batch,
            **decoding.generate_kwargs(),
            num_return_sequences=num_samples,
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


def read_queries(in_path: str | Path) -> list[dict]:
    """The records of a JSONL file to predict (canonical, or just ``image`` + ``phrase``); the first
    line without them raises, naming file and line."""
    records = []
    for line in iter_jsonl(in_path):
        if line.error:
            raise DataError(f"{in_path}:{line.number}: {line.error}")
        missing = missing_fields(line.record, ("image", "phrase"))
        if missing:
            raise DataError(f"{in_path}:{line.number}: missing field(s) {', '.join(missing)}")
        records.append(line.record)
    return records


def predict_jsonl(gm, in_path: str | Path, out_path: str | Path, batch_size: int = 16,
                  max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, progress: bool = True,
                  records: list[dict] | None = None) -> int:
    """Predict every line of a JSONL file (``read_queries``; or ``records`` already read from it)
    and write each input record with a ``prediction`` object added; returns the number written.

    The prediction goes in its own field so a canonical file's true ``bbox`` is kept beside it.
    Images are opened one batch at a time, so a large file never sits in memory at once.
    """
    records = read_queries(in_path) if records is None else records
    starts = range(0, len(records), batch_size)
    if progress:
        starts = track(starts, f"predict ({batch_size}/batch)")
    with atomic_write(out_path) as f:
        for start in starts:
            chunk = records[start : start + batch_size]
            files = [image_path(r, in_path) for r in chunk]
            images = [load_image(file, record_size(r)) for file, r in zip(files, chunk)]
            preds = predict(gm, images, [str(r["phrase"]) for r in chunk], batch_size=batch_size,
                            max_new_tokens=max_new_tokens, names=[str(f) for f in files])
            for record, pred in zip(chunk, preds):
                f.write(json.dumps({**record, "prediction": pred.to_json()}, ensure_ascii=False) + "\n")
    return len(records)
