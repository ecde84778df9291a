"""The generation engine (models/engine.py) against transformers' own ``generate``: greedy answers
token for token in fp32, for all three families, a batch of mixed image sizes and phrase lengths,
LoRA adapters merged and not; sampled answers drawn as generate draws them; an RL group's shared
prefill equal to prefilling each of its rows; and records answered in worker processes come back
in their order. The models are small random ones (tests/family_models.py), mostly with their
weights scrambled: the two paths must agree whatever the weights."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from groundtune import evaluate, infer
from groundtune.data import synth
from groundtune.models import speedups
from groundtune.models.loading import load_model

# Different sizes make prompts of different lengths (a packed row of unequal pieces, a padded batch
# for plain generate); so do the different phrases.
SIZES = [(112, 112), (168, 84), (84, 196), (224, 140), (56, 280), (140, 140)]


def _scramble(model, seed: int = 1) -> None:
    """Large random weights: answers that change with every input, so a mix-up between rows shows
    (a trained model answers these plain pictures with near-identical boxes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.25)


def _batch(gm, n: int = len(SIZES)):
    pairs = []
    for i, (w, h) in enumerate(SIZES[:n]):
        image, record = synth.make_sample(seed=3, index=i, width=w, height=h, task="multi")
        pairs.append((image, record["phrase"] + " " + "please " * i))
    return infer.encode_prompts(gm, pairs)


def _model(name: str, device: str = "cpu"):
    gm = load_model(name, device=device, dtype="fp32")
    _scramble(gm.model)
    speedups.install(gm.model)
    return gm


@pytest.fixture(scope="module")
def small(small_model):
    return _model(small_model)


def _both(gm, decoding: infer.Decoding, num_samples: int = 1, seed: int = 0):
    encoded, _ = _batch(gm)
    engine = infer.engine_for(gm)
    assert engine is not None
    torch.manual_seed(seed)
    plain = infer.plain_generate(gm, encoded, decoding, num_samples)
    torch.manual_seed(seed)
    ours = engine.generate(encoded, decoding.max_new_tokens, decoding.choose, num_samples)
    return plain, ours


def test_greedy_answers_equal_plain_generate_for_every_family(any_family_model):
    gm = _model(any_family_model)
    encoded, _ = _batch(gm)
    assert len({len(e["input_ids"]) for e in encoded}) >= len(SIZES) - 1  # really unequal prompts
    plain, ours = _both(gm, infer.Decoding.greedy(24))
    assert ours == plain
    assert len({tuple(a) for a in plain}) >= len(SIZES) - 1  # the answers depend on the input: the check has teeth


@pytest.mark.parametrize("merged", [False, True], ids=["lora", "merged"])
def test_greedy_answers_equal_plain_generate_with_lora(small_model, merged):
    from peft import LoraConfig, get_peft_model

    gm = load_model(small_model, device="cpu", dtype="fp32")
    _scramble(gm.model)
    model = get_peft_model(gm.model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "qkv", "down_proj"],
                                                init_lora_weights=False))
    if merged:
        model = model.merge_and_unload()
    gm = dataclasses.replace(gm, model=model)
    speedups.install(gm.model)
    plain, ours = _both(gm, infer.Decoding.greedy(16))
    assert ours == plain
    without = _both(_model(small_model), infer.Decoding.greedy(16))[1]
    assert ours != without  # the adapter changes the answers: the engine really runs it


def test_sampled_answers_are_drawn_as_generate_draws_them(small):
    """Same seed, same settings: the same draws (temperature, top-k and top-p by transformers' own
    warpers, in generate's order), G answers per prompt, rows prompt by prompt."""
    decoding = infer.Decoding.sampled(16, temperature=1.3, top_p=0.9, top_k=50)
    plain, ours = _both(small, decoding, num_samples=3, seed=7)
    assert ours == plain
    assert len({tuple(a) for a in ours[:3]}) > 1  # a group's answers differ


