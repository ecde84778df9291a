"""The training objective: cross-entropy on the answer tokens, with the LM head run only there.

``model(**batch).loss`` projects EVERY position onto the vocabulary: for Qwen2.5-VL-3B a batch of 4
samples of ~470 tokens is a 4 x 470 x 151,936 logits tensor (1.1 GB in fp32, and its gradient)
and ~1.2 TFLOP, of which only the ~30 answer positions per sample carry loss. Here the language
model runs as usual, the hidden states of the labelled positions are picked out, and only those
go through the LM head: the same loss (the mean over answer tokens, as transformers computes it;
tests/test_objective.py checks value and gradients), a fraction of the memory and time. With
``loss_per=sample`` each answer token is weighted by 1 / its answer's length (``weigh_samples``)
and the loss is the mean of the samples' own means; with ``loss_per=first`` half of each answer's
weight is on its first token (none or boxes). With
``kernels=liger`` the SFT loss goes further: liger-kernel's fused linear cross-entropy makes the
answer tokens' logits a chunk at a time (``kernels.fused_answer_nll``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from groundtune.errors import TrainingError
from groundtune.models import head, kernels, qwen
from groundtune.models.adapt import base_model
from groundtune.models.attention import attached, keeps_packed_samples_apart, shares_prefixes
from groundtune.models.qwen import IGNORE_INDEX

# what a batch carries besides the model's inputs: the targets, a row of answers' layout and answer
# positions (qwen.collate_answers), the answer tokens' weights (weigh_samples)
NOT_MODEL_INPUTS = ("labels", "box_target", "box_count", "layout", "answer_index", "answer_targets", "answer_owner",
                    "token_weight")


def answer_logprobs(model, batch: dict[str, torch.Tensor],
                    image_of_row: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of every labelled token of ``batch`` under the model, and the batch row
    each belongs to: two 1-D tensors over the answer tokens, row-major. ``model`` is a Qwen-VL
    ForConditionalGeneration model or a PEFT wrapper. ``image_of_row`` (a padded batch, one
    image per row): row i shows the image of row ``image_of_row[i]``, as the G answers of an RL
    prompt do; each image then goes through the vision tower once (``qwen.shared_image_inputs``)."""
    core = base_model(model)
    return _answer_logprobs(core, hidden_states(core, batch, image_of_row), batch)


def hidden_states(core, batch: dict[str, torch.Tensor], image_of_row: list[int] | None = None) -> torch.Tensor:
    """The language model's last hidden states of ``batch`` (batch, length, hidden). A row of
    answers that share their prompts (``qwen.collate_answers``) is attended as its ``layout`` says
    (attached for the forward pass; a recomputed layer attaches it again, ``adapt``)."""
    if "cu_seq_lens_q" in batch and not keeps_packed_samples_apart(core):
        raise TrainingError("a packed batch on a model whose attention would cross its samples: install "
                            "groundtune's attention first (models.speedups.install), as groundtune train does")
    inputs = {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}
    if image_of_row is not None and qwen.family_of(core).image_features_alone:
        inputs = qwen.shared_image_inputs(core, inputs, image_of_row)
    layout = batch.get("layout")
    if layout is not None and not shares_prefixes(core):
        raise TrainingError("a row of answers that share their prompts needs groundtune's attention "
                            "(models.speedups.install)")
    with attached(layout.to(inputs["input_ids"].device)) if layout is not None else contextlib.nullcontext():
        # no KV cache: nothing reuses it, and a recomputed (checkpointed) layer would extend it twice
        return core.model(**inputs, use_cache=False).last_hidden_state


