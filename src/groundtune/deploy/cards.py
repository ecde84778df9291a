"""The model card of an export (its README.md): what the model is, how well it did, and how to
call it without groundtune: a text-answer model from transformers and vLLM, a box-head model with
its own box_head.py and, exported with ``--onnx``, onnx_predict.py. Each card is its sections in
order, one function a section."""

from __future__ import annotations

import json

from groundtune import evaluate, families

EXAMPLE_PHRASE = "the red mug"


def model_card(meta: dict, name: str) -> str:
    """README.md of an export: what it is, how well it did, and how to use it without groundtune."""
    family = families.family(meta["family"])
    prompt = meta["prompt"].format(phrase=EXAMPLE_PHRASE)
    eval_line = _eval_line(meta.get("eval"))
    if meta.get("head") == "box":
        return _box_head_card(meta, name, EXAMPLE_PHRASE, eval_line)
    return (_text_intro(meta, name, eval_line)
            + _resize_section(meta["resize"], "; another budget shows the model other pixels than it learned from")
            + _text_transformers_section(name, prompt, _box_back(meta, family))
            + _text_serving_sections(meta, name, EXAMPLE_PHRASE))


def _box_back(meta: dict, family) -> str:
    """The snippet's last lines: the answer's box mapped back to the caller's image."""
    if meta["convention"] == families.RESIZED_PIXELS:
        return ("# boxes are in pixels of the image as the processor resized it\n"
                f"resized_h, resized_w = (inputs['image_grid_thw'][0, 1:] * {family.patch_size}).tolist()\n"
                "box = [x1 * image.width / resized_w, y1 * image.height / resized_h,\n"
                "       x2 * image.width / resized_w, y2 * image.height / resized_h]")
    return ("# boxes are in 0-1000 of the image\n"
            "box = [x1 * image.width / 1000, y1 * image.height / 1000, x2 * image.width / 1000, y2 * image.height / 1000]")


def _text_intro(meta: dict, name: str, eval_line: str) -> str:
    """A text-answer model's card up to its evaluation: the header, what the model is, the QLoRA
    note where its adapter was trained on a 4-bit base, and the eval result."""
    qlora = ("\nThe adapter was trained with a 4-bit (QLoRA) base and is merged here into the base's "
             "full-precision weights: answers can differ slightly from the 4-bit model's.\n"
             if meta.get("trained_4bit") else "")
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
"""


def _resize_section(resize: dict, advice: str) -> str:
    """The pixel budget the folder's processor carries, and why to keep it (``advice``)."""
    return f"""
## Images are resized as in training

`preprocessor_config.json` carries the training pixel budget: {resize['min_pixels']:,} to
{resize['max_pixels']:,} pixels, sides multiples of {resize['factor']}. Use the processor from this
folder, unchanged{advice}.
"""


def _text_transformers_section(name: str, prompt: str, back: str) -> str:
    """A text-answer model called from transformers alone, its box mapped back (``back``)."""
    return f"""
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
"""


def _text_serving_sections(meta: dict, name: str, example_phrase: str) -> str:
    """A text-answer model served by vLLM, and run by groundtune."""
    return f"""
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
    why = "" if best_by == "acc@0.5" else f" Not Acc@0.5: {evaluate.HEADLINE_REASONS[best_by]}."
    return (f"{', '.join(shown)} on {evaluated['n']} held-out samples (greedy decoding), at the saved step: the "
            f"run's best by {CARD_METRICS[best_by]}.{why}")


def _box_head_card(meta: dict, name: str, example_phrase: str, eval_line: str) -> str:
    """The model card of a box-head model: its box is read off one forward pass by the head in
    ``box_head.safetensors``, not written as text, so the snippets run the export's ``box_head.py``
    (models/box_head.py), which makes that pass."""
    return (_box_head_intro(meta, name, eval_line) + _resize_section(meta["resize"], "")
            + _box_head_transformers_section(name, example_phrase)
            + _onnx_section(meta.get("onnx"), name, example_phrase)
            + _box_head_groundtune_section(name, example_phrase))


def _box_head_intro(meta: dict, name: str, eval_line: str) -> str:
    """A box-head model's card up to its evaluation: the header, what the head does, the eval result."""
    return f"""---
library_name: transformers
tags: [visual-grounding, groundtune, {meta['family']}, box-head]
---

# {name}

A {meta['family']} model fine-tuned for visual grounding (image + phrase -> bounding box) with
groundtune, exported from `{meta['exported_from']}` (base: `{meta['base_model']}`), weights in
{meta['dtype']}. It answers with a **box head** (`box_head.safetensors`): the language model's
hidden state at the last token of the prompt, which ends with the opening of a text answer
(`{meta['prompt_end']}`, `prompt_end` in `groundtune.json`), is read against the image's tokens:
each cell of the image's token grid (or each of K learned slots, in a head trained with
`head_slots` K) gives a candidate box, as fractions of the image, and an objectness score, in
one forward pass, without generating text. A phrase's answer is the boxes of the candidates whose
score reaches the threshold saved with the head (the file's metadata), chosen on the run's eval
set: none, one or several boxes.

## Evaluation

{eval_line.replace("(greedy decoding)", "(the box head)")}
"""


def _box_head_transformers_section(name: str, example_phrase: str) -> str:
    """The export's own box_head.py, from Python and from a shell: torch and transformers, no groundtune."""
    return f"""
## Use with transformers

`box_head.py` in this folder is the head's own code, as groundtune trained it, and a runner that
needs torch, transformers, safetensors and Pillow, no groundtune: it builds the prompt from
`groundtune.json` (the run's prompt, then `prompt_end`), lets this folder's processor resize the
image, runs the model once and the head on the last token's state and the image's tokens, keeps the
candidates whose score reaches the threshold, and maps their boxes from fractions of the image to its
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
"""


def _onnx_section(onnx: dict | None, name: str, example_phrase: str) -> str:
    """The ONNX graph and onnx_predict.py, where the export has them (``onnx`` in groundtune.json)."""
    onnx_section = f"""
## Use with ONNX Runtime (no torch)

`model.onnx`{f" (its weights in `{onnx['weights_file']}` beside it)" if onnx.get('weights_file') else ""} holds the vision tower, the language model and the head in one fp32 graph for
{onnx['image_size'][0]}x{onnx['image_size'][1]} images (exported for {onnx['exported_for'][0]}x{onnx['exported_for'][1]}: other sizes are stretched
to it), any batch and phrase length; it gives every candidate's box and score. `onnx_predict.py`
prepares its inputs with numpy, Pillow and `tokenizer.json`, keeps the candidates whose score reaches
the threshold (`onnx` in `groundtune.json`), and maps their boxes back to the caller's pixels:

```bash
pip install onnxruntime numpy pillow tokenizers
python {name}/onnx_predict.py {name} --image photo.jpg --phrase {json.dumps(example_phrase)}
```
""" if onnx else ""
    return onnx_section


def _box_head_groundtune_section(name: str, example_phrase: str) -> str:
    """A box-head model run by groundtune; vLLM cannot."""
    return f"""
## Use with groundtune

```bash
groundtune predict --model {name} --image photo.jpg --phrase {json.dumps(example_phrase)}
groundtune eval --model {name} --data val.jsonl
groundtune serve --model {name}
```

vLLM serves text answers only: it cannot run the head.
"""
