"""Everything Qwen-VL-specific: families, model classes, special tokens by name, the grounding
prompt, the chat template, and turning (image, phrase, answer) into model inputs.

Box conventions are not here: they live in groundtune.boxes, keyed by the family name this
module reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image

from groundtune.boxes import ResizeSpec, Size

# config.model_type -> groundtune family name (the key of every box convention)
FAMILY_BY_MODEL_TYPE = {"qwen2_5_vl": "qwen2.5-vl", "qwen2_vl": "qwen2-vl", "qwen3_vl": "qwen3-vl"}
MODEL_CLASS_NAME = {
    "qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen2-vl": "Qwen2VLForConditionalGeneration",
    "qwen3-vl": "Qwen3VLForConditionalGeneration",
}

# The official grounding prompt (QwenLM/Qwen3-VL issue 1721). Scores are prompt-sensitive, so the
# prompt is part of a run's saved settings and eval/serve reuse it.
DEFAULT_PROMPT = (
    'Locate every object that matches the description "{phrase}" in the image. '
    "Report bbox coordinates in JSON format."
)

# Published architectures, for benchmarking them randomly initialised where weights cannot be
# downloaded (speed and memory do not depend on weight values): `--model random:qwen2.5-vl-3b`.
ARCHITECTURES = {
    "qwen2.5-vl-3b": dict(
        text_config=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=128000,
                         rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31]),
        tie_word_embeddings=True,
    ),
    "qwen2.5-vl-7b": dict(
        text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000,
                         rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31]),
        tie_word_embeddings=False,
    ),
}

IMAGE_TOKEN = "<|image_pad|>"
IM_END = "<|im_end|>"
IGNORE_INDEX = -100  # label value that carries no loss (PyTorch cross-entropy's default)


def model_class(family: str):
    import transformers

    return getattr(transformers, MODEL_CLASS_NAME[family])


def family_of(config) -> str:
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILY_BY_MODEL_TYPE:
        raise ValueError(
            f"model type {model_type!r} is not a Qwen-VL model; groundtune supports "
            f"{', '.join(sorted(FAMILY_BY_MODEL_TYPE))}"
        )
    return FAMILY_BY_MODEL_TYPE[model_type]


@dataclass
class Processor:
    """The three things that turn an image and text into model inputs. We call the image processor
    on images WE resized (do_resize=False) so the pixels the model sees and the box targets come
    from one ResizeSpec, never from a second resize inside the library."""

    tokenizer: object
    image_processor: object
    chat_template: str

    @property
    def merge_size(self) -> int:
        return int(getattr(self.image_processor, "merge_size", 2))

    def token_id(self, token: str) -> int:
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == self.tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {token} token; is this a Qwen-VL tokenizer?")
        return tid

    @property
    def image_token_id(self) -> int:
        return self.token_id(IMAGE_TOKEN)

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted({self.token_id(IM_END), self.tokenizer.eos_token_id} - {None})

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id


def resize_image(image: Image.Image, resize: ResizeSpec) -> tuple[Image.Image, Size]:
    """The image exactly as the model sees it, and its (width, height)."""
    size = resize.resized_size(image.size)
    if size != image.size:
        image = image.resize(size, Image.BICUBIC)
    return image, size


def prompt_text(processor: Processor, phrase: str, prompt: str = DEFAULT_PROMPT) -> str:
    """The chat-formatted user turn with one image, ending where the assistant's answer starts."""
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": prompt.format(phrase=phrase)}],
        }
    ]
    return processor.tokenizer.apply_chat_template(
        messages, chat_template=processor.chat_template, tokenize=False, add_generation_prompt=True
    )


def encode(
    processor: Processor,
    resized_image: Image.Image,
    prompt: str,
    answer: str | None = None,
) -> dict[str, torch.Tensor]:
    """One sample -> 1-D ``input_ids`` (+ ``labels`` when an answer is given), ``mm_token_type_ids``,
    ``pixel_values`` and ``image_grid_thw``.

    Labels are IGNORE_INDEX everywhere except the answer and its closing <|im_end|>: the model
    learns to answer, not to repeat the prompt or the image placeholders.
    """
    vision = processor.image_processor(images=[resized_image], do_resize=False, return_tensors="pt")
    grid = vision["image_grid_thw"]
    n_image_tokens = int(grid[0].prod()) // processor.merge_size**2
    prompt = prompt.replace(IMAGE_TOKEN, IMAGE_TOKEN * n_image_tokens, 1)
    prompt_ids = processor.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = (processor.tokenizer(answer + IM_END + "\n", add_special_tokens=False)["input_ids"]
                  if answer is not None else None)
    return _sample(processor, prompt_ids, answer_ids, vision["pixel_values"], grid)


def with_answer_ids(processor: Processor, encoded_prompt: dict[str, torch.Tensor], answer_ids: list[int]) -> dict:
    """An encoded prompt followed by an answer given as token ids (a sampled RL completion, kept
    exactly as generated: re-tokenising its text could give other ids) -> a sample whose labels
    are those ids, as ``encode`` makes for a text answer."""
    return _sample(processor, encoded_prompt["input_ids"].tolist(), list(answer_ids),
                   encoded_prompt["pixel_values"], encoded_prompt["image_grid_thw"])


