"""Box-head mode (models/head.py): the query position, the loss, training the tiny model with it,
saving and loading it back, and eval/predict answering through it in one forward pass."""

import json
import random

import numpy as np
import pytest
import torch
from PIL import Image

from groundtune import boxes, infer
from groundtune.config import RLConfig, TrainConfig
from groundtune.errors import ConfigError
from groundtune.models import adapt, head, qwen
from groundtune.models.box_head import map_box
from groundtune.models.loading import load_model
from groundtune.train.batches import Collate, GroundingDataset
from groundtune.train.rl import rl
from groundtune.train.sft import train


def test_unit_boxes_are_fractions_of_the_image_whatever_the_resize():
    assert boxes.to_unit([64, 48, 320, 240], (640, 480)) == [0.1, 0.1, 0.5, 0.5]
    assert boxes.from_unit([0.1, 0.1, 0.5, 0.5], (640, 480)) == pytest.approx([64, 48, 320, 240])
    # the same fractions of the image the model sees, after its resize
    resized = boxes.original_to_resized([64, 48, 320, 240], (640, 480), (644, 476))
    assert boxes.to_unit(resized, (644, 476)) == pytest.approx([0.1, 0.1, 0.5, 0.5])


def test_tensor_giou_is_boxes_giou_and_the_loss_is_zero_only_on_the_box():
    rng = random.Random(0)
    pairs = []
    for _ in range(50):
        a = sorted(rng.random() for _ in range(2)), sorted(rng.random() for _ in range(2))
        b = sorted(rng.random() for _ in range(2)), sorted(rng.random() for _ in range(2))
        pairs.append(([a[0][0], a[1][0], a[0][1], a[1][1]], [b[0][0], b[1][0], b[0][1], b[1][1]]))
    a, b = (torch.tensor([p[i] for p in pairs]) for i in (0, 1))
    assert head.giou(a, b).tolist() == pytest.approx([boxes.giou(x, y) for x, y in pairs], abs=1e-6)
    loss = head.box_loss(a, b, 2.0)
    assert loss.shape == (50,) and (loss > 0).all()
    assert head.box_loss(a, a, 2.0).abs().max() < 1e-6


def test_a_map_spread_over_a_block_of_cells_points_at_that_block():
    xy, cell = head.cells([1, 8, 12], merge_size=2)  # 4 rows x 6 columns of tokens, row by row
    want = [[x / 12, 1 / 8] for x in (1, 3, 5, 7, 9, 11)] + [[1 / 12, 3 / 8]]
    torch.testing.assert_close(xy[:7], torch.tensor(want, dtype=xy.dtype))
    assert cell[0].tolist() == pytest.approx([1 / 6, 1 / 4]) and len(xy) == 24
    block = torch.zeros(4, 6)
    block[1:3, 2:5] = 1 / 6  # rows 1-2, columns 2-4
    centre, size = map_box(block.flatten()[None, :, None], xy[None], cell[None])
    box = torch.cat([centre - size / 2, centre + size / 2], dim=-1)[0]
    assert box.tolist() == pytest.approx([2 / 6, 1 / 4, 5 / 6, 3 / 4], abs=1e-6)
    one = torch.zeros(24)
    one[23] = 1  # the last cell alone: exactly that cell
    centre, size = map_box(one[None, :, None], xy[None], cell[None])
    assert torch.cat([centre - size / 2, centre + size / 2], dim=-1)[0].tolist() == pytest.approx([5 / 6, 3 / 4, 1, 1])


