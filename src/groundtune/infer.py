"""Batched generation: image + phrase -> box in ORIGINAL pixels.

This is the one generation path: eval, predict, training-time eval and serve call
``predict``/``predict_records`` (greedy), RL rollouts call ``encode_prompts`` + ``generate``
(sampled), so the prompt, the resize and the box parsing can never drift apart between stages.
Every call decodes with a complete ``Decoding``: nothing is taken from a checkpoint's
generation_config.json (models/loading.py).

    groundtune predict --model tiny --image cat.jpg --phrase "the cat on the left"
    groundtune predict --model runs/sft --jsonl val.jsonl --out predictions.jsonl

The answers come from the generation engine (models/engine.py: prompts packed without padding,
a static KV cache, on a GPU each decode step one CUDA graph) when the model has our attention
installed (``load`` installs it); otherwise from transformers' ``generate`` on a left-padded
batch (``plain_generate``), whose greedy answers the engine's equal (tests/test_engine.py).
Files are read, resized and tokenised in DataLoader worker processes on a GPU machine, while the
GPU answers the previous batch; a file's records are answered largest image first, so a batch
holds images of similar size, and come back in the file's order.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import torch
from PIL import Image

from groundtune import boxes
from groundtune.config import InferSettings
from groundtune.cores import cores
from groundtune.data.images import load_image, to_rgb
from groundtune.data.records import (MAX_LINE_CHARS, atomic_write, image_path, iter_jsonl, missing_fields,
                                     record_problem, record_size)
from groundtune.data.samples import stop_signal_workers
from groundtune.errors import DataError
from groundtune.models import head, qwen
from groundtune.models.adapt import base_model
from groundtune.models.attention import attached, keeps_packed_samples_apart, shares_prefixes
from groundtune.models.engine import Engine, evaluating
from groundtune.progress import track

T = TypeVar("T")

READ_AHEAD = True  # benchmarks switch it off to measure what it gives (predict_records, _read_ahead)
ROW_AHEAD = True  # ... and this: the next batch put in one row in that thread (answer_batches), not by the engine


@dataclass(frozen=True)
class Decoding:
    """Every setting ``generate`` decodes with, all passed on each call. transformers takes any
    field a call leaves unset from the checkpoint's generation_config.json, and Qwen's differ from
    what grounding needs (Qwen2.5-VL: top_k=1, repetition_penalty 1.05; Qwen3-VL: top_k=20,
    top_p=0.8), so none is left unset. Reports and metrics record it (``to_dict``)."""

    max_new_tokens: int = InferSettings.max_new_tokens  # longer answers are cut (and usually unparsable)
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
    def greedy(cls, max_new_tokens: int = InferSettings.max_new_tokens) -> "Decoding":
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

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """(rows, vocab) float logits -> each row's next token, as ``generate`` picks it with
        these settings: the highest, or a draw after transformers' own temperature, top-k and
        top-p warpers, in generate's order."""
        if not self.do_sample:
            return logits.argmax(dim=-1)
        probs = torch.softmax(self._warpers(None, logits), dim=-1)
        return torch.multinomial(probs, num_samples=1).squeeze(1)

    @functools.cached_property
    def _warpers(self):
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        warpers = LogitsProcessorList()
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(self.top_p))
        return warpers


@dataclass
class Prediction:
    """One answer. ``boxes`` are every box of it and ``bbox`` the first, xyxy in pixels of the
    ORIGINAL image. No box: ``no_target`` when the model answered that nothing matches (``[]``),
    else ``error`` says why there is none. Boxes are never guessed."""

    bbox: list[float] | None
    boxes: list[list[float]]
    label: str | None
    raw: str
    error: str | None
    no_target: bool = False
    scores: list[float] | None = None  # one per box where the model gives one (a box head's objectness)

    def to_json(self) -> dict:
        """The printed form: boxes rounded to 0.1 px (finer is noise), raw text kept whole."""
        def rounded(box: list[float]) -> list[float]:
            return [round(v, 1) for v in box]

        return {"bbox": rounded(self.bbox) if self.bbox is not None else None,
                "boxes": [rounded(box) for box in self.boxes], "no_target": self.no_target,
                "label": self.label, "raw": self.raw, "error": self.error}

    @classmethod
    def scored(cls, found: list[list[float]], scores: list[float], label: str | None = None,
               error: str | None = None) -> Prediction:
        """A box head's answer: ``found`` boxes with their ``scores``; none (and no error) is a
        no-target answer."""
        return cls(bbox=found[0] if found else None, boxes=found, label=label,
                   raw=json.dumps({"boxes": found, "scores": scores}), error=error,
                   no_target=not found and error is None, scores=scores)

    def above(self, threshold: float) -> Prediction:
        """A box head's answer as it would be at a higher ``threshold``: the boxes scored at least
        it, in the same order; none left is a no-target answer."""
        kept = [(box, score) for box, score in zip(self.boxes, self.scores or ()) if score >= threshold]
        return Prediction.scored([box for box, _ in kept], [score for _, score in kept], self.label, self.error)


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
    raw = processor.tokenizer.decode(ids[: answer_length(ids, processor)], skip_special_tokens=False)
    parsed = boxes.parse_answer(raw, family, original_size, resized_size)
    return Prediction(
        bbox=parsed.box,
        boxes=parsed.boxes,
        label=parsed.labels[0] if parsed.labels else None,
        raw=raw,
        error=parsed.error,
        no_target=parsed.no_target,
    )