def _answer_rows(hidden: torch.Tensor,
                 batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hidden states that predict the answer tokens of ``batch`` (tokens, width), those tokens,
    and the batch row each belongs to."""
    if "answer_index" in batch:  # one row of answers (qwen.collate_answers): where each token is predicted
        return hidden[0, batch["answer_index"]], batch["answer_targets"], batch["answer_owner"]
    targets = batch["labels"][:, 1:]  # position t predicts token t + 1
    answer = targets != IGNORE_INDEX
    return hidden[:, :-1][answer], targets[answer], answer.nonzero()[:, 0]


def _answer_logprobs(core, hidden: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, targets, owner = _answer_rows(hidden, batch)
    logits = core.get_output_embeddings()(rows)  # the LM head on answer tokens only
    return -F.cross_entropy(logits.float(), targets, reduction="none"), owner


def answer_nll(model, batch: dict[str, torch.Tensor], image_of_row: list[int] | None = None) -> torch.Tensor:
    """The negative log-likelihood of ``batch``'s labelled tokens under the model, summed (the SFT
    loss's numerator): ``answer_logprobs``' sum, through liger-kernel's fused kernel where
    ``kernels`` installed it."""
    core = base_model(model)
    return _answer_nll(core, hidden_states(core, batch, image_of_row), batch)


def _answer_nll(core, hidden: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The answer tokens' negative log-likelihood, summed: liger-kernel's fused linear cross-entropy
    where ``kernels`` installed it (the logits never whole in memory), else ``_answer_logprobs``'.
    A batch with ``token_weight`` (``weigh_samples``) sums each token's NLL times its weight."""
    rows, targets, _ = _answer_rows(hidden, batch)
    lm_head = core.get_output_embeddings()
    if "token_weight" in batch:  # per-sample means: weighted, so not through the fused kernel (it only sums)
        nll = F.cross_entropy(lm_head(rows).float(), targets, reduction="none")
        return (nll * batch["token_weight"]).sum()
    fused = kernels.fused_answer_nll(core, rows, lm_head.weight, targets)
    return fused if fused is not None else F.cross_entropy(lm_head(rows).float(), targets, reduction="sum")


def answer_samples(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sample each answer token of ``batch`` belongs to (in ``_answer_rows``' order): its row of a
    padded batch, its sample of a packed row (by ``cu_seq_lens_q``) or of a row of answers."""
    if "answer_index" in batch:
        return batch["answer_owner"]
    answer = batch["labels"][:, 1:] != IGNORE_INDEX
    rows, positions = answer.nonzero().unbind(1)
    if "cu_seq_lens_q" in batch:  # one packed row: position t + 1 holds the token, its sample starts before it
        return torch.searchsorted(batch["cu_seq_lens_q"][1:].to(positions.device), positions + 1, right=True)
    return rows


def weigh_samples(batch: dict[str, torch.Tensor], per: str = "sample") -> dict[str, torch.Tensor]:
    """``batch`` with ``token_weight`` for every answer token (``loss_per``):

    - ``sample``: 1 / (its sample's answer tokens), so that the summed weighted NLL is the sum of
      the samples' mean NLLs: a ``[]`` of a few tokens then weighs as much as a six-box answer of ~100;
    - ``first``: each answer weighs its tokens, as in the token mean, but half of it is on its first
      token, the one that says "none" (``[``) or "boxes" (``[{"``), the rest shared by the others.

    Either way a sample's weights sum to what it counts for in the update's denominator (1, or its
    tokens: ``answer_tokens``)."""
    owner = answer_samples(batch)
    counts = torch.bincount(owner)[owner].float()
    if per == "sample":
        return {**batch, "token_weight": 1.0 / counts}
    first = torch.ones_like(owner, dtype=torch.bool)
    first[1:] = owner[1:] != owner[:-1]  # answer tokens come sample by sample (``_answer_rows``' order)
    weight = torch.where(first, counts / 2, counts / 2 / (counts - 1).clamp(min=1))
    return {**batch, "token_weight": torch.where(counts == 1, 1.0, weight)}


class Objective(torch.nn.Module):
    """``answer_logprobs`` of ``model`` as a module of its own: what DDP, FSDP2 and DeepSpeed wrap
    (train/parallel.py), so that their hooks run around it. Wrapping the model itself would put
    them around its own forward, which projects every position onto the vocabulary."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor], image_of_row: list[int] | None = None, summed: bool = False):
        if summed:  # the SFT loss's numerator (answer_loss): one number, which the fused kernel can give
            return answer_nll(self.model, batch, image_of_row)
        return answer_logprobs(self.model, batch, image_of_row)


class BoxObjective(torch.nn.Module):
    """Box-head mode's objective as a module (what the engines wrap, as ``Objective``): the head's
    slots for the samples of a batch (boxes and objectness logits), and with ``text``
    (``head_text_loss_weight`` > 0) the answer's log-probs from the same forward pass, else None."""

    def __init__(self, model, text: bool = False):
        super().__init__()
        self.model, self.text = model, text

    def forward(self, batch: dict[str, torch.Tensor]):
        core = base_model(self.model)
        hidden = hidden_states(core, batch)
        tokens = head.image_tokens(batch, core.config)
        boxes, logits = head.read(head.head_of(self.model), hidden, head.query_positions(batch), tokens)
        return boxes, logits, (_answer_logprobs(core, hidden, batch)[0] if self.text else None)


def box_head_loss(objective: BoxObjective, batch: dict[str, torch.Tensor], samples: int, tokens: int,
                  l1_weight: float, text_weight: float) -> torch.Tensor:
    """The head's set loss (``head.set_loss``: its slots matched to each sample's true boxes)
    summed over ``batch``'s samples and divided by ``samples`` (the update's, as ``answer_loss``
    divides by its answer tokens), plus ``text_weight`` x the answer's cross-entropy where the
    joint mode keeps the model answering in text."""
    boxes, logits, logprobs = objective(batch)
    loss = head.set_loss(boxes, logits, batch["box_target"], batch["box_count"], l1_weight).sum() / samples
    if logprobs is not None:
        loss = loss - text_weight * logprobs.sum() / tokens
    return loss


def answer_loss(model, batch: dict[str, torch.Tensor], tokens: int | None = None) -> torch.Tensor:
    """Next-token cross-entropy over the labelled positions of ``batch`` (a training batch with
    ``labels``), summed and divided by ``tokens``: the answer tokens of the whole update
    (``answer_tokens`` over its micro-batches), so that every token weighs the same however the
    update is split. By default, the mean over this batch's. ``model``: the model, or the
    ``Objective`` the ranks' engine wraps (``Parallel.objective``)."""
    wrapped = isinstance(model, Objective) or isinstance(getattr(model, "module", None), Objective)
    nll = model(batch, summed=True) if wrapped else answer_nll(model, batch)
    return nll / (tokens if tokens is not None else max(answer_tokens(batch), 1))


def answer_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The labelled positions ``answer_logprobs`` scores in ``batch`` (read from its labels, on
    whatever device they are); for a batch of ``weigh_samples``, its weights' sum (its samples
    with an answer for ``loss_per=sample``): the denominator that makes ``answer_loss`` a mean either way."""
    if "token_weight" in batch:
        return round(float(batch["token_weight"].sum()))
    if "answer_targets" in batch:
        return len(batch["answer_targets"])
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()) if "labels" in batch else 0
