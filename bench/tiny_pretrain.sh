#!/usr/bin/env bash
# Pre-training runs of the tiny model, side by side on one GPU (one tiny model leaves it mostly
# idle): each line of the plan is `groundtune train tiny-pretrain` with its own overrides, stopped
# cleanly with a STOP file after SECONDS_PER_RUN (or at its max_steps), then broken down by phrase
# form on 1,000 held-out full-task samples.
#   OUT=/tmp/out SECONDS_PER_RUN=470 bash bench/tiny_pretrain.sh bench/plans/tiny_stage2_sweep.txt
# Plan lines:
#   arch NAME ARGS...        build a tiny architecture (python scripts/tiny_model.py ARGS)
#   run NAME KEY=VALUE...    a training run; model=arch:NAME uses an architecture built above
#   resume NAME DIR          continue run NAME from DIR/NAME.tgz.* (a previous call's output,
#                            carried back to the machine): `groundtune train --resume`; on a machine
#                            kept warm since that call, from its run folder where it still is
# Every run folder comes back as OUT/NAME.tgz.aa, .ab, ... (15 MB pieces: checkpoint, model, log);
# KEEP=N brings back only the N best by the breakdown's overall Acc@0.5 (a run folder is ~40 MB);
# PACK=model brings back each run's model, log and settings only (no checkpoint: ~11 MB a run at
# hidden 192), as OUT/NAME.model.tgz.aa, .ab, ...
# VAL="synth args" sets the held-out set runs are evaluated and selected on (default: the full task
# at 112 px).
set -uo pipefail
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PLAN=$1
T=${SECONDS_PER_RUN:-470}
W=/tmp/tp
mkdir -p $W/arch $OUT
# --overwrite: a machine kept warm between calls still holds the last call's (the same seed: the same set)
python -m groundtune data synth --out $W/data --n 500 --seed 12 --split val --overwrite ${VAL:---task full} | tail -1
runs=()
while read -r kind name rest; do
  case "$kind" in
    arch) python scripts/tiny_model.py --out $W/arch/$name $rest > /dev/null ;;
    run)
      args=$(echo "$rest" | sed "s#arch:#$W/arch/#g")
      python -m groundtune train tiny-pretrain eval_data=$W/data/val.jsonl out_dir=$W/$name $args \
        > $W/$name.log 2>&1 &
      runs+=("$name") ;;
    resume)
      [ -d $W/$name ] || cat $rest/$name.tgz.* | tar xzf - -C $W
      python -m groundtune train --resume $W/$name > $W/$name.log 2>&1 &
      runs+=("$name") ;;
  esac
done < "$PLAN"
t0=$(date +%s)
while [ $(( $(date +%s) - t0 )) -lt "$T" ] && [ -n "$(jobs -r)" ]; do sleep 5; done
for r in "${runs[@]}"; do touch $W/$r/STOP; done
wait
echo "trained for $(( $(date +%s) - t0 )) s" | tee $OUT/summary.txt
for r in "${runs[@]}"; do
  echo "== $r" ; grep -a "eval Acc\|rror\|stopping" $W/$r.log | tail -12
done | tee -a $OUT/summary.txt
models=(); for r in "${runs[@]}"; do models+=("$W/$r/model"); done
python bench/tiny_breakdown.py "${models[@]}" --n 1000 --out $OUT/breakdown.json | tee -a $OUT/summary.txt
keep=$(python -c "import json,sys; b=json.load(open('$OUT/breakdown.json')); b.pop('provenance', None)
best=sorted(b, key=lambda m: -b[m]['all']['acc@0.5'])[:int(sys.argv[1])]
print(' '.join(m.split('/')[-2] for m in best))" "${KEEP:-${#runs[@]}}")
for r in $keep; do
  if [ "${PACK:-}" = model ]; then
    tar czf - -C $W $r/model $r/config.yaml $r/metrics.jsonl | split -b 15M - $OUT/$r.model.tgz.
  else
    tar czf - -C $W --exclude=tb $r | split -b 15M - $OUT/$r.tgz.
  fi
done
ls -la $OUT
