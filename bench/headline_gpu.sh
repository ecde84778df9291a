#!/usr/bin/env bash
# The README's headline GPU figures, each bench writing its JSON (stamped by bench/provenance.py)
# into OUT: Qwen2.5-VL-3B's real architecture, random weights, one GPU capped at 24 GiB.
#
#   bash bench/headline_gpu.sh train OUT     # SFT preset against the plain loop (and compiled); RL step
#                                            # against plain RL and the padded update; 7B QLoRA against LoRA
#   bash bench/headline_gpu.sh infer OUT     # eval 3B (engine against plain generate; answers of natural
#                                            # lengths); box head against text, one and 7 phrases per image
#   bash bench/headline_gpu.sh infer7b OUT   # eval 7B (engine against plain generate)
#   bash bench/headline_gpu.sh serve OUT     # serve 3B against eval on the same requests; the openai client
#   bash bench/headline_gpu.sh plan OUT      # plan's held-out configurations (never fitted), 3B
#   PEER_SITE=DIR bash bench/headline_gpu.sh peers OUT   # the 3B preset against TRL and ms-swift
#   bash bench/headline_gpu.sh checks OUT    # the tests that need a GPU (kernels, graphs, 4-bit bases)
#
# Each stage inside ten minutes on an H200. On a machine that has the tree without its git history,
# set BENCH_COMMIT (and BENCH_DIRTY=1 if the tree differed) where the copy was made. PEER_SITE: a
# folder holding ms-swift and the datasets/trl it pins (BENCHMARKS.md, "Peers, side by side").
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: bash bench/headline_gpu.sh train|infer|infer7b|serve|plan|peers|checks OUT" >&2
  exit 2
fi
stage=$1
out=$2
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
case "$stage" in
  train)
    python bench/sft_speed.py --models 3b --steps 12 --no-loader \
      --variants naive,preset:qwen2.5-vl-3b-lora-24gb,preset:qwen2.5-vl-3b-lora-24gb+compile=true \
      --out "$out/sft_speed_3b.json"
    python bench/rl_speed.py --model 3b --steps 3 --impls plain,groundtune-padded-update,groundtune \
      --out "$out/rl_speed_3b.json"
    python bench/sft_speed.py --models 7b --steps 12 --no-loader \
      --variants preset:qwen2.5-vl-7b-lora-24gb,preset:qwen2.5-vl-7b-qlora --out "$out/sft_speed_7b_qlora.json"
    ;;
  serve)
    python -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path
from sft_speed import make_refcoco_like; make_refcoco_like(Path('/tmp/serve_data'), 1024)"
    python bench/serve_load.py --model random:qwen2.5-vl-3b --device cuda --data /tmp/serve_data/train.jsonl \
      --requests 1024 --concurrency 128 --batch-size 64 --max-new-tokens 32 --eval-too --unbatched-requests 32 \
      --out "$out/serve_load_3b.json"
    python bench/serve_openai.py --model random:qwen2.5-vl-3b --device cuda --requests 512 --concurrency 128 \
      --batch-size 64 --max-new-tokens 32 --out "$out/serve_openai_3b.json"
    ;;
  plan)
    python bench/plan_check.py measure --models 3b --held-out --out "$out/measure_3b_held_out.json"
    ;;
  infer)
    python bench/eval_speed.py --models 3b --samples 1024 --small-batch-too "" --engine-batches "" \
      --out "$out/eval_speed_3b.json"
    python bench/head_speed.py --models 3b --samples 1024 --compile --out "$out/head_speed_3b.json"
    python bench/head_speed.py --models 3b --samples 1024 --phrases-per-image 7 --compile \
      --out "$out/head_speed_3b_k7_compiled.json"
    ;;
  infer7b)
    python bench/eval_speed.py --models 7b:32 --samples 1024 --small-batch-too "" --engine-batches "" --no-natural \
      --out "$out/eval_speed_7b.json"
    ;;
  peers)
    [ -d "${PEER_SITE:-}/swift" ] || { echo "peers: set PEER_SITE to a folder holding ms-swift" \
      "(bench/peer_swift_requirements.txt)" >&2; exit 2; }
    python bench/sft_speed.py --models 3b --steps 6 --no-loader \
      --variants preset:qwen2.5-vl-3b-lora-24gb,trl,swift --peer-site "$PEER_SITE" --variant-timeout 180 \
      --out "$out/sft_peers_3b.json"
    ;;
  checks)
    python -m pytest -q -rs tests/test_attention.py tests/test_engine.py tests/test_kernels.py tests/test_train.py \
      -k "gpu or graph or captured or 4bit or qlora or liger or fp8 or fused" \
      --junitxml "$out/gpu_tests.xml"
    ;;
  *) echo "stage: train, infer, infer7b, peers or checks" >&2; exit 2 ;;
esac
