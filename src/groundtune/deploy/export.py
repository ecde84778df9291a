"""Export a trained model as a folder any transformers or vLLM user can load without groundtune.

    groundtune export runs/sft --out exports/sft                  # LoRA merged into its base
    groundtune export runs/sft --out exports/sft --dtype fp32     # another dtype than the base's
    groundtune export runs/box --out exports/box --onnx --image-size 640x480   # + model.onnx (box head)
    groundtune export runs/sft --out exports/sft --push-to-hub me/sft-grounding --private   # + on the hub

What the folder holds, and why each file:
- ``model*.safetensors`` + ``config.json``: the weights, a LoRA adapter merged into its base. A
  QLoRA run's adapter was trained against the 4-bit base; it is merged into the base's own bf16
  weights (4-bit weights cannot hold a merge), so the export answers as the adapter on the full-
  precision base does: slightly unlike the 4-bit model it was trained with (the quantisation error,
  which training partly adapted to), usually better.
- tokenizer files and the chat template: the prompt is built exactly as in training.
- ``preprocessor_config.json`` with the RUN's pixel budget: the stock processor then resizes every
  image exactly as training did. Peers' merged exports drop this file or keep the base's budget,
  and the served model sees other pixels than it was trained on.
- ``generation_config.json`` with greedy grounding defaults (no sampling, no repetition penalty:
  a box may repeat a digit), not the base's (Qwen2.5-VL ships top_k=1 and a penalty of 1.05).
- ``groundtune.json``: family, box convention, pixel budget, prompt, head; ``groundtune predict``,
  ``eval`` and ``serve`` read it back.
- ``README.md``: a model card (cards.py) with the run's eval result, and how to call the model from
  transformers and vLLM, mapping its box back to the caller's image.
- a box-head model: ``box_head.safetensors``, the head's weights, and ``box_head.py``, the head's
  own module (models/box_head.py), which runs the export with transformers (the card shows how).
- with ``--onnx`` (a box-head model): ``model.onnx``, the whole model in one graph for images of
  one size, and ``onnx_predict.py``, which runs it with onnxruntime, numpy, Pillow and tokenizers
  alone (onnx_export.py).

With ``--push-to-hub REPO`` the folder, every file of it, is then uploaded to that model repo
through huggingface_hub's own API (hub.py's ``push_to_hub``); the repo id and the token are checked
first (``check_hub``), so a push that cannot happen costs no export. tests/test_hub_push.py pushes
to a stand-in of the hub's HTTP API on 127.0.0.1.

tests/test_export.py loads an export with transformers alone (no groundtune import) and gets
groundtune's boxes, for all three families, and a box-head export with its box_head.py.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from groundtune import boxes, families
from groundtune.config import EXPORT_DTYPE, MAX_NEW_TOKENS
from groundtune.deploy import onnx_export
from groundtune.deploy.cards import model_card
from groundtune.errors import DiskFullError, RunExistsError, UsageError
from groundtune.files import not_an_input
from groundtune.models import head
from groundtune.models.loading import load_model, read_metadata, resolve
from groundtune.runs import METADATA_FILE, RunFolder

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD = "text"  # how a model without a box head answers: the box written as text


def export(name: str, out: str | Path, dtype: str = EXPORT_DTYPE, overwrite: bool = False, say=print,
           onnx_image_size: tuple[int, int] | None = None) -> Path:
    """Write the model ``name`` (a run folder, a model folder, a hub id, ``tiny``) to ``out`` as a
    self-contained Hugging Face folder; returns ``out``. ``dtype``: ``base`` (the dtype the base
    weights are stored in) or one of DTYPES. ``onnx_image_size`` (width, height): a box-head model
    is also written as ONNX for images of that size (resized as the run resizes them)."""
    out = Path(out)
    kind, path = resolve(name)
    _check_target(out, overwrite, {"the model being exported": path if kind in ("run", "folder") else None})
    if onnx_image_size is not None:
        onnx_export.check_ready()
    run_meta = read_metadata(RunFolder(path).model) if kind == "run" else (read_metadata(path) if path else {})
    gm = load_model(name, device="cpu", dtype="fp32")  # merged in fp32, then cast once
    if gm.base_model != name:  # an adapter's base: read as well, so never written over either
        base_kind, base_path = resolve(gm.base_model)
        not_an_input(out, "--out", {"the base model of the export": base_path if base_kind == "folder" else None},
                     folder=True)
    target_dtype = _stored_dtype(gm.base_model) if dtype == "base" else DTYPES[dtype]
    model = gm.model
    box_head = head.head_of(model)  # a box-head run's head goes in a file of its own (models/head.py)
    if onnx_image_size is not None and box_head is None:
        raise UsageError(f"--onnx: {name} answers in text (head: text); the ONNX graph is for box-head models "
                         "(train with head=box), whose answer is one forward pass")
    qlora = kind == "run" and _run_method(path) == "qlora"
    if hasattr(model, "peft_config"):
        with warnings.catch_warnings():  # peft calls a transformers method transformers deprecates
            warnings.simplefilter("ignore", FutureWarning)
            model = model.merge_and_unload()
        say(f"merged the LoRA adapter into {gm.base_model}" + (
            " (a QLoRA adapter, merged into the base's full-precision weights: see the model card)" if qlora else ""))
    parameters = sum(p.numel() for p in model.parameters())
    needed = parameters * target_dtype.itemsize  # every weight is written in target_dtype
    onnx_bytes = parameters * 4 if onnx_image_size is not None else 0  # the graph's weights are fp32
    _check_disk(out, needed + onnx_bytes)
    onnx = None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))  # a new folder, ours alone
    try:
        if onnx_image_size is not None:  # from the fp32 weights, before they are cast
            say(f"writing {onnx_export.ONNX_FILE} for {onnx_image_size[0]}x{onnx_image_size[1]} images (fp32)")
            onnx = onnx_export.export_onnx(model, box_head, gm.processor, gm.family, gm.resize, gm.prompt,
                                           onnx_image_size, tmp)
            (tmp / onnx_export.SCRIPT_FILE).write_text(onnx_export.script_source())
        model = model.to(target_dtype)
        if box_head is not None:
            model.save_pretrained(tmp, state_dict=head.model_weights(model.state_dict()))
            head.save(box_head, tmp)
            (tmp / head.SCRIPT_FILE).write_text(head.script_source())  # the head's code, which runs the export
        else:
            model.save_pretrained(tmp)
        _greedy_generation_config(gm).save_pretrained(tmp)
        tokenizer = gm.processor.tokenizer
        tokenizer.chat_template = gm.processor.chat_template
        tokenizer.save_pretrained(tmp)
        _image_processor_at(gm.processor.image_processor, gm.resize).save_pretrained(tmp)
        metadata = _export_metadata(gm, box_head is not None, name, path, target_dtype, run_meta, qlora, onnx)
        (tmp / "README.md").write_text(model_card(metadata, out.name))
        # what this export wrote: all that a later --overwrite may replace
        metadata["files"] = sorted([p.name for p in tmp.iterdir()] + [METADATA_FILE])
        (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
        _usual_modes(tmp)
        _replace(out, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"exported {name} -> {out} ({needed / 2**20:,.1f} MiB of {metadata['dtype']} weights)")
    return out


def _usual_modes(folder: Path) -> None:
    """The folder and its files with the modes the umask gives new ones: the folder was made
    owner-only (a temporary folder) and so were the weights (safetensors' temporary file), which a
    server running as another user could not read."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


def _check_target(out: Path, overwrite: bool, inputs: dict[str, Path | None]) -> None:
    """``out`` may be written: not a file, never what the export reads (``inputs``), and where it
    holds something, only a previous export (its groundtune.json lists what it wrote) replaced with
    ``overwrite``: a folder of anything else is never deleted."""
    if out.exists() and not out.is_dir():
        raise RunExistsError(f"{out}: a file is there; name a folder for the export")
    not_an_input(out, "--out", inputs, folder=True)
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise RunExistsError(f"{out} exists and is not empty; pass --overwrite to replace a previous export there, "
                             "or choose another --out")
    listed = _export_files(out)
    if listed is None:
        raise RunExistsError(f"--overwrite: {out} does not hold a previous export (no {METADATA_FILE} listing its "
                             "files), so nothing there is replaced; choose another --out, or empty it yourself")
    others = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if p.name not in listed)
    if others:
        shown = ", ".join(others[:5]) + (f" (+{len(others) - 5} more)" if len(others) > 5 else "")
        raise RunExistsError(f"--overwrite: {out} holds files an export did not write ({shown}); they would be "
                             "deleted with it: move them, or choose another --out")


