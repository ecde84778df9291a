"""Loading a model from whatever the user names: ``tiny``, a training run folder, a local Hugging
Face folder (an export included), or a hub id.

Every loaded model comes with its family (which box convention), its ResizeSpec (which pixel
budget) and its prompt. Those three are saved in ``groundtune.json`` beside every model groundtune
writes and read back here, so eval, predict and serve see images exactly as training did. A model
groundtune did not write (a base checkpoint) is resized with the pixel budget of its OWN
preprocessor_config.json, as Qwen's processor would resize for it; the family's shipped budget
(``qwen.Family``) only when it has none.

Loading installs nothing: the speed-ups are one explicit call (``models.speedups.install``). The
checkpoint's own decoding settings (generation_config.json: Qwen2.5-VL ships top_k=1 and
repetition_penalty 1.05) are set aside, so that generation uses only what ``infer.Decoding`` passes.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from groundtune import families
from groundtune.boxes import ResizeSpec
from groundtune.errors import ConfigError, MissingError, MissingPackageError, ModelError, shown
from groundtune.models import head, qwen
from groundtune.runs import METADATA_FILE, RunFolder, is_run

TINY_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny"  # the built-in tiny model
TINY_SEED = 0  # the randomly initialised tiny model is the same everywhere
# where a model's pixel budget came from, in the order they are tried
RESIZE_SAVED, RESIZE_PROCESSOR, RESIZE_FAMILY = METADATA_FILE, "preprocessor_config.json", "family default"


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
    resize_source: str = RESIZE_SAVED  # where ``resize`` came from: RESIZE_SAVED, _PROCESSOR or _FAMILY

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def metadata(self) -> dict:
        return {
            "family": self.family,
            "resize": self.resize.to_dict(),
            "prompt": self.prompt,
            "base_model": self.base_model,
            "head": "box" if head.head_of(self.model) is not None else "text",
        }


def pick_device(device: str = "auto") -> torch.device:
    """``auto`` (a CUDA GPU when there is one), ``cpu``, ``cuda`` or ``cuda:N``; anything this machine
    cannot run is a ConfigError naming the setting."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device={shown(device)}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device}: this machine has no CUDA GPU that PyTorch {torch.__version__} can use; "
                          "use device=cpu (or auto)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device={device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={device}: groundtune runs on cpu or cuda")
    return dev


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
    import transformers

    cls = getattr(transformers, qwen.Family.image_processor_class, transformers.AutoImageProcessor)
    return cls.from_pretrained(folder_or_id)


def processor_resize(folder_or_id, family: qwen.Family) -> ResizeSpec | None:
    """The pixel budget a model's own preprocessor_config.json sets (``min_pixels``/``max_pixels``,
    or the newer ``size`` with ``shortest_edge``/``longest_edge``), with its factor (patch x merge);
    None when it sets none, so that the library's class defaults are never mistaken for the model's."""
    import transformers

    try:
        config, _ = transformers.ImageProcessingMixin.get_image_processor_dict(str(folder_or_id))
    except OSError:
        return None
    size = config.get("size") if isinstance(config.get("size"), dict) else {}
    low = config.get("min_pixels") or size.get("shortest_edge")
    high = config.get("max_pixels") or size.get("longest_edge")
    if not (low and high):
        return None
    factor = int(config.get("patch_size", family.patch_size)) * int(config.get("merge_size", family.merge_size))
    return ResizeSpec(factor=factor, min_pixels=int(low), max_pixels=int(high))


def resolve(name: str) -> tuple[str, Path | None]:
    """What kind of thing ``name`` is: ("tiny" | "random" | "run" | "folder" | "hub", path or None).
    A name that looks like a path and is not there is a MissingError at once, never a hub lookup;
    a hub id must be in the local cache or downloadable now (``check_hub``)."""
    if name == "tiny":
        return "tiny", TINY_DIR
    if name.startswith("random:"):
        if name[len("random:"):] not in families.ARCHITECTURES:
            raise ModelError(f"{name}: known architectures are "
                             + ", ".join(f"random:{a}" for a in families.ARCHITECTURES))
        return "random", TINY_DIR
    path = Path(name).expanduser()
    if path.is_dir():
        if RunFolder(path).has_model:
            return "run", path
        if (path / "config.json").exists() or (path / "adapter_config.json").exists():
            return "folder", path
        if is_run(path):  # its settings or checkpoints, and no model yet
            raise MissingError(f"{path}: this run has no model yet (RUN/model is written at its end and at each new "
                               f"best eval); finish it first: groundtune train --resume {path} (an RL run: "
                               f"groundtune rl --resume {path})")
        raise MissingError(f"{path}: neither a training run ({RunFolder(path).model.name}/{METADATA_FILE}) nor a model "
                           "folder (config.json)")
    if path.exists():
        raise MissingError(f"{path}: a file, not a model folder")
    if _looks_like_a_path(name):
        there = next((p for p in path.parents if p.is_dir()), None)
        hint = f" ({there} holds {_listing(there)})" if there is not None and str(there) not in ("", ".", "/") else ""
        raise MissingError(f"{name}: no such model folder{hint}")
    check_hub(name)
    return "hub", None


