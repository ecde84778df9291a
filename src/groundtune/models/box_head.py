"""groundtune's box head (models/head.py says how it reads the image and why), and a runner for a
box-head export that needs torch, transformers, safetensors and Pillow: no groundtune.

    pip install torch transformers safetensors pillow
    python DIR/box_head.py DIR --image photo.jpg --phrase "the red mug" --phrase "the laptop"

It prints one JSON line per phrase, ``{"phrase": ..., "bbox": [x1, y1, x2, y2]}``, in pixels of
the image as given (after its EXIF orientation). From Python, with DIR on the import path:

    from box_head import Grounder
    boxes = Grounder("DIR").ground(Image.open("photo.jpg").convert("RGB"), ["the red mug"])

This file is ``groundtune.models.box_head``, the head groundtune trains, and is copied into every
box-head export (``groundtune export``), so an export carries the head's code as its weights were
trained with. It imports nothing of groundtune for that reason. The runner does with transformers'
own processor and model what groundtune's box-head path does (infer.head_boxes): the prompt ends
with the answer's opening, the phrase is always text, one forward pass, the head on the last state
and the image's tokens, the box mapped from fractions of the image to its pixels.
tests/test_export.py and tests/test_onnx.py check its boxes against groundtune's.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

HEAD_FILE = "box_head.safetensors"  # the head's weights, beside the model's
WIDTH = 512  # the correcting MLP's width
KEY_WIDTH = 128  # the width of the query and the image tokens' keys
FREQUENCIES = 4  # Fourier features of a cell's (x, y): sin and cos at pi x 1, 2, 4, 8


@dataclass
class ImageTokens:
    """Where the image tokens of a batch are and where their cells lie in the image: each image's
    tokens once (``rows``/``columns`` in the hidden states; ``xy`` each cell's centre and ``cell``
    its width and height, as fractions of the image), and each sample's tokens among them
    (``index``, (samples, most tokens), valid where ``mask``)."""

    rows: torch.Tensor
    columns: torch.Tensor
    xy: torch.Tensor
    cell: torch.Tensor
    index: torch.Tensor
    mask: torch.Tensor


class BoxHead(torch.nn.Module):
    def __init__(self, hidden_size: int, width: int = WIDTH, key_width: int = KEY_WIDTH):
        super().__init__()
        self.query = torch.nn.Linear(hidden_size, key_width)
        # no bias on the keys: one added to every key of a sample shifts all its scores alike, which
        # the softmax ignores (its gradient would be rounding noise, which Adam scales up to steps)
        self.key = torch.nn.Linear(hidden_size, key_width, bias=False)
        self.where = torch.nn.Linear(2 + 4 * FREQUENCIES, key_width, bias=False)
        # the MLP's first layer on [query, attended states], split so that each image token is
        # projected once, before the per-sample sum (the same map, a fraction of the memory)
        self.from_query = torch.nn.Linear(hidden_size, width)
        self.from_image = torch.nn.Linear(hidden_size, width, bias=False)
        self.out = torch.nn.Linear(width, 4)
        torch.nn.init.zeros_(self.out.weight)
        torch.nn.init.zeros_(self.out.bias)

    def forward(self, query: torch.Tensor, image: torch.Tensor, tokens: ImageTokens) -> torch.Tensor:
        """``query`` (samples, hidden): each sample's query state; ``image`` (image tokens, hidden):
        the states of ``tokens``'s image tokens, in its order -> (samples, 4) boxes, xyxy as
        fractions of the image."""
        dtype = self.query.weight.dtype
        query, image, xy, cell = query.to(dtype), image.to(dtype), tokens.xy.to(dtype), tokens.cell.to(dtype)
        keys = self.key(image) + self.where(fourier(xy))  # (image tokens, key width)
        q = self.query(query)
        scores = torch.einsum("nk,ntk->nt", q, keys[tokens.index]) / q.shape[-1] ** 0.5
        p = torch.softmax(scores.masked_fill(~tokens.mask, float("-inf")), dim=-1)[..., None]  # (samples, T, 1)
        centre, size = map_box(p, xy[tokens.index], cell[tokens.index])
        correction = self.out(F.gelu(self.from_query(query) + (p * self.from_image(image)[tokens.index]).sum(1)))
        cx, cy = (centre + correction[:, :2]).unbind(-1)
        w, h = (size * torch.exp(correction[:, 2:])).unbind(-1)
        return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


def map_box(p: torch.Tensor, xy: torch.Tensor, cell: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The box an attention map over cells points at: ``p`` (samples, T, 1) the map, ``xy`` and
    ``cell`` (samples, T, 2) its cells' centres and sizes -> (samples, 2) centre and width/height.
    A map spread evenly over a block of cells gives that block: a uniform spread over a width w
    has variance (w^2 - cell^2) / 12 between cell centres."""
    centre = (p * xy).sum(1)
    spread = (p * (xy - centre[:, None]) ** 2).sum(1)
    return centre, torch.sqrt(12 * spread + (p * cell).sum(1) ** 2)


def fourier(xy: torch.Tensor) -> torch.Tensor:
    """(tokens, 2) positions in [0, 1] -> (tokens, 2 + 4 FREQUENCIES): them, then sin and cos."""
    angles = xy[..., None] * (torch.pi * 2 ** torch.arange(FREQUENCIES, device=xy.device, dtype=xy.dtype))
    return torch.cat([xy, angles.sin().flatten(-2), angles.cos().flatten(-2)], dim=-1)