def _export_files(folder: Path) -> set[str] | None:
    """The files a previous export wrote in ``folder`` (its groundtune.json says), else None."""
    try:
        listed = json.loads((folder / METADATA_FILE).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return set(listed) if isinstance(listed, list) and all(isinstance(n, str) for n in listed) else None


def _replace(out: Path, new: Path) -> None:
    """``new`` renamed to ``out``; a previous export there (checked by ``_check_target``) is moved
    aside first and deleted last, so a kill leaves one of the two whole under a name of its own."""
    if not out.exists():
        new.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    out.rename(old / out.name)
    new.rename(out)
    shutil.rmtree(old)


def _export_metadata(gm, box_head: bool, name: str, path: Path | None, dtype: torch.dtype, run_meta: dict,
                     qlora: bool, onnx: dict | None) -> dict:
    """The export's groundtune.json (less its "files"): what the model is and how it answers."""
    return {
        "family": gm.family,
        "convention": families.family(gm.family).coordinates,
        "resize": gm.resize.to_dict(),
        "prompt": gm.prompt,
        "head": "box" if box_head else HEAD,
        # what a box head's prompts end with: it reads the state of the last token (models/head.py)
        **({"prompt_end": head.prompt_end(gm.family)} if box_head else {}),
        "exported_from": str(path.resolve()) if path is not None else name,
        "base_model": gm.base_model,
        "dtype": str(dtype).removeprefix("torch."),
        **({"eval": run_meta["eval"]} if "eval" in run_meta else {}),
        **({"trained_4bit": True} if qlora else {}),
        **({"onnx": onnx} if onnx is not None else {}),
    }


def _check_disk(out: Path, needed: int) -> None:
    parent = next(p for p in [out.resolve().parent, *out.resolve().parents] if p.exists())
    free = shutil.disk_usage(parent).free
    if free < needed * 1.1 + 2**20:  # the weights, and room for the small files
        raise DiskFullError(f"{parent}: the export needs ~{needed / 2**30:.2f} GiB and {free / 2**30:.2f} GiB are free")


def _run_method(run: Path) -> str | None:
    import yaml

    config = RunFolder(run).config
    return (yaml.safe_load(config.read_text()) or {}).get("method") if config.exists() else None


def _stored_dtype(base: str) -> torch.dtype:
    """The dtype the base's weights are stored in (its config.json), fp32 when it does not say."""
    from transformers import AutoConfig

    kind, path = resolve(base)
    folder = RunFolder(path).model if kind == "run" else path  # a full fine-tuning run's weights are its model/
    config = AutoConfig.from_pretrained(folder if folder is not None else base)
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if stored in DTYPES.values() else torch.float32


def _greedy_generation_config(gm):
    """Greedy grounding defaults in place of the base's (which may sample with top_k=1 and a
    repetition penalty of 1.05)."""
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=MAX_NEW_TOKENS, repetition_penalty=1.0,
                            eos_token_id=gm.processor.eos_token_ids, pad_token_id=gm.processor.pad_token_id,
                            bos_token_id=None)


def _image_processor_at(image_processor, resize: boxes.ResizeSpec):
    """A copy of the image processor whose resize is the run's: its min/max pixels (``size`` in
    transformers 5's names, ``min_pixels``/``max_pixels`` in the older ones and vLLM's)."""
    import copy

    factor = image_processor.patch_size * image_processor.merge_size
    if factor != resize.factor:
        raise ValueError(f"the image processor's patch x merge is {factor}, the model's resize factor {resize.factor}")
    processor = copy.deepcopy(image_processor)
    processor.size = {"shortest_edge": resize.min_pixels, "longest_edge": resize.max_pixels}
    processor.min_pixels, processor.max_pixels = resize.min_pixels, resize.max_pixels
    processor.do_resize = True
    return processor
