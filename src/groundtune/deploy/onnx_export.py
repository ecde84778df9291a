"""A box-head model as one ONNX graph, for ONNX Runtime (``groundtune export RUN --out DIR --onnx
--image-size WxH``): vision tower, language model (LoRA merged) and box head, in fp32.

    inputs   input_ids       (batch, length) int64  prompts, right-padded (any phrase length)
             attention_mask  (batch, length) int64  1 on each prompt's tokens
             pixel_values    (batch, patches, patch_dim) float32  images at the export's size
    outputs  boxes           (batch, K, 4) float32  each slot's box, xyxy as fractions of the image
             scores          (batch, K) float32     each slot's objectness (sigmoid)

``onnx_predict.py`` (copied into the export) builds these inputs with numpy, Pillow and the
tokenizer file alone, keeps the slots whose score reaches the head's threshold (``groundtune.json``'s
``onnx`` section holds it), and maps their fractions back to the caller's pixels.

Why not trace transformers' forward as it is: its vision tower derives the window order of the
patches, each layer's attention spans and the rotary tables from ``image_grid_thw`` with Python
loops over the images (and, without flash-attention, splits attention per window with
``.tolist()``), which a traced graph holds only for the batch it was traced with. At a fixed
image size those are the same for every image: ONE probe run of the tower on a blank image of that
size records what the tower itself computes (``_probe``), and the graph runs the tower's own
layers on a batch of images with each layer's attention as one SDPA call under a constant
per-image mask (a window layer's mask keeps each patch in its window). The language model is
transformers' own, given the image features in place of the image tokens and the M-RoPE
positions computed in the graph; with right padding its causal attention alone keeps each
prompt's states clear of the padding. The head reads each prompt's last state and its image's
tokens, which every prompt holds at the same place (models/head.py). The threshold stays out of
the graph: every slot's score comes out, and the runner chooses.
tests/test_onnx.py checks the graph against groundtune's own box-head path and ONNX Runtime
against PyTorch.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

from groundtune import boxes, families
from groundtune.errors import ConfigError, MissingPackageError
from groundtune.models import head, qwen
from groundtune.models.adapt import base_model

ONNX_FILE = "model.onnx"
SCRIPT_FILE = "onnx_predict.py"
# the phrase export_onnx writes the prompt with: spaces and quotes, so a template that trims or
# escapes the phrase (which onnx_predict.py, writing it as given, would not) is caught
PROBE_PHRASE = ' a "b" '
EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf caps one file at 2 GB: bigger weights go beside it
MAX_BATCH = 1024  # the graph's batch axis is dynamic up to this (the exporter wants a bound)


def check_ready() -> None:
    """Fail before any model loads when torch's ONNX exporter cannot run here."""
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401  (what torch's exporter writes the graph with)
    except ImportError:
        raise MissingPackageError("--onnx needs the ONNX exporter: pip install 'groundtune[onnx]'") from None


def export_onnx(model, box_head, processor: qwen.Processor, family: str, resize: boxes.ResizeSpec, prompt: str,
                image_size: tuple[int, int], folder: Path) -> dict:
    """Write ``folder/model.onnx`` for images of ``image_size`` (width, height: resized as the run
    resizes them) and return what ``onnx_predict.py`` needs to feed it (``groundtune.json``'s
    ``onnx`` section). ``model``: the merged fp32 model; ``box_head`` its head."""
    if not families.family(family).onnx:  # the table says which families the graph is built for, and why not
        supported = [name for name, facts in families.FAMILIES.items() if facts.onnx]
        raise ConfigError(f"--onnx: ONNX export supports {', '.join(supported)} models; this one is {family}")
    try:
        resized = resize.resized_size(image_size)
    except boxes.ResizeError as e:
        raise ConfigError(f"--image-size {image_size[0]}x{image_size[1]}: {e}") from None
    blank = Image.new("RGB", resized, (128, 128, 128))
    query = head.prompt_end(family)  # where the head reads (models/head.py)
    encoded = qwen.encode(processor, blank, qwen.prompt_text(processor, "a", prompt, query))
    core = base_model(model)
    if str(core.config.get_text_config()._attn_implementation) not in ("sdpa", "eager"):
        core.set_attn_implementation("sdpa")  # a graph of standard operators
    graph = BoxGraph(core, box_head, encoded, processor).eval()
    example = qwen.collate([encoded, encoded], processor.pad_token_id, "right")
    inputs = (example["input_ids"], example["attention_mask"], encoded["pixel_values"].expand(2, -1, -1).contiguous())
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    length = torch.export.Dim("length", min=2, max=core.config.get_text_config().max_position_embeddings)
    external = sum(p.numel() * p.element_size() for p in graph.parameters()) > EXTERNAL_DATA_BYTES
    with torch.no_grad(), _exporter_quiet():
        torch.onnx.export(
            graph, inputs, str(folder / ONNX_FILE), dynamo=True, verbose=False,
            input_names=["input_ids", "attention_mask", "pixel_values"], output_names=["boxes", "scores"],
            dynamic_shapes={"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length},
                            "pixel_values": {0: batch}},
            external_data=external,
        )
    image = processor.image_processor
    return {
        "file": ONNX_FILE,
        **({"weights_file": ONNX_FILE + ".data"} if external else {}),  # beside it: ONNX Runtime finds it
        "image_size": list(resized),  # every image is resized to this (width, height)
        "slots": len(box_head.slots),
        "threshold": box_head.threshold,  # an answer keeps the slots whose score is at least this
        "exported_for": list(image_size),
        "patches": graph.patches,
        "prompt": prompt_pieces(processor, qwen.prompt_text(processor, PROBE_PHRASE, prompt, query),
                                graph.image_tokens),
        "pad_token_id": processor.pad_token_id,
        "image_mean": [float(v) for v in image.image_mean],
        "image_std": [float(v) for v in image.image_std],
        "patch_size": image.patch_size,
        "temporal_patch_size": image.temporal_patch_size,
        "merge_size": image.merge_size,
    }


def prompt_pieces(processor: qwen.Processor, text: qwen.PhraseText, image_tokens: int) -> list[dict]:
    """What onnx_predict.py builds a prompt's ids from, in order: ``{"ids": [...]}``, the template's
    control tokens (its image placeholder once per image token), and ``{"text": [...]}``, a piece of
    text to tokenize with the phrase between its strings and special tokens' spellings as text:
    ``Processor.tokenize``'s pieces (``text_pieces``), so both give the same ids for any phrase."""
    if text.phrase != PROBE_PHRASE:
        raise ConfigError(f"--onnx: the chat template writes the phrase {PROBE_PHRASE!r} as {text.phrase!r}; "
                          "onnx_predict.py writes a phrase as given")
    pieces: list[dict] = []
    for piece in processor.text_pieces(text):
        if isinstance(piece, list):
            pieces.append({"text": piece})
            continue
        ids = [piece] * image_tokens if piece == processor.image_token_id else [piece]
        if pieces and "ids" in pieces[-1]:
            pieces[-1]["ids"] += ids
        else:
            pieces.append({"ids": ids})
    return pieces


@contextlib.contextmanager
def _exporter_quiet():
    """The exporter's own warnings (torchvision ops it skips, dynamic axes it renames, a pytree
    deprecation) say nothing about the export: kept off the user's terminal. Errors still raise."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def script_source() -> str:
    """The standalone runner copied into the export (this package's ``onnx_predict`` module)."""
    return (Path(__file__).parent / SCRIPT_FILE).read_text()


class BoxGraph(torch.nn.Module):
    """The box-head model for images of one size, batched without per-image Python: what the
    ONNX file holds (the module docstring says why it is built this way)."""

    def __init__(self, core, box_head, encoded: dict[str, torch.Tensor], processor: qwen.Processor):
        super().__init__()
        self.visual, self.language_model, self.head = core.model.visual, core.model.language_model, box_head
        self.image_token_id = processor.image_token_id
        pixel_values, grid = encoded["pixel_values"], encoded["image_grid_thw"]
        self.patches, self.patch_dim = pixel_values.shape
        order, spans, rotary = _probe(self.visual, pixel_values, grid)
        unit = processor.merge_size**2  # patches merged into one image token, kept together by the window order
        self.register_buffer("order", order, persistent=False)
        self.register_buffer("unorder", torch.argsort(order.view(-1, unit)[:, 0] // unit), persistent=False)
        # the family's own rotary function, from the module that defines its vision attention
        rotate = getattr(sys.modules[type(self.visual.blocks[0].attn).__module__], qwen.family_of(core.config).vision_rotary)
        for block, layer_spans in zip(self.visual.blocks, spans):
            _batched_attention(block.attn, self.patches, layer_spans, rotary, rotate)
        rows, cols = (int(n) // processor.merge_size for n in grid[0, 1:])
        self.image_tokens, self.after_image = rows * cols, max(rows, cols)
        self.register_buffer("row_of", torch.arange(rows).repeat_interleave(cols), persistent=False)
        self.register_buffer("col_of", torch.arange(cols).repeat(rows), persistent=False)
        cell_xy, cell_size = head.cells(grid[0].tolist(), processor.merge_size)
        self.register_buffer("cell_xy", cell_xy, persistent=False)
        self.register_buffer("cell_size", cell_size.contiguous(), persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixel_values: torch.Tensor):
        features = self.image_features(pixel_values)
        is_image = input_ids == self.image_token_id
        nth = (is_image.long().cumsum(1) - 1).clamp(min=0)  # which image token each position is
        embeds = self.language_model.embed_tokens(input_ids)
        placed = torch.gather(features, 1, nth.unsqueeze(-1).expand(-1, -1, features.shape[-1]))
        embeds = torch.where(is_image.unsqueeze(-1), placed.to(embeds.dtype), embeds)
        hidden = self.language_model(inputs_embeds=embeds, position_ids=self.positions(is_image, nth),
                                     use_cache=False).last_hidden_state
        boxes, logits = head.read(self.head, hidden, self.query(attention_mask), self.tokens(is_image))
        return boxes, torch.sigmoid(logits)

    def query(self, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the head's query is: each prompt's last token."""
        return torch.arange(attention_mask.shape[0], device=attention_mask.device), attention_mask.sum(dim=1) - 1

    def tokens(self, is_image: torch.Tensor) -> head.ImageTokens:
        """The head's ``ImageTokens``: every prompt's image at the same size, its tokens in one run."""
        batch, n = is_image.shape[0], self.image_tokens
        start = is_image.int().argmax(dim=1, keepdim=True)
        columns = (start + torch.arange(n, device=is_image.device)).flatten()
        rows = torch.arange(batch, device=is_image.device).repeat_interleave(n)
        index = torch.arange(batch * n, device=is_image.device).view(batch, n)
        return head.ImageTokens(rows, columns, self.cell_xy.repeat(batch, 1), self.cell_size.repeat(batch, 1),
                                index, torch.ones_like(index, dtype=torch.bool))

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(batch, patches, patch_dim) -> (batch, image tokens, hidden): the vision tower and its merger."""
        x = self.visual.patch_embed(pixel_values.reshape(-1, self.patch_dim))
        x = x.reshape(-1, self.patches, x.shape[-1])[:, self.order].reshape(-1, x.shape[-1])  # window order
        for block in self.visual.blocks:
            x = block(x, cu_seqlens=None, position_embeddings=None)  # the attention holds its own (_probe)
        merged = self.visual.merger(x)
        return merged.reshape(-1, self.image_tokens, merged.shape[-1])[:, self.unorder]

    def positions(self, is_image: torch.Tensor, nth: torch.Tensor) -> torch.Tensor:
        """(3, batch, length) M-RoPE positions, as ``qwen.mrope_positions`` gives for one image."""
        column = torch.arange(is_image.shape[1], device=is_image.device).unsqueeze(0)
        start = is_image.int().argmax(dim=1, keepdim=True)
        text = torch.where(column < start, column, column - self.image_tokens + self.after_image)
        return torch.stack([torch.where(is_image, start, text),
                            torch.where(is_image, start + self.row_of[nth], text),
                            torch.where(is_image, start + self.col_of[nth], text)])


def _probe(visual, pixel_values: torch.Tensor, grid: torch.Tensor):
    """Run the vision tower once on one image and record what it computes from the grid: the
    order it puts the patches in (the patch embedding's output is replaced by each row's index,
    which the first layer then receives reordered), each layer's attention spans, the rotary
    tables (cos, sin) in that order."""
    seen: dict = {"spans": []}

    def numbered(module, args, out):
        return torch.arange(out.shape[0], dtype=out.dtype, device=out.device)[:, None].expand_as(out).contiguous()

    def record(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.setdefault("order", hidden[:, 0].round().long())
        seen["spans"].append(kwargs["cu_seqlens"].clone())
        seen["rotary"] = tuple(t.clone() for t in kwargs["position_embeddings"])

    hooks = [visual.patch_embed.register_forward_hook(numbered)]
    hooks += [block.register_forward_pre_hook(record, with_kwargs=True) for block in visual.blocks]
    try:
        with torch.no_grad():
            visual(pixel_values, grid_thw=grid)
    finally:
        for hook in hooks:
            hook.remove()
    return seen["order"], seen["spans"], seen["rotary"]


def _batched_attention(attention, patches: int, spans: torch.Tensor, rotary, rotate) -> None:
    """Make a vision attention layer attend within each image of a batch of same-size images,
    within the spans it was probed with (``cu_seqlens``: one span, the whole image, or windows)."""
    piece = torch.searchsorted(spans[1:], torch.arange(patches), right=True)
    attention._onnx_mask = None if len(spans) == 2 else piece[:, None] == piece[None, :]
    attention._onnx_rotary = rotary
    attention._onnx_rotate = rotate
    attention._onnx_patches = patches
    attention.forward = types.MethodType(_attention_forward, attention)


def _attention_forward(self, hidden_states: torch.Tensor, cu_seqlens=None, position_embeddings=None, **kwargs):
    n = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(-1, self._onnx_patches, 3, self.num_heads, hidden_states.shape[-1] // self.num_heads).unbind(2)
    cos, sin = self._onnx_rotary
    q, k = self._onnx_rotate(q, k, cos, sin)  # (batch, patches, heads, dim): the tables broadcast over the batch
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=self._onnx_mask, scale=self.scaling)
    return self.proj(out.transpose(1, 2).reshape(n, -1))
