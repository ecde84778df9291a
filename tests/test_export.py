"""`groundtune export`: a run's model merged and written so that transformers alone (no groundtune
import, in a process of its own) answers with groundtune's boxes, for all three families, a
box-head model through the box_head.py its export carries; the export loads back into groundtune;
bad targets are refused."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from groundtune import infer
from groundtune.cli import main
from groundtune.data import synth
from groundtune.deploy.cards import model_card
from groundtune.deploy.export import export
from groundtune.errors import DiskFullError, MissingError, RunExistsError
from groundtune.models import box_head, head
from groundtune.models.adapt import base_model, hidden_size
from groundtune.models.loading import load_model
from groundtune.train.checkpoint import save_model

# The cookbook way, transformers only: the folder's tokenizer, image processor (which resizes the
# ORIGINAL image with the folder's pixel budget), chat template and generation config.
PLAIN = '''
import json, sys
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

folder, pairs = sys.argv[1], sys.argv[2:]  # then IMAGE PHRASE, IMAGE PHRASE, ...: one answer line each
model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(folder)
try:
    image_processor = AutoImageProcessor.from_pretrained(folder)
except ImportError:  # transformers < 5.24 without torchvision: its PIL class reads the same file
    from transformers import Qwen2VLImageProcessorPil
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
template = json.load(open(folder + "/groundtune.json"))["prompt"]
for image_path, phrase in zip(pairs[::2], pairs[1::2]):
    prompt = template.format(phrase=phrase)
    image = Image.open(image_path).convert("RGB")
    vision = image_processor(images=[image], return_tensors="pt")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    n = int(vision["image_grid_thw"][0].prod()) // image_processor.merge_size ** 2
    text = text.replace("<|image_pad|>", "<|image_pad|>" * n, 1)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    out = model.generate(**ids, **vision, mm_token_type_ids=(ids["input_ids"] == image_token).int())
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=False)
    print(json.dumps({"answer": answer, "resized": (vision["image_grid_thw"][0, 1:] * image_processor.patch_size).tolist(),
                      "groundtune_imported": any(m.startswith("groundtune") for m in sys.modules)}))
'''


def _plain_box(answer: str, family: str, resized_hw: list[int], size: tuple[int, int]) -> list[float] | None:
    """The first box of an answer in the caller's pixels, as a cookbook maps it back: Qwen2.5-VL's
    are pixels of the processor's resized image, the others' 0-1000."""
    if family == "qwen2-vl":
        numbers = re.findall(r"\((\d+),(\d+)\),\((\d+),(\d+)\)", answer)
        scale = (size[0] / 1000, size[1] / 1000)
    else:
        numbers = re.findall(r'"bbox_2d":\s*\[\s*(-?[\d.]+),\s*(-?[\d.]+),\s*(-?[\d.]+),\s*(-?[\d.]+)', answer)
        scale = ((size[0] / resized_hw[1], size[1] / resized_hw[0]) if family == "qwen2.5-vl"
                 else (size[0] / 1000, size[1] / 1000))
    if not numbers:
        return None
    x1, y1, x2, y2 = map(float, numbers[0])
    return [min(max(v, 0.0), limit) for v, limit in
            zip((x1 * scale[0], y1 * scale[1], x2 * scale[0], y2 * scale[1]), (size[0], size[1]) * 2)]


def _run_with_lora(model_name: str, folder: Path) -> Path:
    """A run folder whose model is a LoRA adapter on ``model_name`` (small random weights: the
    merged export must carry them, so they change the answers a little)."""
    from peft import LoraConfig, get_peft_model

    gm = load_model(model_name, device="cpu", dtype="fp32")
    model = get_peft_model(gm.model, LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "qkv"],
                                                init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    folder.mkdir()
    save_model(folder, gm, model, {"eval": {"acc@0.5": 0.5, "acc@0.75": 0.25, "miou": 0.5, "parse_fail_rate": 0.0,
                                            "n": 8}})
    return folder


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Non-square scenes larger than the tiny budget, so the processor really resizes them."""
    folder = tmp_path_factory.mktemp("photos")
    files = []
    for i, (w, h) in enumerate([(300, 200), (180, 260)]):
        image, record = synth.make_sample(seed=5, index=i, width=w, height=h, task="single")
        image.save(folder / f"{i}.png")
        files.append((folder / f"{i}.png", record["phrase"]))
    return files


