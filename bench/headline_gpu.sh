#!/usr/bin/env bash
# The README's headline GPU figures, each bench writing its JSON (stamped by bench/provenance.py)
# into OUT: Qwen2.5-VL-3B's real architecture, random weights, one GPU capped at 24 GiB.
#
#   bash bench/headline_gpu.sh train OUT     # SFT preset against the plain loop; RL step against plain RL
#   bash bench/headline_gpu.sh infer OUT     # eval (engine against plain generate); box head against text
#
# Two stages, each well inside ten minutes on an H200. On a machine that has the tree without its
# git history, set BENCH_COMMIT (and BENCH_DIRTY=1 if the tree differed) where the copy was made.
set -euo pipefail
stage=${1:?train or infer}
out=${2:?an output folder}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
case "$stage" in
  train)
    python bench/sft_speed.py --models 3b --steps 12 --no-loader \
      --variants naive,preset:qwen2.5-vl-3b-lora-24gb --out "$out/sft_speed_3b.json"
    python bench/rl_speed.py --model 3b --steps 3 --impls plain,groundtune --out "$out/rl_speed_3b.json"
    ;;
  infer)
    python bench/eval_speed.py --models 3b --samples 256 --small-batch-too "" --engine-batches "" --no-natural \
      --out "$out/eval_speed_3b.json"
    python bench/head_speed.py --models 3b --samples 1024 --out "$out/head_speed_3b.json"
    ;;
  *) echo "stage: train or infer" >&2; exit 2 ;;
esac
