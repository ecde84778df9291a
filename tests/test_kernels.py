"""The kernels: fused LoRA layers and the padded vision MLP compute what peft's and transformers'
layers compute; without liger-kernel or a GPU, kernels=auto leaves the model as it is and
kernels=liger says what is missing; compiled decoder layers compute the same loss and gradients,
compiled vision blocks the same features and answers."""

import pytest
import torch

from groundtune.config import ConfigError, TrainConfig
from groundtune.data import synth
from groundtune.errors import GroundtuneError
from groundtune.models import adapt, kernels, qwen, speedups
from groundtune.models.adapt import base_model
from groundtune.models.loading import load_model
from groundtune.train.batches import encode_sample
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
    # compile and liger-kernel combine: the vision blocks are compiled, the LLM's layers fused by liger
    assert TrainConfig(train_data="synth:full", kernels="auto", compile=True).compile


@pytest.mark.slow
def test_compiled_vision_blocks_give_the_same_answers_and_features(any_family_model):
    """eval --compile (and compile=true in training) compiles every vision block, dynamic shapes:
    images of other sizes go through the same compiled code and get the features and answers
    the blocks give uncompiled (``aot_eager``: what inductor compiles, without a C++ compiler)."""
    from groundtune import infer

    gm = infer.load(any_family_model, device="cpu")
    images = [synth.make_sample(5, i, width=w, height=h)[0] for i, (w, h) in enumerate([(112, 112), (168, 84), (84, 140)])]
    phrases = ["the red circle", "the blue square", "the green triangle"]
    encoded, _ = infer.encode_prompts(gm, list(zip(images, phrases)))
    visual = base_model(gm.model).model.visual

    def features():
        with torch.no_grad():
            return [visual(e["pixel_values"], grid_thw=e["image_grid_thw"]).pooler_output for e in encoded]

    eager, eager_answers = features(), [p.raw for p in infer.predict(gm, images, phrases, max_new_tokens=8)]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    blocks = qwen.family_of(gm.model).vision_block_list(gm.model)
    assert kernels.compile_vision_blocks(gm.model, backend="aot_eager") == len(blocks)
    compiled = features()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the compiled code ran
    for ours, theirs in zip(compiled, eager):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert [p.raw for p in infer.predict(gm, images, phrases, max_new_tokens=8)] == eager_answers


def test_fused_kernels_fall_back_where_liger_cannot_run(small_model):
    gm = load_model(small_model, device="cpu", dtype="fp32")
    model = adapt.prepare_for_training(gm.model, TrainConfig(train_data="x", method="lora"))
    batch = _batch(gm)
    with torch.no_grad():
        before = answer_loss(model, batch)
    assert not kernels.liger_usable(model)  # the CPU: liger-kernel is Triton, GPU only
    assert kernels.apply_fused_kernels(model, "none") is False
    assert kernels.apply_fused_kernels(model, "auto") is False
    with pytest.raises(GroundtuneError, match="kernels=liger needs"):  # no liger-kernel, or no GPU for it
        kernels.apply_fused_kernels(model, "liger")
    with torch.no_grad():
        assert torch.equal(answer_loss(model, batch), before)  # nothing was swapped