def load(name: str, device: str = InferSettings.device, min_pixels: int | None = None, max_pixels: int | None = None,
         who: str = "predict", compile: bool = InferSettings.compile):
    """A model ready for inference: loaded (``models.loading.load_model``) with its own pixel budget,
    overridden where ``min_pixels``/``max_pixels`` are given (``who`` warns: it is not what the
    model was trained at), and the speed-ups installed, liger-kernel's fused kernels included
    where they can run: a decode step of the 3B at batch 64 is ~1,700 kernels, most of them the
    small elementwise ones of RMSNorm, the rotary embeddings and SwiGLU that those fuse (the
    vision tower's fp32 rotation included: eval 1.19x on the 3B). ``compile``: the vision tower
    compiled too, on a GPU (its norms, rotary embedding and casts fused: 1.02x and 1.11x before
    liger-kernel's rope kernel ran the rotation, 0.95x since; 5-8 s of compiling)."""
    from groundtune.models import speedups
    from groundtune.models.loading import load_model, with_resize

    gm = with_resize(load_model(name, device=device), min_pixels, max_pixels, who)
    speedups.install(gm.model, kernels_mode="auto", compile=compile and gm.device.type == "cuda", compile_layers=False)
    return gm


def engine_for(gm, graphs: bool = True) -> Engine | None:
    """The generation engine for ``gm``'s model, or None where it cannot run (the model lacks our
    attention: ``load`` installs it): ``generate`` then uses transformers' ``generate``. One
    engine serves many batches; on a GPU it keeps the decode steps it captured (and their caches)
    until it is dropped. ``graphs=False``: none captured (for weights that move between batches:
    sharded ones, gathered anew each time)."""
    if not Engine.usable(gm.model):
        return None
    return Engine(gm.model, gm.processor.pad_token_id, gm.processor.eos_token_ids, use_graphs=None if graphs else False)


def predict(
    gm,
    images: list[Image.Image],
    phrases: list[str],
    batch_size: int = InferSettings.batch_size,
    max_new_tokens: int = InferSettings.max_new_tokens,
    progress: bool = False,
    names: list[str] | None = None,
    engine: Engine | None = None,
) -> list[Prediction]:
    """Ground each phrase in its image (images already in memory) with greedy decoding
    (``Decoding.greedy``), ``batch_size`` samples per batch.

    ``gm`` is a loaded GroundingModel; images are resized with ITS ResizeSpec and prompted with ITS
    prompt, as in training. The model is put in eval mode and given back in the mode it was in,
    because training calls this in the middle of a run. ``names`` (each image's file) go into
    the error about an image the model cannot take. ``engine``: one the caller keeps (the server),
    whose captured decode steps are reused; by default one for this call (``engine_for``).
    """
    if len(images) != len(phrases):
        raise ValueError(f"got {len(images)} images but {len(phrases)} phrases")
    _check_batch_size(batch_size)
    starts = range(0, len(images), batch_size)
    if progress:
        starts = track(starts, f"predict ({batch_size}/batch)")
    answering = engine if engine is not None else engine_for(gm)
    decoding, predictions = Decoding.greedy(max_new_tokens), []
    for start in starts:
        chunk = list(zip(images[start : start + batch_size], phrases[start : start + batch_size]))
        chunk_names = names[start : start + batch_size] if names is not None else None
        encoded, sizes = encode_prompts(gm, chunk, chunk_names)
        predictions += [p for _, p in generate(gm, encoded, sizes, decoding, engine=answering)]
    return predictions


