"""The training objective: cross-entropy on the answer tokens, with the LM head run only there.

``model(**batch).loss`` projects EVERY position onto the vocabulary: for Qwen2.5-VL-3B a batch of 4
samples of ~470 tokens is a 4 x 470 x 151,936 logits tensor (1.1 GB in fp32, and its gradient)
and ~1.2 TFLOP, of which only the ~30 answer positions per sample carry loss. Here the language
model runs as usual, the hidden states of the labelled positions are picked out, and only those
go through the LM head: the same loss (the mean over answer tokens, as transformers computes it;
tests/test_objective.py checks value and gradients), a fraction of the memory and time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from groundtune.errors import TrainingError
from groundtune.models.adapt import base_model
from groundtune.models.attention import keeps_packed_samples_apart
from groundtune.models.qwen import IGNORE_INDEX


def answer_logprobs(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of every labelled token of ``batch`` under the model, and the batch row
    each belongs to: two 1-D tensors over the answer tokens, row-major. ``model`` is a Qwen-VL
    ForConditionalGeneration model or a PEFT wrapper."""
    core = base_model(model)
    if "cu_seq_lens_q" in batch and not keeps_packed_samples_apart(core):
        raise TrainingError("a packed batch on a model whose attention would cross its samples: install "
                            "groundtune's attention first (models.speedups.install), as groundtune train does")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    # no KV cache: nothing reuses it, and a recomputed (checkpointed) layer would extend it twice
    hidden = core.model(**inputs, use_cache=False).last_hidden_state  # (batch, length, hidden)
    targets = batch["labels"][:, 1:]  # position t predicts token t + 1
    answer = targets != IGNORE_INDEX
    logits = core.get_output_embeddings()(hidden[:, :-1][answer])  # the LM head on answer tokens only
    logprobs = -F.cross_entropy(logits.float(), targets[answer], reduction="none")
    return logprobs, answer.nonzero()[:, 0]


def answer_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled positions of ``batch`` (a training batch
    with ``labels``)."""
    return -answer_logprobs(model, batch)[0].mean()