@pytest.mark.slow
@pytest.mark.parametrize("checkpointed", [0, -1])
def test_compiled_decoder_layers_give_the_same_loss_and_gradients(checkpointed, small_model):
    """Traced by TorchDynamo and AOTAutograd (the ``aot_eager`` backend: what inductor compiles,
    without needing a C++ compiler here), with and without recomputed layers."""
    gm = load_model(small_model, device="cpu", dtype="fp32")
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


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_lora_layers_give_peft_loss_and_gradients(dtype, small_model):
    gm = load_model(small_model, device="cpu", dtype=dtype)
    model = adapt.prepare_for_training(gm.model, TrainConfig(train_data="x", method="lora"))
    adapt.keep_trainable_fp32(model)  # fp32 adapters on a bf16 base, as training runs them
    torch.manual_seed(0)
    for name, p in model.named_parameters():  # lora_B starts at 0: move it so the adapters matter
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    model.train()
    batch = _batch(gm)

    def loss_and_grads():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = answer_loss(model, batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    peft_loss, peft_grads = loss_and_grads()
    assert kernels.fuse_lora_layers(model) == 7 * len(adapt.decoder_layers(model))  # q k v o gate up down
    fused_loss, fused_grads = loss_and_grads()
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == "fp32" else {"rtol": 3e-2, "atol": 3e-3}
    torch.testing.assert_close(fused_loss, peft_loss, **tol)
    assert fused_grads.keys() == peft_grads.keys() and all("lora_" in n for n in fused_grads)
    for name in peft_grads:
        assert fused_grads[name].dtype == torch.float32
        torch.testing.assert_close(fused_grads[name], peft_grads[name], **(tol if dtype == "fp32" else
                                                                           {"rtol": 1e-1, "atol": 2e-3}))
    with torch.no_grad(), model.disable_adapter():  # peft's own paths still switch the adapters off
        off = answer_loss(model, batch)
    assert not torch.allclose(off, fused_loss.to(off.dtype))


def test_padded_vision_mlp_computes_the_same():
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

    vision = {"hidden_size": 16, "intermediate_size": 30, "hidden_act": "silu"}
    config = Qwen2_5_VLConfig(vision_config=vision).vision_config
    torch.manual_seed(0)
    mlp = Qwen2_5_VLMLP(config, bias=True).requires_grad_(False)
    x = torch.randn(5, 16)
    gate_w, gate_b, up_w, up_b, down_w = kernels._padded_weights(mlp)
    assert gate_w.shape == (32, 16) and down_w.shape == (16, 32) and not gate_w[30:].any()
    padded = torch.nn.functional.linear(mlp.act_fn(torch.nn.functional.linear(x, gate_w, gate_b))
                                        * torch.nn.functional.linear(x, up_w, up_b), down_w, mlp.down_proj.bias)
    torch.testing.assert_close(padded, mlp(x), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2)  # written in place: the copies are made again
    assert torch.equal(kernels._padded_weights(mlp)[2][:30], mlp.up_proj.weight)
    assert kernels.pad_vision_mlp(torch.nn.Sequential(mlp), "Qwen2_5_VLMLP") == 1
    torch.testing.assert_close(mlp(x), type(mlp).forward(mlp, x))  # on a CPU the module's own forward runs


def _rotations(family: str):
    """transformers' own vision and text rotations of ``family``'s modeling module (the text one
    as it was before ``kernels.fuse_rotary`` wrapped it, where it has)."""
    import importlib

    record = qwen.FAMILIES[family]
    modeling = importlib.import_module(record.modeling_module)
    text_rotation = getattr(modeling, record.text_rotary)
    return getattr(modeling, record.vision_rotary), getattr(text_rotation, "_groundtune_fused", text_rotation)


@pytest.mark.parametrize("family", sorted(qwen.FAMILIES))
def test_vision_rotation_in_the_text_layout_is_the_vision_rotation(family):
    """The fused vision rotation hands the vision tower's (tokens, heads, dim) queries and keys to
    a rope function of the language model's layout (liger-kernel's, on a GPU): here transformers'
    own text rotation stands in for it, in fp32, and must give each family's vision rotation."""
    vision_rotation, text_rotation = _rotations(family)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(37, 3, 4, 16, generator=g)  # (tokens, q/k/v, heads, dim): q, k strided views, as ours
    q, k, _ = qkv.unbind(1)
    angles = torch.randn(37, 8, generator=g)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    ours = kernels.rotate_vision_as_text(text_rotation, q, k, cos, sin)
    theirs = vision_rotation(q, k, cos, sin)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape == q.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert not torch.equal(theirs[0], q)  # it rotated


@pytest.mark.skipif(not torch.cuda.is_available(), reason="liger-kernel's rope kernel is Triton, GPU only")
def test_liger_rotations_on_the_gpu_round_as_the_rotations_they_replace(monkeypatch):
    """bf16 on a GPU: liger-kernel's rope kernel in place of the vision tower's rotation, which
    computes in fp32 and rounds once, as the kernel does (nearly every element equal), and of the
    language model's, which rounds each product and the sum to bf16 where the kernel rounds once
    (never further from the exact rotation than the original). In a model, kernels=liger routes
    both through it, and its logits are as close to the fp32 model's as with the rotations unfused."""
    pytest.importorskip("liger_kernel")
    import importlib

    import liger_kernel.transformers.rope as liger_rope

    record = qwen.FAMILIES["qwen2.5-vl"]
    modeling = importlib.import_module(record.modeling_module)
    vision_rotation, text_rotation = _rotations(record.name)
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(4096, 3, 16, 80, device="cuda", generator=g).bfloat16()
    q, k, _ = qkv.unbind(1)
    angles = torch.rand(4096, 40, device="cuda", generator=g) * 100
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    fused = kernels._fused_vision_rotary(liger_rope.liger_rotary_pos_emb, vision_rotation)(q, k, cos, sin)
    for a, b in zip(fused, vision_rotation(q, k, cos, sin)):
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
        assert (a == b).float().mean() > 0.99
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-2)
    tq, tk = (t.unflatten(0, (2, 2048)).transpose(1, 2) for t in (q, k))  # (batch, heads, length, dim)
    tcos, tsin = (t.bfloat16().unflatten(0, (2, 2048)) for t in (cos, sin))
    fused = kernels._fused_text_rotary(liger_rope.liger_rotary_pos_emb, text_rotation)(tq, tk, tcos, tsin)
    exact = text_rotation(tq.float(), tk.float(), tcos.float(), tsin.float())
    for a, b, c in zip(fused, text_rotation(tq, tk, tcos, tsin), exact):
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
        assert (a.float() - c).abs().max() <= (b.float() - c).abs().max()
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=2e-2)

    # in a model: kernels=liger sends every vision layer's rotation through the kernel and the
    # language model's through the fused function; its bf16 logits are no further from the fp32
    # model's than those of the same bf16 model with the rotations unfused
    real, vision_calls = liger_rope.liger_rotary_pos_emb, []

    def counting(q, *args, **kwargs):
        if q.shape[0] == 1:  # the vision layout, (1, heads, tokens, dim); the text batch has 2 rows
            vision_calls.append(q.shape[2])
        return real(q, *args, **kwargs)

    def logits(gm):
        batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in _batch(gm).items()}
        with torch.no_grad():
            return gm.model(**batch).logits.float()

    exact_gm = load_model("tiny", device="cuda", dtype="fp32")
    speedups.install(exact_gm.model)
    monkeypatch.setattr(kernels, "FUSED_ROTARY", False)
    exact = logits(exact_gm)
    gm = load_model("tiny", device="cuda", dtype="bf16")
    speedups.install(gm.model)  # our vision attention, whose rotation the kernel replaces
    monkeypatch.setattr(liger_rope, "liger_rotary_pos_emb", counting)
    assert kernels.apply_fused_kernels(gm.model, "liger")
    monkeypatch.setattr(liger_rope, "liger_rotary_pos_emb", real)
    assert getattr(modeling, record.text_rotary)._groundtune_fused is text_rotation
    unfused = logits(gm)
    assert not vision_calls
    monkeypatch.setattr(kernels, "FUSED_ROTARY", True)
    fused = logits(gm)
    blocks = qwen.family_of(gm.model).vision_block_list(gm.model)
    assert len(vision_calls) == len(blocks)  # one vision pass over both images
    assert not torch.equal(fused, unfused)  # the kernel computed them
    assert (fused - exact).abs().mean() <= 1.25 * (unfused - exact).abs().mean()


