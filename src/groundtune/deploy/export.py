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
- ``README.md``: a model card with the run's eval result, and how to call the model from
  transformers and vLLM, mapping its box back to the caller's image.
- a box-head model: ``box_head.safetensors``, the head's weights, and ``box_head.py``, the head's
  own module (models/box_head.py), which runs the export with transformers (the card shows how).
- with ``--onnx`` (a box-head model): ``model.onnx``, the whole model in one graph for images of
  one size, and ``onnx_predict.py``, which runs it with onnxruntime, numpy, Pillow and tokenizers
  alone (onnx_export.py).

With ``--push-to-hub REPO`` the folder, every file of it, is then uploaded to that model repo
through huggingface_hub's own API (``push_to_hub``); the repo id and the token are checked first
(``check_hub``), so a push that cannot happen costs no export. tests/test_hub_push.py pushes to a
stand-in of the hub's HTTP API on 127.0.0.1.

tests/test_export.py loads an export with transformers alone (no groundtune import) and gets
groundtune's boxes, for all three families, and a box-head export with its box_head.py.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from groundtune import boxes, families
from groundtune.config import EXPORT_DTYPE, MAX_NEW_TOKENS
from groundtune.deploy import onnx_export
from groundtune.errors import DiskFullError, GroundtuneError, RunExistsError, UsageError
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
            model.save_pretrained(tmp, state_dict={k: v for k, v in model.state_dict().items()
                                                   if not k.startswith(f"{head.ATTRIBUTE}.")})
            head.save(box_head, tmp)
            (tmp / head.SCRIPT_FILE).write_text(head.script_source())  # the head's code, which runs the export
        else:
            model.save_pretrained(tmp)
        _greedy_generation_config(gm).save_pretrained(tmp)
        tokenizer = gm.processor.tokenizer
        tokenizer.chat_template = gm.processor.chat_template
        tokenizer.save_pretrained(tmp)
        _image_processor_at(gm.processor.image_processor, gm.resize).save_pretrained(tmp)
        metadata = {
            "family": gm.family,
            "convention": families.family(gm.family).coordinates,
            "resize": gm.resize.to_dict(),
            "prompt": gm.prompt,
            "head": "box" if box_head is not None else HEAD,
            # what a box head's prompts end with: it reads the state of the last token (models/head.py)
            **({"prompt_end": head.prompt_end(gm.family)} if box_head is not None else {}),
            "exported_from": str(path.resolve()) if path is not None else name,
            "base_model": gm.base_model,
            "dtype": str(target_dtype).removeprefix("torch."),
            **({"eval": run_meta["eval"]} if "eval" in run_meta else {}),
            **({"trained_4bit": True} if qlora else {}),
            **({"onnx": onnx} if onnx is not None else {}),
        }
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


def check_hub(repo_id: str) -> None:
    """What ``push_to_hub`` needs, checked before an export's minutes are spent: a repo id that
    huggingface_hub's own validator takes (``name`` or ``owner/name``), the hub not switched off,
    and a token, found as huggingface_hub finds it (HF_TOKEN, then the saved login)."""
    from huggingface_hub import get_token, is_offline_mode
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        why = str(e).replace(" Use `repo_type` argument if needed.", "")  # advice to Python callers
        raise UsageError(f"--push-to-hub {repo_id!r}: not a repo id (name or owner/name): {why}") from None
    if is_offline_mode():
        raise UsageError("--push-to-hub: HF_HUB_OFFLINE is set, so the hub cannot be reached; unset it to push")
    if get_token() is None:
        raise UsageError("--push-to-hub: no Hugging Face token found; log in with `hf auth login` (`huggingface-cli "
                         "login` before huggingface_hub 1.0) or set HF_TOKEN to a token with write access")


