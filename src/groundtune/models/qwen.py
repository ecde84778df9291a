"""Everything Qwen-VL-specific: one record per family (transformers' class and module names, the
vision tower's layout, the special tokens, the config builder), the grounding prompt, and turning
(image, phrase, answer) into model inputs.

Every other module asks a ``Family`` record instead of spelling a Qwen class name, module path,
token or factor itself, so a new family (or a renamed class in a transformers release) is one
record here and one in groundtune/families.py, which holds the facts the layers below the model
need too (box coordinates and answer form, patch and merge size, the pixel budget Qwen ships):
a ``Family`` reads those from there (``Family.facts``) and keeps no copy.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from PIL import Image

from groundtune import families
from groundtune.boxes import ResizeSpec, Size
from groundtune.errors import ModelError
from groundtune.models.attention import SharedPrefixes


@dataclass(frozen=True)
class Tokens:
    """The special tokens of every Qwen-VL tokenizer, looked up by name (never by id: ids differ
    between tokenizers, the tiny model's included)."""

    end_of_text: str = "<|endoftext|>"
    im_start: str = "<|im_start|>"
    im_end: str = "<|im_end|>"  # ends a turn: the answer's stop token
    image: str = "<|image_pad|>"  # one per merged image patch
    video: str = "<|video_pad|>"
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"
    # the tokenizer's full list, in Qwen's order (the tiny model's tokenizer is built with it)
    all: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                            "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
                            "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                            "<|video_pad|>")


TOKENS = Tokens()


def _shared(fact: str) -> property:
    """A ``Family`` attribute read from its ``facts`` (groundtune.families), not copied."""
    return property(lambda self: getattr(self.facts, fact), doc=f"``families.Facts.{fact}``")


@dataclass(frozen=True)
class Family:
    """What groundtune knows of one Qwen-VL family, in transformers 5's names."""

    facts: families.Facts  # what the layers below the model know of it too
    model_class: str  # the image-text-to-text model class in transformers
    config_class: str
    vision_attention: str  # class of the vision tower's attention layers (models/attention.py replaces their forward)
    merger_modules: tuple[str, ...]  # modules under the vision tower that project into the LLM (the "merger" part)
    padded_vision_mlp: str | None = None  # vision MLP class with a width cuBLAS runs slowly (models/kernels.py pads it)
    # Module paths, the same in the three families (transformers 5):
    vision_tower: str = "visual"  # model.visual: the vision tower, merger included
    decoder_layers: str = "language_model.layers"  # the LLM's decoder layers, each with self_attn and mlp
    vision_blocks: str = "visual.blocks"  # the vision tower's transformer blocks
    lm_head: str = "lm_head"
    # apply_rotary_pos_emb_vision: the function of the modeling module our vision attention calls
    vision_rotary: str = "apply_rotary_pos_emb_vision"
    # the modeling module's function its language-model attention rotates queries and keys with (the
    # M-RoPE sections already merged into cos/sin by its rotary module); models/kernels.py fuses it
    text_rotary: str = "apply_rotary_pos_emb"
    image_processor_class: str = "Qwen2VLImageProcessorPil"  # the PIL backend: no torchvision needed
    # whether the image's features enter the LLM only in place of its image tokens (so samples that show
    # one image can share one vision pass, shared_image_inputs); Qwen3-VL also adds DeepStack features
    # inside early LLM layers, which only the model's own forward from pixel_values passes on
    image_features_alone: bool = True

    # the facts the layers below the model know too, read from groundtune.families
    name = _shared("name")
    model_type = _shared("model_type")  # config.model_type
    patch_size = _shared("patch_size")
    merge_size = _shared("merge_size")
    factor = _shared("factor")
    min_pixels = _shared("min_pixels")
    max_pixels = _shared("max_pixels")

    @property
    def modeling_module(self) -> str:
        return f"transformers.models.{self.model_type}.modeling_{self.model_type}"

    @property
    def keep_in_bf16(self) -> list[str]:
        """Module paths QLoRA leaves unquantized: the vision tower (small and sensitive) and the LM
        head. bitsandbytes matches from the start of a module's path, so the path is written whole."""
        return [f"model.{self.vision_tower}", self.lm_head]

    def default_resize(self) -> ResizeSpec:
        return ResizeSpec(factor=self.factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def transformers_class(self, attribute: str = "model_class"):
        import transformers

        return getattr(transformers, getattr(self, attribute))

    def mergers(self, model) -> list:
        """The merger modules a forward calls (Qwen3-VL's DeepStack mergers one by one) of a
        transformers model (under a PEFT wrapper too)."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        tower = getattr(base.model, self.vision_tower)
        found = [getattr(tower, name, None) for name in self.merger_modules]
        return [m for module in found if module is not None
                for m in (module if isinstance(module, torch.nn.ModuleList) else [module])]

    def part_of(self, name: str) -> str:
        """vision | merger | llm, from a parameter or module name (PEFT prefixes included)."""
        tower = rf"(^|\.){self.vision_tower}\."
        if re.search(tower + "(" + "|".join(self.merger_modules) + r")(\.|$)", name):
            return "merger"
        return "vision" if re.search(tower, name) else "llm"

    def llm_layer(self, name: str) -> tuple[int, str] | None:
        """(layer index, "attn" | "mlp") of a module inside an LLM decoder layer, else None."""
        match = re.search(rf"{re.escape(self.decoder_layers)}\.(\d+)\.(self_attn|mlp)\.", name)
        if match is None:
            return None
        return int(match.group(1)), "attn" if match.group(2) == "self_attn" else "mlp"

    def decoder_layer_list(self, model) -> torch.nn.ModuleList:
        """The LLM's decoder layers of ``model`` (a PEFT wrapper included)."""
        return self._module_list(model, self.decoder_layers)

    def vision_block_list(self, model) -> torch.nn.ModuleList:
        """The vision tower's blocks of ``model`` (a PEFT wrapper included)."""
        return self._module_list(model, self.vision_blocks)

    def _module_list(self, model, path: str) -> torch.nn.ModuleList:
        for name, module in model.named_modules():
            if name.endswith(path) and isinstance(module, torch.nn.ModuleList):
                return module
        raise ModelError(f"no {path} in this model; is it a {self.name} model?")

    def build_config(self, token_ids: dict[str, int], text: dict, vision: dict, tie_word_embeddings: bool):
        """A transformers config of this family: ``text``/``vision`` give the sizes, ``token_ids`` the
        ids of TOKENS' fields in the tokenizer the model will speak (for ``random:`` architectures,
        the tiny model and test models)."""
        return self.transformers_class("config_class")(
            text_config=dict(text, bos_token_id=token_ids["end_of_text"], eos_token_id=token_ids["im_end"],
                             pad_token_id=token_ids["end_of_text"], tie_word_embeddings=tie_word_embeddings),
            vision_config=dict(vision, patch_size=self.patch_size, spatial_merge_size=self.merge_size),
            image_token_id=token_ids["image"], video_token_id=token_ids["video"],
            vision_start_token_id=token_ids["vision_start"], vision_end_token_id=token_ids["vision_end"],
            tie_word_embeddings=tie_word_embeddings,
        )


FAMILIES = {
    f.name: f
    for f in (
        Family(families.family("qwen2-vl"), model_class="Qwen2VLForConditionalGeneration",
               config_class="Qwen2VLConfig", vision_attention="VisionAttention", merger_modules=("merger",)),
        Family(families.family("qwen2.5-vl"),
               model_class="Qwen2_5_VLForConditionalGeneration", config_class="Qwen2_5_VLConfig",
               vision_attention="Qwen2_5_VLVisionAttention", merger_modules=("merger",),
               # its 3,420-wide intermediate is no multiple of 8
               padded_vision_mlp="Qwen2_5_VLMLP"),
        # Qwen3-VL: DeepStack mergers that feed vision features into early LLM layers
        Family(families.family("qwen3-vl"), model_class="Qwen3VLForConditionalGeneration",
               config_class="Qwen3VLConfig", vision_attention="Qwen3VLVisionAttention",
               merger_modules=("merger", "deepstack_merger_list"), image_features_alone=False),
    )
}

# The official grounding prompt (QwenLM/Qwen3-VL issue 1721). Scores are prompt-sensitive, so the
# prompt is part of a run's saved settings and eval/serve reuse it.
DEFAULT_PROMPT = (
    'Locate every object that matches the description "{phrase}" in the image. '
    "Report bbox coordinates in JSON format."
)

IGNORE_INDEX = -100  # label value that carries no loss (PyTorch cross-entropy's default)


def family(name: str) -> Family:
    """The record of a family by groundtune's name."""
    if name not in FAMILIES:
        raise ModelError(f"unknown model family {name!r}; expected one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(model_or_config) -> Family:
    """The record of a model's family, from the model (a PEFT wrapper included) or its transformers
    config: the one way from a model to its record, for code that holds either."""
    config = getattr(model_or_config, "config", model_or_config)  # a config has no .config; a model's is its own
    model_type = getattr(config, "model_type", None)
    for record in FAMILIES.values():
        if record.model_type == model_type:
            return record
    raise ModelError(f"model type {model_type!r} is not a Qwen-VL model; groundtune supports "
                     f"{', '.join(f.model_type for f in FAMILIES.values())}")


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
        # an unknown token maps to the unknown token's id (Qwen's is <|endoftext|>, a real token)
        if tid is None or self.tokenizer.convert_ids_to_tokens(tid) != token:
            raise ModelError(f"the tokenizer has no {token} token; is this a Qwen-VL tokenizer?")
        return tid

    @property
    def image_token_id(self) -> int:
        return self.token_id(TOKENS.image)

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted({self.token_id(TOKENS.im_end), self.tokenizer.eos_token_id} - {None})

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    def config_token_ids(self) -> dict[str, int]:
        """The ids of the tokens a model config names (Family.build_config's ``token_ids``)."""
        names = ("end_of_text", "im_end", "image", "video", "vision_start", "vision_end")
        return {name: self.token_id(getattr(TOKENS, name)) for name in names}

    def text_pieces(self, text: PhraseText | str) -> list[int | list[str]]:
        """``text`` cut where the tokenizer cuts it before tokenizing: at each added token its writer
        wrote (chat template, prompt, answer format), given as its id, a control token; between
        them the text, as the writer's strings around the phrase (a list of one string where the
        phrase is not in it). The phrase is put in only after the cut, so whatever it spells stays
        inside a text piece."""
        parts = text.parts if isinstance(text, PhraseText) else (text,)
        pieces: list[int | list[str]] = []
        around = [""]  # the current text piece: the strings between its copies of the phrase
        for n, part in enumerate(parts):
            if n:
                around.append("")
            start = 0
            for match in self._added_tokens_pattern.finditer(part):
                around[-1] += part[start : match.start()]
                pieces += [around, self._added_tokens[match.group()]]
                around, start = [""], match.end()
            around[-1] += part[start:]
        pieces.append(around)
        return [piece for piece in pieces if piece != [""]]

    def tokenize(self, text: PhraseText | str) -> list[int]:
        """The token ids of ``text``: the writer's added tokens as control tokens, and each text piece
        (``text_pieces``, the phrase put back in) tokenized on its own with special tokens' spellings
        as text. A plain ``str`` is all the writer's. For a phrase that spells no added token these
        are exactly the ids of tokenizing the whole text at once (the tokenizer also tokenizes the
        pieces between added tokens one by one; tests/test_phrase_text.py checks it)."""
        phrase = text.phrase if isinstance(text, PhraseText) else ""
        ids: list[int] = []
        for piece in self.text_pieces(text):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids += self._text_tokenizer.encode(phrase.join(piece), add_special_tokens=False).ids
        return ids

    def __getstate__(self) -> dict:
        # the cached properties below are left out and made again where the processor is unpickled
        # (encoding processes): a pickled ``tokenizers`` backend forgets its encode_special_tokens
        return {name: value for name, value in self.__dict__.items() if not name.startswith("_")}

    @functools.cached_property
    def _added_tokens(self) -> dict[str, int]:
        """Every added token (special or not) by its text: where the tokenizer cuts text."""
        added = self.tokenizer.added_tokens_decoder
        # text_pieces cuts at a token's exact spelling, as the tokenizer does for Qwen's tokens; a
        # token that also takes the spaces around it would be cut elsewhere by the tokenizer
        odd = [t.content for t in added.values() if t.lstrip or t.rstrip or t.single_word]
        if odd:
            raise ModelError(f"the tokenizer's added tokens {', '.join(odd)} take spaces around them "
                             "(lstrip/rstrip/single_word); groundtune's Qwen-VL prompts expect none that do")
        return {token.content: token_id for token_id, token in added.items()}

    @functools.cached_property
    def _added_tokens_pattern(self) -> re.Pattern:
        # longest first: the tokenizer takes the longest added token that matches at a place
        longest_first = sorted(self._added_tokens, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")

    @functools.cached_property
    def _text_tokenizer(self):
        """A copy of the tokenizer's ``tokenizers`` backend that tokenizes special tokens' spellings as
        text (``encode_special_tokens``), the same flag transformers' ``split_special_tokens=True``
        sets, and the runner of an ONNX export sets (onnx_predict.py). A copy rather than that call
        argument: the argument sets the flag on the tokenizer's SHARED backend and leaves it set
        until the next call sets it back, so prompts encoded in two threads at once (the server)
        could each read the other's flag; this copy's flag never changes. ``backend_tokenizer`` and
        ``encode_special_tokens`` are the same in transformers 5.17 and 5.24."""
        from tokenizers import Tokenizer

        backend = self.tokenizer.backend_tokenizer
        copy = Tokenizer.from_str(backend.to_str())
        copy.no_truncation()  # transformers sets these per call on its own backend; the copy has none
        copy.no_padding()
        copy.encode_special_tokens = True
        return copy


def resize_image(image: Image.Image, resize: ResizeSpec) -> tuple[Image.Image, Size]:
    """The image exactly as the model sees it, and its (width, height)."""
    size = resize.resized_size(image.size)
    if size != image.size:
        image = image.resize(size, Image.BICUBIC)
    return image, size


# Stands for the phrase while the text around it is written and cut at its added tokens (a
# private-use character: no tokenizer spells a token with it, and json.dumps leaves it as it is)
PHRASE_SLOT = "\ue000"


@dataclass(frozen=True)
class PhraseText:
    """A text written around a caller's phrase: ``parts``, the writer's own text (chat template,
    prompt, answer format), whose added tokens are control tokens, with ``phrase`` between each two
    of them, as the writer writes it (a JSON answer escapes its quotes), always tokenized as text
    (``Processor.tokenize``): a phrase can never close a turn or add an image."""

    parts: tuple[str, ...]
    phrase: str

    @classmethod
    def written(cls, write: Callable[[str], str], phrase: str) -> "PhraseText":
        """What ``write(phrase)`` writes, told apart from the phrase: ``write`` is run once with
        PHRASE_SLOT, whose copies give the parts, and once with the phrase, which gives how the
        phrase is written between them (every copy alike)."""
        parts = write(PHRASE_SLOT).split(PHRASE_SLOT)
        text = write(phrase)
        copies = len(parts) - 1
        phrase_length = (len(text) - sum(map(len, parts))) // copies if copies else 0
        as_written = text[len(parts[0]) : len(parts[0]) + phrase_length]
        if as_written.join(parts) != text:
            raise ModelError(f"the prompt (or answer format) writes the phrase {phrase!r} in more than one way, "
                             f"or itself holds {PHRASE_SLOT!r}; write the phrase as given, the same at every place")
        return cls(tuple(parts), as_written)

    def __str__(self) -> str:
        return self.phrase.join(self.parts)

    def __add__(self, text: str) -> "PhraseText":
        """This text followed by ``text``, the writer's own (the answer's stop token, say)."""
        return PhraseText(self.parts[:-1] + (self.parts[-1] + text,), self.phrase)


def prompt_text(processor: Processor, phrase: str, prompt: str = DEFAULT_PROMPT, answer_start: str = "") -> PhraseText:
    """The chat-formatted user turn with one image, ending where the assistant's answer starts, or
    with ``answer_start``: the answer's first words, given (a box head's query, models/head.py)."""

    def write(phrase: str) -> str:
        messages = [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": prompt.format(phrase=phrase)}],
            }
        ]
        return processor.tokenizer.apply_chat_template(
            messages, chat_template=processor.chat_template, tokenize=False, add_generation_prompt=True
        ) + answer_start

    return PhraseText.written(write, phrase)


def image_inputs(processor: Processor, resized_image: Image.Image) -> dict[str, torch.Tensor]:
    """The image's ``pixel_values`` and ``image_grid_thw``: what ``encode`` needs of it, to be made
    once for all the prompts that show it."""
    return dict(processor.image_processor(images=[resized_image], do_resize=False, return_tensors="pt"))


def encode(
    processor: Processor,
    resized_image: Image.Image,
    prompt: PhraseText | str,
    answer: PhraseText | str | None = None,
    vision: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """One sample -> 1-D ``input_ids`` (+ ``labels`` when an answer is given), ``mm_token_type_ids``,
    ``pixel_values`` and ``image_grid_thw`` (``vision``'s tensors themselves where given:
    ``image_inputs`` of this image). ``prompt`` and ``answer``: a text written around a phrase
    (``PhraseText``: ``prompt_text``), or a ``str`` that is all its writer's, tokenized by
    ``Processor.tokenize``.

    Labels are IGNORE_INDEX everywhere except the answer and its closing <|im_end|>: the model
    learns to answer, not to repeat the prompt or the image placeholders.
    """
    vision = image_inputs(processor, resized_image) if vision is None else vision
    grid = vision["image_grid_thw"]
    n_image_tokens = int(grid[0].prod()) // processor.merge_size**2
    prompt_ids = processor.tokenize(prompt)
    image = processor.image_token_id
    if image in prompt_ids:  # the template's one placeholder (a phrase's spelling of it is text), once per token
        at = prompt_ids.index(image)
        prompt_ids[at : at + 1] = [image] * n_image_tokens
    answer_ids = processor.tokenize(answer + TOKENS.im_end + "\n") if answer is not None else None
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


def image_groups(samples: list[dict[str, torch.Tensor]]) -> list[list[int]]:
    """The samples that show one image, group by group in first-seen order: the same pixel tensor
    (phrases encoded together, ``encode(..., vision=)``) or an equal one (equal grid and pixels)."""
    groups: list[list[int]] = []
    by_key: dict[tuple, list[list[int]]] = {}
    for i, sample in enumerate(samples):
        pixels = sample["pixel_values"]
        # a cheap key first (a strided sum of the pixels), so only likely-equal images are compared
        key = (tuple(sample["image_grid_thw"].flatten().tolist()), float(pixels.flatten()[::101].float().sum()))
        for group in by_key.get(key, []):
            seen = samples[group[0]]["pixel_values"]
            if seen is pixels or torch.equal(seen, pixels):
                group.append(i)
                break
        else:
            groups.append([i])
            by_key.setdefault(key, []).append(groups[-1])
    return groups


@dataclass
class SharedRow:
    """``collate_shared``'s answer: the model's inputs, the attention they need attached
    (``attention.SharedPrefixes``), for each sample the row positions of its tokens in order
    (``tokens[i]``; its last is where its prompt ends) and which of the row's images it shows
    (``images[i]``, in ``image_grid_thw``'s order)."""

    inputs: dict
    layout: SharedPrefixes
    tokens: list[list[int]]
    images: list[int]

    @property
    def last(self) -> list[int]:
        return [positions[-1] for positions in self.tokens]


def collate_shared(samples: list[dict[str, torch.Tensor]], pinned: bool = False) -> SharedRow:
    """Prompts (no labels) in ONE row, as ``collate_packed`` puts them, except that the prompts of a
    group (``image_groups``: one image, several phrases) share the tokens they begin with: the
    system turn, the image, the words before the phrase. The row holds those once, then each
    prompt's rest. Each prompt's rest attends to the shared tokens and then to itself, with the
    positions it has alone, so every prompt's states are those it would have alone (a test checks
    it), and an image of ~400 tokens is run through the vision tower and the language model once
    for all its phrases. A group whose shared beginning would not hold the whole image is packed
    prompt by prompt. ``pinned``: the images' pixels put in page-locked memory (a GPU batch's
    ~200 MB then reach the GPU without a second copy, and without holding up the host)."""
    row_tokens, queries, keys, key_bounds = [], [0], [], [0]
    tokens: list[list[int]] = [[] for _ in samples]
    images = [0] * len(samples)
    pixels, grids = [], []

    def add(sample: dict, start: int, end: int, shared: list[int]) -> list[int]:
        """Put ``sample``'s tokens start:end in the row, attending to ``shared`` then themselves."""
        first = queries[-1]
        positions = list(range(first, first + end - start))
        row_tokens.append((sample, start, end))
        queries.append(first + end - start)
        keys.extend(shared + positions)
        key_bounds.append(len(keys))
        return positions

    for group in image_groups(samples):
        shared = _shared_length([samples[i] for i in group])
        prefix = add(samples[group[0]], 0, shared, []) if shared else []
        for i in group:
            if i == group[0] or not shared:  # the image inputs, in the order of the row's images
                pixels.append(samples[i]["pixel_values"])
                grids.append(samples[i]["image_grid_thw"])
            images[i] = len(pixels) - 1
            tokens[i] = prefix + add(samples[i], shared, len(samples[i]["input_ids"]), prefix)
    bounds = torch.tensor(queries, dtype=torch.int32)
    inputs = {
        "input_ids": torch.cat([s["input_ids"][a:b] for s, a, b in row_tokens])[None],
        "mm_token_type_ids": torch.cat([s["mm_token_type_ids"][a:b] for s, a, b in row_tokens])[None],
        "position_ids": torch.cat([s["position_ids"][:, a:b] for s, a, b in row_tokens], dim=1)[:, None],
        "pixel_values": _cat(pixels, pinned),
        "image_grid_thw": torch.cat(grids),
        # marks the row as packed for transformers; the attention itself follows the layout
        "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds,
        "max_length_q": int((bounds[1:] - bounds[:-1]).max()), "max_length_k": int((bounds[1:] - bounds[:-1]).max()),
    }
    return SharedRow(inputs, SharedPrefixes(queries, keys, key_bounds), tokens, images)


def _cat(tensors: list[torch.Tensor], pinned: bool) -> torch.Tensor:
    if not pinned:
        return torch.cat(tensors)
    rows = sum(len(t) for t in tensors)
    return torch.cat(tensors, out=torch.empty((rows, *tensors[0].shape[1:]), dtype=tensors[0].dtype, pin_memory=True))


def collate_answers(samples: list[dict[str, torch.Tensor]]) -> dict:
    """Answered samples (with labels: an RL update's G answers to each prompt) in ONE row, as
    ``collate_shared`` puts prompts: the answers to one prompt share its tokens, the image's
    included, which go through the vision tower and the language model once for all of them
    (and the first tokens the answers have in common, once). Besides the model's inputs, what
    ``train/objective.py`` reads in place of ``labels``: ``layout`` (the attention to attach),
    and for every labelled token, sample by sample, the row position whose state predicts it
    (``answer_index``), the token (``answer_targets``) and its sample (``answer_owner``)."""
    row = collate_shared(samples)
    index, targets, owner = [], [], []
    for i, (sample, positions) in enumerate(zip(samples, row.tokens)):
        following = sample["labels"][1:]  # the state at token t predicts token t + 1
        labelled = (following != IGNORE_INDEX).nonzero()[:, 0]
        index.append(torch.tensor(positions)[labelled])
        targets.append(following[labelled])
        owner.append(torch.full((len(labelled),), i))
    return {**row.inputs, "layout": row.layout, "answer_index": torch.cat(index),
            "answer_targets": torch.cat(targets), "answer_owner": torch.cat(owner)}


def _shared_length(group: list[dict[str, torch.Tensor]]) -> int:
    """How many first tokens the prompts of ``group`` (one image) share: all their common tokens
    but at least one of each prompt's own, and only when that covers the image; else 0."""
    if len(group) < 2:
        return 0
    first = group[0]["input_ids"]
    shared = min(len(s["input_ids"]) for s in group) - 1
    for sample in group[1:]:
        differ = (sample["input_ids"][:shared] != first[:shared]).nonzero()
        if len(differ):
            shared = int(differ[0])
    image = group[0]["mm_token_type_ids"].nonzero()
    return shared if len(image) and int(image[-1]) < shared else 0


def shared_image_inputs(core, inputs: dict, image_of_sample: list[int]) -> dict:
    """A batch's model inputs with its images' features in place of their tokens (``inputs_embeds``),
    each distinct image through the vision tower once: sample i (a padded batch's row, or one sample
    of a packed row) shows the image of sample ``image_of_sample[i]``. What the model's forward would
    do with ``pixel_values``, which would run an image once per sample that shows it: the G answers
    of an RL prompt (train/objective.py); inference shares more (``collate_shared``). A
    trained vision LoRA gets the gradients of every sample that shows the image, summed, as it would
    from separate passes. Only for a family whose ``image_features_alone``."""
    inputs = dict(inputs)
    grid, pixels, input_ids = inputs.pop("image_grid_thw"), inputs.pop("pixel_values"), inputs.pop("input_ids")
    inputs.pop("mm_token_type_ids", None)  # only used to derive positions, which the batch gives
    per_sample = pixels.split(grid.prod(-1).tolist())
    shown = sorted(set(image_of_sample))
    features = core.model.get_image_features(torch.cat([per_sample[i] for i in shown]), grid[shown]).pooler_output
    by_sample = dict(zip(shown, features))
    embeds = core.model.get_input_embeddings()(input_ids)
    image_embeds = torch.cat([by_sample[i] for i in image_of_sample]).to(embeds.dtype)
    image_tokens = (input_ids == core.config.image_token_id)[..., None]
    inputs["inputs_embeds"] = embeds.masked_scatter(image_tokens, image_embeds)
    return inputs
