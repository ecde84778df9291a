"""Every GPU benchmark's CPU smoke form runs against today's code.

The scripts under bench/ measure on a GPU; each also runs on a small model on a CPU with the
fewest samples and steps (the smoke form its docstring shows): the small random model's folder
where the script takes a folder, the tiny model where it takes only its own names (3b, 7b, tiny).
Here each runs so, in its own process as a user starts it, and must write a JSON stamped with its
provenance (command, commit, date, device, library versions: bench/provenance.py) and the rows of
every stage it has. The figures mean nothing on a CPU; what is tested is that no stage of a bench
has rotted (eval_speed's breakdown once crashed where nothing ran it). The benches' refusals of their arguments, which
end before any work, run each script as ``__main__`` in this process (tests/cli_in_process.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_in_process import script as run_script

ROOT = Path(__file__).resolve().parent.parent
STAMP = {"command", "commit", "date", "device", "versions"}
MODEL = "<small model>"  # replaced by the small random model's folder
# script -> (its smoke arguments, the rows it must write: variants, or keys of its result)
SMOKE = {
    "sft_speed": (["--models", MODEL, "--steps", "2", "--samples", "16", "--loader-seconds", "0.5",
                   "--variants", "naive,gt-b4-no-ckpt,preset:quickstart,preset:quickstart+loss=unfused"],
                  {"naive", "gt-b4-no-ckpt", "preset:quickstart", "preset:quickstart+loss=unfused"}),
    "eval_speed": (["--models", MODEL, "--samples", "24", "--plain-samples", "16", "--batch", "8"],
                   {"plain", "predict-before", "engine", "engine-one-token", "engine-rotary-unfused", "engine-row-inline",
                    "engine-eager", "breakdown", "before-natural", "engine-natural", "engine-natural-full-width",
                    "mean_answer_tokens"}),
    "head_speed": (["--models", MODEL, "--samples", "16", "--batch", "8", "--compile"],
                   {"text", "box", "box_vs_text", "box_compiled", "box_compiled_vs_box"}),
    "rl_speed": (["--model", MODEL, "--steps", "2", "--prompts", "2", "--group", "4", "--new-tokens", "16"],
                 {"impl", "rollouts_per_s"}),
    "memory_probe": (["--model", MODEL, "--batch", "2"], {"stages"}),
    "tiny_breakdown": ([MODEL, "--n", "20"], {MODEL}),
    "tiny_swap": ([MODEL, "--n", "4"], {MODEL}),
    "tiny_offset": ([MODEL, "--n", "2", "--answer-label"], {MODEL}),
    "tiny_step_profile": (["--model", MODEL, "--batch", "4", "--workers", "1", "--loader-seconds", "0.5"],
                          {"ladder", "step_s", "full forward ms", "top_ops"}),
    "plan_check": (["measure", "--models", "tiny", "--samples", "16", "--limit", "1"], {"rows", "data"}),
    "serve_connections": (["--model", MODEL, "--connections", "40", "--holders", "2", "--hold-s", "1", "--settle-s",
                           "1", "--attacks", "once"], {"connections", "targets", "runs"}),
    # random weights never stop: answers cut at 16 tokens
    "serve_openai": (["--model", MODEL, "--requests", "8", "--concurrency", "2", "--batch-size", "4",
                      "--max-new-tokens", "16"], {"runs"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("script", SMOKE)
def test_bench_smoke_form_runs_and_stamps_its_json(script, small_model, tmp_path):
    arguments, expected = SMOKE[script]
    arguments = [small_model if a == MODEL else a for a in arguments]
    expected = {small_model if e == MODEL else e for e in expected}
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"), *arguments, "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert STAMP <= set(result["provenance"]), result["provenance"]
    assert result["provenance"]["command"].startswith(f"python bench/{script}.py ")
    rows = result.get("results", result)
    if isinstance(rows, list):  # one row per variant (or per implementation, per model)
        seen = {row.get("variant") for row in rows} | {key for row in rows for key in row}
    else:
        seen = set(rows)
    assert expected <= seen, (expected - seen, rows)


@pytest.mark.slow
def test_the_trl_peer_variant_trains_the_same_samples(tmp_path):
    """sft_speed's TRL variant (its SFTTrainer, the documented VLM recipe) on the tiny model: it
    trains and its first loss is groundtune's on the same samples, same answers, same LoRA init
    (the same objective; only the speed may differ). transformers' Qwen-VL processor needs
    torchvision, which has no build for this CPU torch: where it is missing, the GPU run checks it."""
    for needed in ("trl", "datasets", "torchvision"):
        pytest.importorskip(needed)
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "sft_speed.py"), "--models", "tiny", "--steps", "3",
                           "--samples", "16", "--no-loader", "--variants", "trl:4,gt-b4-ckpt-all", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = {row["variant"]: row for row in json.loads(out.read_text())["results"]}
    assert "error" not in rows["trl:4"], rows["trl:4"]
    assert rows["trl:4"]["first_losses"][0] == pytest.approx(rows["gt-b4-ckpt-all"]["first_losses"][0], rel=0.02)


@pytest.mark.slow
def test_the_ms_swift_peer_variant_trains_the_same_samples(tmp_path):
    """sft_speed's ms-swift variant (`swift sft` by its own entry point) on the tiny model, with the
    packages ms-swift pins in a folder of their own (GROUNDTUNE_PEER_SITE, given to --peer-site): it
    trains groundtune's first batches to groundtune's losses (the same objective). ms-swift
    pins datasets and trl releases other than groundtune's and needs torchvision, so it is not part
    of the test install; where that folder is not given, the GPU run checks it."""
    import os

    site = os.environ.get("GROUNDTUNE_PEER_SITE")
    if not site or not (Path(site) / "swift").is_dir():
        pytest.skip("GROUNDTUNE_PEER_SITE does not name a folder holding ms-swift")
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "sft_speed.py"), "--models", "tiny", "--steps", "3",
                           "--samples", "16", "--no-loader", "--variants", "swift:4,gt-b4-ckpt-all",
                           "--peer-site", site, "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = {row["variant"]: row for row in json.loads(out.read_text())["results"]}
    assert "error" not in rows["swift:4"], rows["swift:4"]
    assert rows["swift:4"]["settings"]["peer"] == "ms-swift" and rows["swift:4"]["samples_per_s"] > 0
    assert len(rows["swift:4"]["first_losses"]) == 3
    # the same objective: only the speed may differ (its images are saved as JPEG, hence not exact)
    for theirs, ours in zip(rows["swift:4"]["first_losses"], rows["gt-b4-ckpt-all"]["first_losses"]):
        assert theirs == pytest.approx(ours, rel=0.02)


@pytest.mark.parametrize("name", ["sft_speed", "eval_speed", "head_speed"])
def test_a_data_file_that_is_not_there_is_one_line_and_exit_2(name, tmp_path):
    missing = tmp_path / "train.jsonl"
    done = run_script(ROOT / "bench" / f"{name}.py", "--data", missing, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{missing}: no such file" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("name", ["sft_speed", "eval_speed", "head_speed"])
def test_a_data_file_with_a_line_that_is_no_sample_is_one_line_and_exit_2(name, tmp_path):
    corrupt = tmp_path / "train.jsonl"
    corrupt.write_text('{"image": "a.jpg", "phrase": "a cat", "bbox": [0, 0, 4, 4]}\nnot json\n')
    done = run_script(ROOT / "bench" / f"{name}.py", "--data", corrupt, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{corrupt}:" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("name", ["sft_speed", "eval_speed", "head_speed"])
def test_a_data_file_whose_image_does_not_decode_is_one_line_and_exit_2(name, tmp_path):
    (tmp_path / "a.jpg").write_bytes(b"no jpeg")
    corrupt = tmp_path / "train.jsonl"
    corrupt.write_text('{"id": "a", "image": "a.jpg", "width": 64, "height": 64, "phrase": "a cat", '
                       '"bbox": [0, 0, 4, 4]}\n')
    done = run_script(ROOT / "bench" / f"{name}.py", "--data", corrupt, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{corrupt}:1: image_unreadable" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("switch", ["rotary", "loss"])
def test_an_unknown_bench_switch_is_one_line_and_exit_2(switch):
    done = run_script(ROOT / "bench" / "sft_speed.py", "--models", "tiny", "--variants",
                      f"preset:quickstart+{switch}=fast", cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"+{switch}= takes fused or unfused" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("arguments, says", [(["--only", "engine,enigne"], "--only: no variant enigne"),
                                             (["--stop-every", "1"], "--stop-every 1: expected 2 or more")])
def test_eval_speed_refuses_a_variant_it_lacks_and_a_rule_that_stops_at_once(arguments, says):
    done = run_script(ROOT / "bench" / "eval_speed.py", "--models", "tiny", *arguments, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    assert says in done.stderr and "Traceback" not in done.stderr


def test_the_stop_rule_ends_answers_in_the_engine(tmp_path, monkeypatch, small_model):
    """eval_speed's natural runs need answers that end at different steps on random weights: the
    rule (the end-of-turn token wherever the greedy id is a multiple of N) must reach the engine's
    decode steps, and lift off with its hook."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import eval_speed

    from groundtune.data.records import read_samples
    from groundtune.models import speedups
    from groundtune.models.loading import load_model

    gm = load_model(small_model)
    speedups.install(gm.model)  # the engine runs on groundtune's attention
    data = eval_speed.make_refcoco_like(tmp_path, 8)
    samples = read_samples(data)
    unruled = eval_speed.mean_answer_tokens(gm, samples, data, 16)
    hook = eval_speed.stop_by_rule(gm, 2)
    ruled = eval_speed.mean_answer_tokens(gm, samples, data, 16)
    hook.remove()
    assert ruled < unruled / 2, (ruled, unruled)
    assert eval_speed.mean_answer_tokens(gm, samples, data, 16) == unruled
