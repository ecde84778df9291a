"""groundtune's box head (models/head.py says how it reads the image and why), and a runner for a
box-head export that needs torch, transformers, safetensors and Pillow: no groundtune.

    pip install torch transformers safetensors pillow
    python DIR/box_head.py DIR --image photo.jpg --phrase "the red mug" --phrase "every chair"

It prints one JSON line per phrase, ``{"phrase": ..., "boxes": [[x1, y1, x2, y2], ...], "scores":
[...]}``: the boxes of the slots whose objectness reaches the head's threshold (none: nothing
matches), in pixels of the image as given (after its EXIF orientation), in reading order. From
Python, with DIR on the import path:

    from box_head import Grounder
    answers = Grounder("DIR").ground(Image.open("photo.jpg").convert("RGB"), ["the red mug"])

This file is ``groundtune.models.box_head``, the head groundtune trains, and is copied into every
box-head export (``groundtune export``), so an export carries the head's code as its weights were
trained with. It imports nothing of groundtune for that reason. The runner does with transformers'
own processor and model what groundtune's box-head path does (infer.head_boxes): the prompt ends
with the answer's opening, the phrase is always text, one forward pass, the head on the last state
and the image's tokens, the slots kept by the threshold saved with the head, their boxes mapped
from fractions of the image to its pixels. tests/test_export.py and tests/test_onnx.py check its
boxes and scores against groundtune's.
"""

from __future__ import annotations

