"""The SFT loop on a small random model (tests/conftest.py's ``small_model``): label mask, learning,
exact resume, STOP file, NaN guard, the run folder and loading it back. One real process, for
SIGTERM: a signal is sent to a process."""

import functools
import importlib.util
import json
import shutil

import pytest
import torch

from groundtune import boxes
from groundtune.config import TrainConfig
from groundtune.data import synth
from groundtune.data.records import read_samples
from groundtune.models import qwen
from groundtune.models.loading import load_model
from groundtune.train import checkpoint as ckpt
from groundtune.train.sft import TrainingError, train


def _cfg(data, out, model, **kw):
    base = {"model": model, "train_data": str(data / "train.jsonl"), "out_dir": str(out), "method": "full",
            "freeze_vision": False, "freeze_merger": False, "lr": 1e-3, "batch_size": 4, "max_steps": 6,
            "log_every": 1, "save_every": 0, "warmup_steps": 0}
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture
def cfg(small_model):
    """_cfg on the small random model."""
    return functools.partial(_cfg, model=small_model)


def _losses(run):
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r
            and "skipped_nonfinite" not in r]


def test_label_mask_is_exactly_the_answer(small_model):
    gm = load_model(small_model)
    from PIL import Image

    image = Image.new("RGB", (140, 84), "white")
    resized, size = qwen.resize_image(image, gm.resize)
    answer = boxes.format_target([[10, 20, 50, 60]], "the red circle", gm.family, image.size, size)
    enc = qwen.encode(gm.processor, resized, qwen.prompt_text(gm.processor, "the red circle", gm.prompt), answer)
    labelled = enc["labels"] != qwen.IGNORE_INDEX
    # the labelled tokens are exactly the answer and its end-of-turn, and they come last
    tok = gm.processor.tokenizer
    assert tok.decode(enc["input_ids"][labelled]) == answer + "<|im_end|>\n"
    n = int(labelled.sum())
    assert labelled[-n:].all() and not labelled[:-n].any()
    assert torch.equal(enc["labels"][labelled], enc["input_ids"][labelled])
    # the prompt, the image placeholders and the chat markup carry no loss
    image_tokens = enc["input_ids"] == gm.processor.image_token_id
    assert int(image_tokens.sum()) == int(enc["image_grid_thw"].prod()) // 4
    assert not (labelled & image_tokens).any()
    assert torch.equal(enc["mm_token_type_ids"].bool(), image_tokens)


def _labelled_text(gm, encoded) -> str:
    return gm.processor.tokenizer.decode(encoded["input_ids"][encoded["labels"] != qwen.IGNORE_INDEX])


def test_answer_label_false_leaves_the_phrase_out_of_the_target(synth_single, tmp_path, small_model, cfg):
    from groundtune.data.records import sample_boxes
    from groundtune.data.samples import open_samples
    from groundtune.train.batches import GroundingDataset

    gm = load_model(small_model)
    samples = open_samples(str(synth_single / "train.jsonl"), 0)
    image, sample = samples[3]
    _, resized = qwen.resize_image(image, gm.resize)
    args = (samples, gm.processor, gm.family, gm.resize, gm.prompt)
    for answer_label, label in ((False, None), (True, sample["phrase"])):
        encoded = GroundingDataset(*args, answer_label=answer_label)[3, 0]
        target = boxes.format_target(sample_boxes(sample), label, gm.family, image.size, resized)
        assert _labelled_text(gm, encoded) == target + "<|im_end|>\n"
        assert ("label" in target) == answer_label and (sample["phrase"] in target) == answer_label
        question = encoded["input_ids"][encoded["labels"] == qwen.IGNORE_INDEX]
        assert sample["phrase"] in gm.processor.tokenizer.decode(question)  # the question names it either way
    # the setting reaches a run's batches: the same first batch, another target, another loss
    with_label = _losses(train(cfg(synth_single, tmp_path / "label", max_steps=1)))
    without = _losses(train(cfg(synth_single, tmp_path / "no_label", max_steps=1, answer_label=False)))
    assert len(with_label) == len(without) == 1 and with_label != without


