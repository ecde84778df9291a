"""Greedy eval speed on the real Qwen2.5-VL-3B/7B architectures (random weights), end to end from
image files on disk, in ONE run: plain transformers `generate`, the previous `infer.predict` path,
and the generation engine through `groundtune eval`'s own code (`evaluate.evaluate`).

    python bench/eval_speed.py --out bench/results/eval_speed.json            # 3B (batch 64), 7B (32), 24 GiB cap
    python bench/eval_speed.py --models tiny --samples 24 --batch 8          # CPU smoke test of this script
    python bench/eval_speed.py --models 3b --only before-natural,engine-natural,engine-natural-full-width

Data: RefCOCO-like JPEGs (bench/sft_speed.py: long side 480-640, aspect 0.5-2, 3-8 word phrases).
Every variant reads the same files and is timed from the first file read to the last box parsed
(the model already loaded). The engine's variants answer all --samples (1024: an eval set has
thousands, and a pipeline's first batch, which nothing overlaps, weighs on a short run); plain
generate and the loops before the engine answer the first --plain-samples (256) at the pace they
keep from their first batch. Variants:
- plain: transformers' own code, as peers evaluate: images read and encoded in the main process,
  batch of --batch left-padded, `model.generate` (its dynamic KV cache), no groundtune speed-up;
- predict-before: what `infer.predict` did before the engine: the same loop with groundtune's
  attention installed, at its default batch of 16 and at --batch;
- engine: `evaluate.evaluate(batch_size=--batch)`: encoding in DataLoader workers, images by size,
  packed prefill, static KV cache, CUDA-graph decode steps (engine-first-call: the same, timing
  the captures too); engine-eager: the same with every decode step issued from Python;
  engine-row-inline: each batch put in one row (pixels concatenated) by the engine after the
  batch before, instead of by the read-ahead thread while the GPU answers it (infer.ROW_AHEAD);
  engine-rotary-unfused: the rotary embeddings as transformers computes them (vision tower in fp32),
  not through liger-kernel's rope kernel (kernels.FUSED_ROTARY);
  engine-compiled: the engine with the vision tower compiled (eval --compile; GPU only; its first
  call, which compiles, timed apart).
Answers are forced to --new-tokens tokens (random weights seldom stop). The "natural" variants
(predict-before and engine) use a model made to stop on a rule (``stop_by_rule``: where the
greedy token's id is a multiple of --stop-every, the end-of-turn token), so rows end at different
steps, ~--stop-every tokens on average; engine-natural-full-width: the same with every row kept
to the batch's longest answer (finished rows not leaving the batch: engine.ROWS_LEAVE).
--only runs the variants it names (the model still loads and warms up once).
same_answers: the fraction of the samples both answered whose answer text equals plain generate's.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from sft_speed import earlier_samples, make_refcoco_like  # noqa: E402
from provenance import stamped, unstamped  # noqa: E402
from gpu_cap import cap_gpu_memory  # noqa: E402

from groundtune import evaluate, infer  # noqa: E402
from groundtune.data.images import load_image  # noqa: E402
from groundtune.data.records import image_path, read_samples, record_size  # noqa: E402
from groundtune.models import engine as engine_module  # noqa: E402
from groundtune.models import kernels, qwen, speedups  # noqa: E402
from groundtune.models.loading import load_model  # noqa: E402

MODELS = {"3b": "random:qwen2.5-vl-3b", "7b": "random:qwen2.5-vl-7b", "tiny": "tiny"}
# what --only may name (besides engine-bN, the engine at another batch)
VARIANTS = ("plain", "predict-before-b16", "predict-before", "engine-first-call", "engine", "engine-one-token",
            "engine-rotary-unfused", "engine-row-inline", "engine-eager", "breakdown", "profile",
            "engine-compiled-first-call", "engine-compiled", "before-natural", "engine-natural",
            "engine-natural-full-width")


def _now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


def encode_in_process(gm, chunk: list[dict], data: Path) -> tuple[list[dict], list[tuple]]:
    """Records -> encoded prompts and sizes, their files read and encoded here, one after another."""
    images = [load_image(image_path(s, data), record_size(s)) for s in chunk]
    return infer.encode_prompts(gm, list(zip(images, [s["phrase"] for s in chunk])))


def loop_in_process(gm, samples: list[dict], data: Path, batch: int, new_tokens: int) -> list[str]:
    """The loop peers (and infer.predict before the engine) run: read a batch of files, encode it
    in this process, left-pad it, transformers' generate."""
    decoding, answers = infer.Decoding.greedy(new_tokens), []
    for start in range(0, len(samples), batch):
        encoded, sizes = encode_in_process(gm, samples[start : start + batch], data)
        answers += [p.raw for _, p in infer.generate(gm, encoded, sizes, decoding, engine=None)]
    return answers