def push_to_hub(folder: Path, repo_id: str, private: bool = False, revision: str | None = None,
                commit_message: str | None = None, say=print) -> str:
    """Upload every file of the export ``folder`` to the model repo ``repo_id`` on branch
    ``revision`` (main by default; made from main where it is not there) in one call of
    huggingface_hub's ``upload_folder``; returns the repo's URL. A new repo is private with
    ``private``, else as the owner's hub settings make new repos; an existing public repo is
    refused with ``private`` rather than given the weights. Files the repo already holds that this
    export has not are left there. The hub's refusals and network failures raise one line that
    names the repo and the folder, which stays on disk."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    api = HfApi()
    try:
        url = str(api.create_repo(repo_id, repo_type="model", private=private or None, exist_ok=True))
        if private and not api.repo_info(repo_id, repo_type="model").private:
            raise GroundtuneError(f"--push-to-hub {repo_id} --private: the repo exists and is public, and pushing "
                                  "does not change that; make it private on the hub, or push without --private "
                                  f"(the export is in {folder})")
        if revision not in (None, "main"):
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision,
                          commit_message=commit_message or f"Upload {folder.name}, exported by groundtune")
    except _hub_errors() as e:
        again = f"hf upload {repo_id} {shlex.quote(str(folder))} ." + (
            f" --revision {shlex.quote(revision)}" if revision else "")
        raise GroundtuneError(f"--push-to-hub {repo_id}: {_hub_failure(e, api.endpoint)}; the export stays in "
                              f"{folder} (upload it again with `{again}`)") from e
    files = sum(1 for p in folder.rglob("*") if p.is_file())
    say(f"pushed the {files} files of {folder} to {repo_id}" + (f" (branch {revision})" if revision else ""))
    return url


def _hub_errors() -> tuple[type[BaseException], ...]:
    """The errors of a push that say the hub refused it or could not be reached. A refused
    connection or a timeout comes as the hub client's HTTP library's own error, unwrapped (httpx
    in huggingface_hub 1, httpx2 in 2: the one it exports, as data/hub.py reads it)."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    from huggingface_hub.utils import httpx

    return HfHubHTTPError, httpx.HTTPError, OfflineModeIsEnabled


def _hub_failure(error: BaseException, endpoint: str) -> str:
    """One line on why a push failed: the hub's own message where it sent one (a bad token, no
    right to the namespace), else the client's."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(error, HfHubHTTPError) and error.server_message:
        why = f"the hub answered {error.response.status_code}: {error.server_message}"
    elif isinstance(error, HfHubHTTPError):
        why = str(error).splitlines()[0]
    else:
        why = f"cannot reach {endpoint} ({error})"
    return " ".join(why.split())


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


def model_card(meta: dict, name: str) -> str:
    """README.md of an export: what it is, how well it did, and how to use it without groundtune."""
    family = families.family(meta["family"])
    resize = meta["resize"]
    example_phrase = "the red mug"
    prompt = meta["prompt"].format(phrase=example_phrase)
    if meta["convention"] == families.RESIZED_PIXELS:
        back = ("# boxes are in pixels of the image as the processor resized it\n"
                f"resized_h, resized_w = (inputs['image_grid_thw'][0, 1:] * {family.patch_size}).tolist()\n"
                "box = [x1 * image.width / resized_w, y1 * image.height / resized_h,\n"
                "       x2 * image.width / resized_w, y2 * image.height / resized_h]")
    else:
        back = ("# boxes are in 0-1000 of the image\n"
                "box = [x1 * image.width / 1000, y1 * image.height / 1000, x2 * image.width / 1000, y2 * image.height / 1000]")
    eval_line = _eval_line(meta.get("eval"))
    qlora = ("\nThe adapter was trained with a 4-bit (QLoRA) base and is merged here into the base's "
             "full-precision weights: answers can differ slightly from the 4-bit model's.\n"
             if meta.get("trained_4bit") else "")
    if meta.get("head") == "box":
        return _box_head_card(meta, name, example_phrase, eval_line)
    return f"""---
