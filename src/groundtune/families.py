"""The Qwen-VL families groundtune knows and the facts of each that more than one layer needs: how
its boxes are written (groundtune.boxes), how its images are resized, and what the deploy half can
do with it. One record per family, read by every module that needs one of these facts; no module
keeps a list of its own. transformers' class and module names, the special tokens and the config
builder stay with the model code (models/qwen.py's ``Family``, which reads its facts from here).

Plain Python, no torch: the box conventions (groundtune.boxes) sit on it, in the lowest layer.
"""

from __future__ import annotations

from dataclasses import dataclass

# Where a family's box coordinates live (groundtune.boxes converts both ways)
RESIZED_PIXELS = "resized pixels"  # absolute pixels of the image after smart_resize
NORM_1000 = "0-1000"  # thousandths of the image's width and height, whatever its resize
# How a family writes its answer (groundtune.boxes.format_target)
JSON = "JSON"  # [{"bbox_2d": [x1, y1, x2, y2], "label": "..."}]
SPECIAL_TOKENS = "special tokens"  # <|object_ref_start|>label<|object_ref_end|><|box_start|>(x1,y1),(x2,y2)<|box_end|>


@dataclass(frozen=True)
class Facts:
    """One family's facts. ``min_pixels``/``max_pixels``: the budget of the processor Qwen ships
    (its preprocessor_config.json), a run's default when it pins none."""

    name: str  # groundtune's name of the family: the key of every table that speaks of families
    coordinates: str  # RESIZED_PIXELS | NORM_1000
    answer: str  # JSON | SPECIAL_TOKENS
    patch_size: int  # the vision tower's patch side, in pixels
    min_pixels: int
    max_pixels: int
    onnx: bool  # whether ``groundtune export --onnx`` can build its graph (onnx_export.py)
    merge_size: int = 2  # patches merged per side into one LLM token

    def __post_init__(self) -> None:
        if self.coordinates not in (RESIZED_PIXELS, NORM_1000):
            raise ValueError(f"{self.name}: coordinates {self.coordinates!r} is neither {RESIZED_PIXELS!r} "
                             f"nor {NORM_1000!r}")
        if self.answer not in (JSON, SPECIAL_TOKENS):
            raise ValueError(f"{self.name}: answer {self.answer!r} is neither {JSON!r} nor {SPECIAL_TOKENS!r}")

    @property
    def factor(self) -> int:
        """The resize factor: image sides are multiples of it (one merged patch per LLM token)."""
        return self.patch_size * self.merge_size


FAMILIES = {
    f.name: f
    for f in (
        Facts("qwen2.5-vl", RESIZED_PIXELS, JSON, patch_size=14, min_pixels=3_136, max_pixels=12_845_056, onnx=True),
        Facts("qwen2-vl", NORM_1000, SPECIAL_TOKENS, patch_size=14, min_pixels=3_136, max_pixels=12_845_056,
              onnx=True),
        # no ONNX yet: Qwen3-VL's tower adds learned position tables and feeds several LLM layers (DeepStack)
        Facts("qwen3-vl", NORM_1000, JSON, patch_size=16, min_pixels=65_536, max_pixels=16_777_216, onnx=False),
    )
}


def family(name: str) -> Facts:
    """The facts of a family by groundtune's name; a ValueError naming the known ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; expected one of {', '.join(FAMILIES)}")
    return FAMILIES[name]
