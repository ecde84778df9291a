"""answer_loss is transformers' loss (mean cross-entropy over the labelled tokens) with the LM head
run on the answer positions only: same value, same gradients, on every family and through LoRA."""

import pytest
import torch

from groundtune.config import TrainConfig
from groundtune.data import synth
from groundtune.models import adapt, qwen, speedups
from groundtune.models.loading import load_model
from groundtune.train.batches import encode_sample
from groundtune.train.objective import answer_loss, answer_tokens, weigh_samples


def _batch(gm):
    encoded = []
    for i, size in enumerate([(112, 112), (168, 84), (84, 140)]):  # different lengths: right padding
        image, record = synth.make_sample(4, i, width=size[0], height=size[1])
        encoded.append(encode_sample(gm.processor, gm.family, gm.resize, gm.prompt, image, record))
    return qwen.collate(encoded, gm.processor.pad_token_id)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_answer_loss_equals_the_full_head_loss(any_family_model, method):
    gm = load_model(any_family_model, device="cpu", dtype="fp32")
    cfg = TrainConfig(train_data="x", method=method, freeze_vision=False, freeze_merger=False)
    model = adapt.prepare_for_training(gm.model, cfg)
    model.train()
    batch = _batch(gm)

    def loss_and_grads(loss_fn):
        model.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ours, our_grads = loss_and_grads(lambda: answer_loss(model, batch))
    theirs, their_grads = loss_and_grads(lambda: model(**batch, use_cache=False).loss)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert our_grads.keys() == their_grads.keys() and our_grads
    for name in their_grads:
        torch.testing.assert_close(our_grads[name], their_grads[name], rtol=1e-4, atol=1e-7)