def test_the_head_gives_each_sample_its_own_images_box_however_the_batch_is_laid_out(synth_single):
    """Padded (training's default), packed, and in a row where an image's phrases share its tokens:
    the same boxes, each from its own image's tokens."""
    gm = infer.load("tiny", device="cpu")
    core = adapt.base_model(gm.model)
    torch.manual_seed(0)
    box_head = head.attach(gm.model, adapt.hidden_size(core))
    with torch.no_grad():
        box_head.query.weight.mul_(40)  # a peaked map: boxes that differ from image to image
        box_head.out.weight.normal_(std=0.01)
    images = [Image.open(synth_single / "images" / name).convert("RGB")
              for name in sorted(p.name for p in (synth_single / "images").iterdir())[:2]]
    pairs = [(images[0], "the red circle"), (images[1], "the red circle"), (images[0], "a shape")]
    encoded, _ = infer.encode_prompts(gm, pairs)
    got = []
    with torch.inference_mode():
        for batch in (qwen.collate(encoded, gm.processor.pad_token_id, "right"), qwen.collate_packed(encoded)):
            hidden = core.model(**batch, use_cache=False).last_hidden_state
            tokens = head.image_tokens(batch, core.config)
            got.append(head.read(box_head, hidden, head.query_positions(batch), tokens))
        row = qwen.collate_shared(encoded, qwen.image_groups(encoded))
        assert row.images == [0, 1, 0] and len(row.inputs["image_grid_thw"]) == 2
        from groundtune.models.attention import attached

        with attached(row.layout):
            hidden = core.model(**row.inputs, use_cache=False).last_hidden_state
        tokens = head.image_tokens(row.inputs, core.config, row.images)
        got.append(head.read(box_head, hidden, (torch.zeros(3, dtype=torch.long), torch.tensor(row.last)), tokens))
    for other in got[1:]:
        torch.testing.assert_close(other, got[0], atol=1e-4, rtol=0)
    assert (got[0][0] - got[0][1]).abs().max() > 0.01  # another image, another box: the check has teeth


def test_a_head_file_of_the_former_design_is_refused_by_name(tmp_path):
    from safetensors.torch import save_file

    from groundtune.errors import ModelError

    save_file({"mlp.0.weight": torch.zeros(512, 64), "mlp.0.bias": torch.zeros(512)}, tmp_path / head.HEAD_FILE)
    with pytest.raises(ModelError, match="box_head.safetensors: a box head of an earlier groundtune"):
        head.load(torch.nn.Linear(2, 2), tmp_path, 64)


def test_the_head_reads_the_answer_opening_padded_packed_with_and_without_answers(synth_single):
    gm = load_model("tiny")
    from groundtune.data.records import read_samples
    from groundtune.data.samples import FileSamples

    records = read_samples(synth_single / "train.jsonl")[:3]
    samples = FileSamples(records, str(synth_single / "train.jsonl"))
    data = GroundingDataset(samples, gm.processor, gm.family, gm.resize, gm.prompt, box_target=True)
    items = [data[(i, i)] for i in range(3)]
    opening = head.prompt_end(gm.family)
    assert opening == '[{"bbox_2d": ['
    for item, record in zip(items, records):
        prompt = item["input_ids"][item["labels"] == qwen.IGNORE_INDEX]
        assert gm.processor.tokenizer.decode(prompt).endswith("assistant\n" + opening)
        # the rest of the text answer, without the phrase as a label: what the joint mode trains
        answer = gm.processor.tokenizer.decode(item["input_ids"][item["labels"] != qwen.IGNORE_INDEX])
        assert answer.startswith(str(round(record["bbox"][0]))) and "label" not in answer
    last = items[0]["input_ids"][(items[0]["labels"] != qwen.IGNORE_INDEX).nonzero()[0] - 1]
    def prompt_alone(item):  # what inference encodes: the prompt without the answer
        n = int((item["labels"] != qwen.IGNORE_INDEX).nonzero()[0])
        cut = {k: item[k][..., :n] for k in ("input_ids", "mm_token_type_ids", "position_ids")}
        return {**cut, "pixel_values": item["pixel_values"], "image_grid_thw": item["image_grid_thw"]}

    prompts = [prompt_alone(item) for item in items]
    for packing in (False, True):
        batch = Collate(gm.processor.pad_token_id, packing)([dict(item) for item in items])
        assert batch["box_target"].shape == (3, 4)
        rows, columns = head.query_positions(batch)
        assert (batch["input_ids"][rows, columns] == last).all()  # the opening's last token, 3 times
        assert (batch["labels"][rows, columns + 1] != qwen.IGNORE_INDEX).all()  # the answer goes on after it
        alone = (qwen.collate_packed(prompts) if packing else qwen.collate(prompts, gm.processor.pad_token_id))
        rows_alone, columns_alone = head.query_positions(alone)
        assert (alone["input_ids"][rows_alone, columns_alone] == last).all()