def test_dataset_flips_image_box_and_phrase_together(tmp_path, small_model):
    """hflip_prob=1 inside the dataset: the answer's box is mirrored in the family's coordinates,
    left becomes right in the question and the answer, and the pixels are the mirrored picture."""
    from PIL import Image, ImageDraw

    from groundtune.data.samples import open_samples
    from groundtune.train.batches import GroundingDataset, encode_sample

    width, height = 140, 84  # multiples of 28 inside the model's budget (tiny's): not resized
    image = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(image).rectangle([10, 20, 49, 59], fill="red")
    image.save(tmp_path / "a.png")
    record = {"id": "a", "image": "a.png", "width": width, "height": height,
              "phrase": "the red square on the left", "bbox": [10.0, 20.0, 50.0, 60.0]}
    other = {**record, "id": "b", "phrase": "the red square"}  # nothing positional: crops apply
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in (record, other)) + "\n")
    gm = load_model(small_model)
    assert qwen.resize_image(image, gm.resize)[1] == (width, height)
    samples = open_samples(str(tmp_path / "d.jsonl"), 0)
    args = (samples, gm.processor, gm.family, gm.resize, gm.prompt)

    always, never = GroundingDataset(*args, hflip_prob=1.0), GroundingDataset(*args, hflip_prob=0.0)
    flipped = always[0, 7]
    answer = json.loads(_labelled_text(gm, flipped).removesuffix("<|im_end|>\n"))
    assert answer == [{"bbox_2d": [width - 50, 20, width - 10, 60], "label": "the red square on the right"}]
    question = gm.processor.tokenizer.decode(flipped["input_ids"][flipped["labels"] == qwen.IGNORE_INDEX])
    assert "on the right" in question and "left" not in question
    by_hand = {**record, "phrase": "the red square on the right", "bbox": [width - 50.0, 20.0, width - 10.0, 60.0]}
    expected = encode_sample(gm.processor, gm.family, gm.resize, gm.prompt,
                             image.transpose(Image.Transpose.FLIP_LEFT_RIGHT), by_hand)
    assert flipped.keys() == expected.keys() and all(torch.equal(flipped[k], expected[k]) for k in expected)

    unflipped = never[0, 7]
    assert json.loads(_labelled_text(gm, unflipped).removesuffix("<|im_end|>\n")) == [
        {"bbox_2d": [10, 20, 50, 60], "label": "the red square on the left"}]
    for position in range(8):  # probability 1 and 0 mean always and never, at every position
        assert _labelled_text(gm, always[0, position]) == _labelled_text(gm, flipped)
        assert _labelled_text(gm, never[0, position]) == _labelled_text(gm, unflipped)

    # random augmentations are a function of (index, position): the same item twice is the same
    # tensors, while other positions draw other flips and crops
    augmented = GroundingDataset(*args, hflip_prob=0.5, scale_crop_prob=1.0)
    items = [augmented[1, position] for position in range(6)]
    again = augmented[1, 4]
    assert all(torch.equal(again[k], items[4][k]) for k in again)
    answers = {_labelled_text(gm, item) for item in items}
    assert len(answers) > 1


@pytest.fixture(scope="module")
def synth_wide(tmp_path_factory):
    """One-shape scenes on 168 px canvases: coordinates the pre-trained tiny model never wrote,
    so its loss starts high (on its own 112 px scenes there is little left to fall): QLoRA's."""
    out = tmp_path_factory.mktemp("synth_wide")
    synth.make_synthetic_set(out, n=64, seed=1, task="single", width=168, height=168, workers=1)
    return out


def test_loss_falls(synth_single, tmp_path, monkeypatch, capsys, cfg):
    monkeypatch.setenv("GROUNDTUNE_PROGRESS_EVERY", "1e-9")  # a plain progress line every step
    # random weights at a higher lr: 6.2 -> 2.3 (at 1e-3 the loss falls by a quarter only)
    run = train(cfg(synth_single, tmp_path / "run", max_steps=25, batch_size=8, lr=5e-3))
    losses = _losses(run)
    assert len(losses) == 25
    # stderr is no terminal here (as in `train ... > log 2>&1`): the log says where the run is
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train ")]
    assert progress[0].startswith("train 1/25 (4%)") and "ETA" in progress[0]
    assert " loss " in progress[1] and " samples/s " in progress[1]
    assert progress[-1].startswith("train 25/25 (100%)") and " done after " in progress[-1]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:3]) / 3
    meta = json.loads((run / "model" / "groundtune.json").read_text())
    assert meta["family"] == "qwen2.5-vl" and meta["resize"]["max_pixels"] == 224 * 224
    assert (run / "tb").is_dir() and any((run / "tb").iterdir())
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-000025"]
    # the run folder loads back as a model, with the training resize settings
    gm = load_model(str(run))
    assert gm.resize == boxes.ResizeSpec(28, 3136, 224 * 224)


