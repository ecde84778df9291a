"""Loading a model from whatever the user names: ``tiny``, a training run folder, a local Hugging
Face folder (an export included), or a hub id.

Every loaded model comes with its family (which box convention), its ResizeSpec (which pixel
budget) and its prompt. Those three are saved in ``groundtune.json`` beside every model groundtune
writes and read back here, so eval, predict and serve see images exactly as training did.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from groundtune.boxes import ResizeSpec
from groundtune.models import attention, kernels, qwen
from groundtune.models.tiny import TINY_DIR

METADATA_FILE = "groundtune.json"

# transformers draws a bar per weight file loaded or written; ours already say what is going on
from transformers.utils import logging as _hf_logging  # noqa: E402

_hf_logging.disable_progress_bar()
TINY_SEED = 0  # the randomly initialised tiny model is the same everywhere


@dataclass
class GroundingModel:
    """A model ready to ground: the network, how to feed it, and how to read its boxes."""

    model: torch.nn.Module
    processor: qwen.Processor
    family: str
    resize: ResizeSpec
    prompt: str = qwen.DEFAULT_PROMPT
    source: str = ""  # what the user named, for reports
    base_model: str = ""  # the base weights an adapter applies to (same as source for full models)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def metadata(self) -> dict:
        return {
            "family": self.family,
            "resize": self.resize.to_dict(),
            "prompt": self.prompt,
            "base_model": self.base_model,
        }


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(device: torch.device, dtype: str = "auto") -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]


def read_metadata(folder: Path) -> dict:
    path = folder / METADATA_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def write_metadata(folder: str | Path, metadata: dict) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")


def load_processor(folder_or_id: str | Path) -> qwen.Processor:
    """Tokenizer, image processor and chat template of a Qwen-VL model folder or hub id."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder_or_id)
    image_processor = _load_image_processor(folder_or_id)
    template = tokenizer.chat_template
    if not template:
        # Newer exports keep the template with the processor, not the tokenizer.
        from transformers import AutoProcessor

        template = AutoProcessor.from_pretrained(folder_or_id).chat_template
    tokenizer.padding_side = "left"
    return qwen.Processor(tokenizer=tokenizer, image_processor=image_processor, chat_template=template)


def _load_image_processor(folder_or_id):
    # The PIL backend needs no torchvision and gives the same patches; prefer it where it exists.
    try:
        from transformers import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil.from_pretrained(folder_or_id)
    except ImportError:
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(folder_or_id)


def resolve(name: str) -> tuple[str, Path | None]:
    """What kind of thing ``name`` is: ("tiny" | "run" | "folder" | "hub", path or None)."""
    if name == "tiny":
        return "tiny", TINY_DIR
    if name.startswith("random:"):
        if name[len("random:"):] not in qwen.ARCHITECTURES:
            raise ValueError(f"{name}: known architectures are "
                             + ", ".join(f"random:{a}" for a in qwen.ARCHITECTURES))
        return "random", TINY_DIR
    path = Path(name)
    if path.is_dir():
        if (path / "model" / METADATA_FILE).exists():
            return "run", path
        if (path / "config.json").exists() or (path / "adapter_config.json").exists():
            return "folder", path
        raise FileNotFoundError(
            f"{path}: neither a training run (model/{METADATA_FILE}) nor a model folder (config.json)"
        )
    if path.exists():
        raise FileNotFoundError(f"{path}: a file, not a model folder")
    return "hub", None


