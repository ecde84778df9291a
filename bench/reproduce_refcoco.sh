#!/usr/bin/env bash
# Evaluate MODEL on the eight RefCOCO/RefCOCO+/RefCOCOg splits and write the side-by-side table of
# the measured Acc@0.5 and the published one (src/groundtune/assets/published.json) where there is one.
#
#   bash bench/reproduce_refcoco.sh Qwen/Qwen2.5-VL-3B-Instruct              # protocol qwen, data from the Hub
#   bash bench/reproduce_refcoco.sh runs/sft/export lmms-eval out/refcoco    # a fine-tune, lmms-eval's protocol
#   REFCOCO_DIR=data/refcoco bash bench/reproduce_refcoco.sh MODEL           # local files instead:
#       REFCOCO_DIR/{refcoco,refcoco+,refcocog}_{split}.jsonl (groundtune data convert --from refcoco)
#
# Extra eval flags go in EVAL_ARGS (e.g. EVAL_ARGS="--batch-size 32 --limit 500"). Writes OUT/<split>.json
# (each eval report) and OUT/table.md + OUT/table.json.
set -euo pipefail
model=${1:?usage: reproduce_refcoco.sh MODEL [PROTOCOL] [OUT]}
protocol=${2:-qwen}
out=${3:-refcoco-$(basename "$model")-$protocol}
mkdir -p "$out"
# the eight evals and the table in one interpreter: torch and transformers are imported once, not nine times
python - "$model" "$protocol" "$out" <<'PY'
import json, os, shlex, sys
from pathlib import Path
from groundtune import protocols
from groundtune.cli import main
model, protocol, out = sys.argv[1:4]
hub = {"refcoco": "RefCOCO", "refcoco+": "RefCOCOplus", "refcocog": "RefCOCOg"}
local = os.environ.get("REFCOCO_DIR")
for benchmark, name in [("refcoco", "val"), ("refcoco", "testA"), ("refcoco", "testB"), ("refcoco+", "val"),
                        ("refcoco+", "testA"), ("refcoco+", "testB"), ("refcocog", "val"), ("refcocog", "test")]:
    data = f"{local}/{benchmark}_{name}.jsonl" if local else f"hf:lmms-lab/{hub[benchmark]}:{name}"
    print(f"== {benchmark} {name} ({data})", flush=True)
    code = main(["eval", "--model", model, "--data", data, "--protocol", protocol,
                 "--out", f"{out}/{benchmark}_{name}.json", *shlex.split(os.environ.get("EVAL_ARGS", ""))])
    if code:
        sys.exit(code)

out = Path(out)
rows = []
for report_path in sorted(out.glob("refcoco*_*.json")):
    benchmark, split = report_path.stem.rsplit("_", 1)
    report = json.loads(report_path.read_text())
    published = protocols.published_figure(model, benchmark, split, protocol)
    rows.append({"benchmark": benchmark, "split": split, "n": report["n"],
                 "measured_acc@0.5": None if report.get("acc@0.5") is None else round(100 * report["acc@0.5"], 1),
                 "published_acc@0.5": published and published["acc@0.5"], "source": published and published["source"]})
lines = [f"# {model}, protocol {protocol}", "", "| benchmark | split | samples | measured Acc@0.5 | published | source |",
         "|---|---|---|---|---|---|"]
lines += [f"| {protocols.BENCHMARKS[r['benchmark']]} | {r['split']} | {r['n']} | {r['measured_acc@0.5']} | "
          f"{r['published_acc@0.5'] if r['published_acc@0.5'] is not None else '-'} | {r['source'] or '-'} |" for r in rows]
(out / "table.md").write_text("\n".join(lines) + "\n")
(out / "table.json").write_text(json.dumps({"model": model, "protocol": protocol, "rows": rows}, indent=1) + "\n")
print("\n".join(lines))
PY