def _sample(processor: Processor, prompt_ids: list[int], answer_ids: list[int] | None,
            pixel_values: torch.Tensor, grid: torch.Tensor) -> dict[str, torch.Tensor]:
    """The encoded sample: prompt ids (+ answer ids, which alone are labelled), image inputs, and
    what the model needs to place the image tokens."""
    input_ids = torch.tensor(prompt_ids + (answer_ids or []), dtype=torch.long)
    image_tokens = input_ids == processor.image_token_id
    out = {
        "input_ids": input_ids,
        # M-RoPE needs to know which positions are image tokens: without this tensor transformers
        # silently falls back to 1-D positions for the image (a model that cannot see where things are).
        "mm_token_type_ids": image_tokens.int(),
        "position_ids": mrope_positions(image_tokens, grid[0], processor.merge_size),
        "pixel_values": pixel_values,
        "image_grid_thw": grid,
    }
    if answer_ids is not None:
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[len(prompt_ids):] = input_ids[len(prompt_ids):]
        out["labels"] = labels
    return out


def mrope_positions(image_tokens: torch.Tensor, grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """The (3, length) M-RoPE positions (temporal, height, width) of a sequence holding one image:
    text counts up on all three axes; the image's tokens share the temporal position where it
    starts and count rows/columns of its merged grid from there; text after it resumes past the
    largest position used. The same numbers as transformers' ``get_rope_index`` (a test checks
    it), computed here, once per sample in the data workers, because the model computes them
    with a Python loop over the batch on every training step."""
    length = len(image_tokens)
    where = image_tokens.nonzero().flatten()
    if len(where) == 0:
        return torch.arange(length).expand(3, length).clone()
    start, n = int(where[0]), len(where)
    rows, cols = int(grid_thw[1]) // merge_size, int(grid_thw[2]) // merge_size
    if n != rows * cols or int(where[-1]) != start + n - 1:
        raise ValueError(f"expected {rows * cols} consecutive image tokens, found {n}")
    positions = torch.empty(3, length, dtype=torch.long)
    positions[:, :start] = torch.arange(start)
    positions[0, start : start + n] = start
    positions[1, start : start + n] = start + torch.arange(rows).repeat_interleave(cols)
    positions[2, start : start + n] = start + torch.arange(cols).repeat(rows)
    after = start + max(rows, cols)
    positions[:, start + n :] = after + torch.arange(length - start - n)
    return positions


def collate(samples: list[dict[str, torch.Tensor]], pad_token_id: int, padding_side: str = "right") -> dict:
    """Pad a list of encoded samples into a batch. Left padding for generation, right for training."""
    longest = max(len(s["input_ids"]) for s in samples)
    batch = {"input_ids": [], "attention_mask": [], "mm_token_type_ids": [], "position_ids": []}
    has_labels = "labels" in samples[0]
    if has_labels:
        batch["labels"] = []
    for s in samples:
        n = len(s["input_ids"])
        pad = longest - n

        def padded(t: torch.Tensor, value: int) -> torch.Tensor:
            fill = torch.full((pad,), value, dtype=t.dtype)
            return torch.cat([fill, t]) if padding_side == "left" else torch.cat([t, fill])

        batch["input_ids"].append(padded(s["input_ids"], pad_token_id))
        batch["attention_mask"].append(padded(torch.ones(n, dtype=torch.long), 0))
        batch["mm_token_type_ids"].append(padded(s["mm_token_type_ids"], 0))
        batch["position_ids"].append(torch.stack([padded(axis, 0) for axis in s["position_ids"]]))
        if has_labels:
            batch["labels"].append(padded(s["labels"], IGNORE_INDEX))
    out = {k: torch.stack(v) for k, v in batch.items()}
    out["position_ids"] = out["position_ids"].transpose(0, 1)  # (3, batch, length), as the model takes it
    out["pixel_values"] = torch.cat([s["pixel_values"] for s in samples])
    out["image_grid_thw"] = torch.cat([s["image_grid_thw"] for s in samples])
    return out


def collate_packed(samples: list[dict[str, torch.Tensor]]) -> dict:
    """All samples in ONE row without padding (training only): their tokens one after another, the
    M-RoPE positions of each as computed for it alone, and where each sample starts, in the names
    transformers' variable-length attention reads (``cu_seq_lens_q``/``_k``: the starts and the
    end; ``max_length_q``/``_k``: the longest sample). models/attention.py keeps attention within
    each sample (tests/test_objective.py: packed loss == padded loss)."""
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    starts = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(lengths.max())
    out = {
        "input_ids": torch.cat([s["input_ids"] for s in samples])[None],
        "mm_token_type_ids": torch.cat([s["mm_token_type_ids"] for s in samples])[None],
        "position_ids": torch.cat([s["position_ids"] for s in samples], dim=1)[:, None],  # (3, 1, total)
        "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples]),
        "cu_seq_lens_q": starts, "cu_seq_lens_k": starts, "max_length_q": longest, "max_length_k": longest,
    }
    if "labels" in samples[0]:
        # a sample's first token is never labelled, so nothing learns to predict across a boundary
        out["labels"] = torch.cat([s["labels"] for s in samples])[None]
    return out