def test_stop_file_then_resume_equals_uninterrupted(synth_single, tmp_path, cfg):
    straight = train(cfg(synth_single, tmp_path / "straight"))

    def stop_at_3(step, run, model):
        if step == 3:
            (run / "STOP").touch()

    interrupted = train(cfg(synth_single, tmp_path / "interrupted"), on_step=stop_at_3)
    assert [p.name for p in ckpt.list_checkpoints(interrupted)] == ["step-000003"]
    assert len(_losses(interrupted)) == 3  # it really stopped at the STOP file
    resumed = train(resume=interrupted)
    assert resumed == interrupted
    assert _losses(resumed) == _losses(straight)  # same values, not just close
    a = load_model(str(straight)).model.state_dict()
    b = load_model(str(resumed)).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_synthetic_stream_is_the_synthetic_set_drawn_on_the_fly(synth_single, small_model):
    """train_data=synth:TASK gives sample i of the run's seed: the same pixels and target as the
    file `groundtune data synth --seed SEED` writes, in index order, never repeating."""
    from groundtune.data.samples import open_samples
    from groundtune.train.batches import GroundingDataset, make_loader

    gm = load_model(small_model)
    stream = open_samples("synth:single", 1)
    files = open_samples(str(synth_single / "train.jsonl"), 1)  # made with seed 1, task single
    args = (gm.processor, gm.family, gm.resize, gm.prompt)
    from_stream, from_files = GroundingDataset(stream, *args), GroundingDataset(files, *args)
    for i in (0, 5, 63):
        a, b = from_stream[i, i], from_files[i, i]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    batches = iter(make_loader(from_stream, 4, seed=1, start=8, num_workers=0, pad_token_id=0))
    first, expected = next(batches), from_stream[8, 8]["input_ids"]
    assert torch.equal(first["input_ids"][0, : len(expected)], expected)  # resumes at its position
    with pytest.raises(ValueError, match="'synth:bogus'.*synth:full"):
        open_samples("synth:bogus", 0)
    mixture = open_samples("synth:single+attribute", 1)  # a curriculum mixture: tasks alternate
    assert [mixture[i][1]["task"] for i in range(4)] == ["single", "attribute", "single", "attribute"]
    assert mixture[2][1] == stream[2][1]  # sample 2 of the mixture is sample 2 of its task
    varied = open_samples("synth:single+every@112-224", 1)  # canvases drawn per sample
    image, record = varied[3]
    assert image.size == synth.canvas_size(1, 3, "train", (112, 224)) == (record["width"], record["height"])
    assert record == synth.make_sample(1, 3, task="every", canvas=(112, 224))[1]
    with pytest.raises(ValueError, match="'synth:single@big': canvas 'big': expected MIN-MAX"):
        open_samples("synth:single@big", 0)
    # contrast pairs (one image, two colour words) are drawn in turn: a batch of 4 holds a whole pair
    paired = open_samples("synth:every+contrast", 1)
    batch = [paired[i] for i in range(8, 12)]
    assert [r["task"] for _, r in batch] == ["every", "contrast", "every", "contrast"]
    (image_a, a), (image_b, b) = batch[1], batch[3]
    assert image_a.tobytes() == image_b.tobytes() and a["phrase"] != b["phrase"]
    assert (a, b) == tuple(synth.make_sample(1, i, task="contrast")[1] for i in (4, 5))  # pair 2


def test_training_on_the_stream_resumes_exactly(tmp_path, cfg):
    kw = {"train_data": "synth:single", "max_steps": 4, "num_workers": 2}
    straight = train(cfg(tmp_path, tmp_path / "straight", **kw))

    def stop_at_2(step, run, model):
        if step == 2:
            (run / "STOP").touch()

    interrupted = train(cfg(tmp_path, tmp_path / "interrupted", **kw), on_step=stop_at_2)
    resumed = train(resume=interrupted)
    assert len(_losses(straight)) == 4 and _losses(resumed) == _losses(straight)


