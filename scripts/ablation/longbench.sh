#!/usr/bin/env bash
# The paper's ablation (Table 3, appendix Table 12) on LongBench: every row as a ReST-KV knob set, all in one
# run (one prefill per prompt), then eval.py and the tables. The paper: Llama-3.1-8B-Instruct, B=128.
# MODEL=meta-llama/Llama-3.1-8B-Instruct DATA_DIR=data/longbench BUDGET=128 bash scripts/ablation/longbench.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-smollm2-135m}
DATA_DIR=${DATA_DIR:-data/longbench}
BUDGET=${BUDGET:-128}
OUT=${OUT:-results/ablation/longbench}
source scripts/lib/python.sh
eval "set -- $("$PY" scripts/ablation/table.py variants)"
"$PY" run_longbench.py --model_path "$MODEL" --data_dir "$DATA_DIR" --save_dir "$OUT" \
  --max_capacity_prompts "$BUDGET" --method fullkv "$@" ${EXTRA:-}
"$PY" eval.py --results_dir "$OUT"
"$PY" scripts/ablation/table.py longbench "$OUT/results.csv" "$BUDGET" | tee "$OUT/ablation.md"
