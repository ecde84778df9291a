"""Ground phrases with a groundtune ONNX export (``groundtune export RUN --out DIR --onnx``) using
onnxruntime, numpy, Pillow and tokenizers alone: no torch, no transformers, no groundtune.

    pip install onnxruntime numpy pillow tokenizers
    python DIR/onnx_predict.py DIR --image photo.jpg --phrase "the red mug" --phrase "the laptop"

It prints one JSON line per phrase, ``{"phrase": ..., "boxes": [[x1, y1, x2, y2], ...], "scores":
[...]}``: the boxes of the slots whose objectness reaches the export's threshold (none: nothing
matches), in pixels of the image as given (after its EXIF orientation), in reading order. From
Python:

    from onnx_predict import Grounder
    answers = Grounder("DIR").ground(Image.open("photo.jpg"), ["the red mug"])

This file is copied into every ONNX export and is also ``groundtune.onnx_predict``. It repeats, in
numpy, the few steps groundtune's own path takes with torch (the image resized with Pillow's
bicubic filter as training resized it, scaled, normalised and cut into the processor's patches;
the prompt's pieces put together around the phrase, which is always text; the slots kept by the
threshold, their boxes from fractions of the image to its pixels, in reading order), because it
must run where groundtune cannot be installed. tests/test_onnx.py checks each step against
groundtune's and the boxes and scores against the PyTorch model's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps


class Grounder:
    """An ONNX export, loaded: ``ground(image, phrases)`` -> one answer per phrase,
    ``{"boxes": [...], "scores": [...]}``."""

    def __init__(self, folder: str | Path, threads: int = 0):
        import onnxruntime
        from tokenizers import Tokenizer

        folder = Path(folder)
        self.settings = json.loads((folder / "groundtune.json").read_text())["onnx"]
        if "prompt" not in self.settings:
            raise ValueError(f"{folder}: exported by an older groundtune, which wrote the phrase into the prompt's "
                             "text; use that export's own onnx_predict.py, or export the run again")
        if "threshold" not in self.settings:
            raise ValueError(f"{folder}: exported by an older groundtune, whose graph gives one box and no scores; "
                             "use that export's own onnx_predict.py, or export the run again")
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # it tokenizes only the prompt's text pieces, where a phrase is text: a special token's
        # spelling in it (<|im_end|>, <|image_pad|>) is read as text, as groundtune reads it
        self.tokenizer.encode_special_tokens = True
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads  # 0: ONNX Runtime's choice
        self.session = onnxruntime.InferenceSession(str(folder / self.settings["file"]), options,
                                                    providers=["CPUExecutionProvider"])

    def ground(self, image: Image.Image, phrases: list[str]) -> list[dict]:
        """Each phrase's answer (``answer``: boxes [x1, y1, x2, y2] in pixels of ``image`` and their
        scores; none when nothing matches), all in one run of the graph."""
        image = _rgb(image)
        pixels = self.pixel_values(image)
        prompts = [self.input_ids(phrase) for phrase in phrases]
        longest = max(len(ids) for ids in prompts)
        input_ids = np.full((len(prompts), longest), self.settings["pad_token_id"], dtype=np.int64)
        attention_mask = np.zeros((len(prompts), longest), dtype=np.int64)
        for row, ids in enumerate(prompts):  # right-padded: each prompt's last token is read
            input_ids[row, : len(ids)] = ids
            attention_mask[row, : len(ids)] = 1
        fractions, scores = self.session.run(["boxes", "scores"], {
            "input_ids": input_ids, "attention_mask": attention_mask,
            "pixel_values": np.repeat(pixels[None], len(prompts), axis=0)})
        return [answer(slots, slot_scores, self.settings["threshold"], image.size)
                for slots, slot_scores in zip(fractions.tolist(), scores.tolist())]

    def input_ids(self, phrase: str) -> list[int]:
        """The prompt's token ids: the template's control tokens as exported, and each piece of text
        with the phrase in its place, tokenized on its own (groundtune's ``Processor.tokenize``)."""
        ids = []
        for piece in self.settings["prompt"]:
            if "ids" in piece:
                ids += piece["ids"]
            else:
                ids += self.tokenizer.encode(phrase.join(piece["text"]), add_special_tokens=False).ids
        return ids

    def pixel_values(self, image: Image.Image) -> np.ndarray:
        """(patches, patch_dim) float32: the image at the export's size, as the processor cuts it."""
        s = self.settings
        width, height = s["image_size"]
        if image.size != (width, height):
            image = image.resize((width, height), Image.BICUBIC)
        x = np.asarray(image, dtype=np.float32) / 255.0
        x = (x - np.array(s["image_mean"], np.float32)) / np.array(s["image_std"], np.float32)
        x = x.transpose(2, 0, 1)  # (channels, height, width)
        t, p, m = s["temporal_patch_size"], s["patch_size"], s["merge_size"]
        frames = np.repeat(x[None], t, axis=0)  # one image is t equal frames
        grid_h, grid_w = height // p, width // p
        # patches in the order the model reads them: merge blocks row by row, the patches of a
        # block together; each patch's values channel, frame, row, column
        frames = frames.reshape(t, 3, grid_h // m, m, p, grid_w // m, m, p)
        frames = frames.transpose(2, 5, 3, 6, 1, 0, 4, 7)
        return np.ascontiguousarray(frames.reshape(grid_h * grid_w, 3 * t * p * p), dtype=np.float32)


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
    scale = (width, height, width, height)
    return [min(max(v * s, 0.0), float(s)) for v, s in zip(fractions, scale)]


def _rgb(image: Image.Image) -> Image.Image:
    """EXIF orientation applied; transparent pixels over white (as groundtune reads images)."""
    image = ImageOps.exif_transpose(image)
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Ground phrases in an image with a groundtune ONNX export.")
    parser.add_argument("folder", help="the export folder (holds model.onnx, tokenizer.json, groundtune.json)")
    parser.add_argument("--image", required=True, help="the image file")
    parser.add_argument("--phrase", action="append", required=True, help="what to find (repeat for several)")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    if not (folder / "groundtune.json").exists() or "onnx" not in json.loads((folder / "groundtune.json").read_text()):
        print(f"{folder}: not an ONNX export (export it with: groundtune export RUN --out DIR --onnx "
              "--image-size WxH)", file=sys.stderr)
        return 2
    try:
        with Image.open(args.image) as opened:
            opened.load()
            image = opened.copy()
    except (OSError, ValueError) as e:
        print(f"{args.image}: cannot read the image ({e})", file=sys.stderr)
        return 2
    for phrase, found in zip(args.phrase, Grounder(folder).ground(image, args.phrase)):
        print(json.dumps({"phrase": phrase, "boxes": [[round(v, 2) for v in box] for box in found["boxes"]],
                          "scores": [round(s, 4) for s in found["scores"]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