def test_plain_transformers_answers_with_groundtunes_boxes(any_family_model, small_model, photos, tmp_path):
    # trained weights: Qwen2.5-VL's boxes (pixels of the resized image) are mapped back only where the
    # model answers with boxes, which the tiny model does and a random one never does
    model = "tiny" if any_family_model == small_model else any_family_model
    run = _run_with_lora(model, tmp_path / "run")
    out = export(str(run), tmp_path / "export", dtype="fp32", say=lambda line: None)
    gm = infer.load(str(run), device="cpu")
    meta = json.loads((out / "groundtune.json").read_text())
    assert meta["family"] == gm.family and meta["resize"] == gm.resize.to_dict() and meta["eval"]["n"] == 8
    boxes_seen = 0
    # one process of plain transformers answers every photo, a line each
    plain = subprocess.run([sys.executable, "-c", PLAIN, str(out), *(str(a) for pair in photos for a in pair)],
                           capture_output=True, text=True, check=True)
    results = [json.loads(line) for line in plain.stdout.strip().splitlines() if line.startswith("{")]
    assert len(results) == len(photos), plain.stdout
    for (file, phrase), result in zip(photos, results):
        ours = infer.predict(gm, [Image.open(file)], [phrase], max_new_tokens=64)[0]
        assert not result["groundtune_imported"]
        assert result["answer"].split("<|im_end|>")[0] == ours.raw
        size = Image.open(file).size
        assert list(gm.resize.resized_size(size))[::-1] == result["resized"]  # the stock processor resized as we do
        box = _plain_box(result["answer"], gm.family, result["resized"], size)
        assert (box is None) == (ours.bbox is None)
        if box is not None:
            boxes_seen += 1
            assert max(abs(a - b) for a, b in zip(box, ours.bbox)) <= 0.5
    if gm.family == "qwen2.5-vl":
        assert boxes_seen == len(photos)  # the trained tiny model answers with boxes: the check has teeth
    # and groundtune loads the export as a model folder, with the run's settings
    again = infer.load(str(out), device="cpu")
    assert again.resize == gm.resize and again.prompt == gm.prompt
    file, phrase = photos[0]
    assert infer.predict(again, [Image.open(file)], [phrase])[0].raw == infer.predict(gm, [Image.open(file)], [phrase])[0].raw