def predict_records(gm, records: list[dict], data_path, batch_size: int = InferSettings.batch_size,
                    max_new_tokens: int = InferSettings.max_new_tokens, progress: str | None = None,
                    workers: int | None = None) -> list[Prediction]:
    """Greedy predictions for records (``image`` relative to ``data_path``'s folder, ``phrase``,
    and ``width``/``height`` where known), in the records' order.

    Images are read and encoded in ``workers`` DataLoader processes (by default some on a GPU
    machine, none on a CPU one, where they would take cores from the model), one batch at a time:
    a large file never sits in memory. Records are answered largest image first, so each batch
    holds similar sizes, then image by image, so an image's phrases share a batch, one encoding
    and one pass through the vision tower. ``progress``: the progress bar's label, or None for
    none. An image that cannot be read or resized is a DataError naming its file."""
    _check_batch_size(batch_size)
    order = sorted(range(len(records)), key=lambda i: _answer_order(records[i], gm.resize), reverse=True)
    # Each batch's records of one image go to a worker together: it reads and encodes the image once
    # and sends its pixels once for all of them (RefCOCO's val split asks 7.2 phrases of an image).
    batches = [_image_runs(order[start:start + batch_size], records) for start in range(0, len(order), batch_size)]
    workers = default_workers(gm.device) if workers is None else workers
    # Each worker keeps two batches' share in flight, so the next batch is ready when the GPU is.
    runs_per_batch = max(len(runs) for runs in batches) if batches else 1
    items = iter(torch.utils.data.DataLoader(
        _EncodedRecords(gm, records, data_path),
        batch_size=None,
        sampler=[run for runs in batches for run in runs],
        num_workers=workers,
        prefetch_factor=-(-2 * runs_per_batch // workers) if workers else None,
        **stop_signal_workers(workers),
    ))
    arriving = (_gathered(list(itertools.islice(items, len(runs)))) for runs in batches)
    answered = answer_batches(gm, arriving, Decoding.greedy(max_new_tokens), read_ahead=bool(workers))
    if progress:
        answered = track(answered, f"{progress} ({batch_size}/batch)", total=len(batches))
    predictions: list[Prediction | None] = [None] * len(records)
    try:
        for indices, answers in answered:
            for index, (_, prediction) in zip(indices, answers):
                predictions[index] = prediction
    finally:
        # A failure's traceback keeps this frame, and through it the loader and its encoding
        # processes, until the garbage collector finds it; letting go of them here ends them now.
        del answered, arriving, items
    return predictions


def _gathered(items: list[dict]) -> tuple[list[dict], list[tuple], list[int]]:
    """One batch's items from the encoding processes -> its prompts, sizes and record indices."""
    encoded, sizes, indices = [], [], []
    for item in items:
        if "error" in item:
            raise DataError(item["error"])
        encoded += item["encoded"]
        sizes += [item["sizes"]] * len(item["indices"])
        indices += item["indices"]
    return encoded, sizes, indices


def answer_batches(gm, batches: Iterator[tuple[list[dict], list[tuple], T]], decoding: Decoding,
                   engine: Engine | None = None, read_ahead: bool = True,
                   keep_going: bool = False) -> Iterator[tuple[T, list[tuple[list[int], Prediction]] | Exception]]:
    """THE way batches of encoded prompts are answered, by eval and predict (``predict_records``)
    and by the server's model process alike: ``batches`` of (prompts, sizes, a tag of the
    caller's) -> (the tag, ``generate``'s answers), batch after batch, on one engine
    (``engine_for``, made here unless given).

    For a model that takes them so, each batch's prompts go into one row (``qwen.collate_shared``:
    the phrases of an image share its tokens in the prefill), its pixels in page-locked memory on
    a GPU. With ``read_ahead``, a thread takes the next batch from ``batches`` and puts it in its
    row while the model answers this one. ``keep_going``: a batch that fails is answered with its
    exception, and the batches after it still are (the server outlives a failed batch)."""
    one_row = ROW_AHEAD and shares_prefixes(base_model(gm.model))
    pinned = gm.device.type == "cuda"
    answering = engine if engine is not None else engine_for(gm)

    def in_rows():
        for encoded, sizes, tag in batches:
            try:
                row = qwen.collate_shared(encoded, pinned) if one_row and encoded else None
            except Exception as e:
                if not keep_going:
                    raise
                row = e
            yield encoded, sizes, tag, row

    rows = _read_ahead(in_rows()) if read_ahead and READ_AHEAD else in_rows()
    for encoded, sizes, tag, row in rows:
        try:
            if isinstance(row, Exception):
                raise row
            answers = generate(gm, encoded, sizes, decoding, engine=answering, row=row)
        except Exception as e:
            if not keep_going:
                raise
            answers = e
        yield tag, answers


def _read_ahead(batches: Iterator[T]) -> Iterator[T]:
    """``batches``, each next one made in a thread while the caller works on the current one:
    receiving a batch's items from the encoding processes (~70 ms for 64 prompts of the 3B, most
    of it rebuilding their tensors) and putting them in one row (~0.1-0.2 s: ~200 MB of pixels)
    then overlap the GPU's work instead of following it."""
    with ThreadPoolExecutor(max_workers=1) as fetcher:
        upcoming = fetcher.submit(next, batches, None)
        while (batch := upcoming.result()) is not None:
            upcoming = fetcher.submit(next, batches, None)
            yield batch


def _image_runs(indices: list[int], records: list[dict]) -> list[list[int]]:
    """``indices`` cut where the record's image changes (consecutive records of one image together)."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and records[runs[-1][-1]].get("image") == records[i].get("image"):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def default_workers(device) -> int:
    """Encoding processes for ``predict_records``: on a GPU machine enough to keep up with the GPU
    (a 640x480 photo takes ~15 ms to decode, resize and patchify; the 3B answers ~50 a second), on
    a CPU none: the model needs the cores more than the encoding does."""
    if torch.device(device).type == "cpu":
        return 0
    return max(1, min(8, cores() // 2))


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")


def _answer_order(record: dict, resize: boxes.ResizeSpec) -> tuple[int, str, int]:
    """Sort key: the image's pixels as the model sees them (0 where the record does not say its size
    or the resize refuses it: the worker reports that), the image (its phrases side by side, so a
    batch can run it through the vision tower once: ``head_boxes``), then the phrase's length."""
    size = record_size(record)
    pixels = 0
    if size is not None:
        try:
            width, height = resize.resized_size(size)
            pixels = width * height
        except boxes.ResizeError:
            pass
    return pixels, str(record.get("image", "")), len(str(record.get("phrase", "")))