def through_eval(gm, samples: list[dict], data: Path, batch: int, new_tokens: int) -> list[str]:
    _, rows = evaluate.evaluate(gm, samples, data, batch_size=batch, progress=False, max_new_tokens=new_tokens)
    return [r["raw"] for r in rows]


def stop_by_rule(gm, every: int):
    """Make the model stop on a rule that holds whatever its weights: wherever a row's greedy
    token's id is a multiple of ``every``, the end-of-turn token takes its place (its logit set
    above the row's highest, by a hook on the LM head, so plain ``generate``, the loops and the
    engine's captured decode steps all obey it). On random weights the ids fall evenly, so answers
    end at different steps, ~``every`` tokens on average, capped by --new-tokens. (Raising the
    end-of-turn logit along the hidden states' mean direction, as this bench did before, ended no
    answer early on some runs' weights.) Returns the hook's handle."""
    stop = gm.processor.eos_token_ids[0]

    def end_where_the_rule_says(module, inputs, logits):
        top = logits.max(-1)
        logits = logits.clone()
        logits[..., stop] = torch.where(top.indices % every == 0, top.values + 1, logits[..., stop])
        return logits

    return gm.model.get_output_embeddings().register_forward_hook(end_where_the_rule_says)


def mean_answer_tokens(gm, samples: list[dict], data: Path, new_tokens: int) -> float:
    """The first 64 samples' mean greedy answer length in generated tokens, the stop token
    included (the answers' text says less: a random model's tokens may decode to nothing)."""
    encoded, _ = encode_in_process(gm, samples[:64], data)
    ids = infer.engine_for(gm).generate(encoded, new_tokens, infer.Decoding.greedy(new_tokens).choose)
    lengths = [min(infer.answer_length(row, gm.processor) + 1, len(row)) for row in ids]
    return round(sum(lengths) / len(lengths), 1)


def breakdown(gm, samples: list[dict], data: Path, batch: int, new_tokens: int) -> dict:
    """Where one batch's time goes, the images already encoded: prefill alone (one new token) and
    the whole answer, for transformers' generate and the engine (with and without graphs); and
    what the encoding workers deliver alone."""
    encoded, _ = encode_in_process(gm, samples[:batch], data)
    out = {"prompt_tokens_mean": round(sum(len(e["input_ids"]) for e in encoded) / len(encoded), 1)}

    def best_of_3(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            t0 = _now()
            fn()
            times.append(_now() - t0)
        return round(min(times), 4)

    for tokens in (1, new_tokens):
        decoding = infer.Decoding.greedy(tokens)
        with torch.inference_mode():
            out[f"generate_{tokens}_s"] = best_of_3(lambda: infer.plain_generate(gm, encoded, decoding))
            for graphs in (True, False):
                answering = engine_module.Engine(gm.model, gm.processor.pad_token_id, gm.processor.eos_token_ids,
                                                 use_graphs=graphs and torch.cuda.is_available())
                name = "engine" if graphs else "engine_eager"
                out[f"{name}_{tokens}_s"] = best_of_3(lambda: answering.generate(encoded, tokens, decoding.choose))
                answering.release()
    for name in ("generate", "engine", "engine_eager"):
        out[f"{name}_decode_step_ms"] = round((out[f"{name}_{new_tokens}_s"] - out[f"{name}_1_s"])
                                              / (new_tokens - 1) * 1000, 2)
    workers = infer.default_workers(gm.device)
    # one record a time: the dataset takes the indices of records that share an image
    loader = torch.utils.data.DataLoader(infer._EncodedRecords(gm, samples, data), batch_size=None,
                                         sampler=[[i] for i in range(len(samples))],
                                         num_workers=workers, prefetch_factor=16 if workers else None)
    t0 = time.perf_counter()
    count = sum(1 for _ in loader)
    out[f"encode_per_s_{workers}_workers"] = round(count / (time.perf_counter() - t0), 1)
    print(json.dumps(out), flush=True)
    return out


def _device_us(event) -> float:
    return getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)