def load_model(
    name: str,
    device: str = "auto",
    dtype: str = "auto",
    quantize_4bit: bool = False,
) -> GroundingModel:
    """Load ``tiny``, a run folder, a local model folder or a hub id, ready for inference, with the
    resize settings and prompt it was saved with (callers that override them say so loudly)."""
    kind, path = resolve(name)
    if kind == "random" and quantize_4bit:
        raise ValueError(f"{name}: a random architecture is built in memory, not loaded, so it cannot be loaded in "
                         "4-bit (method=qlora); use method=lora, or name weights (a model folder or a hub id)")
    dev = pick_device(device)
    torch_dtype = pick_dtype(dev, dtype)
    folder = path / "model" if kind == "run" else path
    meta = read_metadata(folder) if folder and kind != "random" else {}

    if folder is not None and (folder / "adapter_config.json").exists():
        base_name = meta.get("base_model") or _adapter_base(folder)
        base = load_model(base_name, device=device, dtype=dtype)
        from peft import PeftModel

        model = PeftModel.from_pretrained(base.model, folder)
        processor = base.processor
        family = meta.get("family", base.family)
        base_meta = base.metadata()
    else:
        source = folder if folder is not None else name
        processor = load_processor(source)
        if kind == "random":
            model = _random_architecture(name[len("random:"):], processor, torch_dtype)
        else:
            model = _load_weights(source, kind, torch_dtype, dev if quantize_4bit else None)
        attention.install(model)  # one attention call per layer, not per window or per padded row
        kernels.pad_vision_mlp(model)  # Qwen2.5-VL's vision MLP at a width cuBLAS runs fast
        family = qwen.family_of(model.config)
        # an adapter trained on these weights applies to THESE weights (for a full fine-tuning run,
        # not the model that run started from), named so that it loads from any working directory
        base_name = str(path.resolve()) if kind in ("run", "folder") else name
        base_meta = {}
    if not quantize_4bit:  # a 4-bit model is placed by from_pretrained and cannot be moved
        model.to(dev)
    model.eval()

    saved_resize = meta.get("resize") or base_meta.get("resize")
    return GroundingModel(
        model=model,
        processor=processor,
        family=family,
        resize=ResizeSpec.from_dict(saved_resize) if saved_resize else ResizeSpec.for_family(family),
        prompt=meta.get("prompt") or base_meta.get("prompt") or qwen.DEFAULT_PROMPT,
        source=name,
        base_model=base_name,
    )


def _random_architecture(arch: str, processor: qwen.Processor, torch_dtype: torch.dtype):
    """A published architecture, randomly initialised, speaking the tiny model's tokenizer (the real
    one cannot be downloaded here); its embedding keeps the real vocabulary size, so every matrix
    has its real shape and cost."""
    from transformers import Qwen2_5_VLConfig

    spec = qwen.ARCHITECTURES[arch]
    tok = processor.tokenizer
    ids = {t: processor.token_id(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                              "<|vision_end|>", "<|im_end|>")}
    config = Qwen2_5_VLConfig(
        text_config=dict(spec["text_config"], bos_token_id=tok.eos_token_id, eos_token_id=ids["<|im_end|>"],
                         pad_token_id=processor.pad_token_id),
        vision_config=spec["vision_config"],
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=spec["tie_word_embeddings"],
    )
    torch.manual_seed(TINY_SEED)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # init on the GPU: minutes faster
        return qwen.model_class("qwen2.5-vl")._from_config(config, dtype=torch_dtype)


def _adapter_base(folder: Path) -> str:
    config = json.loads((folder / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise FileNotFoundError(f"{folder}: adapter without a base model reference")
    return base


def _load_weights(source, kind: str, torch_dtype: torch.dtype, quantize_on: torch.device | None = None):
    """Weights from a folder or the hub; seeded random init for the tiny model without weights.
    ``quantize_on``: load the base in 4-bit NF4 (QLoRA) on that CUDA device."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source)
    cls = qwen.model_class(qwen.family_of(config))
    has_weights = any(Path(source).glob("*.safetensors")) if kind != "hub" else True
    if kind in ("tiny", "folder") and not has_weights:
        # a folder with a config and no weights is an architecture to train from scratch
        if kind == "folder":
            warnings.warn(f"{source} has no weights: the model is randomly initialised", stacklevel=3)
        torch.manual_seed(TINY_SEED)
        model = cls._from_config(config, dtype=torch_dtype)
        return model
    extra = {}
    if quantize_on is not None:
        try:
            from transformers import BitsAndBytesConfig

            import bitsandbytes  # noqa: F401  (fail here with a clear message, not deep in transformers)
        except ImportError:
            raise ImportError("method=qlora needs bitsandbytes: pip install 'groundtune[gpu]'") from None
        extra = {
            "quantization_config": BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                bnb_4bit_use_double_quant=True,
                # the vision tower is small and sensitive: keep it in bf16. Names match from the
                # start of a module's path ("visual" alone would match nothing and quantize the tower)
                llm_int8_skip_modules=["model.visual", "lm_head"],
            ),
            "device_map": {"": quantize_on.index or 0},
        }
    try:
        return cls.from_pretrained(source, dtype=torch_dtype, **extra)
    except OSError as e:
        raise FileNotFoundError(
            f"could not load weights for {source!r} ({e}). On a machine without network, download "
            "the model first (huggingface-cli download) and pass its folder."
        ) from None


__all__ = ["GroundingModel", "load_model", "load_processor", "resolve", "write_metadata", "read_metadata",
           "METADATA_FILE"]
