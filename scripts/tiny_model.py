"""How the built-in tiny model was made: the real Qwen2.5-VL architecture at 10.1 M parameters, with
an offline tokenizer and image processor, PRE-TRAINED by groundtune itself on the synthetic shapes
task and shipped in src/groundtune/assets/tiny (weights in bf16, its training log and the commands
that made it in TRAINING.md there). A demonstration model for coloured shapes, not a general
grounding model. The library only loads it (``groundtune.models.loading``: ``--model tiny``); this
script writes its assets, or those of another tiny architecture to pre-train.

Two settings decide whether such a small model can learn to ground (field-notes, "Learning from
scratch"): a small BPE vocabulary in which every digit is its own token (Qwen's pre-tokenizer
already splits digits), and the rotary frequencies. Qwen2.5-VL's M-RoPE gives the temporal, height
and width axes consecutive blocks of frequencies, highest first, so the width axis always gets the
lowest. With Qwen's stock theta of 1e6 those are too low for a tiny model to learn horizontal
position. With theta 20 and head_dim 32 every frequency is high: position is read well, but no
dimension stays nearly unrotated across the image, and a phrase's colour or kind word cannot find
its shape by content (the model stalled at 0.83, picking at chance among shapes named by colour).
The first tiny model's setting, head_dim 64, theta 300 and mrope_section [2, 10, 20], keeps width
frequencies from 0.12 down to 0.004 radians per position: the high ones read position, the low
ones match content (docs/benchmarks-history.md, "groundtune-tiny"). Colour, though, no model of that
layout has learnt to match; mrope_section [10, 10, 12] at theta 20 (head_dim 64) has, from random
weights, likely because ten temporal pairs, on which every image token shares one position, let a
word meet every image token at one phase ("groundtune-tiny 2: positions that let colour match").
groundtune-tiny 2 (shipped) has that layout, a language model twice as wide (384, six heads, each
with its own key/value head: a 192-wide one did not learn to pick by colour on the stream of sets),
and its vision tower was pre-trained at a tenth of the language model's rate with the merger left at
its random draw (assets/tiny/TRAINING.md).

    python scripts/tiny_model.py --out DIR [--hidden 256 ...]    # another tiny architecture (config only)
    python scripts/tiny_model.py --install-weights RUN/model     # ship a pre-trained model as `tiny`
    python scripts/tiny_model.py --fresh-merger RUN/model --out DIR   # RUN's model, its merger drawn anew
    python scripts/tiny_model.py --fresh-vision RUN/model --out DIR   # ... its whole vision tower drawn anew
"""

from __future__ import annotations

import itertools
from pathlib import Path

from groundtune.models import qwen
from groundtune.models.loading import TINY_DIR

FAMILY = qwen.family("qwen2.5-vl")
# This checkout's tiny folder, where this script writes by default (TINY_DIR is the installed
# package's: from a second clone it would be another checkout's)
SHIPPED = Path(__file__).resolve().parents[1] / "src" / "groundtune" / "assets" / "tiny"
SPECIAL_TOKENS = list(qwen.TOKENS.all)

# The Qwen2-VL chat layout, without the default system message (it would only lengthen every
# sequence of a model that has never seen another system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Text the tokenizer is trained on: the prompt, answers, and the words of synthetic phrases
# (present and plausible future variants), so whole words become single tokens.
_COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "cyan", "pink", "black", "white", "gray"]
_SHAPES = ["circle", "square", "triangle", "star", "diamond", "cross", "hexagon", "shape", "object"]
_WORDS = (
    "the a an of on in at to is left right top bottom above below upper lower leftmost rightmost "
    "topmost bottommost middle center next beside between near far small big large smallest largest "
    "one two three first second third other"
).split()
TEXT_CONFIG = dict(
    hidden_size=384,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=6,  # head_dim 64 (Qwen2.5-VL's rotary needs head_dim = hidden / heads)
    num_key_value_heads=6,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 20.0, "mrope_section": [10, 10, 12]},
    tie_word_embeddings=True,
)
VISION_CONFIG = dict(
    depth=4,
    hidden_size=64,
    intermediate_size=256,
    num_heads=2,
    out_hidden_size=384,  # the language model's width
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[3],
)
VOCAB_SIZE = 512
TINY_MAX_PIXELS = 224 * 224