def test_lora_init_is_a_function_of_the_seed(small_model):
    """The adapters start the same for the same seed whatever drew random numbers before (so a
    benchmark's baseline and groundtune's run start from identical weights)."""
    from groundtune.models import adapt

    def lora_a(seed, noise):
        torch.rand(noise)  # some earlier use of the global generator
        model = adapt.prepare_for_training(load_model(small_model).model, TrainConfig(train_data="x", seed=seed))
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}

    a, b, c = lora_a(0, 3), lora_a(0, 100), lora_a(1, 3)
    assert a and all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], c[n]) for n in a)


def test_packed_training_follows_the_padded_run(synth_single, tmp_path, cfg):
    # fp32 on the CPU, where packing must be exact (the GPU's bf16 kernels: test_attention.py)
    padded = train(cfg(synth_single, tmp_path / "padded", max_steps=3, method="lora", lr=5e-3, device="cpu"))
    packed = train(cfg(synth_single, tmp_path / "packed", max_steps=3, method="lora", lr=5e-3, packing=True,
                        device="cpu"))
    assert _losses(packed) == pytest.approx(_losses(padded), rel=1e-4)
    rows = [json.loads(line) for line in (packed / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in rows if "samples" in r] == [4, 8, 12]  # samples, not rows, are counted


def test_gradient_accumulation_weights_every_answer_token_alike(synth_single, tmp_path, cfg):
    """Two micro-batches of 2 make the update one batch of 4 makes: the loss is the mean over the
    step's answer tokens, not the mean of each micro-batch's mean (answers differ in length, so
    those would weigh a short answer's tokens more)."""
    whole = train(cfg(synth_single, tmp_path / "whole", max_steps=3, method="lora", lr=5e-3, device="cpu"))
    halves = train(cfg(synth_single, tmp_path / "halves", max_steps=3, method="lora", lr=5e-3, device="cpu",
                        batch_size=2, grad_accum=2))
    assert _losses(halves) == pytest.approx(_losses(whole), rel=1e-5)


def test_existing_run_is_not_overwritten(synth_single, tmp_path, cfg):
    stopped = train(cfg(synth_single, tmp_path / "stopped", max_steps=3),
                    on_step=lambda step, run, model: (run / "STOP").touch())
    with pytest.raises(FileExistsError, match=f"resume it with `groundtune train --resume {stopped}`"):
        train(cfg(synth_single, stopped, max_steps=3))
    finished = train(cfg(synth_single, tmp_path / "finished", max_steps=1))
    model = (finished / "model" / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match=r"already holds a run \(model/, checkpoints\); choose another out_dir, "
                                              "or set overwrite=true"):
        train(cfg(synth_single, finished, max_steps=1, lr=5e-3))
    assert (finished / "model" / "model.safetensors").read_bytes() == model
    shutil.rmtree(finished / "checkpoints")  # deleted to save disk: the model alone is still a finished run
    with pytest.raises(FileExistsError, match=r"already holds a run \(model/\)"):
        train(cfg(synth_single, finished, max_steps=1, lr=5e-3))
    assert (finished / "model" / "model.safetensors").read_bytes() == model
    assert (finished / "metrics.jsonl").exists()
    train(cfg(synth_single, finished, max_steps=1, lr=5e-3, overwrite=True))  # asked for: replaced
    assert (finished / "model" / "model.safetensors").read_bytes() != model


def test_nan_guard_skips_then_stops(synth_single, tmp_path, cfg):
    def poison(step, run, model):
        if step == 2:  # from here on every loss is NaN
            with torch.no_grad():
                next(p for p in model.parameters() if p.requires_grad).fill_(float("nan"))

    with pytest.raises(TrainingError, match="3 non-finite"):
        train(cfg(synth_single, tmp_path / "nan", max_steps=10, max_bad_steps=3), on_step=poison)
    records = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in records if r.get("skipped_nonfinite")]
    assert len(skipped) == 3 and all(r["step"] == 2 for r in skipped)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "nan")] == ["step-000002"]