def test_a_box_head_trains_saves_loads_and_answers_in_one_pass(synth_single, tmp_path):
    cfg = TrainConfig(model="tiny", train_data=str(synth_single / "train.jsonl"), eval_data=str(synth_single / "val.jsonl"),
                      out_dir=str(tmp_path / "run"), head="box", lr=3e-3, batch_size=8, max_steps=30,
                      log_every=1, save_every=0, eval_samples=16, warmup_steps=0, packing=True)
    run = train(cfg)
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert sum(losses[-5:]) < sum(losses[:5])  # it learns
    assert (run / "model" / head.HEAD_FILE).is_file()
    saved = json.loads((run / "model" / "groundtune.json").read_text())
    assert saved["head"] == "box" and "eval" in saved
    gm = infer.load(str(run))
    assert head.head_of(gm.model) is not None
    # the loaded head answers as the trained one did: the eval it was saved with, again
    from groundtune import evaluate

    records = [json.loads(line) for line in (synth_single / "val.jsonl").read_text().splitlines()][:16]
    report, rows = evaluate.evaluate(gm, records, synth_single / "val.jsonl", batch_size=5)
    assert report["acc@0.5"] == pytest.approx(saved["eval"]["acc@0.5"]) and report["parse_fail_rate"] == 0
    assert report["head"] == "box" and report["several_true_boxes"] == 0 and "box_head" in report["decoding"]
    two = {k: v for k, v in records[0].items() if k != "bbox"} | {"bboxes": [records[0]["bbox"], [0, 0, 4, 4]]}
    report_two, _ = evaluate.evaluate(gm, [two] + records[1:3], synth_single / "val.jsonl", batch_size=5)
    assert report_two["several_true_boxes"] == 1  # one box per phrase: the report says how many have more
    # every answer is a box inside its image, in original pixels; batches of any size agree
    image = Image.open(synth_single / records[0]["image"])
    one = infer.predict(gm, [image] * 3, [records[0]["phrase"]] * 3, batch_size=1)
    three = infer.predict(gm, [image] * 3, [records[0]["phrase"]] * 3, batch_size=3)
    for p, q in zip(one, three):
        assert p.bbox == pytest.approx(q.bbox, abs=0.05) and p.error is None
        assert 0 <= p.bbox[0] <= p.bbox[2] <= image.width and 0 <= p.bbox[1] <= p.bbox[3] <= image.height
    # exported (LoRA merged), it loads with its head and answers the same boxes
    from groundtune.export import export

    exported = export(str(run), tmp_path / "export")
    assert (exported / head.HEAD_FILE).is_file()
    assert json.loads((exported / "groundtune.json").read_text())["head"] == "box"
    again = infer.predict(infer.load(str(exported)), [image], [records[0]["phrase"]])
    assert again[0].bbox == pytest.approx(one[0].bbox, abs=0.5)  # the export's weights are bf16
    # RL has nothing to sample from a box head: refused, naming the setting
    with pytest.raises(ConfigError, match="box head"):
        rl(RLConfig(model=str(run), train_data=str(synth_single / "train.jsonl"), out_dir=str(tmp_path / "rl"),
                    max_steps=1))


def test_head_settings_are_checked():
    with pytest.raises(ConfigError, match="head='boxes'"):
        TrainConfig(train_data="x", head="boxes")
    with pytest.raises(ConfigError, match="head_l1_weight"):
        TrainConfig(train_data="x", head="box", head_l1_weight=-1)


def test_phrases_asked_of_one_image_share_its_vision_pass_and_get_the_same_boxes():
    gm = infer.load("tiny", device="cpu")  # as eval, predict and serve load it: our attention installed
    core = adapt.base_model(gm.model)
    torch.manual_seed(0)
    head.attach(gm.model, adapt.hidden_size(core))
    rng = np.random.default_rng(0)
    a, b = (Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for w, h in ((112, 84), (96, 96)))
    pairs = [(a, "the red circle"), (b, "the red circle"), (a, "the blue square on the left"), (a, "a"),
             (b.copy(), "the top shape")]  # a copy: the same pixels, another object
    encoded, sizes = infer.encode_prompts(gm, pairs)
    assert qwen.image_groups(encoded) == [[0, 2, 3], [1, 4]]
    images_seen = []
    hook = core.model.visual.register_forward_hook(
        lambda module, args, kwargs, out: images_seen.append(len(kwargs.get("grid_thw", args[1:2] and args[1]))),
        with_kwargs=True)
    try:
        together = infer.head_boxes(gm, encoded, sizes)
        assert images_seen == [2]  # two distinct images, five phrases
        alone = [infer.head_boxes(gm, [e], [s])[0] for e, s in zip(encoded, sizes)]
    finally:
        hook.remove()
    for p, q in zip(together, alone):
        assert p.bbox == pytest.approx(q.bbox, abs=1e-3)
