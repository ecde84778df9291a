"""The Qwen-VL families groundtune knows and the facts of each that more than one layer needs: how
its boxes are written (groundtune.boxes), how its images are resized, and what the deploy half can
do with it, and the architecture facts groundtune.plan counts a model's parameters with (it sizes
models without torch, so without the model code). One record per family, read by every module that
needs one of these facts; no module keeps a list of its own. transformers' class and module names,
the special tokens and the config builder stay with the model code (models/qwen.py's ``Family``,
which reads its facts from here).

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
# Which vision_config keys size a family's vision tower (groundtune.plan counts its parameters from them)
EMBED_DIM_MLP_RATIO = "embed_dim, mlp_ratio"  # width embed_dim, MLP mlp_ratio x width (hidden_size is the LLM's)
HIDDEN_INTERMEDIATE = "hidden_size, intermediate_size"  # width hidden_size, MLP intermediate_size
# The vision tower's normalisation: RMSNorm has a weight, LayerNorm a weight and a bias
LAYER_NORM, RMS_NORM = "LayerNorm", "RMSNorm"
# The vision blocks' MLP: two linears around a GELU, or SwiGLU's gate, up and down (all three with biases)
GELU_MLP, SWIGLU_MLP = "GELU", "SwiGLU"


@dataclass(frozen=True)
class Facts:
    """One family's facts. ``min_pixels``/``max_pixels``: the budget of the processor Qwen ships
    (its preprocessor_config.json), a run's default when it pins none. The architecture facts after
    ``onnx`` are what groundtune.plan needs to count a model's parameters from its config.json
    without torch (transformers builds them into its modules, which plan cannot import)."""

    name: str  # groundtune's name of the family: the key of every table that speaks of families
    model_type: str  # its config.json's model_type (transformers' name)
    coordinates: str  # RESIZED_PIXELS | NORM_1000
    answer: str  # JSON | SPECIAL_TOKENS
    patch_size: int  # the vision tower's patch side, in pixels
    min_pixels: int
    max_pixels: int
    onnx: bool  # whether ``groundtune export --onnx`` can build its graph (onnx_export.py)
    vision_sizes: str  # EMBED_DIM_MLP_RATIO | HIDDEN_INTERMEDIATE: where the tower's width and MLP width are read
    default_vision_width: int  # the tower's width when config.json leaves it out (transformers' default)
    vision_norm: str  # LAYER_NORM | RMS_NORM, in the vision blocks and the merger: its parameters per width
    vision_mlp: str  # GELU_MLP | SWIGLU_MLP: two linears or three in each vision block's MLP
    # DeepStack: one more merger for each of vision_config's deepstack_visual_indexes, each normalising
    # the 4 merged patches, whose features enter early LLM layers (parameters "merger" trains)
    deepstack: bool
    patch_bias: bool  # whether the patch embedding (a convolution) has a bias
    learned_positions: bool  # a learned position table of vision_config's num_position_embeddings x width
    attention_bias: bool  # whether the LLM's q/k/v projections have biases when config.json does not say
    qk_norm: bool  # whether the LLM's attention normalises queries and keys (a head_dim RMSNorm each)
    merge_size: int = 2  # patches merged per side into one LLM token

    def __post_init__(self) -> None:
        if self.coordinates not in (RESIZED_PIXELS, NORM_1000):
            raise ValueError(f"{self.name}: coordinates {self.coordinates!r} is neither {RESIZED_PIXELS!r} "
                             f"nor {NORM_1000!r}")
        if self.answer not in (JSON, SPECIAL_TOKENS):
            raise ValueError(f"{self.name}: answer {self.answer!r} is neither {JSON!r} nor {SPECIAL_TOKENS!r}")
        for key, value, allowed in (("vision_sizes", self.vision_sizes, (EMBED_DIM_MLP_RATIO, HIDDEN_INTERMEDIATE)),
                                      ("vision_norm", self.vision_norm, (LAYER_NORM, RMS_NORM)),
                                      ("vision_mlp", self.vision_mlp, (GELU_MLP, SWIGLU_MLP))):
            if value not in allowed:
                raise ValueError(f"{self.name}: {key} {value!r} is neither {allowed[0]!r} nor {allowed[1]!r}")

    @property
    def factor(self) -> int:
        """The resize factor: image sides are multiples of it (one merged patch per LLM token)."""
        return self.patch_size * self.merge_size


FAMILIES = {
    f.name: f
    for f in (
        Facts("qwen2.5-vl", "qwen2_5_vl", RESIZED_PIXELS, JSON, patch_size=14, min_pixels=3_136, max_pixels=12_845_056, onnx=True,
              vision_sizes=HIDDEN_INTERMEDIATE, default_vision_width=1280, vision_norm=RMS_NORM, vision_mlp=SWIGLU_MLP,
              deepstack=False, patch_bias=False, learned_positions=False, attention_bias=True, qk_norm=False),
        Facts("qwen2-vl", "qwen2_vl", NORM_1000, SPECIAL_TOKENS, patch_size=14, min_pixels=3_136, max_pixels=12_845_056,
              onnx=True, vision_sizes=EMBED_DIM_MLP_RATIO, default_vision_width=1280, vision_norm=LAYER_NORM,
              vision_mlp=GELU_MLP, deepstack=False, patch_bias=False, learned_positions=False, attention_bias=True,
              qk_norm=False),
        # no ONNX yet: Qwen3-VL's tower adds learned position tables and feeds several LLM layers (DeepStack)
        Facts("qwen3-vl", "qwen3_vl", NORM_1000, JSON, patch_size=16, min_pixels=65_536, max_pixels=16_777_216, onnx=False,
              vision_sizes=HIDDEN_INTERMEDIATE, default_vision_width=1152, vision_norm=LAYER_NORM, vision_mlp=GELU_MLP,
              deepstack=True, patch_bias=True, learned_positions=True, attention_bias=False, qk_norm=True),
    )
}


def family(name: str) -> Facts:
    """The facts of a family by groundtune's name; a ValueError naming the known ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; expected one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of_model_type(model_type: str) -> str:
    """groundtune's name of the family whose config.json says ``model_type``."""
    for facts in FAMILIES.values():
        if facts.model_type == model_type:
            return facts.name
    raise ValueError(f"model type {model_type!r} is not a Qwen-VL model; groundtune supports "
                     f"{', '.join(f.model_type for f in FAMILIES.values())}")