def test_fp8_is_refused_where_it_cannot_run(tmp_path, small_model):
    from groundtune.train.sft import train

    if not torch.cuda.is_available():  # on a CPU, before any weights load
        with pytest.raises(GroundtuneError, match="fp8=true needs a GPU with FP8 matmuls"):
            train(TrainConfig(model=small_model, train_data="synth:full", fp8=True, max_steps=1,
                              out_dir=str(tmp_path / "run")))
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
    with pytest.raises(ConfigError, match="fp8=true with method=qlora"):
        TrainConfig(train_data="synth:full", method="qlora", fp8=True)
    with pytest.raises(ConfigError, match="fp8=true with distributed=fsdp2"):
        TrainConfig(train_data="synth:full", fp8=True, distributed="fsdp2")
    gm = load_model(small_model, device="cpu", dtype="fp32")
    model = adapt.prepare_for_training(gm.model, TrainConfig(train_data="x", method="lora"))
    with pytest.raises(GroundtuneError, match="fp8=true needs a GPU with FP8 matmuls"):
        speedups.install(model, fp8=True)


def _lora_on_the_gpu():
    gm = load_model("tiny", device="cuda", dtype="bf16")
    model = adapt.prepare_for_training(gm.model, TrainConfig(train_data="x", method="lora"))
    adapt.keep_trainable_fp32(model)
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in _batch(gm).items()}
    return model, batch


def _loss_and_gradients(model, batch):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = answer_loss(model, batch)
    loss.backward()
    return loss.detach().float(), torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="liger-kernel is Triton, GPU only")