library_name: transformers
pipeline_tag: image-text-to-text
tags: [visual-grounding, groundtune, {meta['family']}]
---

# {name}

A {meta['family']} model fine-tuned for visual grounding (image + phrase -> bounding box) with
groundtune, exported from `{meta['exported_from']}` (base: `{meta['base_model']}`), weights in
{meta['dtype']}. Its answers are boxes as text in the {meta['family']} convention: coordinates in
{meta['convention']}{" of the image as resized by the processor" if meta['convention'] == families.RESIZED_PIXELS else ""}.
{qlora}
## Evaluation

{eval_line}

## Images are resized as in training

`preprocessor_config.json` carries the training pixel budget: {resize['min_pixels']:,} to
{resize['max_pixels']:,} pixels, sides multiples of {resize['factor']}. Use the processor from this
folder, unchanged; another budget shows the model other pixels than it learned from.

## Use with transformers

```python
import json, re, torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

model = AutoModelForImageTextToText.from_pretrained("{name}", dtype="auto")
processor = AutoProcessor.from_pretrained("{name}")
image = Image.open("photo.jpg").convert("RGB")
messages = [{{"role": "user", "content": [{{"type": "image"}},
             {{"type": "text", "text": {json.dumps(prompt)}}}]}}]
text = processor.apply_chat_template(messages, add_generation_prompt=True)
inputs = processor(text=[text], images=[image], return_tensors="pt")
out = model.generate(**inputs)  # greedy: generation_config.json
answer = processor.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=False)[0]
x1, y1, x2, y2 = map(float, re.findall(r"-?\\d+(?:\\.\\d+)?", answer.split("bbox_2d")[-1])[:4]) \\
    if "bbox_2d" in answer else map(float, re.findall(r"\\d+", answer)[:4])
{back}
```

## Use with vLLM

```bash
vllm serve {name} --limit-mm-per-prompt '{{"image": 1}}'
```

Send the same prompt with the image as an `image_url` (a data: URI), and map the box back as above
(vLLM resizes with this folder's `preprocessor_config.json`; for {meta['convention']} boxes the
resized size is the image's size rounded by the processor's `smart_resize` with the budget above).

## Use with groundtune

```bash
groundtune predict --model {name} --image photo.jpg --phrase {json.dumps(example_phrase)}
groundtune serve --model {name}
```
"""


# the metrics a card shows, as it names them, where the run's eval recorded a number for them
CARD_METRICS = {"acc@0.5": "Acc@0.5", "acc@0.75": "Acc@0.75", "miou": "mIoU", "f1@0.5": "F1@0.5",
                "set_acc@0.5": "set accuracy@0.5", "n_acc": "no-target accuracy", "parse_fail_rate": "parse failures"}


def _eval_line(evaluated: dict | None) -> str:
    """The card's evaluation: the saved step's metrics, the one its step was chosen by in bold
    (``best_by``; Acc@0.5 for a run saved before it was recorded), and why where it is not Acc@0.5.
    A metric the eval set left undefined (Acc@0.5 on no-target samples only) is not shown."""
    if not evaluated:
        return "No evaluation was recorded with this model."
    best_by = evaluated.get("best_by", "acc@0.5")
    shown = [f"{label} **{evaluated[key]:.3f}**" if key == best_by else f"{label} {evaluated[key]:.3f}"
             for key, label in CARD_METRICS.items() if evaluated.get(key) is not None]
    why = "" if best_by == "acc@0.5" else " Acc@0.5 counts no sample of this eval set, so it is not the measure here."
    return (f"{', '.join(shown)} on {evaluated['n']} held-out samples (greedy decoding), at the saved step: the "
            f"run's best by {CARD_METRICS[best_by]}.{why}")


def _box_head_card(meta: dict, name: str, example_phrase: str, eval_line: str) -> str:
    """The model card of a box-head model: its box is read off one forward pass by the head in
    ``box_head.safetensors``, not written as text, so the snippets run the export's ``box_head.py``
    (models/box_head.py), which makes that pass."""
    resize = meta["resize"]
    onnx = meta.get("onnx")
    onnx_section = f"""
