"""Box-head mode (models/head.py): the query position, the set loss and its Hungarian matching,
K slots answering 0..K boxes, the single-box head of before sets, training a model with it (one box
per phrase, and sets with none or several), saving and loading it back, and eval/predict answering
through it in one forward pass. On a small random model (tests/conftest.py's ``small_model``): what
is checked holds whatever the weights."""

import itertools
import json
import random

import numpy as np
import pytest
import torch
from PIL import Image

from groundtune import boxes, infer
from groundtune.config import RLConfig, TrainConfig
from groundtune.data import synth
from groundtune.errors import ConfigError, ModelError, TrainingError
from groundtune.models import adapt, head, qwen
from groundtune.models.box_head import BoxHead, ImageTokens, fourier, map_box
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
    # every pair at once, as the matching needs them: (5, 1, 4) against (1, 7, 4)
    every = head.giou(a[:5, None], b[None, :7])
    assert every.shape == (5, 7)
    assert every[3, 6].item() == pytest.approx(boxes.giou(pairs[3][0], pairs[6][1]), abs=1e-6)


def _random_boxes(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """xyxy boxes inside the unit square, (*shape, 4)."""
    corner = torch.rand(*shape, 2, generator=generator) * 0.6
    return torch.cat([corner, corner + 0.05 + torch.rand(*shape, 2, generator=generator) * 0.35], dim=-1)


def _loss_of_assignment(predicted, logits, targets, slot_of_box, l1_weight):
    """A sample's loss when true box j goes to slot ``slot_of_box[j]``: written out from its
    definition, slot by slot, with no matching."""
    total = 0.0
    for k in range(len(logits)):
        if k in slot_of_box:
            j = slot_of_box.index(k)
            total += float(head.box_loss(predicted[k], targets[j], l1_weight))
            total += float(torch.nn.functional.softplus(-logits[k]))  # -log sigmoid: "an object"
        else:
            total += head.NO_OBJECT_WEIGHT * float(torch.nn.functional.softplus(logits[k]))  # -log(1 - sigmoid)
    return total


def test_the_hungarian_loss_is_the_least_loss_over_every_assignment():
    """set_loss against a brute force over every assignment of true boxes to slots, for 0 to K
    true boxes: the matching finds the assignment that costs least, and the loss is its loss."""
    generator = torch.Generator().manual_seed(0)
    slots, samples = 4, 40
    predicted = _random_boxes(generator, samples, slots)
    logits = torch.randn(samples, slots, generator=generator) * 2
    targets = _random_boxes(generator, samples, slots)
    counts = torch.arange(samples) % (slots + 1)  # 0, 1, ..., K true boxes
    got = head.set_loss(predicted, logits, targets, counts, l1_weight=2.0)
    beaten = 0
    for i, n in enumerate(counts.tolist()):
        every = [_loss_of_assignment(predicted[i], logits[i], targets[i, :n], list(order), 2.0)
                 for order in itertools.permutations(range(slots), n)]
        assert got[i].item() == pytest.approx(min(every), rel=1e-5)
        beaten += min(every) < every[0] - 1e-3  # the first slots in order would have cost more
    assert beaten > samples // 2  # the matching has work to do: the check has teeth
    # no true box: every slot's objectness towards 0, nothing else
    assert got[0].item() == pytest.approx(float(torch.nn.functional.softplus(logits[0]).sum()), rel=1e-6)
    with pytest.raises(TrainingError, match="head_slots=5 or more"):
        head.set_loss(predicted[:1], logits[:1], _random_boxes(generator, 1, 5), torch.tensor([5]), 2.0)


def test_only_matched_slots_learn_boxes_and_every_slot_learns_its_objectness():
    generator = torch.Generator().manual_seed(1)
    predicted = _random_boxes(generator, 2, 3).requires_grad_()
    logits = torch.zeros(2, 3, requires_grad=True)
    targets = torch.stack([predicted[0, 2].detach(), torch.zeros(4)])[:, None]  # sample 0: slot 2's own box
    head.set_loss(predicted, logits, targets, torch.tensor([1, 0]), 2.0).sum().backward()
    moved = predicted.grad.abs().sum(-1)
    assert moved[0, :2].tolist() == [0, 0] and moved[1].tolist() == [0, 0, 0]  # unmatched: no box gradient
    # the matched slot (its box exactly the target's: at its minimum, giou's gradient ~0) is pushed up, the rest down
    assert logits.grad[0, 2] < 0 and (logits.grad[0, :2] > 0).all() and (logits.grad[1] > 0).all()


def test_a_map_spread_over_a_block_of_cells_points_at_that_block():
    xy, cell = head.cells([1, 8, 12], merge_size=2)  # 4 rows x 6 columns of tokens, row by row
    want = [[x / 12, 1 / 8] for x in (1, 3, 5, 7, 9, 11)] + [[1 / 12, 3 / 8]]
    torch.testing.assert_close(xy[:7], torch.tensor(want, dtype=xy.dtype))
    assert cell[0].tolist() == pytest.approx([1 / 6, 1 / 4]) and len(xy) == 24
    block = torch.zeros(4, 6)
    block[1:3, 2:5] = 1 / 6  # rows 1-2, columns 2-4
    centre, size = map_box(block.flatten()[None], xy[None], cell[None])
    box = torch.cat([centre - size / 2, centre + size / 2], dim=-1)[0]
    assert box.tolist() == pytest.approx([2 / 6, 1 / 4, 5 / 6, 3 / 4], abs=1e-6)
    one = torch.zeros(24)
    one[23] = 1  # the last cell alone: exactly that cell
    centre, size = map_box(one[None], xy[None], cell[None])
    assert torch.cat([centre - size / 2, centre + size / 2], dim=-1)[0].tolist() == pytest.approx([5 / 6, 3 / 4, 1, 1])


@pytest.mark.parametrize("slots", [0, 8])
def test_the_head_gives_each_sample_its_own_images_box_however_the_batch_is_laid_out(synth_single, slots,
                                                                                     small_model):
    """Padded (training's default), packed, and in a row where an image's phrases share its tokens:
    the same boxes, each from its own image's tokens; in both layouts (a candidate per cell, K slots)."""
    gm = infer.load(small_model, device="cpu")
    core = adapt.base_model(gm.model)
    torch.manual_seed(0)
    box_head = head.attach(gm.model, adapt.hidden_size(core), slots=slots)
    with torch.no_grad():
        box_head.query.weight.mul_(40)  # a peaked map: boxes that differ from image to image
        box_head.out.weight.normal_(std=0.01 if slots else 0.03)
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
        row = qwen.collate_shared(encoded)
        assert row.images == [0, 1, 0] and len(row.inputs["image_grid_thw"]) == 2
        from groundtune.models.attention import attached

        with attached(row.layout):
            hidden = core.model(**row.inputs, use_cache=False).last_hidden_state
        tokens = head.image_tokens(row.inputs, core.config, row.images)
        got.append(head.read(box_head, hidden, (torch.zeros(3, dtype=torch.long), torch.tensor(row.last)), tokens))
    for other in got[1:]:
        torch.testing.assert_close(other, got[0], atol=1e-4, rtol=0)
    candidates = slots or int(tokens.mask.sum(dim=1).max())  # the cells layout: one per image token
    assert got[0][0].shape == (3, candidates, 4) and got[0][1].shape == (3, candidates)
    assert (got[0][0][0] - got[0][0][1]).abs().max() > 0.01  # another image, another box: the check has teeth


def _single_box_head_of_before_sets(head_: BoxHead, query, image, tokens):
    """The single-box head's forward as groundtune had it before sets (models/box_head.py at
    8baec6f), on ``head_``'s weights: the reference a one-slot head must answer as."""
    query, image = query.float(), image.float()
    keys = head_.key(image) + head_.where(fourier(tokens.xy))
    q = head_.query(query)
    scores = torch.einsum("nk,ntk->nt", q, keys[tokens.index]) / q.shape[-1] ** 0.5
    p = torch.softmax(scores.masked_fill(~tokens.mask, float("-inf")), dim=-1)[..., None]
    xy, cell = tokens.xy[tokens.index], tokens.cell[tokens.index]
    centre = (p * xy).sum(1)
    size = torch.sqrt(12 * (p * (xy - centre[:, None]) ** 2).sum(1) + (p * cell).sum(1) ** 2)
    correction = head_.out(torch.nn.functional.gelu(head_.from_query(query)
                                                    + (p * head_.from_image(image)[tokens.index]).sum(1)))
    cx, cy = (centre + correction[:, :2]).unbind(-1)
    w, h = (size * torch.exp(correction[:, 2:])).unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


def test_a_single_box_head_file_of_before_sets_loads_as_one_slot_that_always_answers(tmp_path):
    """A file of the head of before sets (no slots, no objectness, no threshold) loads as K=1 with
    threshold 0 and objectness 1: the same box as that head gave, always kept. A new one-slot head
    with threshold 0 is that head too."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    hidden = 32
    new = BoxHead(hidden, slots=1, threshold=0.0)
    with torch.no_grad():
        new.query.weight.mul_(20)  # a peaked map and a correction: boxes that differ from sample to sample
        new.out.weight.normal_(std=0.01)
    old_state = {k: v for k, v in new.state_dict().items() if k not in ("slots", "objectness.weight", "objectness.bias")}
    save_file(old_state, tmp_path / head.HEAD_FILE)  # as groundtune wrote it then: no metadata
    model = torch.nn.Linear(2, 2)
    loaded = head.load(model, tmp_path, hidden)
    assert head.head_of(model) is loaded and loaded.slots.shape == (1, hidden) and loaded.threshold == 0.0
    xy, cell = head.cells([1, 6, 8], merge_size=2)
    tokens = ImageTokens(torch.zeros(12, dtype=torch.long), torch.arange(12), xy, cell,
                         torch.arange(12).repeat(3, 1), torch.ones(3, 12, dtype=torch.bool))
    query, image = torch.randn(3, hidden), torch.randn(12, hidden)
    with torch.no_grad():
        before = _single_box_head_of_before_sets(new, query, image, tokens)
        fractions, logits = loaded(query, image, tokens)
        fresh_fractions, _ = new(query, image, tokens)
    assert fractions.shape == (3, 1, 4) and torch.sigmoid(logits).tolist() == [[1.0]] * 3
    torch.testing.assert_close(fractions[:, 0], before, atol=1e-6, rtol=0)
    torch.testing.assert_close(fresh_fractions[:, 0], before, atol=1e-6, rtol=0)
    assert len({tuple(box) for box in before.round(decimals=3).tolist()}) == 3  # boxes that differ: teeth
    answer = infer.head_answer(fractions[0].tolist(), torch.sigmoid(logits[0]).tolist(), loaded.threshold, (640, 480))
    assert answer.boxes[0] == pytest.approx(boxes.clip_box(boxes.from_unit(before[0].tolist(), (640, 480)), (640, 480)),
                                            abs=1e-3)
    assert len(answer.boxes) == 1 and 0 < answer.boxes[0][0] < answer.boxes[0][2] < 640  # a box inside the image
    assert answer.scores == [1.0] and not answer.no_target
    # saved again, it is a head of this version: its slot and threshold come back as they are
    loaded.threshold = 0.25
    head.save(loaded, tmp_path)
    again = head.load(model, tmp_path, hidden)
    assert again.threshold == 0.25 and torch.equal(again.objectness.bias, loaded.objectness.bias)


def test_a_head_file_of_the_former_design_is_refused_by_name(tmp_path):
    from safetensors.torch import save_file

    save_file({"mlp.0.weight": torch.zeros(512, 64), "mlp.0.bias": torch.zeros(512)}, tmp_path / head.HEAD_FILE)
    with pytest.raises(ModelError, match="box_head.safetensors: a box head of an earlier groundtune"):
        head.load(torch.nn.Linear(2, 2), tmp_path, 64)


def test_k_slots_answer_none_to_k_boxes_in_reading_order_with_their_scores(small_model):
    """A head of K slots answers each phrase with the boxes of the slots whose objectness reaches
    the threshold: every count from 0 to K as the threshold falls, in reading order, each box with
    its own slot's score; none is a no-target answer."""
    gm = infer.load(small_model, device="cpu")
    torch.manual_seed(0)
    slots = 4
    box_head = head.attach(gm.model, adapt.hidden_size(adapt.base_model(gm.model)), slots=slots)
    with torch.no_grad():
        box_head.query.weight.mul_(40)  # peaked maps: each slot its own box
        box_head.slots.normal_(std=1.0)
        box_head.objectness.bias.copy_(torch.tensor([0.0]))
        box_head.objectness.weight.normal_(std=0.5)  # scores that differ from slot to slot
    image = Image.fromarray((np.random.default_rng(0).random((84, 112, 3)) * 255).astype("uint8"))
    encoded, sizes = infer.encode_prompts(gm, [(image, "every red circle")])
    batch = qwen.collate(encoded, gm.processor.pad_token_id, "right")
    with torch.no_grad():
        core = adapt.base_model(gm.model)
        hidden = core.model(**batch, use_cache=False).last_hidden_state
        fractions, logits = head.read(box_head, hidden, head.query_positions(batch), head.image_tokens(batch, core.config))
    scores = sorted(torch.sigmoid(logits[0]).tolist(), reverse=True)
    assert scores[0] - scores[-1] > 0.1  # scores spread out: each threshold below keeps another slot
    thresholds = [1.0] + [(a + b) / 2 for a, b in itertools.pairwise(scores)] + [0.0]
    for kept, threshold in enumerate(thresholds):
        box_head.threshold = threshold
        (answer,) = infer.head_boxes(gm, encoded, sizes)
        assert len(answer.boxes) == len(answer.scores) == kept and answer.no_target == (kept == 0)
        assert sorted(answer.scores, reverse=True) == pytest.approx(scores[:kept], abs=1e-6)
        assert answer.boxes == boxes.reading_order(answer.boxes) and answer.bbox == (answer.boxes or [None])[0]
        for box, score in zip(answer.boxes, answer.scores):  # each box with its own slot's score
            slot = int(torch.argmin((torch.sigmoid(logits[0]) - score).abs()))
            want = boxes.clip_box(boxes.from_unit(fractions[0, slot].tolist(), image.size), image.size)
            assert box == pytest.approx(want, abs=1e-3)
    assert len({tuple(np.round(box, 1)) for box in answer.boxes}) == slots  # K distinct boxes: teeth


def test_the_runners_keep_order_and_map_slots_as_groundtune_does():
    """box_head.py's and onnx_predict.py's ``answer`` (standalone copies: no groundtune where they
    run) against infer.head_answer, on a table of slots: the same boxes kept by the threshold,
    clipped to the image, in reading order, with their scores."""
    from groundtune.deploy import onnx_predict
    from groundtune.models import box_head

    generator = torch.Generator().manual_seed(2)
    seen = set()
    for case in range(60):
        slots = 1 + case % 5
        fractions = (_random_boxes(generator, slots) * 1.4 - 0.2).tolist()  # some beyond the image: clipped
        scores = torch.rand(slots, generator=generator).tolist()
        threshold = [0.0, 0.5, 0.9, scores[0]][case % 4]  # a score equal to the threshold is kept
        size = [(640, 480), (97, 300)][case % 2]
        ours = infer.head_answer(fractions, scores, threshold, size)
        for runner in (box_head.answer, onnx_predict.answer):
            assert runner(fractions, scores, threshold, size) == {"boxes": ours.boxes, "scores": ours.scores}
        seen.add(len(ours.boxes))
        if len(ours.boxes) > 1:  # reading order, not slot order
            centres = [boxes.box_centre(b)[::-1] for b in ours.boxes]
            assert centres == sorted(centres)
    assert seen == {0, 1, 2, 3, 4, 5}  # every count of kept slots came up


def test_the_head_reads_the_answer_opening_padded_packed_with_and_without_answers(synth_single, small_model):
    gm = load_model(small_model)
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
        assert batch["box_target"].shape == (3, 1, 4) and batch["box_count"].tolist() == [1, 1, 1]
        rows, columns = head.query_positions(batch)
        assert (batch["input_ids"][rows, columns] == last).all()  # the opening's last token, 3 times
        assert (batch["labels"][rows, columns + 1] != qwen.IGNORE_INDEX).all()  # the answer goes on after it
        alone = (qwen.collate_packed(prompts) if packing else qwen.collate(prompts, gm.processor.pad_token_id))
        rows_alone, columns_alone = head.query_positions(alone)
        assert (alone["input_ids"][rows_alone, columns_alone] == last).all()


def test_a_box_head_trains_saves_loads_and_answers_in_one_pass(synth_single, tmp_path, small_model):
    cfg = TrainConfig(model=small_model, train_data=str(synth_single / "train.jsonl"),
                      eval_data=str(synth_single / "val.jsonl"), out_dir=str(tmp_path / "run"), head="box", lr=3e-3,
                      batch_size=8, max_steps=30, log_every=1, save_every=0, eval_samples=16, warmup_steps=0,
                      packing=True, head_slots=3, head_threshold=0.3)
    run = train(cfg)
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert sum(losses[-5:]) < sum(losses[:5])  # it learns
    assert (run / "model" / head.HEAD_FILE).is_file()
    saved = json.loads((run / "model" / "groundtune.json").read_text())
    assert saved["head"] == "box" and "eval" in saved
    gm = infer.load(str(run))
    loaded = head.head_of(gm.model)
    assert loaded.slots.shape[0] == 3  # the layout it was trained with
    # its threshold was chosen on the eval set (not head_threshold's 0.3): the one of best F1@0.5 there
    from groundtune import evaluate

    records = [json.loads(line) for line in (synth_single / "val.jsonl").read_text().splitlines()][:16]
    chosen = loaded.threshold
    logged = [r["eval/head_threshold"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if "eval/head_threshold" in r]
    assert chosen in evaluate.THRESHOLD_CHOICES and chosen in logged
    loaded.threshold = evaluate.THRESHOLD_CHOICES[0]
    assert evaluate.best_threshold(infer.predict_records(gm, records, synth_single / "val.jsonl"), records) == chosen
    loaded.threshold = chosen
    # the loaded head answers as the trained one did: the eval it was saved with, again
    report, _ = evaluate.evaluate(gm, records, synth_single / "val.jsonl", batch_size=5)
    assert report["acc@0.5"] == pytest.approx(saved["eval"]["acc@0.5"]) and report["parse_fail_rate"] == 0
    assert report["head"] == "box"
    # every answer is 0..3 boxes inside its image, in original pixels, each with its score; batches of any size agree
    image = Image.open(synth_single / records[0]["image"])
    one = infer.predict(gm, [image] * 3, [records[0]["phrase"]] * 3, batch_size=1)
    three = infer.predict(gm, [image] * 3, [records[0]["phrase"]] * 3, batch_size=3)
    for p, q in zip(one, three):
        assert p.error is None and len(p.boxes) == len(q.boxes) <= 3 and len(p.scores) == len(p.boxes)
        assert np.array(p.boxes).reshape(-1, 4) == pytest.approx(np.array(q.boxes).reshape(-1, 4), abs=0.05)
        assert all(s >= chosen for s in p.scores)
        for box in p.boxes:
            assert 0 <= box[0] <= box[2] <= image.width and 0 <= box[1] <= box[3] <= image.height
    # exported (LoRA merged), it loads with its head and answers the same slots (threshold 0: all of them)
    from groundtune.deploy.export import export

    exported = export(str(run), tmp_path / "export")
    assert (exported / head.HEAD_FILE).is_file()
    assert json.loads((exported / "groundtune.json").read_text())["head"] == "box"
    again_gm = infer.load(str(exported))
    assert head.head_of(again_gm.model).threshold == chosen
    for model in (gm, again_gm):
        head.head_of(model.model).threshold = 0.0
    ours, again = (infer.predict(model, [image], [records[0]["phrase"]])[0] for model in (gm, again_gm))
    assert len(ours.boxes) == len(again.boxes) == 3
    for box in again.boxes:  # the export's weights are bf16: each box within half a pixel of one of ours
        assert min(np.abs(np.array(box) - np.array(ours.boxes)).max(axis=1)) < 0.5
    assert sorted(again.scores) == pytest.approx(sorted(ours.scores), abs=0.01)
    # RL has nothing to sample from a box head: refused, naming the setting
    with pytest.raises(ConfigError, match="box head"):
        rl(RLConfig(model=str(run), train_data=str(synth_single / "train.jsonl"), out_dir=str(tmp_path / "rl"),
                    max_steps=1))


def _set_task(folder, n: int, seed: int) -> list[dict]:
    """Records of a set task drawn with the synthetic set's shapes: "all the shapes" (1-3 boxes),
    "every {colour} shape" for a colour in the scene (its shapes) or for one that is not (none)."""
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        image, _ = synth.make_sample(seed, i, task="full")
        scene = synth.make_scene(seed, i, task="full")  # the same scene, every shape of it
        present = sorted({s.colour for s in scene.shapes})
        absent = [c for c in synth.DEFAULT_PALETTE.colours if c not in present]
        colour, phrase = [(None, "all the shapes"), (present[0], f"every {present[0]} shape"),
                          (absent[0], f"every {absent[0]} shape")][i % 3]
        image.save(folder / f"{i}.png")
        records.append({"id": f"set-{i}", "image": f"{i}.png", "width": image.width, "height": image.height,
                        "phrase": phrase, "bboxes": [[float(v) for v in s.box] for s in scene.shapes
                                                     if colour is None or s.colour == colour]})
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def test_a_box_head_learns_a_set_task_of_several_boxes_and_none(tmp_path, small_model):
    """Trained on phrases with 0-3 boxes, the set loss on a fixed batch of them falls (the layout of
    a candidate per image cell, quickstart-every's)."""
    from groundtune.data.records import read_samples
    from groundtune.data.samples import FileSamples
    from groundtune.train.objective import BoxObjective, box_head_loss

    records = _set_task(tmp_path / "sets", 48, seed=3)
    counts = [len(r["bboxes"]) for r in records]
    assert 0 in counts and max(counts) >= 2  # no-target and multi-box phrases both
    gm = load_model(small_model)
    data = tmp_path / "sets" / "train.jsonl"
    dataset = GroundingDataset(FileSamples(read_samples(data), str(data)), gm.processor, gm.family, gm.resize,
                               gm.prompt, box_target=True)
    fixed = Collate(gm.processor.pad_token_id)([dataset[(i, i)] for i in range(24)])
    fixed = {k: v for k, v in fixed.items() if k not in ("drawn", "failed")}
    measured = {}

    def measure(step, run, model):
        if step in (1, 30):
            with torch.no_grad():
                measured[step] = float(box_head_loss(BoxObjective(model), fixed, 24, 1, 2.0, 0.0))

    cfg = TrainConfig(model=small_model, train_data=str(data), eval_data="", out_dir=str(tmp_path / "run"),
                      head="box", head_slots=0, lr=3e-3, batch_size=8, max_steps=30, log_every=1, save_every=0, warmup_steps=0)
    run = train(cfg, on_step=measure)
    assert measured[30] < 0.8 * measured[1]  # it learns the sets
    gm = infer.load(str(run))
    assert head.head_of(gm.model).per_cell  # saved and loaded in its layout
    image = Image.open(tmp_path / "sets" / "0.png")
    cells = (image.width // 28) * (image.height // 28)  # the model's merged cells (tiny's processor): 28 px
    answers = infer.predict(gm, [image] * 2, ["all the shapes", "every purple shape"])
    assert all(a.error is None and len(a.boxes) <= cells and len(a.scores) == len(a.boxes) for a in answers)


def test_the_threshold_chosen_is_the_one_of_best_f1_on_the_eval_set():
    """Scored answers where the true boxes score 0.7 and the extra ones 0.2 or 0.4: every threshold
    in (0.4, 0.7] keeps exactly the true ones; the highest of them is chosen. Then a set where a
    true box scores 0.15 and nothing else is extra: the threshold drops to keep it."""
    from groundtune import evaluate

    def answer(scored):
        return infer.Prediction(bbox=None, boxes=[b for b, _ in scored], label=None, raw="", error=None,
                                scores=[s for _, s in scored])

    a, b, c = [0, 0, 10, 10], [20, 20, 30, 30], [40, 40, 50, 50]
    samples = [{"bboxes": [a, b]}, {"bboxes": []}, {"bboxes": [c]}]
    predictions = [answer([(a, 0.7), (b, 0.7), (c, 0.2)]), answer([(a, 0.4)]), answer([(c, 0.7)])]
    assert evaluate.best_threshold(predictions, samples) == 0.7
    assert predictions[1].above(0.7).no_target and predictions[0].above(0.7).boxes == [a, b]
    predictions = [answer([(a, 0.7), (b, 0.15)]), answer([]), answer([(c, 0.7)])]
    assert evaluate.best_threshold(predictions, samples) == 0.15


def test_a_box_head_run_that_trains_no_text_answer_encodes_none(synth_single, small_model):
    """Without the joint mode nothing reads the answer's tokens (a causal model's states at the
    prompt and the image do not see them): a sample carries only the closing tokens, which mark
    where the prompt ends, and the head's loss is the same as with the whole answer."""
    from groundtune.data.records import read_samples
    from groundtune.data.samples import FileSamples
    from groundtune.train.objective import BoxObjective, box_head_loss

    gm = load_model(small_model)
    records = read_samples(synth_single / "train.jsonl")[:4]
    records[0] = {k: v for k, v in records[0].items() if k != "bbox"} | {"bboxes": []}
    samples = FileSamples(records, str(synth_single / "train.jsonl"))
    batches = {}
    for text in (True, False):
        data = GroundingDataset(samples, gm.processor, gm.family, gm.resize, gm.prompt, box_target=True, answer_text=text)
        batch = Collate(gm.processor.pad_token_id)([data[(i, i)] for i in range(4)])
        batches[text] = {k: v for k, v in batch.items() if k not in ("drawn", "failed")}
    labelled = (batches[False]["labels"] != qwen.IGNORE_INDEX).sum(dim=1)
    assert labelled.tolist() == [2] * 4  # <|im_end|> and the newline
    assert batches[False]["input_ids"].shape[1] < batches[True]["input_ids"].shape[1] - 10
    head.attach(gm.model, gm.model.config.text_config.hidden_size, slots=0, threshold=0.5)
    gm.model.eval()
    with torch.no_grad():
        losses = [float(box_head_loss(BoxObjective(gm.model), batches[text], 4, 1, 2.0, 0.0)) for text in (True, False)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_a_batch_holds_every_true_box_of_each_phrase_and_none_for_a_no_target_one(synth_single, small_model):
    gm = load_model(small_model)
    from groundtune.data.records import read_samples
    from groundtune.data.samples import FileSamples

    records = read_samples(synth_single / "train.jsonl")[:3]
    records[0] = {k: v for k, v in records[0].items() if k != "bbox"} | {"bboxes": []}
    records[1] = {k: v for k, v in records[1].items() if k != "bbox"} | {"bboxes": [records[1]["bbox"], [0, 0, 56, 28]]}
    samples = FileSamples(records, str(synth_single / "train.jsonl"))
    data = GroundingDataset(samples, gm.processor, gm.family, gm.resize, gm.prompt, box_target=True)
    batch = Collate(gm.processor.pad_token_id)([data[(i, i)] for i in range(3)])
    assert batch["box_count"].tolist() == [0, 2, 1] and batch["box_target"].shape == (3, 2, 4)
    width, height = records[1]["width"], records[1]["height"]
    assert batch["box_target"][1, 1].tolist() == pytest.approx([0, 0, 56 / width, 28 / height])
    assert batch["box_target"][2, 0].tolist() == pytest.approx(boxes.to_unit(records[2]["bbox"], (width, height)))


def test_head_settings_are_checked():
    with pytest.raises(ConfigError, match="head='boxes'"):
        TrainConfig(train_data="x", head="boxes")
    with pytest.raises(ConfigError, match="head_l1_weight"):
        TrainConfig(train_data="x", head="box", head_l1_weight=-1)
    with pytest.raises(ConfigError, match="head_slots=-1 must be 0 or more"):
        TrainConfig(train_data="x", head="box", head_slots=-1)
    with pytest.raises(ConfigError, match=r"head_threshold=1.5 must be in \[0, 1\]"):
        TrainConfig(train_data="x", head="box", head_threshold=1.5)
    # the head alone may train: every part of the model frozen
    TrainConfig(train_data="x", head="box", method="full", freeze_vision=True, freeze_merger=True, freeze_llm=True)
    with pytest.raises(ConfigError, match="trains nothing"):
        TrainConfig(train_data="x", method="full", freeze_vision=True, freeze_merger=True, freeze_llm=True)


def test_phrases_asked_of_one_image_share_its_vision_pass_and_get_the_same_boxes(small_model):
    gm = infer.load(small_model, device="cpu")  # as eval, predict and serve load it: our attention installed
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
        assert np.array(p.boxes) == pytest.approx(np.array(q.boxes), abs=1e-3) and p.scores == pytest.approx(q.scores)


def test_a_box_head_run_starts_from_the_head_its_model_brings(tmp_path, small_model, capsys):
    """A text model may bring a box head pre-trained with it (``box_head_pretrained.safetensors``, as
    tiny does): its answers stay text, and a ``head=box`` run on it starts from that head where the
    layout is the one asked for (a new head otherwise, said); a box-head model's own head is where a
    run on it starts."""
    import shutil

    from groundtune.models import loading
    from groundtune.models.box_head import save_head
    from groundtune.train.sft import _setup_model

    folder = tmp_path / "model"
    shutil.copytree(small_model, folder)
    gm = load_model(str(folder), device="cpu")
    brought = head.attach(gm.model, adapt.hidden_size(adapt.base_model(gm.model)), slots=0, threshold=0.3)
    with torch.no_grad():  # weights no new head would draw
        for p in brought.parameters():
            p.add_(torch.randn_like(p))
    save_head(brought, folder / head.PRETRAINED_FILE)
    assert loading.box_head_start(str(folder)) == folder / head.PRETRAINED_FILE
    assert head.head_of(infer.load(str(folder)).model) is None  # not used for answers

    _, model = _setup_model(TrainConfig(model=str(folder), train_data="synth:every", head="box", head_slots=0,
                                             head_threshold=0.6))
    started = head.head_of(model)
    assert "starting from" in capsys.readouterr().out and started.threshold == 0.6  # the run's own threshold
    for (name, p), q in zip(started.state_dict().items(), brought.state_dict().values()):
        assert torch.equal(p, q.float()), name
    assert all(p.requires_grad and p.dtype == torch.float32 for p in started.parameters())

    _, model = _setup_model(TrainConfig(model=str(folder), train_data="synth:every", head="box", head_slots=3))
    assert head.head_of(model).slots.shape[0] == 3 and "another layout" in capsys.readouterr().out
    # a box-head model (groundtune.json: head box): a run on it goes on from its own head
    (folder / head.PRETRAINED_FILE).rename(folder / head.HEAD_FILE)
    assert head.start_file(folder, {"head": "box"}) == folder / head.HEAD_FILE
    assert head.start_file(folder, {}) is None
    # a head file cut short: one error naming it, before any step
    (folder / head.PRETRAINED_FILE).write_bytes((folder / head.HEAD_FILE).read_bytes()[:100])
    with pytest.raises(ModelError, match=f"{head.PRETRAINED_FILE}: not a box head"):
        _setup_model(TrainConfig(model=str(folder), train_data="synth:every", head="box", head_slots=0))