def test_fused_answer_loss_on_the_gpu_is_the_loss_it_replaces(monkeypatch):
    """kernels=liger scores the answer tokens with liger-kernel's fused linear cross-entropy: the
    same loss and LoRA gradients as the LM head's logits and cross-entropy (bf16 noise), and the
    kernel is what ran."""
    pytest.importorskip("liger_kernel")
    import liger_kernel.transformers.functional as liger_functional

    model, batch = _lora_on_the_gpu()
    speedups.install(model, "liger")
    real, calls = liger_functional.liger_fused_linear_cross_entropy, []
    monkeypatch.setattr(liger_functional, "liger_fused_linear_cross_entropy",
                        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    monkeypatch.setattr(kernels, "FUSED_LOSS", False)
    loss, grads = _loss_and_gradients(model, batch)
    assert not calls
    monkeypatch.setattr(kernels, "FUSED_LOSS", True)
    fused_loss, fused_grads = _loss_and_gradients(model, batch)
    tokens = int((batch["labels"][:, 1:] != -100).sum())
    assert calls == [(tokens, base_model(model).config.text_config.hidden_size)]  # the answer tokens alone
    torch.testing.assert_close(fused_loss, loss, rtol=1e-2, atol=0)
    assert _relative(fused_grads, grads) < 0.02


def test_fp8_lora_layer_computes_what_the_bf16_one_does_up_to_fp8_rounding():
    """The float8 function against the fused LoRA function on the same inputs (float8 matmuls run
    on the CPU too, slowly): output and every gradient within FP8's rounding (e4m3 keeps 3 bits of
    mantissa: a few percent of the norm); the adapters' gradients, which never meet the base weight, exact."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=g).bfloat16()  # 37 tokens: no multiple of 16, as a packed row
    weight, bias = torch.randn(48, 64, generator=g).bfloat16(), torch.randn(48, generator=g).bfloat16()
    lora_a, lora_b = torch.randn(8, 64, generator=g) * 0.1, torch.randn(48, 8, generator=g) * 0.1
    grad = torch.randn(37, 48, generator=g).bfloat16()

    def run(base):
        inputs = [t.clone().requires_grad_(t is not weight and t is not bias)
                  for t in (x, weight, bias, lora_a, lora_b)]
        out = kernels._LoraLinear.apply(*inputs, 2.0, base)
        out.backward(grad)
        return [out.float()] + [inputs[i].grad.float() for i in (0, 3, 4)]

    errors = [_relative(got, want) for got, want in zip(run(kernels.FP8), run(kernels.BF16))]
    assert errors[0] < 0.05  # the output, through e4m3 (3 bits of mantissa)
    assert errors[1] < 0.1  # the input's gradient, through the e5m2 gradient (2 bits of mantissa)
    assert errors[2] == errors[3] == 0  # the adapters' gradients never pass through the base's float8 products


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 matmuls need a GPU of compute capability 8.9 or later")
def test_fp8_matmuls_on_the_gpu_train_as_bf16_does(monkeypatch):
    """fp8=true puts every LoRA layer's base products in float8 (every projection of the language
    model): the loss and gradients of a step stay within FP8's rounding of bf16's, and a few
    steps lower the loss as bf16's do. The targets are shifted to other tokens: the tiny model
    answers its own synthetic task almost exactly (a loss near 0.002, where any rounding is a
    large share), and a target it must still learn shows whether the steps learn."""
    model, batch = _lora_on_the_gpu()
    vocab = base_model(model).config.text_config.vocab_size
    batch["labels"] = torch.where(batch["labels"] == -100, batch["labels"], (batch["labels"] + 7) % vocab)
    speedups.install(model)
    loss, grads = _loss_and_gradients(model, batch)
    layers = adapt.decoder_layers(model)
    assert kernels.fp8_matmuls(model) == 7 * len(layers)  # q, k, v, o, gate, up, down of every layer
    calls = []
    counting = kernels.FP8._replace(forward=lambda x2, *a: calls.append(x2.shape) or kernels._fp8_forward(x2, *a))
    monkeypatch.setattr(kernels, "FP8", counting)
    fp8_loss, fp8_grads = _loss_and_gradients(model, batch)
    assert len(calls) == 7 * len(layers)
    torch.testing.assert_close(fp8_loss, loss, rtol=0.05, atol=0)
    assert _relative(fp8_grads, grads) < 0.2
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(5):
        optimizer.step()
        fp8_loss = _loss_and_gradients(model, batch)[0]
    assert fp8_loss < loss
