#!/usr/bin/env bash
# Pre-train the tiny model on one GPU with `groundtune train tiny-pretrain`: two architectures side by
# side (the GPU is mostly idle for one tiny model), each stopped cleanly (STOP file) after SECONDS.
#   OUT=/tmp/out SECONDS_PER_RUN=470 bash bench/tiny_pretrain.sh
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
gt="python -m groundtune"
T=${SECONDS_PER_RUN:-470}
D=/tmp/tp/data
t0=$(date +%s)
$gt data synth --out $D --n 400000 --seed 11 --task full | tail -1
$gt data synth --out $D --n 500 --seed 12 --task full --split val | tail -1
echo "data: $(( $(date +%s) - t0 )) s" | tee $OUT/timing.txt
python -m groundtune.models.tiny --out /tmp/tp/arch_b --hidden 192 --layers 4 --vision-layers 4
common="train_data=$D/train.jsonl eval_data=$D/val.jsonl"
$gt train tiny-pretrain $common out_dir=/tmp/tp/a > /tmp/tp/a.log 2>&1 &
$gt train tiny-pretrain $common out_dir=/tmp/tp/b model=/tmp/tp/arch_b > /tmp/tp/b.log 2>&1 &
sleep $T; touch /tmp/tp/a/STOP /tmp/tp/b/STOP
wait
for r in a b; do
  echo "== $r"; grep -a "eval Acc\|rror\|stopping" /tmp/tp/$r.log | tail -20
  last=$(ls -d /tmp/tp/$r/checkpoints/step-* | tail -1)
  tar czf $OUT/pre_$r.tgz -C /tmp/tp/$r model config.yaml metrics.jsonl -C /tmp/tp/$r checkpoints/$(basename $last)
  ls -la $OUT/pre_$r.tgz
done | tee $OUT/summary.txt