class PromptEncoder:
    """``encode_prompt`` with a model's resize and prompt, the pixels given the model's own dtype
    (the vision tower casts them to it): a bf16 model's batch of 64 photos is 235 MB to move from
    an encoding process instead of 470. Picklable: what those processes keep (here and in the
    server)."""

    def __init__(self, gm):
        self.processor, self.resize, self.prompt = gm.processor, gm.resize, gm.prompt
        self.answer_start = answer_start(gm)
        self.pixel_dtype = gm.model.get_input_embeddings().weight.dtype

    def __call__(self, image: Image.Image, phrase: str, name: str) -> tuple[dict, tuple]:
        return self.many(image, [phrase], name)[0]

    def many(self, image: Image.Image, phrases: list[str], name: str) -> list[tuple[dict, tuple]]:
        """The prompts of several phrases asked of one image, which is resized and patchified once:
        they share one pixel tensor, sent once from an encoding process and recognised as one
        image by ``qwen.image_groups``."""
        encoded, sizes = encode_image_prompts(self.processor, self.resize, self.prompt, image, phrases, name,
                                              self.answer_start)
        pixels = encoded[0]["pixel_values"].to(self.pixel_dtype)
        for one in encoded:
            one["pixel_values"] = pixels
        return [(one, sizes) for one in encoded]


class _EncodedRecords(torch.utils.data.Dataset):
    """Records that show one image (their indices) -> {"indices", "encoded", "sizes"}: the image read
    and encoded once (``PromptEncoder.many``); or {"indices", "error"}: an error is said by the main
    process, not as a worker's traceback."""

    def __init__(self, gm, records: list[dict], data_path):
        self.encode = PromptEncoder(gm)
        self.records, self.data_path = records, data_path

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, indices: list[int]) -> dict:
        record = self.records[indices[0]]
        file = image_path(record, self.data_path)
        try:
            prompts = self.encode.many(load_image(file, record_size(record)),
                                       [str(self.records[i]["phrase"]) for i in indices], str(file))
        except DataError as e:
            return {"indices": indices, "error": str(e)}
        return {"indices": indices, "encoded": [encoded for encoded, _ in prompts], "sizes": prompts[0][1]}