import argparse
import json
import math
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
# Slots 1..K-1 start this far (std, per hidden unit) from the query state, slot 0 on it: small
# beside a state of RMS ~1 after the model's final norm, so every slot starts reading the image as
# the single-box head did, and different enough that the matching tells them apart from step one.
SLOT_SPREAD = 0.1
# The cells layout's objectness prior: one of a phrase's ~1 true boxes among a 112-px image's 16 cells
TYPICAL_CELLS = 16
# A padding token's logit (a sample of a batch with fewer image tokens than another): its score is
# 0, below any threshold but 0, and no true box is ever matched to it (finite: a cross-entropy of
# -inf against 0 is NaN)
PADDING_LOGIT = -1e4
# The objectness logit of a head saved before sets (one box, no score): sigmoid(20) is 1.0 in fp32,
# so its one slot is always kept, as its box always was.
SURE = 20.0


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
    """A phrase's boxes and their objectness scores, from one query state and the image's tokens,
    in one of two layouts (models/head.py says which answers what better):

    - ``slots`` = 0: one candidate per image token (CELLS). Token t's candidate box is its own cell,
      corrected by an MLP on the query state, the token's state and where its cell lies (a sum,
      plus their elementwise product: "red" in the query meeting "red" in the cell); its
      objectness logit is that MLP's, plus the query's attention score on the token.
    - ``slots`` = K > 0: K query SLOTS. Slot k's query is the query state plus a learned offset
      (``slots[k]``); each slot attends over the image on its own and its box comes from its own
      map, corrected by the MLP, whose features also give its objectness logit. Slot 0's offset
      starts at zero: one slot starts as, and with a zero offset is, the single-box head of before.

    ``threshold``: an answer keeps the candidates whose objectness (the logit's sigmoid) is at
    least it; saved with the weights (``save_head``), not learned (training chooses it on its eval
    set, loop.py)."""

    def __init__(self, hidden_size: int, slots: int = 1, threshold: float = 0.0, width: int = WIDTH,
                 key_width: int = KEY_WIDTH):
        super().__init__()
        self.threshold = threshold
        self.per_cell = slots == 0
        self.slots = torch.nn.Parameter(torch.zeros(slots, hidden_size))
        torch.nn.init.normal_(self.slots[1:], std=SLOT_SPREAD)
        self.query = torch.nn.Linear(hidden_size, key_width)
        # no bias on the keys: one added to every key of a sample shifts all its scores alike, which
        # the softmax ignores (its gradient would be rounding noise, which Adam scales up to steps)
        self.key = torch.nn.Linear(hidden_size, key_width, bias=False)
        self.where = torch.nn.Linear(2 + 4 * FREQUENCIES, key_width, bias=False)
        # the MLP's first layer on [query, attended states], split so that each image token is
        # projected once, before the per-slot sum (the same map, a fraction of the memory)
        self.from_query = torch.nn.Linear(hidden_size, width)
        self.from_image = torch.nn.Linear(hidden_size, width, bias=False)
        self.out = torch.nn.Linear(width, 4)
        torch.nn.init.zeros_(self.out.weight)
        torch.nn.init.zeros_(self.out.bias)
        # Weight zero: the box features get no gradient from it before it has learned anything.
        # Bias: every candidate starts at the prior that it holds one of a phrase's ~1 true boxes,
        # 1/candidates (RetinaNet's prior), under any threshold of 0.5: at 0 (a score of 0.5) every
        # slot of an untrained head answers, and the first steps go to pushing 7 of 8 slots down.
        self.objectness = torch.nn.Linear(width, 1)
        torch.nn.init.zeros_(self.objectness.weight)
        candidates = slots or TYPICAL_CELLS
        torch.nn.init.constant_(self.objectness.bias, -math.log(max(candidates - 1, 1)))
        if self.per_cell:
            # where the cell lies, the product of query and token, and a second (residual) layer: what
            # the cells' MLP reads besides the slots' sum of query and attended states
            self.cell_where = torch.nn.Linear(2 + 4 * FREQUENCIES, width, bias=False)
            self.product_query = torch.nn.Linear(hidden_size, width)
            self.product_image = torch.nn.Linear(hidden_size, width, bias=False)
            self.second = torch.nn.Linear(width, width)

    def forward(self, query: torch.Tensor, image: torch.Tensor,
                tokens: ImageTokens) -> tuple[torch.Tensor, torch.Tensor]:
        """``query`` (samples, hidden): each sample's query state; ``image`` (image tokens, hidden):
        the states of ``tokens``'s image tokens, in its order -> (samples, slots, 4) boxes, xyxy as
        fractions of the image, and (samples, slots) objectness logits."""
        dtype = self.query.weight.dtype
        query, image, xy, cell = query.to(dtype), image.to(dtype), tokens.xy.to(dtype), tokens.cell.to(dtype)
        keys = self.key(image) + self.where(fourier(xy))  # (image tokens, key width)
        if self.per_cell:
            return self._cells(query, image, xy, cell, keys, tokens)
        slots = query[:, None] + self.slots  # (samples, slots, hidden): each slot's query state
        q = self.query(slots)
        scores = torch.einsum("nsk,ntk->nst", q, keys[tokens.index]) / q.shape[-1] ** 0.5
        p = torch.softmax(scores.masked_fill(~tokens.mask[:, None], float("-inf")), dim=-1)  # (samples, slots, T)
        centre, size = map_box(p, xy[tokens.index][:, None], cell[tokens.index][:, None])
        attended = torch.einsum("nst,ntw->nsw", p, self.from_image(image)[tokens.index])
        features = F.gelu(self.from_query(slots) + attended)
        correction = self.out(features)
        cx, cy = (centre + correction[..., :2]).unbind(-1)
        w, h = (size * torch.exp(correction[..., 2:])).unbind(-1)
        return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1), self.objectness(features)[..., 0]

    def _cells(self, query: torch.Tensor, image: torch.Tensor, xy: torch.Tensor, cell: torch.Tensor,
               keys: torch.Tensor, tokens: ImageTokens) -> tuple[torch.Tensor, torch.Tensor]:
        """The CELLS layout's (samples, most tokens, 4) boxes and logits: one candidate per image
        token of each sample, a padding token's logit at ``PADDING_LOGIT`` (never kept, never
        matched)."""
        per_token = self.from_image(image) + self.cell_where(fourier(xy))  # (image tokens, width): once each
        features = F.gelu(self.from_query(query)[:, None] + per_token[tokens.index]
                          + self.product_query(query)[:, None] * self.product_image(image)[tokens.index])
        features = features + F.gelu(self.second(features))
        correction = self.out(features)
        cx, cy = (xy[tokens.index] + correction[..., :2]).unbind(-1)
        w, h = (cell[tokens.index] * torch.exp(correction[..., 2:])).unbind(-1)
        score = torch.einsum("nk,ntk->nt", self.query(query), keys[tokens.index]) / keys.shape[-1] ** 0.5
        logits = (self.objectness(features)[..., 0] + score).masked_fill(~tokens.mask, PADDING_LOGIT)
        return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1), logits