def _corpus() -> list[str]:
    lines = []
    for colour, shape, other in itertools.product(_COLOURS, _SHAPES, _WORDS):
        phrase = f"the {colour} {shape} {other} the {shape}"
        lines.append(qwen.DEFAULT_PROMPT.format(phrase=phrase))
        lines.append(f'[{{"bbox_2d": [12, 34, 56, 78], "label": "{phrase}"}}]')
        lines.append(f"<|object_ref_start|>{phrase}<|object_ref_end|><|box_start|>(1,2),(3,4)<|box_end|>")
    lines += ["system\nYou are a helpful assistant.\nuser\nassistant\n", "```json\n[]\n```"] * 20
    return lines


def build_tokenizer():
    """Train the small byte-level BPE on the corpus above and wrap it as a Qwen2Tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(), trainer)
    import json

    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})  # the first is its eos
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_config(tokenizer, text: dict | None = None, vision: dict | None = None):
    """The tiny Qwen2.5-VL config; ``text``/``vision`` override sizes (other tiny architectures)."""
    processor = qwen.Processor(tokenizer=tokenizer, image_processor=None, chat_template=CHAT_TEMPLATE)
    text = dict(TEXT_CONFIG, **(text or {}), vocab_size=max(len(tokenizer), VOCAB_SIZE))
    return FAMILY.build_config(processor.config_token_ids(), text, dict(VISION_CONFIG, **(vision or {})),
                               tie_word_embeddings=True)


def build_image_processor():
    # The pixel budget the tiny model is trained and served with: the 112 px synthetic canvas
    # unchanged, larger images scaled down to about 224 x 224 (saved in groundtune.json too).
    return FAMILY.transformers_class("image_processor_class")(
        patch_size=FAMILY.patch_size, merge_size=FAMILY.merge_size, temporal_patch_size=2,
        min_pixels=FAMILY.min_pixels, max_pixels=TINY_MAX_PIXELS)


def build_assets(out_dir: str | Path = SHIPPED, text: dict | None = None, vision: dict | None = None) -> Path:
    """Write config.json, the tokenizer files and preprocessor_config.json of the tiny model (or,
    with size overrides, of another tiny architecture sharing its tokenizer)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if out_dir.resolve() in (SHIPPED, TINY_DIR.resolve()):
        tokenizer = build_tokenizer()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(TINY_DIR)
    tokenizer.save_pretrained(out_dir)
    build_config(tokenizer, text, vision).save_pretrained(out_dir)
    build_image_processor().save_pretrained(out_dir)
    from groundtune.boxes import ResizeSpec
    from groundtune.models.loading import write_metadata

    resize = ResizeSpec(factor=FAMILY.factor, min_pixels=FAMILY.min_pixels, max_pixels=TINY_MAX_PIXELS)
    write_metadata(out_dir, {"family": FAMILY.name, "resize": resize.to_dict(), "prompt": qwen.DEFAULT_PROMPT,
                             "base_model": "tiny"})
    return out_dir


def install_weights(model_folder: str | Path, out_dir: str | Path = SHIPPED) -> Path:
    """Ship a trained model of the tiny architecture as `tiny`: its weights in bf16 (half the
    size; the tiny model trains and serves in fp32 on CPU, bf16 on GPU) next to the tokenizer,
    image processor and metadata already in ``out_dir``; and the pixel budget it was trained with
    (a run with min_pixels/max_pixels of its own), in groundtune.json and the image processor. The
    model of a box-head run ships without its head (``--install-head`` ships that)."""
    import torch

    from groundtune.models import head
    from groundtune.models.loading import load_model, read_metadata, write_metadata

    gm = load_model(str(model_folder), device="cpu", dtype="fp32")
    model = gm.model.to(torch.bfloat16)
    model.save_pretrained(out_dir, state_dict=head.model_weights(model.state_dict()))
    (Path(out_dir) / "model.safetensors").chmod(0o644)  # written 0600; a package file is everyone's to read
    shipped = read_metadata(Path(out_dir))
    if shipped.get("resize") != gm.resize.to_dict():
        write_metadata(out_dir, {**shipped, "resize": gm.resize.to_dict()})
        FAMILY.transformers_class("image_processor_class")(
            patch_size=FAMILY.patch_size, merge_size=FAMILY.merge_size, temporal_patch_size=2,
            min_pixels=gm.resize.min_pixels, max_pixels=gm.resize.max_pixels).save_pretrained(out_dir)
    return Path(out_dir) / "model.safetensors"