@dataclass(frozen=True)
class Architecture:
    """A published model's shape (its hub config.json's sizes): to build it randomly initialised where
    its weights cannot be downloaded (speed and memory do not depend on weight values: ``--model
    random:qwen2.5-vl-3b``), and for ``groundtune plan`` to size it without downloading anything."""

    family: str
    hub_id: str
    text: dict
    vision: dict
    tied: bool  # the LM head is the embedding

    def config(self) -> dict:
        """Its config.json's shape entries (what groundtune.plan reads)."""
        return {"model_type": family(self.family).model_type, "tie_word_embeddings": self.tied,
                "text_config": dict(self.text, tie_word_embeddings=self.tied),
                "vision_config": dict(self.vision, patch_size=family(self.family).patch_size,
                                      spatial_merge_size=family(self.family).merge_size)}


# Qwen2.5-VL's 3B and 7B share one vision tower (its output width is the LLM's) and one rotary layout.
_QWEN25_TEXT = dict(max_position_embeddings=128000, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
_QWEN25_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, temporal_patch_size=2,
                      window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
ARCHITECTURES = {
    "qwen2.5-vl-3b": Architecture("qwen2.5-vl", "Qwen/Qwen2.5-VL-3B-Instruct",
                                  dict(_QWEN25_TEXT, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936),
                                  dict(_QWEN25_VISION, out_hidden_size=2048), tied=True),
    "qwen2.5-vl-7b": Architecture("qwen2.5-vl", "Qwen/Qwen2.5-VL-7B-Instruct",
                                  dict(_QWEN25_TEXT, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064),
                                  dict(_QWEN25_VISION, out_hidden_size=3584), tied=False),
}


def architecture(name: str) -> Architecture | None:
    """The published architecture ``name`` is (its key, e.g. qwen2.5-vl-3b, or its hub id), or None."""
    if name in ARCHITECTURES:
        return ARCHITECTURES[name]
    by_hub = {a.hub_id.lower(): a for a in ARCHITECTURES.values()}
    return by_hub.get(name.lower())