def answer_start(gm) -> str:
    """What ``gm``'s prompts end with: a box head's query (``head.prompt_end``), else nothing."""
    return head.prompt_end(gm.family) if head.head_of(gm.model) is not None else ""


def encode_prompt(processor: qwen.Processor, resize: boxes.ResizeSpec, prompt: str, image: Image.Image,
                  phrase: str, name: str, answer_start: str = "") -> tuple[dict, tuple]:
    """(image, phrase) -> the encoded prompt (image resized with ``resize``, the model's ``prompt``,
    ending with ``answer_start``) and the image's (original size, resized size) for reading the
    answer back. An image the resize cannot take is a DataError naming it (``name``)."""
    encoded, sizes = encode_image_prompts(processor, resize, prompt, image, [phrase], name, answer_start)
    return encoded[0], sizes


def encode_image_prompts(processor: qwen.Processor, resize: boxes.ResizeSpec, prompt: str, image: Image.Image,
                         phrases: list[str], name: str, answer_start: str = "") -> tuple[list[dict], tuple]:
    """``encode_prompt`` for several phrases asked of one image, resized and patchified once: the
    prompts share its pixel tensor."""
    image = to_rgb(image)
    try:
        resized, resized_size = qwen.resize_image(image, resize)
    except boxes.ResizeError as e:
        raise DataError(f"{name} ({image.width}x{image.height}): {e}") from None
    vision = qwen.image_inputs(processor, resized)
    encoded = [qwen.encode(processor, resized, qwen.prompt_text(processor, phrase, prompt, answer_start), vision=vision)
               for phrase in phrases]
    return encoded, (image.size, resized_size)


def encode_prompts(gm, chunk: list[tuple[Image.Image, str]],
                   names: list[str] | None = None) -> tuple[list[dict], list[tuple]]:
    """``encode_prompt`` for (image, phrase) pairs with ``gm``'s resize and prompt; ``names[i]``
    (or its place in the batch) names an image the resize cannot take."""
    encoded, sizes = [], []
    start = answer_start(gm)
    for i, (image, phrase) in enumerate(chunk):
        name = names[i] if names is not None else f"image {i + 1} of the batch"
        one, size = encode_prompt(gm.processor, gm.resize, gm.prompt, image, phrase, name, start)
        encoded.append(one)
        sizes.append(size)
    return encoded, sizes