def test_lora_run_saves_an_adapter_that_loads(synth_single, tmp_path, cfg):
    run = train(cfg(synth_single, tmp_path / "lora", method="lora", lora_r=4, max_steps=3, lr=1e-2))
    assert (run / "model" / "adapter_config.json").exists()
    assert not (run / "model" / "model.safetensors").exists()
    gm = load_model(str(run), device="cpu")  # fp32: the two decoding paths agree exactly
    trained = {n: p for n, p in gm.model.named_parameters() if "lora_B" in n}
    assert trained and any(p.abs().sum() > 0 for p in trained.values())  # lora_B starts at zero
    samples = read_samples(synth_single / "val.jsonl")
    assert samples  # the adapter model runs end to end through generation
    from groundtune import infer
    from groundtune.data.images import load_image

    s = samples[0]
    image = load_image(synth_single / s["image"])
    preds = infer.predict(gm, [image], [s["phrase"]], max_new_tokens=12)
    assert len(preds) == 1
    # predict's answer is the adapter model's greedy answer, decoded by a second path: a plain
    # forward per token (no KV cache, the model's own M-RoPE positions), argmax until a stop token
    # (random weights: 12 tokens of junk, unless a stop token comes first)
    resized, _ = qwen.resize_image(image, gm.resize)
    enc = qwen.encode(gm.processor, resized, qwen.prompt_text(gm.processor, s["phrase"], gm.prompt))
    vision = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
    ids, stop = enc["input_ids"], set(gm.processor.eos_token_ids) | {gm.processor.pad_token_id}

    def logits(ids):
        return gm.model(input_ids=ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        mm_token_type_ids=(ids == gm.processor.image_token_id).int()[None], **vision).logits[0, -1]

    with torch.no_grad():
        with gm.model.disable_adapter():  # the adapter is in the loaded model's computation
            base_logits = logits(ids)
        assert not torch.allclose(logits(ids), base_logits)
        while len(ids) - len(enc["input_ids"]) < 12 and int(ids[-1]) not in stop:
            ids = torch.cat([ids, logits(ids).argmax()[None]])
    answer = ids[len(enc["input_ids"]):].tolist()
    assert preds[0].raw == gm.processor.tokenizer.decode(answer[:-1] if answer[-1] in stop else answer)


def test_gradient_checkpointing_changes_memory_not_results(synth_single, tmp_path, cfg):
    from groundtune.models import adapt

    def counting(entered):
        """From step 1 on, count entries into the first and last decoder layers' attention and MLP
        (pre-hooks: a recomputation stops as soon as it has what backward needs, inside the MLP)."""

        def on_step(step, run, model):
            if step == 1:
                layers = adapt.decoder_layers(model)
                for where, layer in (("first", layers[0]), ("last", layers[-1])):
                    for part in ("self_attn", "mlp"):
                        entered[where, part] = 0
                        getattr(layer, part).register_forward_pre_hook(
                            lambda module, args, key=(where, part): entered.__setitem__(key, entered[key] + 1))
        return on_step

    once, twice = {}, {}
    plain = train(cfg(synth_single, tmp_path / "plain", method="lora", max_steps=3, lr=1e-2), on_step=counting(once))
    recomputed = train(cfg(synth_single, tmp_path / "ckpt", method="lora", max_steps=3, lr=1e-2,
                            gradient_checkpointing=-1), on_step=counting(twice))
    assert _losses(recomputed) == pytest.approx(_losses(plain), rel=1e-5)
    # steps 2 and 3: one forward each, and with checkpointing one recomputation in backward each
    assert set(once.values()) == {2} and set(twice.values()) == {4} and len(twice) == 4