def test_a_group_shares_its_prefill(small):
    """A prompt prefilled once for its G rows answers as G copies of it prefilled one each."""
    encoded, _ = _batch(small, 2)
    engine = infer.engine_for(small)
    decoding = infer.Decoding.sampled(12, temperature=1.5)
    torch.manual_seed(3)
    shared = engine.generate(encoded, 12, decoding.choose, num_samples=4)
    torch.manual_seed(3)
    copies = engine.generate([e for e in encoded for _ in range(4)], 12, decoding.choose)
    assert shared == copies
    assert len({tuple(a) for a in shared}) > 2


def test_phrases_asked_of_one_image_share_its_prefill_and_answer_as_alone(any_family_model):
    """Prompts that show one image (the same pixels, another object too) are prefilled with their
    shared beginning once (qwen.collate_shared): the image goes through the vision tower once, and
    every answer is plain generate's for that prompt alone, in every family (Qwen3-VL's DeepStack
    features included)."""
    gm = _model(any_family_model)
    (a, record_a), (b, record_b) = (synth.make_sample(seed=5, index=i, width=w, height=h, task="multi")
                                    for i, (w, h) in enumerate([(168, 112), (112, 140)]))
    pairs = [(a, record_a["phrase"]), (b, record_b["phrase"]), (a, "the shape on the left"),
             (a.copy(), "the biggest shape of all of them"), (b, "a")]
    encoded, _ = infer.encode_prompts(gm, pairs)
    images_seen = []
    hook = gm.model.model.visual.register_forward_hook(
        lambda module, args, kwargs, out: images_seen.append(len(kwargs.get("grid_thw", args[1:2] and args[1]))),
        with_kwargs=True)
    try:
        ours = infer.engine_for(gm).generate(encoded, 20, infer.Decoding.greedy().choose)
    finally:
        hook.remove()
    assert images_seen == [2]  # two images, five phrases
    assert ours == infer.plain_generate(gm, encoded, infer.Decoding.greedy(20))
    assert len({tuple(x) for x in ours}) >= 4  # the answers depend on the phrase: the check has teeth


def test_rows_rounded_up_to_a_power_of_two_answer_the_same(small):
    """With graphs, a batch of 6 runs as 8 rows (copies of the last) so batches of 5 to 8 share a
    captured shape; the answers are those of the 6 rows alone."""
    encoded, _ = _batch(small)
    assert len(encoded) == 6
    engine = infer.engine_for(small)
    engine.row_buckets = True
    decoding = infer.Decoding.greedy(16)
    assert engine.generate(encoded, 16, decoding.choose) == infer.plain_generate(small, encoded, decoding)
    assert list(engine.steps) == [(8, 256)]
    assert engine.generate(encoded[:5], 16, decoding.choose) == infer.plain_generate(small, encoded[:5], decoding)
    assert list(engine.steps) == [(8, 256)]  # the same shape served both


def test_top_k_1_sampling_is_greedy(small):
    greedy = _both(small, infer.Decoding.greedy(12))[1]
    assert _both(small, infer.Decoding.sampled(12, temperature=1.0, top_k=1), seed=5)[1] == greedy


def test_rows_stop_at_their_own_end(small):
    """A row that has answered is padded while the others go on; every row has max_new_tokens ids."""
    encoded, _ = _batch(small)
    engine = infer.engine_for(small)
    stop = small.processor.eos_token_ids[0]

    def stop_in_row_0_at_step_2(logits, calls=[0]):  # noqa: B006 - counts this test's calls
        tokens = logits.argmax(dim=-1)
        calls[0] += 1
        if calls[0] == 3:
            tokens[0] = stop
        return tokens

    answers = engine.generate(encoded, 10, stop_in_row_0_at_step_2)
    assert [len(a) for a in answers] == [10] * len(SIZES)
    assert answers[0][2] == stop and set(answers[0][3:]) == {small.processor.pad_token_id}
    assert all(small.processor.pad_token_id not in a for a in answers[1:])


