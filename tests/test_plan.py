"""groundtune plan: the model's shape counted as transformers builds it, the constants equal to a fit
of the measured file, what that file records (predicted against measured), the command line (fast,
no torch, one line and exit 2 for bad input), and batch_size=auto in train. The command line
runs in fresh processes: that it never imports torch can only be seen there."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from groundtune import families, plan
from groundtune.cli import main
from groundtune.config import TrainConfig, load_config, preset_path
from groundtune.data.records import write_samples

REPO = Path(__file__).resolve().parent.parent
CHECK = REPO / "bench" / "results" / "plan_check.json"


def _plan_check():
    """bench/plan_check.py, the script that measures and fits what the planner ships."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import plan_check
    finally:
        sys.path.remove(str(REPO / "bench"))
    return plan_check


def _meta_counts(config) -> tuple[int, int, int]:
    """(language model, vision tower, its mergers) parameters of the model transformers builds."""
    from groundtune.models import qwen

    family = qwen.family_of(config)
    with torch.device("meta"):
        model = family.transformers_class()._from_config(config)
    named = dict(model.named_parameters())
    return (sum(p.numel() for n, p in named.items() if "visual" not in n),
            sum(p.numel() for n, p in named.items() if "visual" in n),
            sum(p.numel() for n, p in named.items() if family.part_of(n) == "merger"))


@pytest.mark.parametrize("name", list(families.ARCHITECTURES))
def test_published_shapes_count_the_parameters_transformers_builds(name):
    from groundtune.models import qwen

    arch = families.ARCHITECTURES[name]
    ids = {"end_of_text": 0, "im_end": 1, "image": 2, "video": 3, "vision_start": 4, "vision_end": 5}
    config = qwen.family(arch.family).build_config(ids, arch.text, arch.vision, arch.tied)
    shape = plan.shape_of(arch.hub_id)
    assert (shape.llm_params, shape.vision_params, shape.merger_params) == _meta_counts(config)


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen3-vl"])
def test_other_families_shapes_count_their_parameters(family, tmp_path):
    from family_models import build_family_folder

    folder = build_family_folder(family, tmp_path / family)
    shape = plan.shape_of(str(folder))
    config = json.loads((Path(folder) / "config.json").read_text())
    from transformers import AutoConfig

    assert shape.family == family
    assert (shape.llm_params, shape.vision_params, shape.merger_params) == _meta_counts(
        AutoConfig.from_pretrained(folder))
    assert config["model_type"] == families.family(family).model_type


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen2-vl", "qwen3-vl"])
def test_lora_parameter_count_matches_peft(family, tmp_path):
    from family_models import build_family_folder

    from groundtune.models import adapt
    from groundtune.models.loading import load_model

    # qwen2.5-vl: the name tiny, which plan sizes from the shipped config.json (plan.shape_of)
    model = "tiny" if family == "qwen2.5-vl" else str(build_family_folder(family, tmp_path / family))
    for targets in (["llm_attn", "llm_mlp"], ["llm_attn"], ["merger"], ["vision", "llm_mlp"]):
        cfg = TrainConfig(train_data="synth:full", lora_targets=targets, lora_r=8)
        adapted = adapt.prepare_for_training(load_model(model, device="cpu").model, cfg)
        trained = sum(p.numel() for n, p in adapted.named_parameters() if p.requires_grad and "lora_" in n)
        assert plan.shape_of(model).lora_params(8, targets) == trained, targets


def test_constants_are_the_fit_of_the_measured_file():
    """plan_model.json is what bench/plan_check.py fit makes of plan_check.json's measured rows: no
    constant typed in."""
    plan_check = _plan_check()
    check = json.loads(CHECK.read_text())
    files = [REPO / "bench" / "results" / "plan" / f"measure_{k}.json"
             for k in ("3b", "3b_fused", "7b", "extra", "tiny", "3b_held_out")]
    fitted, predicted = plan_check.fit([json.loads(f.read_text()) for f in files])
    shipped = plan.load_model_file()
    assert fitted["memory"] == pytest.approx(shipped["memory"], rel=1e-6)
    assert fitted["time"] == pytest.approx(shipped["time"], rel=1e-3)
    for key in ("margin", "cuda_context_gib", "text_tokens", "answer_tokens", "answer_tokens_per_box"):
        assert fitted[key] == pytest.approx(shipped[key], rel=1e-6), key
    assert [p["predicted_peak_gib"] for p in predicted] == pytest.approx(
        [r["predicted_peak_gib"] for r in check["rows"]], rel=1e-4)


