"""The shipped tiny model gives meaningful answers: it was pre-trained by groundtune, so predict,
eval and a merged LoRA adapter are checked against the truth, not only for their shape."""

from __future__ import annotations

import json

import pytest

from groundtune.boxes import iou
from groundtune.cli import main
from groundtune.data import synth
from groundtune.infer import predict
from groundtune.models import head
from groundtune.models.loading import TINY_DIR, box_head_start, load_model


def test_shipped_weights_log_and_commands():
    weights, box_head = TINY_DIR / "model.safetensors", TINY_DIR / head.PRETRAINED_FILE
    assert weights.stat().st_size + box_head.stat().st_size <= 30 * 10**6  # the package's budget for them
    log = [json.loads(line) for line in (TINY_DIR / "training_log.jsonl").read_text().splitlines()]
    assert any("eval/acc@0.5" in r for r in log) and any("loss" in r for r in log)
    assert "groundtune train" in (TINY_DIR / "TRAINING.md").read_text()
    gm = load_model("tiny", device="cpu")
    assert 8_000_000 < sum(p.numel() for p in gm.model.parameters()) < 12_000_000
    # it answers in text; the box head pre-trained with it (a candidate per image cell, as
    # quickstart-every's head=box) is where a head=box run on it starts
    assert head.head_of(gm.model) is None and box_head_start("tiny") == box_head
    assert head.attach_from(gm.model, box_head, gm.model.config.text_config.hidden_size, 0, 0.5) is not None


def test_predict_cli_finds_the_named_shape(tmp_path, capsys):
    image, record = synth.make_sample(2027, 3, task="single", split="test")
    path = tmp_path / "scene.png"
    image.save(path)
    assert main(["predict", "--model", "tiny", "--image", str(path), "--phrase", record["phrase"],
                 "--device", "cpu"]) == 0
    answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert answer["error"] is None and iou(answer["bbox"], record["bbox"]) >= 0.5, (answer, record)


def test_predict_finds_shapes_named_by_position():
    """Scenes of 2-3 shapes where the phrase says where ("the leftmost shape", "the circle above
    the red square"): what the tiny model was pre-trained to do."""
    samples = []
    for i in range(200):
        scene = synth.make_scene(2027, i, task="multi", split="test")
        if scene.query.form in ("extreme", "relation", "attribute+position") and len(samples) < 24:
            samples.append(synth.make_sample(2027, i, task="multi", split="test"))
    gm = load_model("tiny", device="cpu")
    answers = predict(gm, [im for im, _ in samples], [r["phrase"] for _, r in samples], batch_size=24)
    hits = [a.bbox is not None and iou(a.bbox, r["bbox"]) >= 0.5 for a, (_, r) in zip(answers, samples)]
    assert sum(hits) >= 0.75 * len(hits), [a.raw for a in answers]


def test_eval_on_held_out_full_task_scores_high(tmp_path):
    synth.make_synthetic_set(tmp_path, n=100, seed=2027, task="full", split="test", workers=1)
    out = tmp_path / "report.json"
    assert main(["eval", "--model", "tiny", "--data", str(tmp_path / "test.jsonl"), "--out", str(out),
                 "--device", "cpu"]) == 0
    report = json.loads(out.read_text())
    # tiny 2.2 cuts about one answer in a hundred short on this task (`[{"bbox_2d": [`, 3 of 400 on
    # seed 2028; TRAINING.md), since its last cycle trained the box head with it; tiny 2.1 never did
    assert report["n"] == 100 and report["acc@0.5"] >= 0.85 and report["parse_fail_rate"] <= 0.02