def _looks_like_a_path(name: str) -> bool:
    """A hub id is ``name`` or ``owner/name``; a relative or absolute path, a ~ path, a path of more
    than two parts, or one whose first part is a folder here, is a path."""
    parts = name.split("/")
    return (name.startswith((".", "/", "~")) or "\\" in name or name.endswith("/") or len(parts) > 2
            or (len(parts) == 2 and Path(parts[0]).is_dir()))


def _listing(folder: Path) -> str:
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    return ", ".join(names[:6]) + (", ..." if len(names) > 6 else "") if names else "nothing"


def check_hub(name: str) -> None:
    """A hub id groundtune can load: in the local cache, or downloadable from here now. Otherwise
    one line saying what to do, instead of transformers' minute of retries and chained traceback."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise MissingError(f"{name}: no folder of that name here, and not in the local Hugging Face cache with "
                           f"HF_HUB_OFFLINE set: download it where there is network (hf download {name}) and name "
                           "its folder")
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError:
        raise MissingError(f"{name}: no folder of that name here, not in the local Hugging Face cache, and {host} "
                           "cannot be reached from here: "
                           f"download it where there is network (hf download {name}), then name its folder "
                           "(or copy the cache here and set HF_HUB_OFFLINE=1)") from None


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
        raise ModelError(f"{name}: a random architecture is built in memory, not loaded, so it cannot be loaded in "
                         "4-bit (method=qlora); use method=lora, or name weights (a model folder or a hub id)")
    dev = pick_device(device)
    torch_dtype = pick_dtype(dev, dtype)
    folder = RunFolder(path).model if kind == "run" else path
    meta = read_metadata(folder) if folder and kind != "random" else {}

    if folder is not None and (folder / "adapter_config.json").exists():
        base_name = meta.get("base_model") or _adapter_base(folder)
        base = load_model(base_name, device=device, dtype=dtype)
        from peft import PeftModel

        model = PeftModel.from_pretrained(base.model, folder)
        processor = base.processor
        family = qwen.family(meta.get("family", base.family))
        own_resize = (base.resize, base.resize_source)
        base_meta = base.metadata()
    else:
        from safetensors import SafetensorError

        source = folder if folder is not None else name
        try:
            processor = load_processor(source)
            if kind == "random":
                model = _random_architecture(name[len("random:"):], processor, torch_dtype)
            else:
                model = _load_weights(source, kind, torch_dtype, dev if quantize_4bit else None)
        except (OSError, SafetensorError) as e:
            if kind not in ("run", "folder"):
                raise
            # a folder of ours that transformers cannot read: a corrupt config.json, weights cut short
            raise ModelError(f"{source}: cannot be loaded as a model: {str(e).splitlines()[0][:300]}") from None
        family = qwen.family_of(model.config)
        from_processor = processor_resize(source, family) if kind != "random" else None
        own_resize = ((from_processor, RESIZE_PROCESSOR) if from_processor is not None
                      else (family.default_resize(), RESIZE_FAMILY))
        # an adapter trained on these weights applies to THESE weights (for a full fine-tuning run,
        # not the model that run started from), named so that it loads from any working directory
        base_name = str(path.resolve()) if kind in ("run", "folder") else name
        base_meta = {}
        _set_aside_decoding_defaults(model)
    if meta.get("head") == "box":  # its weights beside the model's (models/head.py)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        head.load(model, folder, getattr(base.config, "text_config", base.config).hidden_size)
    if not quantize_4bit:  # a 4-bit model is placed by from_pretrained and cannot be moved
        model.to(dev)
    model.eval()

    saved_resize = meta.get("resize") or base_meta.get("resize")
    resize, resize_source = (ResizeSpec.from_dict(saved_resize), RESIZE_SAVED) if saved_resize else own_resize
    return GroundingModel(
        model=model,
        processor=processor,
        family=family.name,
        resize=resize,
        prompt=meta.get("prompt") or base_meta.get("prompt") or qwen.DEFAULT_PROMPT,
        source=name,
        base_model=base_name,
        resize_source=resize_source,
    )


def with_resize(gm: GroundingModel, min_pixels: int | None, max_pixels: int | None, who: str,
                pins_base_budget: bool = False) -> GroundingModel:
    """``gm`` resized with another pixel budget where ``min_pixels``/``max_pixels`` are given (the
    factor stays the family's). Overriding the budget groundtune saved with a model changes what it
    sees from what it was trained on: ``who`` (eval, train) warns. So does overriding a base
    checkpoint's own budget, unless ``pins_base_budget`` (training pins one to fit its GPU: said,
    not warned). Boxes stay right either way: they are mapped with the resize actually used."""
    import dataclasses

    override = dataclasses.replace(gm.resize, min_pixels=min_pixels or gm.resize.min_pixels,
                                   max_pixels=max_pixels or gm.resize.max_pixels)
    if override == gm.resize:
        return gm
    if gm.resize_source == RESIZE_SAVED or (gm.resize_source == RESIZE_PROCESSOR and not pins_base_budget):
        what = "it was trained at" if gm.resize_source == RESIZE_SAVED else "its own processor gives"
        warnings.warn(f"{who}: {gm.source} has its pixel budget in {gm.resize_source} ({gm.resize}) but runs with "
                      f"{override}: it sees images at other sizes than {what}, which usually costs accuracy and "
                      "makes scores incomparable", stacklevel=2)
    else:
        print(f"{who}: pixel budget {override} (the model's {gm.resize_source}: {gm.resize})")
    return dataclasses.replace(gm, resize=override, resize_source=f"{who} setting")


def _set_aside_decoding_defaults(model) -> None:
    """Keep only the token ids of the checkpoint's generation_config.json. transformers fills every
    decoding field a ``generate`` call leaves unset from it: Qwen2.5-VL ships top_k=1 (every sampled
    answer the same, so RL learns nothing) and repetition_penalty 1.05 (greedy answers change where
    a digit repeats). ``infer.Decoding`` passes every field explicitly; this makes sure nothing else
    comes in."""
    from transformers import GenerationConfig

    shipped = getattr(model, "generation_config", None)
    if shipped is None:
        return
    model.generation_config = GenerationConfig(
        bos_token_id=shipped.bos_token_id, eos_token_id=shipped.eos_token_id, pad_token_id=shipped.pad_token_id)


def _random_architecture(arch: str, processor: qwen.Processor, torch_dtype: torch.dtype):
    """A published architecture, randomly initialised, speaking the tiny model's tokenizer (the real
    one cannot be downloaded here); its embedding keeps the real vocabulary size, so every matrix
    has its real shape and cost."""
    published = families.ARCHITECTURES[arch]
    family = qwen.family(published.family)
    config = family.build_config(processor.config_token_ids(), published.text, published.vision, published.tied)
    torch.manual_seed(TINY_SEED)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # init on the GPU: minutes faster
        return family.transformers_class()._from_config(config, dtype=torch_dtype)


def box_head_start(name: str) -> Path | None:
    """The box head a ``head=box`` run on model ``name`` starts from (``head.start_file``): its
    folder's (a run's model), a LoRA adapter's base model's where the adapter has none; None: a
    new head (a hub id, a random architecture, a model without one)."""
    kind, path = resolve(name)
    if path is None or kind == "random":
        return None
    folder = RunFolder(path).model if kind == "run" else path
    meta = read_metadata(folder)
    found = head.start_file(folder, meta)
    if found is None and (folder / "adapter_config.json").exists():
        return box_head_start(meta.get("base_model") or _adapter_base(folder))
    return found


def _adapter_base(folder: Path) -> str:
    config = json.loads((folder / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise MissingError(f"{folder}: adapter without a base model reference")
    return base


def _load_weights(source, kind: str, torch_dtype: torch.dtype, quantize_on: torch.device | None = None):
    """Weights from a folder or the hub; seeded random init for the tiny model without weights.
    ``quantize_on``: load the base in 4-bit NF4 (QLoRA) on that CUDA device."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source)
    family = qwen.family_of(config)
    cls = family.transformers_class()
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
            raise MissingPackageError("method=qlora needs bitsandbytes: pip install 'groundtune[gpu]'") from None
        extra = {
            "quantization_config": BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                bnb_4bit_use_double_quant=True,
                llm_int8_skip_modules=family.keep_in_bf16,
            ),
            "device_map": {"": quantize_on.index or 0},
        }
    try:
        return cls.from_pretrained(source, dtype=torch_dtype, **extra)
    except OSError as e:
        raise MissingError(
            f"could not load weights for {source!r} ({e}). On a machine without network, download "
            "the model first (huggingface-cli download) and pass its folder."
        ) from None


__all__ = ["GroundingModel", "load_model", "load_processor", "resolve", "with_resize", "write_metadata",
           "read_metadata", "TINY_DIR"]