## Use with ONNX Runtime (no torch)

`model.onnx`{f" (its weights in `{onnx['weights_file']}` beside it)" if onnx.get('weights_file') else ""} holds the vision tower, the language model and the head in one fp32 graph for
{onnx['image_size'][0]}x{onnx['image_size'][1]} images (exported for {onnx['exported_for'][0]}x{onnx['exported_for'][1]}: other sizes are stretched
to it), any batch and phrase length; it gives every slot's box and score. `onnx_predict.py`
prepares its inputs with numpy, Pillow and `tokenizer.json`, keeps the slots whose score reaches
the threshold (`onnx` in `groundtune.json`), and maps their boxes back to the caller's pixels:

```bash
pip install onnxruntime numpy pillow tokenizers
python {name}/onnx_predict.py {name} --image photo.jpg --phrase {json.dumps(example_phrase)}
```
""" if onnx else ""
    return f"""---
library_name: transformers
tags: [visual-grounding, groundtune, {meta['family']}, box-head]
---

# {name}

A {meta['family']} model fine-tuned for visual grounding (image + phrase -> bounding box) with
groundtune, exported from `{meta['exported_from']}` (base: `{meta['base_model']}`), weights in
{meta['dtype']}. It answers with a **box head** (`box_head.safetensors`): the language model's
hidden state at the last token of the prompt, which ends with the opening of a text answer
(`{meta['prompt_end']}`, `prompt_end` in `groundtune.json`), is the query of K slots, each of which
attends over the image's tokens and reads a box off its attention map over the image's cells, as
fractions of the image, and an objectness score, in one forward pass, without generating text.
A phrase's answer is the boxes of the slots whose score reaches the threshold saved with the head
(the file's metadata): 0 to K boxes.

## Evaluation

{eval_line.replace("(greedy decoding)", "(the box head)")}

## Images are resized as in training

`preprocessor_config.json` carries the training pixel budget: {resize['min_pixels']:,} to
{resize['max_pixels']:,} pixels, sides multiples of {resize['factor']}. Use the processor from this
folder, unchanged.

## Use with transformers

`box_head.py` in this folder is the head's own code, as groundtune trained it, and a runner that
needs torch, transformers, safetensors and Pillow, no groundtune: it builds the prompt from
`groundtune.json` (the run's prompt, then `prompt_end`), lets this folder's processor resize the
image, runs the model once and the head on the last token's state and the image's tokens, keeps the
slots whose score reaches the threshold, and maps their boxes from fractions of the image to its
pixels. From Python:

```python
import json, sys
from PIL import Image, ImageOps

sys.path.insert(0, "{name}")  # where box_head.py is
from box_head import Grounder

grounder = Grounder("{name}")  # device="cuda" for a GPU
image = ImageOps.exif_transpose(Image.open("photo.jpg")).convert("RGB")  # upright, as groundtune reads it
answer, = grounder.ground(image, [{json.dumps(example_phrase)}])  # one answer per phrase
print(json.dumps(answer))  # {{"boxes": [[x1, y1, x2, y2], ...] in pixels of photo.jpg, "scores": [...]}}
```

or from a shell, one JSON line per phrase:

```bash
pip install torch transformers safetensors pillow
python {name}/box_head.py {name} --image photo.jpg --phrase {json.dumps(example_phrase)}
```
{onnx_section}
## Use with groundtune

```bash
groundtune predict --model {name} --image photo.jpg --phrase {json.dumps(example_phrase)}
groundtune eval --model {name} --data val.jsonl
groundtune serve --model {name}
```

vLLM serves text answers only: it cannot run the head.
"""
