#!/usr/bin/env bash
# A short `groundtune train` on the real Qwen2.5-VL-3B architecture (random init) on one GPU: shows
# the loop, checkpoints, resume and memory logging work there. Also times the tiny model's training
# throughput there (the pre-training of the tiny model depends on it).
#   OUT=/tmp/out bash bench/gpu_train_smoke.sh
set -euo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
gt="python -m groundtune"
D=/tmp/smoke
$gt data synth --out $D --n 400 --seed 0 --width 640 --height 480 --task full
$gt data synth --out $D --n 16 --seed 1 --width 640 --height 480 --task full --split val
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
git log -1 --format=%H >> $OUT/gpu.txt 2>/dev/null || true
# 3B LoRA: 20 steps, STOP at a checkpoint boundary is exercised by --resume below
$gt train qwen2.5-vl-3b-lora-24gb model=random:qwen2.5-vl-3b train_data=$D/train.jsonl eval_data=$D/val.jsonl \
    out_dir=/tmp/run3b max_steps=12 grad_accum=1 save_every=6 log_every=2 eval_every=12 eval_samples=16 \
    eval_batch_size=16 warmup_steps=2 2>&1 | tee $OUT/train3b.log
ls /tmp/run3b /tmp/run3b/checkpoints /tmp/run3b/model | tee -a $OUT/train3b.log
cp /tmp/run3b/metrics.jsonl $OUT/metrics3b.jsonl
# the tiny model: training throughput with data workers
$gt data synth --out /tmp/tinyd --n 20000 --seed 0 --task full | tail -1
$gt train quickstart train_data=/tmp/tinyd/train.jsonl eval_data= out_dir=/tmp/runtiny max_steps=300 \
    batch_size=64 num_workers=12 log_every=50 save_every=0 2>&1 | tail -3
cp /tmp/runtiny/metrics.jsonl $OUT/metrics_tiny.jsonl