def cells(grid_thw: list[int], merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's tokens' cells, in the order the prompt holds the tokens (the merged grid row by
    row, as ``qwen.mrope_positions`` lays it out): (tokens, 2) centres and (tokens, 2) sizes, as
    fractions of the image."""
    frames, height, width = (int(n) for n in grid_thw)
    rows, cols = height // merge_size, width // merge_size
    y = ((torch.arange(rows) + 0.5) / rows).repeat_interleave(cols).repeat(frames)
    x = ((torch.arange(cols) + 0.5) / cols).repeat(rows * frames)
    return torch.stack([x, y], dim=-1), torch.tensor([1 / cols, 1 / rows]).expand(len(x), 2)


# --------------------------------------------------------------------------------------------
# The runner of an export


class Grounder:
    """A box-head export, loaded with transformers: ``ground(image, phrases)`` -> one box per phrase."""

    def __init__(self, folder: str | Path, device: str = "cpu"):
        from safetensors.torch import load_file
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

        folder = Path(folder)
        self.settings = json.loads((folder / "groundtune.json").read_text())  # prompt, prompt_end
        self.device = torch.device(device)
        self.model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.image_processor = AutoImageProcessor.from_pretrained(folder)  # resizes with the run's pixel budget
        self.head = BoxHead(self.model.config.get_text_config().hidden_size).to(self.device).eval()
        self.head.load_state_dict(load_file(folder / HEAD_FILE))

    def ground(self, image, phrases: list[str]) -> list[list[float]]:
        """Boxes [x1, y1, x2, y2] in pixels of ``image`` (an RGB PIL image), one per phrase."""
        vision = self.image_processor(images=[image], return_tensors="pt").to(self.device)
        xy, cell = (t.to(self.device) for t in cells(vision["image_grid_thw"][0].tolist(),
                                                     self.model.config.vision_config.spatial_merge_size))
        found = []
        # one forward pass per phrase, the image's included: plain to read; groundtune's own path
        # runs an image once for all its phrases (qwen.collate_shared), to the same boxes
        for phrase in phrases:
            ids = torch.tensor([self.input_ids(phrase, len(xy))], device=self.device)
            is_image = ids == self.model.config.image_token_id
            with torch.inference_mode():
                hidden = self.model.model(input_ids=ids, **vision,
                                          mm_token_type_ids=is_image.int()).last_hidden_state[0]
                where = is_image[0].nonzero()[:, 0]  # the image's tokens, row by row of its merged grid
                tokens = ImageTokens(torch.zeros_like(where), where, xy, cell, torch.arange(len(where))[None],
                                     torch.ones(1, len(where), dtype=torch.bool))
                fractions = self.head(hidden[-1:], hidden[where], tokens)[0].tolist()  # the query: the last token
            found.append(to_pixels(fractions, image.size))
        return found

    def input_ids(self, phrase: str, image_tokens: int) -> list[int]:
        """The prompt's token ids: the chat template's user turn with the image and the run's prompt,
        then the answer's opening (``prompt_end``), where the head reads. As groundtune's
        ``Processor.tokenize``: the text is cut at the template's added tokens, the image token
        repeated once per image token, and each piece between them tokenized with the phrase in
        its place, the spelling of a special token in the phrase as text."""
        slot = "\ue000"  # stands for the phrase while the template's text is cut (no token spells it)
        messages = [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": self.settings["prompt"].format(phrase=slot)}]}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        text += self.settings["prompt_end"]
        added = {token.content: token_id for token_id, token in self.tokenizer.added_tokens_decoder.items()}
        longest_first = sorted(added, key=len, reverse=True)  # as the tokenizer matches them
        ids = []
        for piece in re.split("(" + "|".join(map(re.escape, longest_first)) + ")", text):
            if piece in added:
                repeat = image_tokens if added[piece] == self.model.config.image_token_id else 1
                ids += [added[piece]] * repeat
            elif piece:
                ids += self.tokenizer(piece.replace(slot, phrase), add_special_tokens=False,
                                      split_special_tokens=True)["input_ids"]
        return ids


def to_pixels(fractions: list[float], size: tuple[int, int]) -> list[float]:
    """xyxy fractions of the image -> its pixels, clipped to it (``groundtune.boxes.from_unit``
    then ``clip_box``)."""
    width, height = size
    return [min(max(v * s, 0.0), float(s)) for v, s in zip(fractions, (width, height, width, height))]


def main(argv: list[str] | None = None) -> int:
    from PIL import Image, ImageOps

    parser = argparse.ArgumentParser(description="Ground phrases in an image with a groundtune box-head export.")
    parser.add_argument("folder", help="the export folder (holds box_head.safetensors and groundtune.json)")
    parser.add_argument("--image", required=True, help="the image file")
    parser.add_argument("--phrase", action="append", required=True, help="what to find (repeat for several)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ... (default: cpu)")
    args = parser.parse_args(argv)
    with Image.open(args.image) as opened:
        image = ImageOps.exif_transpose(opened).convert("RGB")
    for phrase, box in zip(args.phrase, Grounder(args.folder, args.device).ground(image, args.phrase)):
        print(json.dumps({"phrase": phrase, "bbox": [round(v, 2) for v in box]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
