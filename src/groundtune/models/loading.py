"""Loading a model from whatever the user names: ``tiny``, a training run folder, a local Hugging
Face folder (an export included), or a hub id.

Every loaded model comes with its family (which box convention), its ResizeSpec (which pixel
budget) and its prompt. Those three are saved in ``groundtune.json`` beside every model groundtune
writes and read back here, so eval, predict and serve see images exactly as training did.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from groundtune.boxes import DEFAULT_MAX_PIXELS, ResizeSpec
from groundtune.models import qwen
from groundtune.models.tiny import TINY_DIR

METADATA_FILE = "groundtune.json"
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
    extra: dict = field(default_factory=dict)

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
    path = Path(name)
    if path.is_dir():
        if (path / "model").is_dir() and (path / METADATA_FILE).exists():
            return "run", path
        if (path / "config.json").exists() or (path / "adapter_config.json").exists():
            return "folder", path
        raise FileNotFoundError(
            f"{path}: neither a training run (model/ and {METADATA_FILE}) nor a model folder (config.json)"
        )
    if path.exists():
        raise FileNotFoundError(f"{path}: a file, not a model folder")
    return "hub", None


def load_model(
    name: str,
    device: str = "auto",
    dtype: str = "auto",
    resize: ResizeSpec | None = None,
    prompt: str | None = None,
    merge_adapter: bool = False,
) -> GroundingModel:
    """Load ``tiny``, a run folder, a local model folder or a hub id, ready for inference.

    ``resize``/``prompt`` override what the model was saved with; a different pixel budget than
    the one it was trained with is allowed (a user may want it) but warned about loudly.
    """
    kind, path = resolve(name)
    dev = pick_device(device)
    torch_dtype = pick_dtype(dev, dtype)
    folder = path / "model" if kind == "run" else (path if path is not None else None)
    meta = read_metadata(path) if kind == "run" else (read_metadata(folder) if folder else {})

    if folder is not None and (folder / "adapter_config.json").exists():
        base_name = meta.get("base_model") or _adapter_base(folder)
        base = load_model(base_name, device=device, dtype=dtype)
        from peft import PeftModel

        model = PeftModel.from_pretrained(base.model, folder)
        if merge_adapter:
            model = model.merge_and_unload()
        processor = base.processor
        family = meta.get("family", base.family)
        base_meta = base.metadata()
    else:
        source = folder if folder is not None else name
        processor = load_processor(source)
        model = _load_weights(source, kind, torch_dtype)
        family = qwen.family_of(model.config)
        base_name = meta.get("base_model") or name
        base_meta = {}
    model.to(dev).eval()

    saved_resize = meta.get("resize") or base_meta.get("resize")
    saved = ResizeSpec.from_dict(saved_resize) if saved_resize else ResizeSpec.for_family(family)
    if resize is not None and resize != saved and (saved_resize is not None):
        warnings.warn(
            f"{name} was trained with {saved} but is being run with {resize}: boxes stay correct "
            "(they are mapped with the resize actually used) but accuracy may drop.",
            stacklevel=2,
        )
    return GroundingModel(
        model=model,
        processor=processor,
        family=family,
        resize=resize or saved,
        prompt=prompt or meta.get("prompt") or base_meta.get("prompt") or qwen.DEFAULT_PROMPT,
        source=name,
        base_model=base_name,
    )


def _adapter_base(folder: Path) -> str:
    config = json.loads((folder / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise FileNotFoundError(f"{folder}: adapter without a base model reference")
    return base


def _load_weights(source, kind: str, torch_dtype: torch.dtype):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source)
    cls = qwen.model_class(qwen.family_of(config))
    has_weights = any(Path(source).glob("*.safetensors")) if kind != "hub" else True
    if kind == "tiny" and not has_weights:
        torch.manual_seed(TINY_SEED)
        model = cls._from_config(config, dtype=torch_dtype)
        return model
    try:
        return cls.from_pretrained(source, dtype=torch_dtype)
    except OSError as e:
        raise FileNotFoundError(
            f"could not load weights for {source!r} ({e}). On a machine without network, download "
            "the model first (huggingface-cli download) and pass its folder."
        ) from None


__all__ = ["GroundingModel", "load_model", "load_processor", "resolve", "write_metadata", "read_metadata",
           "METADATA_FILE", "DEFAULT_MAX_PIXELS"]