def generate(gm, encoded: list[dict], sizes: list[tuple], decoding: Decoding, num_samples: int = 1,
             engine: Engine | None = None, row: qwen.SharedRow | None = None) -> list[tuple[list[int], Prediction]]:
    """Answer encoded prompts in one batch with ``decoding``: greedy, or ``num_samples`` sampled
    answers per prompt (RL rollouts). Returns, prompt by prompt and sample by sample, the answer's
    token ids (up to and including its end-of-turn token, exactly as generated) and what they say.
    ``engine`` (``engine_for``) answers; without one, transformers' ``generate`` does. ``row``:
    the prompts already in one row (``qwen.collate_shared``), for the engine or a box head."""
    if num_samples > 1 and not decoding.do_sample:
        raise ValueError(f"{num_samples} answers per prompt need sampling: greedy gives the same one each time")
    if head.head_of(gm.model) is not None:
        if num_samples > 1:
            raise ValueError("a box head answers each prompt in one forward pass: there is nothing to sample")
        return [([], prediction) for prediction in head_boxes(gm, encoded, sizes, row)]
    with evaluating(gm.model):
        if engine is not None:
            answers = engine.generate(encoded, decoding.max_new_tokens, decoding.choose, num_samples,
                                      row if num_samples == 1 else None, compact=not decoding.do_sample)
        else:
            answers = plain_generate(gm, encoded, decoding, num_samples)
    results = []
    for answer, ids in enumerate(answers):
        original, resized = sizes[answer // num_samples]
        end = answer_length(ids, gm.processor)
        results.append((ids[: end + 1], read_answer(ids, gm.processor, gm.family, original, resized)))  # + its stop token
    return results


def head_boxes(gm, encoded: list[dict], sizes: list[tuple], row: qwen.SharedRow | None = None) -> list[Prediction]:
    """A box-head model's answers (models/head.py): the prompts in one forward pass, the head's K
    slots on each prompt's last hidden state and its image's tokens, the slots whose objectness
    reaches the head's threshold kept (``head_answer``).

    The phrases asked of one image (an eval set's, ordered by image; a server request's) share
    their prompts' beginning, the image's hundreds of tokens included: with our attention they run
    through the vision tower and the language model once for all of them (``qwen.collate_shared``),
    and every prompt still gets the states it would get alone. Otherwise (transformers' own
    attention) the prompts are packed in one row where that attention keeps them apart, else
    right-padded. ``row``: the prompts already in one row (``predict_records``)."""
    core = base_model(gm.model)
    layout, image_of_sample = contextlib.nullcontext(), None
    if shares_prefixes(core):
        if row is None:
            row = qwen.collate_shared(encoded)
        batch, layout, image_of_sample = row.inputs, attached(row.layout.to(gm.device)), row.images
        query = torch.zeros(len(encoded), dtype=torch.long), torch.tensor(row.last)
    else:
        packed = keeps_packed_samples_apart(core)
        batch = qwen.collate_packed(encoded) if packed else qwen.collate(encoded, gm.processor.pad_token_id, "right")
        query = head.query_positions(batch)
    batch = {k: v.to(gm.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    tokens = head.image_tokens(batch, core.config, image_of_sample)
    box_head = head.head_of(gm.model)
    with evaluating(gm.model), torch.inference_mode(), layout:
        hidden = core.model(**batch, use_cache=False).last_hidden_state
        units, logits = head.read(box_head, hidden, query, tokens)
    scores = torch.sigmoid(logits.float()).cpu().tolist()
    # the cells layout: a sample's candidates are its own image's cells, the first of its row (a
    # batch pads each row to its largest image's tokens); the slots layout: every slot
    candidates = tokens.mask.sum(dim=1).tolist() if box_head.per_cell else [logits.shape[1]] * len(scores)
    return [head_answer(unit[:n], score[:n], box_head.threshold, original)
            for unit, score, n, (original, _) in zip(units.float().cpu().tolist(), scores, candidates, sizes)]


def head_answer(units: list[list[float]], scores: list[float], threshold: float, size: boxes.Size) -> Prediction:
    """One prompt's slots -> its Prediction: the boxes of the slots whose score is at least
    ``threshold``, mapped to the original image (``size``) and clipped to it, in reading order,
    each with its score; none kept is a no-target answer."""
    kept = [[*boxes.clip_box(boxes.from_unit(unit, size), size), score]
            for unit, score in zip(units, scores) if score >= threshold]
    kept = boxes.reading_order(kept)  # by each box's centre: the score rides along as a fifth number
    return Prediction.scored([k[:4] for k in kept], [k[4] for k in kept])


def plain_generate(gm, encoded: list[dict], decoding: Decoding, num_samples: int = 1) -> list[list[int]]:
    """transformers' ``generate`` on the prompts left-padded into one batch: each row's answer ids
    (padding after its end). Every prompt then ends where its answer starts; the attention mask
    and ``mm_token_type_ids`` are padded with it, and transformers derives the M-RoPE positions
    (and the rope deltas its KV cache continues from) from that mask."""
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
    return out[:, batch["input_ids"].shape[1] :].tolist()


def answer_length(ids: list[int], processor: qwen.Processor) -> int:
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
        problem = record_problem(line.record)
        if problem:
            raise DataError(f"{in_path}:{line.number}: {problem}")
        records.append(line.record)
    return records


def written_by_predict(path: Path) -> bool:
    """Whether ``path`` holds what `groundtune predict --jsonl --out` wrote (its first line a record
    with a ``prediction``): it may be replaced by the next one without --overwrite."""
    try:
        with open(path, encoding="utf-8") as f:
            first = json.loads(f.readline(MAX_LINE_CHARS))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(first, dict) and isinstance(first.get("prediction"), dict)


def predict_jsonl(gm, in_path: str | Path, out_path: str | Path, batch_size: int = InferSettings.batch_size,
                  max_new_tokens: int = InferSettings.max_new_tokens, progress: bool = True,
                  records: list[dict] | None = None) -> int:
    """Predict every line of a JSONL file (``read_queries``; or ``records`` already read from it)
    and write each input record with a ``prediction`` object added, in the file's order; returns
    the number written. The prediction goes in its own field so a canonical file's true ``bbox`` is
    kept beside it."""
    records = read_queries(in_path) if records is None else records
    predictions = predict_records(gm, records, in_path, batch_size, max_new_tokens,
                                  progress="predict" if progress else None)
    with atomic_write(out_path) as f:
        for record, pred in zip(records, predictions):
            f.write(json.dumps({**record, "prediction": pred.to_json()}, ensure_ascii=False) + "\n")
    return len(records)