@pytest.mark.slow
def test_lora_merge_keeps_predictions_identical(tmp_path):
    from groundtune.config import TrainConfig
    from groundtune.train.sft import train

    synth.make_synthetic_set(tmp_path / "data", n=64, seed=1, width=168, height=168, workers=1)
    run = train(TrainConfig(model="tiny", train_data=str(tmp_path / "data" / "train.jsonl"),
                            out_dir=str(tmp_path / "run"), method="lora", lr=5e-3, max_steps=8, batch_size=8,
                            save_every=0, log_every=4))
    samples = [synth.make_sample(3, i, width=168, height=168, split="val") for i in range(12)]
    images, phrases = [im for im, _ in samples], [r["phrase"] for _, r in samples]
    gm = load_model(str(run), device="cpu")
    tuned = predict(gm, images, phrases, batch_size=12)
    base = load_model("tiny", device="cpu")
    assert [a.raw for a in predict(base, images, phrases, batch_size=12)] != [a.raw for a in tuned]  # it learned
    gm.model = gm.model.merge_and_unload()
    assert not any("lora" in name for name, _ in gm.model.named_parameters())
    merged = predict(gm, images, phrases, batch_size=12)
    assert [a.raw for a in merged] == [a.raw for a in tuned]
    assert [a.bbox for a in merged] == [a.bbox for a in tuned]


def _script():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("tiny_model", Path(__file__).parents[1] / "scripts" / "tiny_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_a_box_head_run_ships_as_a_text_model_and_its_head(tmp_path, small_model):
    # scripts/tiny_model.py --install-weights / --install-head from a box-head run's model (a joint
    # pre-training cycle): the head goes in its own file; in the model's weights it would load as
    # weights of no module, and the model would be the head's size bigger than it is
    import shutil

    import torch
    from safetensors.torch import load_file

    from groundtune.models.loading import read_metadata, write_metadata

    run_model, shipped = tmp_path / "run_model", tmp_path / "shipped"
    shutil.copytree(small_model, run_model)
    shutil.copytree(small_model, shipped)
    gm = load_model(str(run_model), device="cpu")
    trained = head.attach(gm.model, gm.model.config.text_config.hidden_size, slots=0, threshold=0.4)
    head.save(trained, run_model)
    write_metadata(run_model, {**read_metadata(run_model), "head": "box"})
    script = _script()
    weights = load_file(script.install_weights(run_model, shipped))
    assert weights.keys() == load_file(f"{small_model}/model.safetensors").keys()
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    brought = head.read_file(script.install_head(run_model, shipped), gm.model.config.text_config.hidden_size)
    assert len(brought.slots) == 0 and brought.threshold == pytest.approx(0.4)
    assert head.head_of(load_model(str(shipped), device="cpu").model) is None  # it answers in text


@pytest.mark.parametrize("whole_tower", [False, True])
def test_a_fresh_merger_or_tower_changes_that_alone(tmp_path, whole_tower):
    # scripts/tiny_model.py --fresh-merger / --fresh-vision start the next pre-training cycle
    # (bench/plans/tiny2_merger.txt, tiny2_colour.txt): a slip that redrew more, or kept it, would go unseen there
    import torch
    from safetensors.torch import load_file

    script = _script()
    # the built-in model by its name, as the CLI names it, or by its folder
    written = script.fresh_vision("tiny" if whole_tower else TINY_DIR, tmp_path / "fresh", whole_tower=whole_tower)
    before, after = load_file(TINY_DIR / "model.safetensors"), load_file(written)
    assert before.keys() == after.keys()
    redrawn = {k for k in before if not torch.equal(before[k].float(), after[k].float())}
    part = {k for k in before if k.startswith("visual." if whole_tower else "visual.merger.")}
    # nothing outside the part; every weight matrix in it drawn anew (its norms and biases start
    # at constants: a part never trained, as tiny 2's merger, has them at those constants still)
    assert redrawn <= part and {k for k in part if before[k].dim() >= 2} <= redrawn
    if not whole_tower:
        assert sum(before[k].dim() >= 2 for k in part) == 2  # the MLP's two layers
    answers = predict(load_model(str(tmp_path / "fresh"), device="cpu"), [synth.make_sample(1, 0)[0]], ["the red circle"])
    assert len(answers) == 1  # the folder loads as a model and answers
