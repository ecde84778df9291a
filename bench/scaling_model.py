"""A throughput model of data-parallel training on N GPUs: Qwen2.5-VL-3B/7B, LoRA and full fine-tuning.

    python bench/scaling_model.py                         # tables; JSON to bench/results/scaling_model.json
    python bench/scaling_model.py --inter-node 8x200 --global-batch 256 --out /tmp/s.json

A model, not a measurement: no GPU, no network, no weights. Measured inputs (BENCHMARKS.md, "SFT speed
and memory, second round", one H200 capped at 24 GiB): the 3B LoRA preset 40.7 samples/s at batch 64
(runs F/G/M: 40.68-40.86), the 7B LoRA preset 22.2 samples/s at batch 16 (runs F/J; 23.3 in run H), the
loader 76 samples/s per worker (run E). Everything else (bandwidths, latencies, overlap, full
fine-tuning's speed) is an assumption, each an option below. One optimizer step on N GPUs:
    compute    = per-GPU batch / single-GPU samples/s       (every rank runs the same step)
    all-reduce = 2 (N-1)/N * gradient bytes / bus bandwidth + 2 (N-1) * per-hop latency   (ring)
    no overlap: step = compute + all-reduce  (the bound: the all-reduce after the backward, as the
                hand-written sync before distributed=ddp did);  overlap: step = compute +
                max(0, all-reduce - overlap * compute)  (DDP's buckets hide it behind the backward, at most
                the backward's share of the step).
Bus bandwidth: NVLink within a node; beyond it, the node's NICs together (see links()).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import Qwen2_5_VLTextConfig

from groundtune.families import ARCHITECTURES
from provenance import stamped

NS = (1, 2, 4, 8, 16, 32, 64)
GIB = 2**30

# The real text towers (hub config.json of Qwen/Qwen2.5-VL-{3B,7B}-Instruct: groundtune.families'
# published architectures, which --model random:qwen2.5-vl-3b builds). head_dim = hidden / heads = 128 in
# both. The vision tower is frozen in every case.
CONFIGS = {size: Qwen2_5_VLTextConfig(**ARCHITECTURES[f"qwen2.5-vl-{size}"].text,
                                      tie_word_embeddings=ARCHITECTURES[f"qwen2.5-vl-{size}"].tied)
           for size in ("3b", "7b")}


def linears(c) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's seven linears: q, k, v, o, gate, up, down."""
    h, i, hd = c.hidden_size, c.intermediate_size, c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]


def lora_params(c, r: int) -> int:
    return c.num_hidden_layers * sum(r * (a + b) for a, b in linears(c))  # A: r x in, B: out x r


def llm_params(c) -> int:
    """Every LLM weight: decoder layers (with q/k/v biases and two norms), embedding, final norm, LM head."""
    hd = c.hidden_size // c.num_attention_heads
    biases = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd
    layer = sum(a * b for a, b in linears(c)) + biases + 2 * c.hidden_size
    head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    return c.num_hidden_layers * layer + c.vocab_size * c.hidden_size + c.hidden_size + head


def links(a) -> list[tuple[str, float]]:
    """Bus bandwidth (GB/s) of each link class across nodes. NCCL runs one ring per NIC, each carrying
    its share of the data through its own NIC, so the ring's bus bandwidth is the node's NICs together
    (NCCL's maintainers: 192 GB/s on DGX-A100, 8 x 200 Gb/s), never more than NVLink's."""
    out = []
    for spec in a.inter_node:
        nics, gbit = spec.lower().rstrip("g").split("x")
        out.append((f"{nics}x{gbit}G", min(a.nvlink_gbs, int(nics) * float(gbit) / 8 * a.nic_efficiency)))
    return out


def allreduce_s(nbytes: float, n: int, bus_gbs: float, a) -> float:
    """Ring all-reduce on n GPUs; beyond one node (conservatively) every hop pays the inter-node latency."""
    if n == 1:
        return 0.0
    lat = (a.lat_intra_us if n <= a.gpus_per_node else a.lat_inter_us) * 1e-6
    return 2 * (n - 1) / n * nbytes / (bus_gbs * 1e9) + 2 * (n - 1) * lat