def test_packed_batch_gives_the_padded_batch_loss(any_family_model):
    """Samples packed into one row without padding: the same loss and gradients as the padded
    batch, so attention does not cross from one sample into the next."""
    gm = load_model(any_family_model, device="cpu", dtype="fp32")
    model = adapt.prepare_for_training(gm.model, TrainConfig(train_data="x", method="lora"))
    speedups.install(model)  # packing's attention within each sample (models/attention.py)
    model.train()
    encoded = []
    for i, size in enumerate([(112, 112), (168, 84), (84, 140)]):
        image, record = synth.make_sample(4, i, width=size[0], height=size[1])
        encoded.append(encode_sample(gm.processor, gm.family, gm.resize, gm.prompt, image, record))
    padded, packed = qwen.collate(encoded, gm.processor.pad_token_id), qwen.collate_packed(encoded)
    assert packed["input_ids"].shape == (1, sum(len(e["input_ids"]) for e in encoded))  # no padding
    assert "attention_mask" not in packed

    def loss_and_grads(batch):
        model.zero_grad()
        loss = answer_loss(model, batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (a, a_grads), (b, b_grads) = loss_and_grads(padded), loss_and_grads(packed)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for name in a_grads:
        torch.testing.assert_close(b_grads[name], a_grads[name], rtol=1e-4, atol=1e-7)
    # and the loss really depends on the boundaries: the same row read as one sequence gives another loss
    total = packed["input_ids"].shape[1]
    joined = dict(packed, cu_seq_lens_q=torch.tensor([0, total], dtype=torch.int32), max_length_q=total)
    assert not torch.allclose(answer_loss(model, joined).detach(), a)


def _three_answers(model):
    """``model`` (our attention, fp32) and three encoded samples of synth's every task whose
    answers differ in length: one box, none, two boxes."""
    gm = load_model(model, device="cpu", dtype="fp32")
    speedups.install(gm.model)
    encoded = []
    for i in (1, 2, 0):  # one box, none, two boxes
        image, record = synth.make_sample(3, i, task="every")
        encoded.append(encode_sample(gm.processor, gm.family, gm.resize, gm.prompt, image, record, answer_label=False))
    return gm, encoded


def test_loss_per_sample_is_the_mean_of_each_answers_own_mean(small_model):
    """loss_per=sample: a set of three answers of different lengths (one box, none, two boxes),
    padded or packed, gives the mean of the three answers' own mean NLLs, not the token mean."""
    gm, encoded = _three_answers(small_model)
    lengths = [int((e["labels"] != qwen.IGNORE_INDEX).sum()) for e in encoded]
    assert len(set(lengths)) == 3, lengths  # answers of three lengths, or the test proves nothing
    with torch.no_grad():
        own_means = torch.stack([answer_loss(gm.model, qwen.collate([e], gm.processor.pad_token_id))
                                 for e in encoded])
        for batch in (qwen.collate(encoded, gm.processor.pad_token_id), qwen.collate_packed(encoded)):
            weighted = weigh_samples(batch)
            assert answer_tokens(weighted) == 3 and answer_tokens(batch) == sum(lengths)
            torch.testing.assert_close(answer_loss(gm.model, weighted), own_means.mean(), rtol=1e-5, atol=1e-6)
            token_mean = (own_means * torch.tensor(lengths)).sum() / sum(lengths)
            torch.testing.assert_close(answer_loss(gm.model, batch), token_mean, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(own_means.mean(), token_mean)


def test_loss_per_first_puts_half_of_each_answers_weight_on_its_first_token(small_model):
    """loss_per=first: the token mean, except that each answer's first token (``[`` for none,
    ``[{"`` for boxes) carries half of its answer's weight; checked against each token's NLL from
    the model's own logits, padded and packed alike."""
    import torch.nn.functional as F

    gm, encoded = _three_answers(small_model)
    expected, total = 0.0, 0
    with torch.no_grad():
        for e in encoded:
            one = qwen.collate([e], gm.processor.pad_token_id)
            logits = gm.model(**{k: v for k, v in one.items() if k != "labels"}).logits[0, :-1]
            labels = one["labels"][0, 1:]
            nll = F.cross_entropy(logits.float(), labels.clamp(min=0), reduction="none")[labels != qwen.IGNORE_INDEX]
            n = len(nll)
            expected += n / 2 * nll[0] + n / 2 / (n - 1) * nll[1:].sum()
            total += n
        for batch in (qwen.collate(encoded, gm.processor.pad_token_id), qwen.collate_packed(encoded)):
            weighted = weigh_samples(batch, "first")
            assert answer_tokens(weighted) == total == answer_tokens(batch)
            torch.testing.assert_close(answer_loss(gm.model, weighted), expected / total, rtol=1e-4, atol=1e-5)
            assert not torch.allclose(answer_loss(gm.model, batch), expected / total)


def test_a_packed_batch_is_refused_where_attention_would_cross_samples(small_model):
    """Without groundtune's attention (or flash-attention) transformers' SDPA would attend across
    the samples of a packed row and train on a wrong loss without a word (2.68 instead of 0.35 on
    the tiny model): refused instead."""
    from groundtune.errors import TrainingError

    gm = load_model(small_model, device="cpu", dtype="fp32")
    image, record = synth.make_sample(4, 0)
    packed = qwen.collate_packed([encode_sample(gm.processor, gm.family, gm.resize, gm.prompt, image, record)])
    with pytest.raises(TrainingError, match="packed batch on a model whose attention would cross"):
        answer_loss(gm.model, packed)
    speedups.install(gm.model)
    assert torch.isfinite(answer_loss(gm.model, packed))


def _two_prompts(gm) -> list[dict]:
    """Two encoded prompts (no answer) of two images of different sizes, as RL samples answers to."""
    prompts = []
    for i, size in enumerate([(112, 112), (168, 84)]):
        image, record = synth.make_sample(4, i, width=size[0], height=size[1])
        prompts.append(qwen.encode(gm.processor, qwen.resize_image(image, gm.resize)[0],
                                   qwen.prompt_text(gm.processor, record["phrase"], gm.prompt)))
    return prompts


def test_answers_to_one_image_share_its_vision_pass(any_family_model):
    """RL's update: G answers to each of two prompts. Telling answer_logprobs which rows show the
    same image runs each image through the vision tower once (where the family's features enter
    the LLM only at the image tokens) and gives the same log-probabilities and gradients, the
    vision LoRA's included."""
    from groundtune.train.objective import answer_logprobs

    gm = load_model(any_family_model, device="cpu", dtype="fp32")
    cfg = TrainConfig(train_data="x", method="lora", lora_targets=["llm_attn", "vision"])
    model = adapt.prepare_for_training(gm.model, cfg)
    model.train()
    sequences, group = [], 3
    for i, prompt in enumerate(_two_prompts(gm)):
        for g in range(group):  # answers of different lengths and tokens, as sampled ones are
            sequences.append(qwen.with_answer_ids(gm.processor, prompt, [300 + 7 * g + i, 301, 302][: 1 + g]))
    batch = qwen.collate(sequences, gm.processor.pad_token_id)
    vision_rows = []
    model.base_model.model.model.visual.register_forward_hook(  # images per vision pass
        lambda module, args, kwargs, out: vision_rows.append(len(kwargs["grid_thw"])), with_kwargs=True)

    def logprobs_and_grads(image_of_row):
        model.zero_grad()
        logprobs, owner = answer_logprobs(model, batch, image_of_row)
        logprobs.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logprobs.detach(), owner, grads

    ours, our_owner, our_grads = logprobs_and_grads([0, 0, 0, 3, 3, 3])
    theirs, their_owner, their_grads = logprobs_and_grads(None)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert torch.equal(our_owner, their_owner)
    assert our_grads.keys() == their_grads.keys() and any("visual" in n for n in our_grads)
    for name in their_grads:
        torch.testing.assert_close(our_grads[name], their_grads[name], rtol=1e-4, atol=1e-6)
    shares = qwen.family(gm.family).image_features_alone
    assert len(vision_rows) == 2
    assert vision_rows[0] == (2 if shares else 6) and vision_rows[1] == 6


def test_answers_to_one_prompt_share_it_in_one_row(any_family_model):
    """RL's update: G answers to each of two prompts in ONE row (qwen.collate_answers), each
    prompt and its image run once for its answers, give the padded batch's log-probabilities and
    gradients (the vision LoRA's included), with every layer recomputed in backward: the
    recomputation attends as the forward did."""
    from groundtune.train.objective import answer_logprobs

    gm = load_model(any_family_model, device="cpu", dtype="fp32")
    cfg = TrainConfig(train_data="x", method="lora", lora_targets=["llm_attn", "llm_mlp", "vision"],
                      gradient_checkpointing=-1)
    model = adapt.prepare_for_training(gm.model, cfg)
    speedups.install(model)
    model.train()
    sequences, prompt_tokens = [], 0
    for i, prompt in enumerate(_two_prompts(gm)):
        prompt_tokens += len(prompt["input_ids"])
        # answers of different lengths; the first two of each prompt begin alike
        for answer in ([300 + i, 301, 302], [300 + i, 301], [310 + i, 305, 306, 307]):
            sequences.append(qwen.with_answer_ids(gm.processor, prompt, answer))
    padded, row = qwen.collate(sequences, gm.processor.pad_token_id), qwen.collate_answers(sequences)
    # each prompt once, then its answers' own tokens (3 + 2 + 4); each image once
    assert row["input_ids"].shape[1] == prompt_tokens + 2 * 9
    assert len(row["image_grid_thw"]) == 2

    def logprobs_and_grads(batch):
        model.zero_grad()
        logprobs, owner = answer_logprobs(model, batch)
        (logprobs * torch.linspace(1, 2, len(logprobs))).sum().backward()  # every token weighs differently
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logprobs.detach(), owner, grads

    ours, our_owner, our_grads = logprobs_and_grads(row)
    theirs, their_owner, their_grads = logprobs_and_grads(padded)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert torch.equal(our_owner, their_owner)
    assert our_grads.keys() == their_grads.keys() and any("visual" in n for n in our_grads)
    for name in their_grads:  # the shared tokens' gradients are summed in another order: fp32 rounding
        scale = float(their_grads[name].abs().max())
        torch.testing.assert_close(our_grads[name], their_grads[name], rtol=1e-4, atol=1e-4 * scale)