def test_records_come_back_in_their_order_from_worker_processes(small, tmp_path, monkeypatch):
    """Answered largest image first, in two worker processes, the predictions come back in the
    file's order: equal to answering each record alone. Some images are asked several phrases,
    lines apart in the file: encoded once, prefilled together, each answered as alone. Each batch
    is put in its row as it arrives (by the read-ahead thread, with workers); made by the engine
    instead, the same."""
    records = []
    for i, (w, h) in enumerate(SIZES):
        image, record = synth.make_sample(seed=4, index=i, width=w, height=h)
        image.save(tmp_path / f"{i}.png")
        records.append({"id": str(i), "image": f"{i}.png", **record})
    records += [{**records[i], "id": f"{i}-{n}", "phrase": phrase}
                for n, (i, phrase) in enumerate([(0, "the shape at the top"), (2, "a"), (2, "the left one, please")])]
    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    in_workers = infer.predict_records(small, records, data, batch_size=4, max_new_tokens=12, workers=2)
    alone = [infer.predict_records(small, [r], data, batch_size=1, max_new_tokens=12, workers=0)[0] for r in records]
    assert in_workers == alone
    monkeypatch.setattr(infer, "ROW_AHEAD", False)
    assert infer.predict_records(small, records, data, batch_size=4, max_new_tokens=12, workers=0) == alone
    monkeypatch.undo()
    assert len({p.raw for p in alone}) >= len(SIZES) - 1
    report, rows = evaluate.evaluate(small, records, data, batch_size=4, max_new_tokens=12, progress=False)
    assert [r["raw"] for r in rows] == [p.raw for p in alone]
    assert report["n"] == len(records)