def install_head(model_folder: str | Path, out_dir: str | Path = SHIPPED) -> Path:
    """Ship the box head of a box-head run on the tiny model (its model folder) as the head pre-trained
    with it, in bf16 (``models/head.py``'s PRETRAINED_FILE): its answers stay text; a head=box run
    on it starts from this head."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from groundtune.models.box_head import HEAD_FILE
    from groundtune.models.head import PRETRAINED_FILE

    with safe_open(str(Path(model_folder) / HEAD_FILE), "pt") as f:
        state, metadata = {k: f.get_tensor(k).to(torch.bfloat16).contiguous() for k in f.keys()}, f.metadata()
    out = Path(out_dir) / PRETRAINED_FILE
    save_file(state, str(out), metadata=metadata)  # the threshold it was last evaluated at
    out.chmod(0o644)
    return out


def fresh_vision(model_folder: str | Path, out_dir: str | Path, whole_tower: bool = False) -> Path:
    """``model_folder``'s model (``tiny``, a run or a model folder) written to ``out_dir`` with its
    vision->LLM merger (``whole_tower``: the whole vision tower, merger included) drawn anew, as a
    new model of the architecture draws it, everything else as trained: to continue pre-training
    with ``freeze_merger=true`` (and ``freeze_vision=true``). Pre-training teaches the merger's
    MLP to drop the shapes' colour (a linear probe reads it from the tower's last block at 0.94,
    from the merged tokens at 0.42-0.44, chance 0.25); a random merger passes it on
    (docs/benchmarks-history.md, "groundtune-tiny 2: a wider vision tower, and where colour is
    lost"). The trained tower turns colour down too: a colour moves its last block's features a
    fifth to a third as far as a kind does, a random tower's a quarter further ("groundtune-tiny 2:
    the tower turns colour down")."""
    import shutil

    import torch

    from groundtune.errors import ModelError
    from groundtune.models.loading import load_model, resolve
    from groundtune.runs import RunFolder

    kind, folder = resolve(str(model_folder))  # `tiny`, a run or a model folder: what is copied is its model
    if kind not in ("tiny", "run", "folder"):
        raise ModelError(f"{model_folder}: give the built-in `tiny`, a run or a model folder (its tokenizer and "
                         "processor are copied with the weights)")
    folder = RunFolder(folder).model if kind == "run" else folder
    gm = load_model(str(model_folder), device="cpu", dtype="fp32")
    torch.manual_seed(0)
    drawn = FAMILY.transformers_class("model_class")(gm.model.config)  # initialised as a new model is
    if whole_tower:
        parts = [(getattr(gm.model.model, FAMILY.vision_tower), getattr(drawn.model, FAMILY.vision_tower))]
    else:
        parts = zip(FAMILY.mergers(gm.model), FAMILY.mergers(drawn))
    for trained, new in parts:
        trained.load_state_dict(new.state_dict())
    shutil.copytree(folder, out_dir, dirs_exist_ok=True)  # tokenizer, processor, metadata
    gm.model.save_pretrained(out_dir)
    return Path(out_dir) / "model.safetensors"


if __name__ == "__main__":
    import argparse

    from groundtune.cli.flags import positive_int

    parser = argparse.ArgumentParser(description="Write the tiny model's assets (or another tiny architecture's).")
    parser.add_argument("--out", default=str(SHIPPED), help="default: this checkout's src/groundtune/assets/tiny")
    parser.add_argument("--hidden", type=int, help="text hidden size")
    parser.add_argument("--layers", type=int, help="text layers")
    parser.add_argument("--head-dim", type=int, default=64, help="text attention head size")
    parser.add_argument("--mrope", help="M-RoPE sections t,h,w (sum = head_dim / 2), e.g. 2,10,20")
    parser.add_argument("--rope-theta", type=float)
    parser.add_argument("--vision-hidden", type=int)
    parser.add_argument("--vision-layers", type=int)
    parser.add_argument("--vision-heads", type=int)
    parser.add_argument("--kv-heads", type=positive_int, help="text key/value heads (default: 2 where the query heads are even, "
                        "else 1); as many as the query heads: plain multi-head attention")
    parser.add_argument("--install-weights", metavar="MODEL_FOLDER",
                        help="write this trained model's weights (bf16) into --out as the tiny model's")
    parser.add_argument("--install-head", metavar="MODEL_FOLDER",
                        help="write this box-head model's head (bf16) into --out as the head pre-trained with the tiny "
                             "model (head=box runs on it start from it)")
    fresh = parser.add_mutually_exclusive_group()
    fresh.add_argument("--fresh-merger", metavar="MODEL_FOLDER",
                       help="write this trained model into --out with its merger drawn anew (random)")
    fresh.add_argument("--fresh-vision", metavar="MODEL_FOLDER",
                       help="write this trained model into --out with its whole vision tower, merger included, "
                            "drawn anew (random)")
    a = parser.parse_args()
    source, flag = (a.fresh_merger, "--fresh-merger") if a.fresh_merger else (a.fresh_vision, "--fresh-vision")
    if source and Path(a.out).resolve() in (SHIPPED, TINY_DIR.resolve(), Path(source).resolve()):
        parser.error(f"{flag} writes a new model folder: give --out a folder other than the "
                     "shipped tiny model's and the model read")
    if source:
        from groundtune.errors import GroundtuneError

        try:
            print(fresh_vision(source, a.out, whole_tower=bool(a.fresh_vision)))
        except GroundtuneError as e:  # a folder that is not a model: one line, exit 2
            parser.error(str(e))
        raise SystemExit(0)
    if a.install_weights or a.install_head:
        from groundtune.errors import GroundtuneError

        try:
            print(install_weights(a.install_weights, a.out) if a.install_weights else install_head(a.install_head, a.out))
        except (GroundtuneError, FileNotFoundError) as e:  # not a model, or no head in it: one line, exit 2
            parser.error(str(e))
        raise SystemExit(0)
    text = {}
    if a.hidden:
        heads = a.hidden // a.head_dim
        text.update(hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_attention_heads=heads,
                    num_key_value_heads=2 if heads % 2 == 0 else 1, head_dim=a.head_dim)
    if a.layers:
        text["num_hidden_layers"] = a.layers
    if a.kv_heads:
        heads = text.get("num_attention_heads", TEXT_CONFIG["num_attention_heads"])
        if heads % a.kv_heads:  # grouped-query attention shares each key/value head among whole groups
            parser.error(f"--kv-heads {a.kv_heads} does not divide the {heads} query heads")
        text["num_key_value_heads"] = a.kv_heads
    if a.mrope or a.rope_theta:
        rope = dict(TEXT_CONFIG["rope_parameters"])
        if a.mrope:
            rope["mrope_section"] = [int(v) for v in a.mrope.split(",")]
        if a.rope_theta:
            rope["rope_theta"] = a.rope_theta
        text["rope_parameters"] = rope
    vision = {}
    if a.vision_hidden:
        vision.update(hidden_size=a.vision_hidden, intermediate_size=4 * a.vision_hidden)
    if a.vision_layers:
        vision.update(depth=a.vision_layers, fullatt_block_indexes=[a.vision_layers - 1])
    if a.vision_heads:
        vision["num_heads"] = a.vision_heads
    if text.get("hidden_size"):
        vision["out_hidden_size"] = text["hidden_size"]
    print(build_assets(a.out, text, vision))
