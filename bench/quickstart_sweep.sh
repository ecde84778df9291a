#!/usr/bin/env bash
# Settings sweep for the quickstart (tiny model from scratch, one-shape task), several runs at once
# on one GPU: which learning-rate schedule and answer format learn fastest per sample.
#   OUT=/tmp/out bash bench/quickstart_sweep.sh
set -uo pipefail  # a run without evals must not stop the summary
export PYTHONPATH=src PYTHONUNBUFFERED=1
gt="python -m groundtune"
D=/tmp/qsd
$gt data synth --out $D --n 30000 --seed 1 --task single | tail -1
$gt data synth --out $D --n 200 --seed 2 --task single --split val | tail -1
common="train_data=$D/train.jsonl eval_data=$D/val.jsonl num_workers=2 log_every=100 save_every=0 eval_every=875"
declare -A runs=(
  [base]=""
  [lr2e-3]="lr=2e-3"
  [const]="min_lr_ratio=1.0"
  [nolabel]="answer_label=false"
  [nolabel_lr2e-3]="answer_label=false lr=2e-3"
  [b16_lr2e-3]="batch_size=16 max_steps=1750 lr=2e-3 eval_every=437"
)
for name in "${!runs[@]}"; do
  $gt train quickstart $common out_dir=/tmp/sweep/$name ${runs[$name]} > /tmp/sweep_$name.log 2>&1 &
done
wait
for name in "${!runs[@]}"; do
  echo "== $name: ${runs[$name]}"; grep "eval Acc" /tmp/sweep_$name.log | tr '\n' ' '; echo
  tail -n 3 /tmp/sweep/$name/metrics.jsonl | head -1 | cut -c1-160
done | tee $OUT/sweep.txt