def table(sps1: float, grad_bytes: float, batch_for, a, state_bytes: float = 0.0) -> list[dict]:
    rows = []
    for n in NS:
        b = batch_for(n)
        if b < 1:
            continue
        compute = b / sps1  # the measured rate at another batch is an assumption (see --global-batch)
        for link, bus in [("NVLink", a.nvlink_gbs)] if n <= a.gpus_per_node else links(a):
            ar = allreduce_s(grad_bytes, n, bus, a)
            exposed = max(0.0, ar - a.overlap * compute)
            row = {"gpus": n, "link": link, "bus_gbs": bus, "batch_per_gpu": b, "global_batch": n * b,
                   "compute_ms": 1e3 * compute, "allreduce_ms": 1e3 * ar,
                   "samples_s_no_overlap": n * b / (compute + ar), "samples_s_overlap": n * b / (compute + exposed)}
            row["efficiency_no_overlap"] = row["samples_s_no_overlap"] / (n * sps1)
            row["efficiency_overlap"] = row["samples_s_overlap"] / (n * sps1)
            if state_bytes:  # weights + grads + Adam: 16 bytes/param, activations not counted
                p = state_bytes / 16
                row["state_gib_ddp"] = state_bytes / GIB
                row["state_gib_zero2"] = (4 * p + 12 * p / n) / GIB  # weights whole, grads + Adam sharded
                row["state_gib_fsdp2_zero3"] = state_bytes / n / GIB
            rows.append(row)
    return rows


