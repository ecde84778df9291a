"""Evaluation protocols: whose prompt is asked and whose rules read the answer.

The same model scores 15% or 82% on RefCOCO depending only on the prompt and on how its answer's
numbers are read. ``groundtune eval --protocol NAME`` reproduces a public harness's prompt and
reading, so a number printed here can stand beside one that harness printed:

==========  ================================================  ============================================
protocol    prompt                                            answer read as
==========  ================================================  ============================================
groundtune  the model's own (what it was trained with;        the family's native coordinates (families.py,
            ``groundtune.json``)                              boxes.parse_answer), every box, [] = none
qwen        Qwen's official grounding prompt (QwenLM/Qwen3-VL  the same native reading: Qwen2.5-VL absolute
            issue 1721), whatever the model was trained with   pixels of the resized image, Qwen2-VL and
                                                              Qwen3-VL 0-1000
lmms-eval   its ``refcoco*_bbox_rec`` prompt (0-1 floats       the first ``[a, b, c, d]`` of plain numbers,
            asked), phrase appended                           read as fractions of the image; none found:
                                                              the box [0, 0, 0, 0]
vlmevalkit  "Please provide the bounding box coordinate of   the first bracketed four numbers (else the
            the region this sentence describes: {phrase}"     first four numbers); all <= 1.5: fractions;
            (VLMEvalKit keeps its prompt in its data file,    all <= 1000: per mille; else pixels; clipped
            RefCOCO.tsv, not in its code: see below)
==========  ================================================  ============================================

Acc@0.5 is the same rule in all four (the first box's IoU with the true box >= 0.5), and IoU does
not change when both boxes are scaled by the image size, so a harness's score on fractions equals
ours on pixels. Where they differ is only what is asked and how the answer's numbers are read:
Qwen2.5-VL answers in absolute pixels, which lmms-eval reads as fractions (nearly every box then
covers the whole image: its documented low scores for Qwen2.5-VL) and VLMEvalKit reads as per
mille when no number exceeds 1000 (most COCO images are at most 640 px wide).

VLMEvalKit's reading and scoring are in its code (vlmeval/dataset/refcoco.py), its prompt is the
``question`` column of the RefCOCO.tsv it downloads, which groundtune cannot read offline: the
vlmevalkit protocol asks lmms-eval's sentence without its 0-1 instruction. Its figure is
comparable in reading and scoring; the prompt may differ from the file's.
"""

from __future__ import annotations

import dataclasses
import json
import re
from functools import cache
from importlib import resources

from groundtune.errors import UsageError


_NUMBER = r"-?\d+(?:\.\d+)?"
# lmms-eval: four plain numbers (no sign but minus, no exponent) in square brackets, comma-separated
_LMMS_BOX = re.compile(r"\[\s*" + r",\s*".join([f"({_NUMBER})"] * 4) + r"\s*\]")
# VLMEvalKit: any float notation, separated by commas or spaces
_ANY_NUMBER = r"[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?"
_VLMEVAL_BOX = re.compile(r"\[\s*" + r"(?:\s*,\s*|\s+)".join([f"({_ANY_NUMBER})"] * 4) + r"\s*\]")


OFFICIAL = "official"  # Qwen's grounding prompt, kept with the rest of Qwen's knowledge (models/qwen.py)
DEFAULT_PROTOCOL = "groundtune"  # a model is asked as it was trained: its own prompt, its family's coordinates


@dataclasses.dataclass(frozen=True)
class Protocol:
    name: str
    prompt: str | None  # None: the model's own; OFFICIAL: Qwen's
    source: str  # where the prompt and the reading come from
    native: bool  # the answer is read by the family's own parser (boxes.parse_answer)

    def prompt_for(self, model_prompt: str) -> str:
        if self.prompt == OFFICIAL:
            from groundtune.models.qwen import DEFAULT_PROMPT  # torch: only when a model is evaluated

            return DEFAULT_PROMPT
        return self.prompt or model_prompt