def test_frozen_vision_tower_is_never_back_propagated(small_model):
    """LoRA on the language model with the vision tower and merger frozen: their outputs carry no
    autograd graph, so backward stops at the image embeddings and checkpointing never recomputes
    the tower (what the plain PEFT recipe's enable_input_require_grads does)."""
    from groundtune.data.samples import open_samples
    from groundtune.models import adapt
    from groundtune.train.batches import GroundingDataset, to_device
    from groundtune.train.objective import answer_loss

    gm = load_model(small_model)
    model = adapt.prepare_for_training(gm.model, TrainConfig(train_data="x", method="lora", gradient_checkpointing=-1))
    model.train()
    seen = []
    merger = model.get_base_model().model.visual.merger
    merger.register_forward_hook(lambda module, args, out: seen.append(out.requires_grad))
    dataset = GroundingDataset(open_samples("synth:full", 0), gm.processor, gm.family, gm.resize, gm.prompt)
    batch = qwen.collate([dataset[i, i] for i in range(2)], gm.processor.pad_token_id)
    answer_loss(model, to_device(batch, gm.device)).backward()
    assert seen == [False]  # one vision forward, no graph behind it
    assert all(p.grad is None for n, p in model.named_parameters() if "visual" in n)
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora_B" in n)


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(synth_single, tmp_path, small_model):
    """A real `groundtune train` process, sent SIGTERM mid-run: it saves a checkpoint, exits 0 and
    prints the resume command whole (a log line users copy)."""
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "sig"
    cmd = [sys.executable, "-m", "groundtune", "train", "quickstart", f"model={small_model}",
           f"train_data={synth_single / 'train.jsonl'}", "eval_data=", f"out_dir={run}", "max_steps=100000",
           "log_every=1", "save_every=0", "num_workers=0", "batch_size=2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    # mid-run: a training step is logged (step 0's line, written during setup, comes before the
    # stop handler is installed, and a signal then ends the process the default way)
    while not (run / "metrics.jsonl").exists() or '"loss"' not in (run / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() else "timeout"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "SIGTERM" in out and f"groundtune train --resume {run}" in out
    saved = ckpt.list_checkpoints(run)
    assert len(saved) == 1 and not ckpt.is_finished(saved[-1])
    step = json.loads((saved[-1] / "state.json").read_text())["step"]
    assert 1 <= step < 100000


def test_lora_on_a_full_fine_tuning_run_applies_to_that_run(synth_single, tmp_path, small_model, cfg):
    """The adapter's base is the full run's weights, not the model the full run started from."""
    full = train(cfg(synth_single, tmp_path / "full", max_steps=2, lr=1e-2))
    lora = train(cfg(synth_single, tmp_path / "lora", model=str(full), method="lora", max_steps=2))
    meta = json.loads((lora / "model" / "groundtune.json").read_text())
    assert meta["base_model"] == str(full.resolve())
    loaded = load_model(str(lora)).model.get_base_model().state_dict()
    trained = load_model(str(full)).model.state_dict()
    started = load_model(small_model).model.state_dict()
    name = next(k for k in trained if k.endswith("language_model.norm.weight"))  # no adapter on it
    assert torch.equal(loaded[name], trained[name]) and not torch.equal(trained[name], started[name])


def test_a_random_architecture_is_not_silently_trained_unquantized_by_qlora():
    with pytest.raises(ValueError, match="cannot be loaded in 4-bit"):
        load_model("random:qwen2.5-vl-7b", quantize_4bit=True)  # refused before anything is built


needs_gpu_and_bitsandbytes = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None,
    reason="4-bit bases need a CUDA GPU and bitsandbytes")


@needs_gpu_and_bitsandbytes
def test_qlora_trains_adapters_on_a_4bit_base_and_the_run_loads_back(synth_wide, tmp_path):
    import bitsandbytes as bnb

    from groundtune.models import adapt

    seen = {}

    def on_step(step, run, model):
        if step == 1:
            seen["4bit"] = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.get_base_model().modules())
            seen["decoder_linears"] = 7 * len(adapt.decoder_layers(model))  # q k v o gate up down
            seen["trainable"] = [n for n, p in model.named_parameters() if p.requires_grad]

    # the tiny model's 4-bit base: its loss figures below (GPU only, no CPU time spent)
    run = train(_cfg(synth_wide, tmp_path / "qlora", model="tiny", method="qlora", lr=5e-3, max_steps=12,
                    batch_size=8), on_step=on_step)
    assert seen["4bit"] == seen["decoder_linears"]  # every LLM linear in 4-bit, the vision tower and LM head not
    assert seen["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in seen["trainable"])
    losses = _losses(run)
    assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[:3]) / 3  # (LoRA on the unquantized base, CPU: 1.40 -> 0.40)
    loaded = load_model(str(run))  # the adapter applies to the same base, here unquantized
    assert hasattr(loaded.model, "peft_config") and loaded.model.peft_config["default"].r == 16