def test_an_unreadable_record_names_its_file(small, tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a png")
    data = tmp_path / "val.jsonl"
    record = {"image": "bad.png", "phrase": "the cat"}
    with pytest.raises(infer.DataError, match="bad.png: cannot decode image"):
        infer.predict_records(small, [record], data, workers=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_graph_steps_equal_plain_generate(dtype):
    """On a GPU the decode step is a replayed CUDA graph; in fp32 its answers are plain generate's
    exactly, in bf16 (the variable-length kernel in the prefill) all but a rounding flip or two.
    The tiny model's shapes: on the small random model's, bf16 flipped more than two rows (H100)."""
    gm = load_model("tiny", device="cuda", dtype=dtype)
    _scramble(gm.model)
    speedups.install(gm.model)
    encoded, _ = _batch(gm)
    engine = infer.engine_for(gm)
    assert engine.use_graphs
    decoding = infer.Decoding.greedy(24)
    plain = infer.plain_generate(gm, encoded, decoding)
    first = engine.generate(encoded, 24, decoding.choose)
    again = engine.generate(encoded, 24, decoding.choose)  # the captured step, replayed for a new batch
    assert first == again
    same = sum(a == b for a, b in zip(first, plain))
    assert same == len(plain) if dtype == "fp32" else same >= len(plain) - 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_capture_survives_another_thread_pinning_memory(small_model):
    """eval reads the next batch into page-locked memory on a thread while the decode step of a new
    batch shape is captured; training's loader pins on its own thread around an eval. Both must go
    on (a pin during a global-mode capture failed both, on an H200)."""
    import threading

    gm = load_model(small_model, device="cuda", dtype="bf16")
    speedups.install(gm.model)
    encoded, _ = _batch(gm)
    engine = infer.engine_for(gm)
    stop, failures = threading.Event(), []

    def pin() -> None:
        while not stop.is_set():
            try:
                torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
            except Exception as e:  # noqa: BLE001 - recorded, the test fails on it
                failures.append(e)

    thread = threading.Thread(target=pin)
    thread.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a capture given up on is a failure too
            answers = engine.generate(encoded, 24, infer.Decoding.greedy(24).choose)
    finally:
        stop.set()
        thread.join()
    assert not failures and len(answers) == len(SIZES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_steps_dropped_for_room_are_captured_again(small_model, monkeypatch):
    """A server's batches come in many shapes; steps are dropped to keep their caches small. When
    every captured step is gone, the next capture must still work (a pool with no live graph
    cannot take one) and answer as before, without falling back to uncaptured steps."""
    import warnings

    from groundtune.models import engine as engine_module

    gm = load_model(small_model, device="cuda", dtype="fp32")
    _scramble(gm.model)
    speedups.install(gm.model)
    encoded, _ = _batch(gm)
    engine = infer.engine_for(gm)
    decoding = infer.Decoding.greedy(8)
    monkeypatch.setattr(engine_module, "CACHE_BYTES_KEPT", 1)  # room for one step: each new shape drops all
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a step that could not be captured warns
        first = engine.generate(encoded, 8, decoding.choose)
        fewer = engine.generate(encoded[:2], 8, decoding.choose)  # another shape: the first step is dropped
        again = engine.generate(encoded, 8, decoding.choose)  # and the first shape again, captured anew
    assert list(engine.steps) == [(8, 256)] and all(step.graph is not None for step in engine.steps.values())
    assert again == first and fewer == first[:2]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a GPU"))])
def test_finished_rows_leave_a_greedy_batch_with_or_without_graphs(small_model, device, monkeypatch):
    """Greedy rows that have answered leave the batch once at most half are still answering (on a
    GPU into the captured step of the next power of two): each answer is the one it is when every
    row runs to the end. A share of the vocabulary made to end answers scatters the rows' ends."""
    from groundtune.models.engine import Engine

    gm = _model(small_model, device)
    encoded, _ = _batch(gm)
    encoded = encoded + encoded[::-1] + encoded[:4]  # 16 rows: room to halve twice
    vocab = gm.model.get_output_embeddings().out_features
    engine = Engine(gm.model, gm.processor.pad_token_id, list(range(3, vocab, 7)) + gm.processor.eos_token_ids)
    greedy = infer.Decoding.greedy(32)
    widths, compacted = [], engine._compacted

    def recorded(step, keep, *state):  # each compaction: (the step's rows, the rows kept)
        widths.append((step.cache.keys[0].shape[0], len(keep)))
        return compacted(step, keep, *state)

    monkeypatch.setattr(engine, "_compacted", recorded)
    full = engine.generate(encoded, 32, greedy.choose)
    assert widths == []  # without compact, every row runs to the end
    ours = engine.generate(encoded, 32, greedy.choose, compact=True)
    assert ours == full
    assert len(widths) >= 2 and all(kept <= width // 2 for width, kept in widths), widths
    ends = {infer.answer_length(ids, gm.processor) for ids in full}
    assert len(ends) >= 4  # the rows end at many steps: the check has teeth
    if device == "cuda":
        assert all(step.graph is not None for step in engine.steps.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bitsandbytes' 4-bit layers and CUDA graphs need a GPU")
def test_captured_steps_on_a_4bit_qlora_base_answer_as_its_eager_steps(small_model):
    """QLoRA's evals during training and its RL rollouts decode on the NF4 base with LoRA on it:
    the engine's captured steps (finished rows leaving the batch too) answer exactly as the same
    steps issued from Python, replay after replay. Random adapters (B not zero) make the answers
    differ from row to row, so a mix-up between rows shows. (Against plain generate on the tiny
    model the H200 agreed on 3 of 6 rows, BENCHMARKS.md's history says so; bf16 rounding of the 4-bit
    kernels or a defect, not yet told apart.)"""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from groundtune.config import TrainConfig
    from groundtune.models import adapt

    gm = load_model(small_model, device="cuda", dtype="bf16", quantize_4bit=True)
    model = adapt.add_lora(gm.model, TrainConfig(model=small_model, method="qlora", train_data="unused.jsonl"))
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.eval()
    speedups.install(model)
    gm = dataclasses.replace(gm, model=model)
    encoded, _ = _batch(gm)
    greedy = infer.Decoding.greedy(24)
    eager = infer.engine_for(gm, graphs=False)
    eager.row_buckets = True  # rows rounded up as the captured steps round them: the same shapes, the same kernels
    expected = eager.generate(encoded, 24, greedy.choose, compact=True)
    assert len(set(map(tuple, expected))) >= len(expected) - 1  # the rows answer differently: the check has teeth
    engine = infer.engine_for(gm)
    assert engine.use_graphs
    first = engine.generate(encoded, 24, greedy.choose, compact=True)
    again = engine.generate(encoded, 24, greedy.choose, compact=True)
    assert all(step.graph is not None for step in engine.steps.values())
    assert first == expected and again == expected