PROTOCOLS = {
    "groundtune": Protocol("groundtune", None, "the model's own prompt and its family's coordinates", True),
    "qwen": Protocol("qwen", OFFICIAL, "QwenLM/Qwen3-VL issue 1721 (the official grounding eval prompt)", True),
    "lmms-eval": Protocol(
        "lmms-eval",
        "Bounding box coordinates are specified in the format (top-left x, top-left y, bottom-right x, "
        "bottom-right y). All values are floating point numbers bounded between 0 and 1. Please provide the "
        "bounding box coordinate of the region this sentence describes: {phrase}",
        "lmms-eval 0.7, lmms_eval/tasks/refcoco/utils_rec.py (refcoco*_bbox_rec)", False),
    "vlmevalkit": Protocol(
        "vlmevalkit",
        "Please provide the bounding box coordinate of the region this sentence describes: {phrase}",
        "VLMEvalKit, vlmeval/dataset/refcoco.py (RefCOCODataset: its reading; its prompt is its data file's)",
        False),
}


def protocol(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise UsageError(f"unknown protocol {name!r}: choose from {', '.join(PROTOCOLS)}")
    return PROTOCOLS[name]


def read_lmms_eval(text: str, width: float, height: float) -> list[float]:
    """lmms-eval's reading, in pixels of the original image: the first bracketed four plain numbers
    as fractions of the width and height; none: the box [0, 0, 0, 0] (which scores 0)."""
    found = _LMMS_BOX.search(text or "")
    x1, y1, x2, y2 = (float(v) for v in found.groups()) if found else (0.0, 0.0, 0.0, 0.0)
    return [x1 * width, y1 * height, x2 * width, y2 * height]


def read_vlmevalkit(text: str, width: float, height: float) -> list[float] | None:
    """VLMEvalKit's reading, in pixels: the first bracketed four numbers, else the text's first four
    numbers; every |value| <= 1.5: fractions, <= 1000: per mille, else pixels; clipped to the image
    and put in corner order. None when fewer than four numbers are found."""
    text = text or ""
    found = _VLMEVAL_BOX.search(text)
    numbers = [float(v) for v in found.groups()] if found else [float(v) for v in re.findall(_ANY_NUMBER, text)[:4]]
    if len(numbers) < 4:
        return None
    largest = max(abs(v) for v in numbers)
    scale = (width, height) if largest <= 1.5 else (width / 1000, height / 1000) if largest <= 1000 else (1.0, 1.0)
    x1, x2 = sorted(min(max(v * scale[0], 0.0), width) for v in numbers[0::2])
    y1, y2 = sorted(min(max(v * scale[1], 0.0), height) for v in numbers[1::2])
    return [x1, y1, x2, y2]


def read_answer(name: str, text: str, width: float, height: float) -> list[list[float]]:
    """A harness protocol's boxes (one, or none) for an answer, in pixels of the original image."""
    box = read_lmms_eval(text, width, height) if name == "lmms-eval" else read_vlmevalkit(text, width, height)
    return [] if box is None else [box]


# --------------------------------------------------------------------------------------------
# Published figures

BENCHMARKS = {"refcoco": "RefCOCO", "refcoco+": "RefCOCO+", "refcocog": "RefCOCOg"}
_HUB_BENCHMARKS = {"lmms-lab/refcoco": "refcoco", "lmms-lab/refcocoplus": "refcoco+", "lmms-lab/refcocog": "refcocog"}


@cache
def published() -> list[dict]:
    """The official Qwen-VL RefCOCO/+/g Acc@0.5 figures shipped with groundtune (assets/published.json),
    each with its source."""
    return json.loads(resources.files("groundtune").joinpath("assets/published.json").read_text())["rows"]


def benchmark_of(data: str, records: list[dict]) -> str | None:
    """refcoco / refcoco+ / refcocog when the data says which: an ``hf:lmms-lab/...`` spec, or the
    records' ``source`` (``convert --from refcoco`` writes it)."""
    if str(data).startswith("hf:"):
        from groundtune.data import hub  # pyarrow: only once a data set is named, not at the CLI's start

        return _HUB_BENCHMARKS.get(hub.parse(str(data))[0].lower())
    sources = {str(r.get("source", "")).lower() for r in records}
    return sources.pop() if len(sources) == 1 and next(iter(sources)) in BENCHMARKS else None


def published_figure(model: str, benchmark: str | None, split: str | None, protocol_name: str) -> dict | None:
    """The published row for this model, benchmark, split and protocol, if there is one."""
    model = model.rstrip("/").lower()
    for row in published():
        if (row["model"].lower() == model and row["benchmark"] == benchmark and row["split"] == split
                and row["protocol"] == protocol_name):
            return row
    return None
