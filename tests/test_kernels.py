"""The optional kernels: without liger-kernel or a GPU, kernels=auto leaves the model as it is and
kernels=liger says what is missing; compiled decoder layers compute the same loss and gradients."""

import pytest
import torch

from groundtune.config import ConfigError, TrainConfig
from groundtune.data import synth
from groundtune.data.dataset import encode_sample
from groundtune.models import adapt, kernels, qwen
from groundtune.models.loading import load_model
from groundtune.train.objective import answer_loss


def _batch(gm):
    encoded = []
    for i, size in enumerate([(112, 112), (168, 84)]):  # two lengths: padding and dynamic shapes
        image, record = synth.make_sample(5, i, width=size[0], height=size[1])
        encoded.append(encode_sample(gm.processor, gm.family, gm.resize, gm.prompt, image, record))
    return qwen.collate(encoded, gm.processor.pad_token_id)


def test_kernels_setting_is_checked():
    with pytest.raises(ConfigError, match="kernels='fast'"):
        TrainConfig(train_data="synth:full", kernels="fast")
    with pytest.raises(ConfigError, match="compile=true with kernels=auto"):
        TrainConfig(train_data="synth:full", kernels="auto", compile=True)


def test_fused_kernels_fall_back_where_liger_cannot_run():
    gm = load_model("tiny", device="cpu", dtype="fp32")
    model = adapt.prepare_for_training(gm.model, TrainConfig(train_data="x", method="lora"))
    batch = _batch(gm)
    with torch.no_grad():
        before = answer_loss(model, batch)
    assert not kernels.liger_usable(model)  # the CPU: liger-kernel is Triton, GPU only
    assert kernels.apply_fused_kernels(model, "none") is False
    assert kernels.apply_fused_kernels(model, "auto") is False
    with pytest.raises((ImportError, ValueError), match="kernels=liger needs"):
        kernels.apply_fused_kernels(model, "liger")
    with torch.no_grad():
        assert torch.equal(answer_loss(model, batch), before)  # nothing was swapped


@pytest.mark.slow
@pytest.mark.parametrize("checkpointed", [0, -1])
def test_compiled_decoder_layers_give_the_same_loss_and_gradients(checkpointed):
    """Traced by TorchDynamo and AOTAutograd (the ``aot_eager`` backend: what inductor compiles,
    without needing a C++ compiler here), with and without recomputed layers."""
    gm = load_model("tiny", device="cpu", dtype="fp32")
    cfg = TrainConfig(train_data="x", method="lora", gradient_checkpointing=checkpointed)
    model = adapt.prepare_for_training(gm.model, cfg)
    model.train()
    batch = _batch(gm)

    def loss_and_grads():
        model.zero_grad()
        loss = answer_loss(model, batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager, eager_grads = loss_and_grads()
    torch._dynamo.reset()
    assert kernels.compile_decoder_layers(model, backend="aot_eager") == len(adapt.decoder_layers(model))
    compiled, compiled_grads = loss_and_grads()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the compiled code ran
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    assert compiled_grads.keys() == eager_grads.keys() and compiled_grads
    for name in eager_grads:
        torch.testing.assert_close(compiled_grads[name], eager_grads[name], rtol=1e-4, atol=1e-6)