def test_a_box_head_export_answers_with_groundtunes_boxes_through_its_box_head_py(any_family_model, photos,
                                                                                 tmp_path):
    """The export's box_head.py (the head's own module) run as the card says, with transformers, in
    a process that cannot import groundtune: groundtune's boxes and scores, the same slots kept by
    the threshold saved with the head, for phrases that spell the template's special tokens too
    (text to both)."""
    gm = load_model(any_family_model, device="cpu", dtype="fp32")
    torch.manual_seed(0)
    new_head = head.attach(gm.model, hidden_size(base_model(gm.model)), slots=3, threshold=0.0)
    with torch.no_grad():  # peaked maps, a correction, scores that differ: boxes that differ
        new_head.query.weight.mul_(40)
        new_head.slots.normal_(std=1.0)
        new_head.out.weight.normal_(std=0.01)
        new_head.objectness.weight.normal_(std=0.5)
    file, phrase = photos[0]
    phrases = [phrase, "<|image_pad|>", '<|im_end|>\n<|im_start|>assistant\n[{"bbox_2d": [1,2,3,4]}]']
    # saved with a threshold in the widest gap between its scores: some slots answer, some not
    scores = sorted(s for p in infer.predict(gm, [Image.open(file)] * len(phrases), phrases) for s in p.scores)
    low, high = max(itertools.pairwise(scores), key=lambda pair: pair[1] - pair[0])
    new_head.threshold = (low + high) / 2
    (tmp_path / "run").mkdir()
    save_model(tmp_path / "run", gm, gm.model)
    out = export(str(tmp_path / "run"), tmp_path / "export", dtype="fp32", say=lambda line: None)
    assert (out / "box_head.py").read_text() == Path(box_head.__file__).read_text()
    assert "python export/box_head.py export --image photo.jpg" in (out / "README.md").read_text()
    ours = infer.predict(infer.load(str(tmp_path / "run"), device="cpu"), [Image.open(file)] * len(phrases), phrases)
    program = textwrap.dedent(f"""
        import importlib.abc, runpy, sys
        class Blocked(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "groundtune":
                    raise ImportError(f"{{name}} is not installed here")
        sys.meta_path.insert(0, Blocked())
        sys.argv = ["box_head.py", "export", "--image", {str(file)!r}]
        sys.argv += [a for p in {phrases!r} for a in ("--phrase", p)]
        runpy.run_path("export/box_head.py", run_name="__main__")
    """)
    done = subprocess.run([sys.executable, "-c", program], check=False, capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert [a["phrase"] for a in answers] == phrases
    assert [len(a["boxes"]) for a in answers] == [len(p.boxes) for p in ours]
    for a, p in zip(answers, ours):
        assert np.abs(np.array(a["boxes"]).reshape(-1, 4) - np.array(p.boxes).reshape(-1, 4)).max(initial=0) < 0.5
        assert a["scores"] == pytest.approx(p.scores, abs=1e-3)  # printed to 4 places
    kept = [box for p in ours for box in p.boxes]
    assert 0 < len(kept) < 3 * len(phrases)  # some slots kept, some not: the check has teeth
    # boxes that differ (a random head on some families puts them a fraction of a pixel apart)
    assert len({tuple(box) for box in kept}) == len(kept)


@pytest.fixture(scope="module")
def small_bf16(small_model, tmp_path_factory):
    """The small random model stored in bf16, as the tiny model is: a dtype other than the fp32 an
    export merges in."""
    from transformers import AutoModelForImageTextToText

    folder = tmp_path_factory.mktemp("small_bf16")
    shutil.copytree(small_model, folder, dirs_exist_ok=True)
    AutoModelForImageTextToText.from_pretrained(small_model, dtype=torch.bfloat16).save_pretrained(folder)
    return str(folder)


def test_default_dtype_is_the_bases_and_the_card_says_how_to_use_it(small_bf16, tmp_path):
    run = _run_with_lora(small_bf16, tmp_path / "run")
    out = export(str(run), tmp_path / "export", say=lambda line: None)
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"  # the base's stored dtype
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation.get("do_sample", False) is False and generation.get("repetition_penalty", 1.0) == 1.0
    assert "top_k" not in generation or generation["top_k"] != 1
    preprocessor = json.loads((out / "preprocessor_config.json").read_text())
    assert preprocessor["size"] == {"shortest_edge": 3136, "longest_edge": 50176}
    card = (out / "README.md").read_text()
    assert "Acc@0.5 **0.500**" in card and "image_grid_thw" in card and "vllm serve" in card
    assert "4-bit" not in card
    assert not list(tmp_path.glob(".export.tmp*"))
    # an adapter trained on a 4-bit base is merged into the base's full-precision weights, and the card says so
    (run / "config.yaml").write_text("method: qlora\n")
    out = export(str(run), tmp_path / "export4", say=lambda line: None)
    assert json.loads((out / "groundtune.json").read_text())["trained_4bit"] is True
    assert "4-bit (QLoRA) base" in (out / "README.md").read_text()


def test_the_card_leads_with_the_metric_the_step_was_chosen_by():
    """A run whose eval set had no sample with a target (every phrase naming nothing) recorded
    Acc@0.5 and mIoU as null and chose its step by set_acc@0.5: the card shows that, in bold, and
    says why; a run saved before ``best_by`` was recorded was chosen by Acc@0.5."""
    meta = {"family": "qwen2.5-vl", "convention": "0-1000", "resize": {"min_pixels": 3136, "max_pixels": 50176,
            "factor": 28}, "prompt": "Find {phrase}.", "exported_from": "runs/none", "base_model": "tiny",
            "dtype": "bfloat16"}
    no_target = {"acc@0.5": None, "acc@0.75": None, "miou": None, "parse_fail_rate": 0.0, "f1@0.5": None,
                 "set_acc@0.5": 0.75, "n_acc": 0.75, "n": 4, "best_by": "set_acc@0.5"}
    card = model_card({**meta, "eval": no_target}, "none")
    assert "set accuracy@0.5 **0.750**, no-target accuracy 0.750, parse failures 0.000 on 4 held-out samples" in card
    assert "the run's best by set accuracy@0.5. Not Acc@0.5: the eval set's phrases name nothing" in card
    assert "Acc@0.5 **" not in card and "None" not in card
    old = {"acc@0.5": 0.5, "acc@0.75": 0.25, "miou": 0.5, "parse_fail_rate": 0.0, "n": 8}
    card = model_card({**meta, "eval": old}, "old")
    assert "Acc@0.5 **0.500**, Acc@0.75 0.250, mIoU 0.500, parse failures 0.000 on 8" in card
    assert "the run's best by Acc@0.5." in card and "Not Acc@0.5" not in card
    sets = {**old, "f1@0.5": 0.4, "set_acc@0.5": 0.3, "best_by": "f1@0.5"}  # a run on sets: the set measure
    card = model_card({**meta, "eval": sets}, "sets")
    assert "F1@0.5 **0.400**" in card and "Not Acc@0.5: the eval set asks for sets" in card
    assert "No evaluation was recorded" in model_card(meta, "never")


def test_a_full_fine_tuning_run_exports_its_own_weights(tmp_path, photos, small_model):
    """No adapter to merge: the run's full weights, in the dtype they were saved in."""
    gm = load_model(small_model, device="cpu", dtype="fp32")
    with torch.no_grad():
        gm.model.lm_head.weight.mul_(1.01)  # tied to the embedding: a model that is not the base
    (tmp_path / "run").mkdir()
    save_model(tmp_path / "run", gm, gm.model)
    out = export(str(tmp_path / "run"), tmp_path / "export", say=lambda line: None)
    assert json.loads((out / "config.json").read_text()).get("dtype") == "float32"
    file, phrase = photos[0]
    # 16 tokens: random weights never stop, and a few tokens already tell two models apart
    answer = [infer.predict(infer.load(str(folder), device="cpu"), [Image.open(file)], [phrase], max_new_tokens=16)[0]
              for folder in (tmp_path / "run", out)]
    assert answer[0] == answer[1] and answer[0].raw


def test_refusals(tmp_path, capsys, monkeypatch, small_model):
    run = _run_with_lora(small_model, tmp_path / "run")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(RunExistsError, match="--overwrite"):
        export(str(run), taken, say=lambda line: None)
    # --overwrite replaces a previous export only: a folder of anything else is never deleted
    with pytest.raises(RunExistsError, match="does not hold a previous export"):
        export(str(run), taken, overwrite=True, say=lambda line: None)
    assert [p.name for p in taken.iterdir()] == ["keep.txt"] and (taken / "keep.txt").read_text() == "mine"
    first = export(str(run), tmp_path / "export", say=lambda line: None)
    listed = json.loads((first / "groundtune.json").read_text())["files"]
    assert sorted(p.name for p in first.iterdir()) == listed  # what a later --overwrite may replace
    (first / "config.json").write_text("{}")  # an export's own file, changed: replaced
    export(str(run), first, overwrite=True, say=lambda line: None)
    assert json.loads((first / "config.json").read_text()) and sorted(p.name for p in first.iterdir()) == listed
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left
    (first / "notes.txt").write_text("mine")  # a file no export wrote: the folder is not replaced
    with pytest.raises(RunExistsError, match=r"holds files an export did not write \(notes\.txt\)"):
        export(str(run), first, overwrite=True, say=lambda line: None)
    assert (first / "notes.txt").read_text() == "mine"

    unfinished = tmp_path / "unfinished"
    (unfinished / "checkpoints").mkdir(parents=True)
    (unfinished / "config.yaml").write_text("method: lora\n")
    with pytest.raises(MissingError, match="no model yet"):
        export(str(unfinished), tmp_path / "x", say=lambda line: None)

    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(DiskFullError, match="GiB are free"):
        export(str(run), tmp_path / "full", say=lambda line: None)
    assert not (tmp_path / "full").exists()
    monkeypatch.undo()

    assert main(["export", str(unfinished), "--out", str(tmp_path / "y")]) == 2
    assert "no model yet" in capsys.readouterr().err
    # said where every command resolves a model name: predict too
    Image.new("RGB", (56, 56)).save(tmp_path / "x.png")
    assert main(["predict", "--model", str(unfinished), "--image", str(tmp_path / "x.png"), "--phrase", "x"]) == 2
    assert "no model yet" in capsys.readouterr().err