def profile(gm, samples: list[dict], data: Path, batch: int) -> dict:
    """GPU kernel time of one batch's prefill and of one decode step issued from Python, by kind
    (the graph replays the same kernels; the profile cannot see inside a graph)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    encoded, _ = encode_in_process(gm, samples[:batch], data)
    # the batch in its row with its pixels page-locked, as eval's read-ahead thread hands it over (a
    # pageable upload, ~50 ms for 64 photos of the 3B, would count as copies that eval does not make)
    row = qwen.collate_shared(encoded, pinned=True)
    engine = engine_module.Engine(gm.model, gm.processor.pad_token_id, gm.processor.eos_token_ids, use_graphs=False)
    greedy = infer.Decoding.greedy(1).choose
    out = {}
    for name, tokens in (("prefill", 1), ("prefill_and_4_steps", 5)):
        with torch.inference_mode():
            engine.generate(encoded, tokens, greedy, row=row)
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine.generate(encoded, tokens, greedy, row=row)
                torch.cuda.synchronize()
        kinds: dict[str, float] = {}
        count = 0
        for event in prof.key_averages():
            us = _device_us(event)
            if us <= 0:
                continue
            count += event.count
            key = event.key.lower()
            kind = ("attention" if any(w in key for w in ("flash", "fmha", "attention", "varlen", "efficient"))
                    else "gemm" if any(w in key for w in ("gemm", "cutlass", "sm90", "nvjet", "matmul"))
                    else "copy" if "memcpy" in key or "copy" in key else "elementwise/norm/other")
            kinds[kind] = kinds.get(kind, 0.0) + us / 1e6
        out[name] = {"gpu_s": round(sum(kinds.values()), 4), "kernels": count,
                     "by_kind_s": {k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}}
        if name == "prefill":  # the next lever is among these
            heaviest = sorted((e for e in prof.key_averages() if _device_us(e) > 0), key=_device_us, reverse=True)
            out["prefill_top_kernels"] = [{"kernel": e.key[:120], "calls": e.count, "ms": round(_device_us(e) / 1e3, 2)}
                                          for e in heaviest[:15]]
    step = {k: round((out["prefill_and_4_steps"]["by_kind_s"].get(k, 0) - out["prefill"]["by_kind_s"].get(k, 0)) / 4 * 1000, 3)
            for k in out["prefill_and_4_steps"]["by_kind_s"]}
    out["decode_step_ms_by_kind"] = step
    out["decode_step_kernels"] = (out["prefill_and_4_steps"]["kernels"] - out["prefill"]["kernels"]) // 4
    del engine
    print(json.dumps(out), flush=True)
    return out


def run_variant(name: str, fn, gm, samples, data, batch, new_tokens, reference: list[str] | None) -> tuple[dict, list[str]]:
    _reset_peak()
    t0 = _now()
    answers = fn(gm, samples, data, batch, new_tokens)
    seconds = _now() - t0
    row = {"variant": name, "batch": batch, "new_tokens": new_tokens, "samples": len(samples),
           "seconds": round(seconds, 3), "samples_per_s": round(len(samples) / seconds, 2), "peak_gib": _peak_gib(),
           "same_answers": (round(sum(a == b for a, b in zip(answers, reference)) / min(len(answers), len(reference)), 4)
                            if reference is not None else 1.0)}
    print(json.dumps(row), flush=True)
    return row, answers


def bench_model(key: str, samples, data, args) -> list[dict]:
    rows = []

    # the loops without a pipeline answer at one pace from their first batch: they take the first
    # --plain-samples; the engine's variants take all (a pipeline fills once: a real eval set has
    # thousands); same_answers compares the samples both answered
    looped = samples[: args.plain_samples]

    def wanted(*names: str) -> bool:
        """Whether --only (empty: every variant) asks for any of ``names``."""
        return not args.only or bool(args.only & set(names))

    def add(name, fn, gm, batch, reference, new_tokens=None, **extra):
        if not wanted(name):
            return None
        subset = looped if fn is loop_in_process else samples
        try:
            row, answers = run_variant(name, fn, gm, subset, data, batch, new_tokens or args.new_tokens, reference)
        except torch.OutOfMemoryError:
            rows.append({"model": key, "variant": name, "batch": batch, "oom": True})
            print(f"{name} at batch {batch}: out of memory at {args.cap_gib:g} GiB", flush=True)
            _reset_peak()
            return None
        rows.append({"model": key, **row, **extra})
        return answers

    gm = load_model(MODELS.get(key, key), dtype=args.dtype)  # transformers' own attention, nothing installed
    try:  # warms the GPU up
        loop_in_process(gm, samples[: args.batch], data, args.batch, args.new_tokens)
    except torch.OutOfMemoryError:
        _reset_peak()  # the plain variant below says so
    reference = add("plain", loop_in_process, gm, args.batch, None)
    speedups.install(gm.model)  # what infer.load installed before the engine
    if key in args.small_batch_too:
        add("predict-before-b16", loop_in_process, gm, 16, reference)
    before = add("predict-before", loop_in_process, gm, args.batch, reference)
    kernels.apply_fused_kernels(gm.model, "auto")  # what infer.load installs now (liger-kernel on a GPU)
    add("engine-first-call", through_eval, gm, args.batch, reference)  # captures its decode steps
    answers = add("engine", through_eval, gm, args.batch, reference)
    if answers and before:
        rows[-1]["same_as_predict_before"] = round(sum(a == b for a, b in zip(answers, before)) / len(before), 4)
    # answers that end after their first token: the prefill and one step (what a model that answers
    # at once costs; the answers differ from the 32-token ones, so there is nothing to compare)
    add("engine-one-token", through_eval, gm, args.batch, None, new_tokens=1)
    kernels.FUSED_ROTARY = False  # the rotations as transformers computes them (before liger's rope kernel ran them)
    add("engine-rotary-unfused", through_eval, gm, args.batch, reference)
    kernels.FUSED_ROTARY = True
    infer.ROW_AHEAD = False  # each batch put in one row by the engine, after the batch before (as before)
    add("engine-row-inline", through_eval, gm, args.batch, reference)
    infer.ROW_AHEAD = True
    for batch in (b for b in args.engine_batches if b != args.batch):
        add(f"engine-b{batch}", through_eval, gm, batch, reference)
    engine_module.GRAPHS_ENABLED = False  # the same engine, every decode step issued from Python
    add("engine-eager", through_eval, gm, args.batch, reference)
    engine_module.GRAPHS_ENABLED = True
    if wanted("breakdown"):
        rows.append({"model": key, "variant": "breakdown", "batch": args.batch,
                     **breakdown(gm, samples, data, args.batch, args.new_tokens)})
    if torch.cuda.is_available() and wanted("profile"):
        rows.append({"model": key, "variant": "profile", "batch": args.batch, **profile(gm, samples, data, args.batch)})
    if torch.cuda.is_available() and wanted("engine-compiled-first-call", "engine-compiled"):
        kernels.compile_vision_blocks(gm.model)  # what eval --compile adds (a GPU's: inductor)
        add("engine-compiled-first-call", through_eval, gm, args.batch, reference)  # compiles
        add("engine-compiled", through_eval, gm, args.batch, reference)
    if args.natural and wanted("before-natural", "engine-natural", "engine-natural-full-width"):
        stop_by_rule(gm, args.stop_every)  # the model ends its answers from here on
        mean_length = mean_answer_tokens(gm, samples, data, args.new_tokens)
        natural = add("before-natural", loop_in_process, gm, args.batch, None, mean_answer_tokens=mean_length)
        add("engine-natural", through_eval, gm, args.batch, natural, mean_answer_tokens=mean_length)
        engine_module.ROWS_LEAVE = False  # every row runs to the batch's longest answer, as before
        add("engine-natural-full-width", through_eval, gm, args.batch, natural, mean_answer_tokens=mean_length)
        engine_module.ROWS_LEAVE = True
    del gm
    _reset_peak()
    return rows


def in_fresh_process(spec: str, data: Path, args) -> list[dict]:
    """One model's variants in a process of its own: liger-kernel patches transformers' modeling
    module process-wide, and the next model's plain variant must run transformers' own code."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, __file__, "--models", spec, "--data", str(data), "--out", str(out),
               "--new-tokens", str(args.new_tokens), "--plain-samples", str(args.plain_samples),
               "--dtype", args.dtype, "--cap-gib", str(args.cap_gib), "--small-batch-too", args.small_batch_too,
               "--engine-batches", ",".join(map(str, args.engine_batches)), "--stop-every", str(args.stop_every),
               "--only", ",".join(sorted(args.only))] + ([] if args.natural else ["--no-natural"])
        subprocess.run(cmd)
        return unstamped(json.loads(out.read_text())) if out.exists() else [{"model": spec, "variant": "-",
                                                                             "error": "no result"}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="3b,7b:32",
                        help="comma-separated: 3b, 7b, tiny or a model folder; MODEL:N times MODEL at batch N instead of --batch "
                             "(the 7B's plain generate runs out of 24 GiB at 64)")
    parser.add_argument("--data", type=earlier_samples,
                        help="samples made by an earlier run (train.jsonl) instead of new ones")
    parser.add_argument("--samples", type=int, default=1024, help="samples the engine's variants answer")
    parser.add_argument("--plain-samples", type=int, default=256,
                        help="the first samples of them that plain generate and the loops before the engine answer")
    parser.add_argument("--batch", type=int, default=64, help="batch of every variant but --engine-batches")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory cap (a 24 GB card)")
    parser.add_argument("--small-batch-too", default="3b,tiny",
                        help="models also timed the old way at batch 16 (infer.predict's default)")
    parser.add_argument("--engine-batches", default="64,128", type=lambda v: [int(b) for b in v.split(",") if b],
                        help="other batch sizes to time the engine at")
    parser.add_argument("--no-natural", dest="natural", action="store_false", help="skip the model-that-stops runs")
    parser.add_argument("--stop-every", type=int, default=20,
                        help="the natural runs' stop rule: the end-of-turn token wherever the greedy token's id is a "
                             "multiple of this (answers ~this many tokens on average)")
    parser.add_argument("--only", default="", type=lambda v: {name for name in v.split(",") if name},
                        help="comma-separated variants to run (breakdown and profile count as variants); "
                             "default: all")
    parser.add_argument("--out")
    args = parser.parse_args()
    unknown = sorted(name for name in args.only if name not in VARIANTS and not re.fullmatch(r"engine-b\d+", name))
    if unknown:
        parser.error(f"--only: no variant {', '.join(unknown)}; the variants: {', '.join(VARIANTS)}, engine-bN")
    if args.stop_every < 2:
        parser.error(f"--stop-every {args.stop_every}: expected 2 or more (1 would end every answer at once)")
    specs = args.models.split(",")
    if len(specs) == 1:  # only the measuring process touches the GPU
        cap_gpu_memory(args.cap_gib)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or make_refcoco_like(Path(tmp), args.samples)
        samples = read_samples(data)
        for spec in specs:
            if len(specs) > 1:
                results += in_fresh_process(spec, data, args)
            else:
                key, _, batch = spec.partition(":")
                args.batch = int(batch or args.batch)
                results += bench_model(key, samples, data, args)
            if args.out:
                Path(args.out).write_text(json.dumps(stamped(results), indent=1) + "\n")
    print(f"\n{'model':6s}{'variant':16s}{'batch':>6s}{'samples/s':>11s}{'x plain':>9s}{'peak GiB':>10s}{'same':>7s}")
    for r in results:
        if r["variant"] in ("breakdown", "profile"):
            continue
        if "error" in r:
            print(f"{r['model']:6s}failed: {r['error']}")
            continue
        if r.get("oom"):
            print(f"{r['model']:6s}{r['variant']:16s}   out of memory at {args.cap_gib:g} GiB")
            continue
        base = next((b["samples_per_s"] for b in results if b["model"] == r["model"] and "samples_per_s" in b
                     and b["variant"] == ("before-natural" if "natural" in r["variant"] else "plain")), float("nan"))
        print(f"{r['model']:6s}{r['variant']:16s}{r['batch']:6d}{r['samples_per_s']:11.2f}"
              f"{r['samples_per_s'] / base:9.2f}{r['peak_gib'] or 0:10.2f}{r['same_answers']:7.3f}")
    for r in results:
        if r["variant"] == "breakdown":
            print(f"{r['model']} one batch of {r['batch']}, encoded: " + ", ".join(
                f"{k} {v}" for k, v in r.items() if k not in ("model", "variant", "batch")))
        if r["variant"] == "profile":
            print(f"{r['model']} profile: prefill {r['prefill']}; decode step (eager) {r['decode_step_kernels']} "
                  f"kernels, ms by kind {r['decode_step_ms_by_kind']}")


if __name__ == "__main__":
    main()