def show(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    mem = "state_gib_ddp" in rows[0]
    head = "   N  link    bus GB/s  B/GPU  global  compute ms  all-reduce ms  samples/s (eff): no overlap | overlap"
    print(head + ("   state GiB/GPU: ddp  zero2  fsdp2/zero3" if mem else ""))
    for r in rows:
        line = (f"{r['gpus']:4d}  {r['link']:7s} {r['bus_gbs']:8.0f} {r['batch_per_gpu']:6d} {r['global_batch']:7d}"
                f" {r['compute_ms']:11.0f} {r['allreduce_ms']:14.1f}  {r['samples_s_no_overlap']:13.1f}"
                f" ({r['efficiency_no_overlap']:4.0%}) {r['samples_s_overlap']:8.1f} ({r['efficiency_overlap']:4.0%})")
        if mem:
            line += f" {r['state_gib_ddp']:18.1f} {r['state_gib_zero2']:6.1f} {r['state_gib_fsdp2_zero3']:12.1f}"
        print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sps-3b", type=float, default=40.7, help="measured 3B LoRA samples/s, one H200 (BENCHMARKS.md)")
    p.add_argument("--batch-3b", type=int, default=64, help="the batch it was measured at (the preset's)")
    p.add_argument("--sps-7b", type=float, default=22.2, help="measured 7B LoRA samples/s, one H200 (BENCHMARKS.md)")
    p.add_argument("--batch-7b", type=int, default=16, help="the batch it was measured at (the preset's)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nvlink-gbs", type=float, default=350.0, help="NCCL bus bandwidth within a node, GB/s (H100/H200 NVLink4)")
    p.add_argument("--inter-node", nargs="+", default=["8x400", "1x400", "1x100"],
                   help="NICs per node x Gb/s per NIC: 8x400 is an HGX H100/H200 with a 400 Gb/s NIC per GPU")
    p.add_argument("--nic-efficiency", type=float, default=0.95, help="achieved / line rate (NDR: 46-48 GB/s of 50)")
    p.add_argument("--lat-intra-us", type=float, default=5.0, help="per ring hop on NVLink")
    p.add_argument("--lat-inter-us", type=float, default=15.0, help="per ring hop across nodes")
    p.add_argument("--overlap", type=float, default=2 / 3, help="share of compute that can hide the all-reduce (the backward's)")
    p.add_argument("--full-grad-bytes", type=int, default=4, help="full fine-tuning: 4 = fp32 grads (groundtune keeps trainable weights fp32), 2 = bf16")
    p.add_argument("--full-speed", type=float, default=0.75, help="full fine-tuning's samples/s / LoRA's: the backward adds the weight gradients (4 passes instead of 3 with recompute)")
    p.add_argument("--global-batch", type=int, default=512, help="the fixed-global-batch variant (0: skip)")
    p.add_argument("--loader-per-core", type=float, default=76.0, help="loader samples/s per worker core (measured, run E: 480-640 px JPEGs)")
    p.add_argument("--out", type=Path, default=Path("bench/results/scaling_model.json"))
    a = p.parse_args()

    result = {"assumptions": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
              "models": {}, "cases": []}
    for name, c in CONFIGS.items():
        sps1, batch = (a.sps_3b, a.batch_3b) if name == "3b" else (a.sps_7b, a.batch_7b)
        lora, full = lora_params(c, a.lora_r), llm_params(c)
        lora_bytes, full_bytes = 4 * lora, a.full_grad_bytes * full  # LoRA adapters train in fp32
        result["models"][name] = {"lora_params": lora, "lora_grad_mb": lora_bytes / 1e6, "llm_params": full,
                                  "full_grad_gb": full_bytes / 1e9, "full_state_gib": 16 * full / GIB}
        print(f"\n== Qwen2.5-VL-{name.upper()}: LoRA r{a.lora_r} {lora / 1e6:.1f} M params -> {lora_bytes / 1e6:.0f} MB "
              f"of fp32 grads per step; all LLM weights {full / 1e9:.2f} B -> {full_bytes / 1e9:.1f} GB of "
              f"{'fp32' if a.full_grad_bytes == 4 else 'bf16'} grads; measured {sps1} samples/s at batch {batch} on one GPU")
        cases = [("lora", f"LoRA, batch {batch} per GPU", sps1, lora_bytes, lambda n, b=batch: b, 0.0)]
        if a.global_batch:  # smaller per-GPU batches than the measured one run less efficiently: not modelled
            what = f"LoRA, global batch {a.global_batch} fixed ({a.global_batch}/N per GPU, grad_accum where it does not fit)"
            cases.append(("lora-global", what, sps1, lora_bytes, lambda n: a.global_batch // n, 0.0))
        cases.append(("full", f"full fine-tuning, batch {batch} per GPU, at {a.full_speed:g}x LoRA's speed",
                      sps1 * a.full_speed, full_bytes, lambda n, b=batch: b, 16.0 * full))
        where = (f"NVLink {a.nvlink_gbs:g} GB/s bus bandwidth within a node of {a.gpus_per_node}; beyond, "
                 + ", ".join(f"{k} NICs per node" for k, _ in links(a)))
        for mode, what, s, nbytes, batch_for, state in cases:
            rows = table(s, nbytes, batch_for, a, state)
            show(f"{name.upper()} {what}; {where}", rows)
            result["cases"].append({"model": name, "mode": mode, "rows": rows})
        # data loading: every GPU needs its samples/s decoded, resized and encoded by its own workers
        print(f"\nloading: {sps1:.0f} samples/s per GPU needs ~{sps1 / a.loader_per_core:.1f} cores per GPU at "
              f"{a.loader_per_core:g} samples/s per core (measured, 480-640 px JPEGs); "
              f"{a.gpus_per_node * sps1 / a.loader_per_core:.0f} of a node's cores for {a.gpus_per_node} GPUs. "
              f"ASSUMED: decode scales with pixels, so 1-2 Mpx photos need ~3-6x that. (The synthetic set draws "
              f"~650 samples/s per core, BENCHMARKS.md, before the model's resize and encode: not this figure.)")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(stamped(result), indent=1) + "\n")
    n = max(NS)
    print(f"\nglobal batch N x B: {n} GPUs x {a.batch_3b} = {n * a.batch_3b:,} samples per step (3B), an optimisation "
          f"limit (learning rate, steps per epoch) before any hardware one. JSON: {a.out}")


if __name__ == "__main__":
    main()
