#!/usr/bin/env bash
# groundtune-tiny 2's presets, screened on one GPU from a pre-trained candidate (MODEL):
# quickstart-every in text and with the box head at a few learning rates and lengths, RL on sets from a text run, every run scored on
# bench/every_proof.py's held-out scenes; meanwhile (the GPU is mostly idle) a further
# pre-training cycle of the candidate runs beside them (`groundtune train tiny-pretrain`, STOP after
# SECONDS seconds), its model brought back in 15 MB pieces. Runs are in fp32, as on a CPU; the
# preset's step counts are what a CPU affords, so each run is its CPU recipe, only faster.
#   OUT=/tmp/out MODEL=tiny SECONDS_PER_RUN=470 bash bench/tiny2_presets.sh
set -uo pipefail
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
gt="python -m groundtune"
W=/tmp/t2p
T=${SECONDS_PER_RUN:-470}
X=${EXTRA:-}  # appended to every run's settings (a smoke run: EXTRA="max_steps=2 eval_samples=8")
N=${N_HELDOUT:-300}
mkdir -p $W $OUT
t0=$(date +%s)
# the further cycle: single objects towards 0.92 (the full task twice as often), a lower rate
$gt data synth --out $W/pval --n 500 --seed 12 --split val --task full --overwrite | tail -1
$gt train tiny-pretrain model=$MODEL eval_data=$W/pval/val.jsonl out_dir=$W/c3 overwrite=true \
  freeze_vision=false freeze_merger=true lr_vision=5e-5 lr=1.5e-4 warmup_steps=300 max_steps=5000 \
  train_data=synth:full+full+attribute+colour+every+every@112-224 answer_label=false num_workers=3 \
  eval_every=500 eval_samples=250 eval_max_new_tokens=128 save_every=500 keep_last=1 $X > $W/c3.log 2>&1 &
pretrain=$!
# quickstart-every: text at two rates and two lengths, the box head (its own rate; the LLM's lower)
$gt data synth --task every --out $W/every --n 300 --seed 2 --split val --overwrite | tail -1
common="model=$MODEL eval_data=$W/every/val.jsonl precision=fp32 overwrite=true"
declare -A runs=(
  [qe-1e-4-300]="lr=1e-4 max_steps=300"
  [qe-3e-5-300]="lr=3e-5 max_steps=300"
  [qe-1e-4-150]="lr=1e-4 max_steps=150"
  [box-1e-3-300]="head=box lr=1e-3 lr_llm=1e-4 max_steps=300"
  [box-3e-3-300]="head=box lr=3e-3 lr_llm=1e-4 max_steps=300"
  [box-1e-3-600]="head=box lr=1e-3 lr_llm=1e-4 max_steps=600"
)
for r in "${!runs[@]}"; do
  $gt train quickstart-every $common out_dir=$W/$r ${runs[$r]} $X > $W/$r.log 2>&1 &
done
while [ -n "$(jobs -rp | grep -v "^$pretrain$")" ]; do sleep 2; done
echo "presets trained at $(( $(date +%s) - t0 )) s"
# RL on sets from the 300-step text run: the preset, and at a lower rate
for lr in 5e-4 2e-4; do
  $gt rl quickstart-every-rl model=$W/qe-1e-4-300 eval_data=$W/every/val.jsonl out_dir=$W/rl-$lr lr=$lr \
    overwrite=true $X > $W/rl-$lr.log 2>&1 &
done
while [ -n "$(jobs -rp | grep -v "^$pretrain$")" ]; do sleep 2; done
echo "RL done at $(( $(date +%s) - t0 )) s"
for r in "${!runs[@]}" rl-5e-4 rl-2e-4; do echo "== $r"; grep -a "eval \|rror\|threshold" $W/$r.log | tail -4; done
python bench/every_proof.py --work $W/ep --n $N --out $OUT/presets_scores.json \
  --score $MODEL $(for r in "${!runs[@]}" rl-5e-4 rl-2e-4; do echo $W/$r; done) | grep -v "^\s*$" > $W/scores.log
for r in "${!runs[@]}" rl-5e-4 rl-2e-4; do
  python - "$W/$r" <<'EOF' >> $W/walls.txt
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if l.strip()]
print(sys.argv[1].rsplit("/", 1)[1], "steps", rows[-1]["step"], "train s", round(rows[-1]["time"] - rows[0]["time"], 1))
EOF
done
# the further cycle: stop at T seconds from the start (or now, if the screen took longer)
while [ $(( $(date +%s) - t0 )) -lt "$T" ] && kill -0 $pretrain 2>/dev/null; do sleep 5; done
touch $W/c3/STOP; wait $pretrain
grep -a "eval Acc\|rror\|stopping" $W/c3.log | tail -6 > $W/c3.txt
tar czf - -C $W c3/model c3/config.yaml c3/metrics.jsonl | split -b 15M - $OUT/c3.model.tgz.
{ cat $W/walls.txt; cat $W/scores.log; echo "== c3"; cat $W/c3.txt; } > $OUT/summary.txt
cat $OUT/summary.txt