def test_the_measured_file_holds_the_targets():
    """What bench/results/plan_check.json records (BENCHMARKS.md quotes it): at least 24 measured
    configurations of the 3B and 7B over LoRA, QLoRA, full and the box head and two pixel budgets,
    each predicted within 10%; no batch the plan said fits ran out of memory under its cap, and
    twice it never fit; the presets' speed within 15%."""
    check = json.loads(CHECK.read_text())
    rows = [r for r in check["rows"] if r["model"] != "tiny"]
    assert len(rows) >= 24
    assert {r["model"] for r in rows} == {"3b", "7b"}
    assert {r["settings"]["method"] for r in rows} == {"lora", "qlora", "full"}
    assert any(r["settings"].get("head") == "box" for r in rows)
    assert len({r["tokens_per_sample"] // 25 for r in rows}) >= 2  # budgets that change the tokens
    assert all(abs(r["peak_error"]) <= 0.10 for r in rows), [(r["settings"], r["peak_error"]) for r in rows]
    verified = check["verified"]
    largest = [v for v in verified if v["role"] == "predicted largest"]
    twice = [v for v in verified if v["role"] == "twice that"]
    assert largest and all(v["status"] == "ok" and v["steps"] == 20 for v in largest)
    assert twice and all(v["status"] == "oom" for v in twice)
    assert {v["cap_gib"] for v in largest} >= {12, 16, 24}
    presets = [r for r in rows if r["speed_error"] is not None and _plan_check()._is_preset(r)]
    assert len(presets) == 3 and all(abs(r["speed_error"]) <= 0.15 for r in presets)
    assert check["summary"]["largest_peak_error"] == max(abs(r["peak_error"]) for r in rows)


def test_the_shipped_plan_agrees_with_every_capped_run():
    """Under caps of 12-40 GiB, the batch the plan gave when it was verified ran, and twice it ran
    out of memory: the shipped constants must say the first fits and the second does not, for the
    code those runs measured (their loss, fused or not), or re-run bench/plan_check.py verify."""
    plan_check = _plan_check()
    shipped, sizes = plan.load_model_file(), plan_check.bench_sizes()
    verified = json.loads(CHECK.read_text())["verified"]
    assert {v["role"] for v in verified} == {"predicted largest", "twice that"}
    for v in verified:
        shape, setting, tokens, _ = plan_check.row_counts(v, shipped, sizes)
        capped = plan.Card("cap", "cap", v["cap_gib"], None, None, emulated=True)
        largest = plan.max_batch(shape, dataclasses.replace(setting, batch_size=1), capped, tokens, shipped)
        ran = v["status"] == "ok"
        assert (v["settings"]["batch_size"] <= largest) == ran, (v["settings"], v["status"], largest)


def test_the_cpu_rows_are_predicted_from_a_fit_that_did_not_see_them():
    """The CPU's coefficients (its dense attention) come from the tiny rows marked "fit"; the "check"
    rows, other batches, budgets, recomputation and padding, are predictions, reported as they came."""
    check = json.loads(CHECK.read_text())
    tiny = [r for r in check["rows"] if r["model"] == "tiny"]
    held_out = [r for r in tiny if r["role"] == "check"]
    fitted = [r for r in tiny if r["role"] == "fit"]
    assert len(held_out) >= 5 and len(fitted) >= 5
    settings = [{k: v for k, v in r["settings"].items()} for r in fitted]
    assert not any(r["settings"] in settings for r in held_out)
    assert check["summary"]["cpu_largest_held_out_error"] == max(abs(r["peak_error"]) for r in held_out)


def _cfg(name: str, *overrides: str) -> TrainConfig:
    return load_config(TrainConfig, preset_path(name), ["train_data=synth:full", *overrides])


def test_the_card_torch_names_is_found_in_the_table():
    for name, key in (("NVIDIA GeForce RTX 4090", "rtx4090"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
                      ("NVIDIA H200", "h200"), ("Tesla T4", "t4"), ("NVIDIA L4", "l4")):
        found = plan.card_from_device(name, 24 * 2**30)
        assert found.key == key and found.memory_gib == 24, name
    unknown = plan.card_from_device("NVIDIA Future GPU", 8 * 2**30)  # the reference card's rates, its memory
    assert unknown.memory_gib == 8 and unknown.bf16_tflops == plan.card("h200").bf16_tflops


def test_the_largest_batch_fits_and_one_more_does_not():
    for name, gpu in (("qwen2.5-vl-3b-lora-24gb", "rtx4090"), ("qwen2.5-vl-7b-qlora", "l4"),
                      ("qwen2.5-vl-7b-lora-24gb", "a100-40gb")):
        result = plan.plan_run(_cfg(name), plan.card(gpu))
        best = result.plan.max_batch_size
        assert best > 0
        at = plan.plan_run(_cfg(name, f"batch_size={best}"), plan.card(gpu)).plan
        over = plan.plan_run(_cfg(name, f"batch_size={best + 1}"), plan.card(gpu)).plan
        assert at.fits and not over.fits
        assert over.peak_gib > at.peak_gib


def test_a_run_that_does_not_fit_gets_changes_that_do_ranked_by_speed():
    result = plan.plan_run(_cfg("qwen2.5-vl-7b-lora-24gb"), plan.card("rtx4080"))
    assert not result.plan.fits and result.plan.max_batch_size == 0  # bf16 7B weights alone are 15.5 GiB
    assert result.suggestions
    assert all(x.plan.fits for x in result.suggestions)
    speeds = [x.plan.samples_per_s for x in result.suggestions]
    assert speeds == sorted(speeds, reverse=True)
    assert "method=qlora" in result.suggestions[0].change


def test_the_box_heads_cells_are_counted_in_its_memory():
    """A candidate per image cell keeps (samples x image tokens x width) activations that K slots do
    not: head_slots=0 plans more memory, by the counted bytes, at the head's own width."""
    from groundtune.models import box_head

    assert plan.HEAD_WIDTH == box_head.WIDTH
    slots, cells = (plan.plan_run(_cfg("qwen2.5-vl-3b-lora-24gb", "head=box", f"head_slots={k}"),
                                  plan.card("rtx4090")).plan for k in (8, 0))
    counted = (cells.setting.batch_size * cells.tokens.image * plan.HEAD_WIDTH * 2 * plan.HEAD_CELL_TENSORS
               / plan.GIB)
    assert cells.peak_gib - slots.peak_gib == pytest.approx(counted, rel=1e-6) and counted > 0.05
    assert "box head's cells" in plan.render(plan.plan_run(
        _cfg("qwen2.5-vl-3b-lora-24gb", "head=box", "head_slots=0"), plan.card("rtx4090")))  # each part named


def test_the_fused_loss_is_planned_where_training_uses_it():
    """liger-kernel's fused loss (kernels=liger, or auto where it is installed; text answers, the
    token mean, an LM head not sharded) holds the answers' logits a chunk at a time: its memory is
    its own term, fitted from runs that had it, and the plain loss's elsewhere."""
    import importlib.util

    def setting(*overrides, device="cuda"):
        return plan.Setting.of(_cfg("qwen2.5-vl-3b-lora-24gb", *overrides), "qwen2.5-vl", device=device)

    assert setting("kernels=liger").fused_loss
    assert not setting("kernels=none").fused_loss
    assert not setting("kernels=liger", device="cpu").fused_loss
    assert not setting("kernels=liger", "loss_per=sample").fused_loss
    assert not setting("kernels=liger", "head=box").fused_loss
    assert not setting("kernels=liger", "distributed=fsdp2").fused_loss
    assert setting("kernels=auto").fused_loss == (importlib.util.find_spec("liger_kernel") is not None)
    shape = plan.shape_of("random:qwen2.5-vl-3b")
    tokens = plan.Tokens(mean=400.0, std=0.0, largest=400.0, image=300.0, answer=50.0, source="test")
    fused, plain = (plan.counts(shape, setting(f"kernels={k}"), tokens) for k in ("liger", "none"))
    assert fused["logits"] == 0 and fused["fused_logits"] == plain["logits"] > 0 and plain["fused_logits"] == 0


def test_data_image_sizes_and_boxes_change_the_plan(tmp_path):
    def data(name, size, boxes):
        records = [{"id": str(i), "image": f"{i}.jpg", "width": size[0], "height": size[1], "phrase": "a dog",
                    "bboxes": [[1, 1, 20, 20]] * boxes, "split": "train", "source": "t"} for i in range(20)]
        write_samples(tmp_path / name, records)
        return str(tmp_path / name)

    cfg = _cfg("qwen2.5-vl-3b-lora-24gb")
    small = plan.plan_run(cfg, plan.card("rtx4090"), data("small.jsonl", (320, 240), 1)).plan
    large = plan.plan_run(cfg, plan.card("rtx4090"), data("large.jsonl", (640, 480), 1)).plan
    many = plan.plan_run(cfg, plan.card("rtx4090"), data("many.jsonl", (320, 240), 5)).plan
    assert small.tokens.image * 4 == pytest.approx(large.tokens.image, rel=0.05)  # 4x the pixels
    assert large.peak_gib > small.peak_gib and large.max_batch_size < small.max_batch_size
    assert many.tokens.answer > small.tokens.answer
    assert small.samples == 20 and small.epoch_s == pytest.approx(20 / small.samples_per_s)


def test_plan_reads_the_config_files_own_train_data(tmp_path, monkeypatch, capsys):
    """groundtune plan defaults train_data only where neither the config file nor the command line
    names it: a config's data file is planned (its samples, its image sizes), the command line's
    train_data wins over the file's, and a file not made yet is planned as the default images."""
    monkeypatch.chdir(tmp_path)
    records = [{"id": str(i), "image": f"{i}.jpg", "width": 320, "height": 240, "phrase": "a dog",
                "bbox": [1, 1, 20, 20], "split": "train", "source": "t"} for i in range(7)]
    write_samples(tmp_path / "mine.jsonl", records)
    write_samples(tmp_path / "other.jsonl", records[:3])
    base = yaml.safe_load(preset_path("qwen2.5-vl-3b-lora-24gb").read_text())
    (tmp_path / "with.yaml").write_text(yaml.safe_dump({**base, "train_data": "mine.jsonl"}))
    (tmp_path / "unmade.yaml").write_text(yaml.safe_dump({**base, "train_data": "data/not-yet.jsonl"}))

    def planned(*args):
        assert main(["plan", *args, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        return out["tokens_source"], out["samples"]

    assert planned("with.yaml") == ("mine.jsonl (7 samples)", 7)
    assert planned("with.yaml", "train_data=other.jsonl") == ("other.jsonl (3 samples)", 3)
    source, samples = planned("unmade.yaml")
    assert source.startswith("COCO-sized") and "data/not-yet.jsonl is not there yet" in source and samples is None
    source, samples = planned("qwen2.5-vl-3b-lora-24gb")  # no train_data anywhere: the default stream
    assert source.startswith("COCO-sized") and "--data FILE" in source and samples is None


def test_sharding_engines_plan_per_gpu():
    shape = plan.shape_of("qwen2.5-vl-7b")
    base = plan.Setting.of(_cfg("qwen2.5-vl-7b-lora-24gb", "method=full", "freeze_vision=true"), shape.family)
    tokens = plan.data_tokens([(640, 480)], [1], shape.family, base.min_pixels, base.max_pixels,
                              plan.load_model_file(), "t")
    coef = plan.load_model_file()["memory"]
    one = plan.peak_bytes(plan.counts(shape, base, tokens), coef)[1]
    ddp = plan.peak_bytes(plan.counts(shape, dataclasses.replace(base, gpus=8), tokens), coef)[1]
    fsdp = plan.peak_bytes(plan.counts(shape, dataclasses.replace(base, gpus=8, distributed="fsdp2"), tokens), coef)[1]
    zero2 = plan.peak_bytes(plan.counts(shape, dataclasses.replace(base, gpus=8, distributed="zero2"), tokens), coef)[1]
    assert ddp == one
    assert fsdp["trained"] == pytest.approx(one["trained"] / 8) and zero2["trained"] == pytest.approx(one["trained"] / 8)
    assert zero2["weights"] == one["weights"] and fsdp["weights"] == pytest.approx(one["weights"] / 8)


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    code = ("import sys, time; from groundtune.cli import main; t = time.perf_counter(); rc = main(sys.argv[1:]); "
            "print('SECONDS', time.perf_counter() - t, file=sys.stderr); "
            "print('TORCH', 'torch' in sys.modules, file=sys.stderr); sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], check=False, capture_output=True, text=True, timeout=60)


def test_plan_answers_fast_without_torch():
    done = _run_cli("plan", "qwen2.5-vl-7b-lora-24gb", "--gpu", "rtx3090")
    assert done.returncode == 0, done.stderr
    assert "TORCH False" in done.stderr
    assert float(done.stderr.split("SECONDS")[1].split()[0]) < 2.0
    assert "FITS" in done.stdout and "RTX 3090" in done.stdout and "largest batch_size that fits" in done.stdout


def test_plan_json_for_scripts(capsys):
    assert main(["plan", "qwen2.5-vl-7b-qlora", "--gpu", "l4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"peak_gib", "fits", "max_batch_size", "samples_per_s"} <= set(out)
    assert out["fits"] is True and out["max_batch_size"] >= 8
    assert main(["plan", "qwen2.5-vl-7b-lora-24gb", "--gpu", "rtx4080", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["suggestions"]


def test_plan_explains_its_assumptions(capsys):
    assert main(["plan", "qwen2.5-vl-3b-lora-24gb", "--gpu", "rtx3090", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "plan_check.json" in out and "margin" in out and "https://" in out


@pytest.mark.parametrize("args, says", [
    (["--gpu", "rtx9999"], "unknown card"),
    (["--memory-gib", "-3"], "positive"),
    (["--data", "/no/such/file.jsonl"], "no such file"),
    (["--gpus", "0"], "--gpus"),
])
def test_plan_bad_input_is_one_line_exit_2(args, says):
    done = _run_cli("plan", "qwen2.5-vl-7b-lora-24gb", *args)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if not line.startswith(("SECONDS", "TORCH"))]
    assert len(errors) == 1 and says in errors[0], done.stderr


def test_an_unknown_model_offline_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert main(["plan", "qwen2.5-vl-3b-lora-24gb", "model=someone/not-cached", "--gpu", "rtx4090"]) == 2
    assert "local hub cache" in capsys.readouterr().err


def test_batch_size_auto_on_cpu_is_written_to_the_run(tmp_path, small_model):
    from groundtune.train.sft import train

    cfg = load_config(TrainConfig, preset_path("quickstart"),
                      [f"model={small_model}", "train_data=synth:full", f"out_dir={tmp_path / 'run'}", "max_steps=1",
                       "batch_size=auto", "eval_data=", "save_every=0", "report_to=none"])
    run = train(cfg)
    assert yaml.safe_load((run / "config.yaml").read_text())["batch_size"] == 8


def test_batch_size_must_be_a_number_or_auto():
    from groundtune.errors import ConfigError

    with pytest.raises(ConfigError, match="whole number or auto"):
        TrainConfig(train_data="synth:full", batch_size="many")