def map_box(p: torch.Tensor, xy: torch.Tensor, cell: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The box an attention map over cells points at: ``p`` (..., T) the map, ``xy`` and ``cell``
    (..., T, 2) its cells' centres and sizes (broadcast against it) -> (..., 2) centre and
    width/height. A map spread evenly over a block of cells gives that block: a uniform spread
    over a width w has variance (w^2 - cell^2) / 12 between cell centres."""
    p = p[..., None]
    centre = (p * xy).sum(-2)
    spread = (p * (xy - centre[..., None, :]) ** 2).sum(-2)
    return centre, torch.sqrt(12 * spread + (p * cell).sum(-2) ** 2)


def save_head(head: BoxHead, path: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """The head's weights (``state``: given whole, else its own) and its threshold (the file's
    metadata) into ``path``."""
    from safetensors.torch import save_file

    if state is None:
        state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(path), metadata={"threshold": repr(float(head.threshold))})


def load_head(path: str | Path, hidden_size: int) -> BoxHead:
    """A head from its file: as many slots as it holds, the threshold saved with it. A file of the
    single-box head of before sets (no slots, no objectness) loads as one slot on the query state
    whose objectness is always 1, with threshold 0: it answers its one box exactly as it did."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata() or {}
    if "slots" in state:
        if "threshold" not in metadata:
            raise ValueError(f"{path}: a box head without its threshold (the file's metadata); save it with "
                             "save_head")
        threshold = float(metadata["threshold"])
    else:
        width = state["out.weight"].shape[1]
        state = {**state, "slots": torch.zeros(1, hidden_size), "objectness.weight": torch.zeros(1, width),
                 "objectness.bias": torch.tensor([SURE])}
        threshold = 0.0
    head = BoxHead(hidden_size, len(state["slots"]), threshold, width=state["out.weight"].shape[1],
                   key_width=state["query.weight"].shape[0])
    head.load_state_dict(state)
    return head


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
    """A box-head export, loaded with transformers: ``ground(image, phrases)`` -> one answer per
    phrase, ``{"boxes": [...], "scores": [...]}``."""

    def __init__(self, folder: str | Path, device: str = "cpu"):
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

        folder = Path(folder)
        self.settings = json.loads((folder / "groundtune.json").read_text())  # prompt, prompt_end
        self.device = torch.device(device)
        self.model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.image_processor = AutoImageProcessor.from_pretrained(folder)  # resizes with the run's pixel budget
        self.head = load_head(folder / HEAD_FILE, self.model.config.get_text_config().hidden_size)
        self.head.to(self.device).eval()

    def ground(self, image, phrases: list[str]) -> list[dict]:
        """Each phrase's answer in ``image`` (an RGB PIL image): ``answer``'s boxes [x1, y1, x2, y2]
        in its pixels and their objectness scores; no box when nothing matches."""
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
                fractions, logits = self.head(hidden[-1:], hidden[where], tokens)  # the query: the last token
            found.append(answer(fractions[0].tolist(), torch.sigmoid(logits[0]).tolist(), self.head.threshold,
                                image.size))
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


def answer(fractions: list[list[float]], scores: list[float], threshold: float, size: tuple[int, int]) -> dict:
    """One phrase's slots -> its answer: the boxes of the slots whose score is at least
    ``threshold``, in pixels of an image of ``size`` (``to_pixels``), in reading order (by centre,
    top to bottom then left to right: ``groundtune.boxes.reading_order``), with their scores."""
    kept = [(to_pixels(box, size), score) for box, score in zip(fractions, scores) if score >= threshold]
    kept.sort(key=lambda pair: ((pair[0][1] + pair[0][3]) / 2, (pair[0][0] + pair[0][2]) / 2))
    return {"boxes": [box for box, _ in kept], "scores": [score for _, score in kept]}


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
    for phrase, found in zip(args.phrase, Grounder(args.folder, args.device).ground(image, args.phrase)):
        print(json.dumps({"phrase": phrase, "boxes": [[round(v, 2) for v in box] for box in found["boxes"]],
                          "scores": [round(s, 4) for s in found["scores"]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
