#!/usr/bin/env bash
# The needle arm twice on the same needles: the question inside the compressed prompt (as the paper
# evaluates) and read only after compression (--query_agnostic: one compressed context, any question).
# Every method at every budget, one prefill per needle and mode; resumes after an interruption.
# MODEL=gemma3-270m DEPTHS=0:100/11 bash scripts/study/query_agnostic.sh
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
LENGTHS=${LENGTHS:-2048}
DEPTHS=${DEPTHS:-0:100/3}
BUDGETS=${BUDGETS:-"128 256"}
OUT=${OUT:-results/study}
source "$(dirname "${BASH_SOURCE[0]}")/../lib/python.sh"
MODES=${MODES:-"question_aware query_agnostic"}  # MODES=query_agnostic: that mode alone
VARIANTS=${VARIANTS-"--variant restkv_paper preset=paper --variant restkv_both query_proxy=both"}
EXTRA=${EXTRA:-}  # more runner flags, e.g. EXTRA="--seed 7"
METHODS=${METHODS:-"fullkv restkv snapkv adakv streamingllm cam expected_attention criticalkv kvzip
  defensivekv"}
for mode in $MODES; do
  flag=$([ "$mode" = query_agnostic ] && echo --query_agnostic || true)
  "$PY" run_needle_in_haystack.py --model_path "$MODEL" --needles passkey --context_lengths $LENGTHS \
    --depth_percents $DEPTHS --max_capacity_prompts $BUDGETS --save_dir "$OUT/needle_$mode" --no_plots \
    --method $METHODS $VARIANTS $EXTRA $flag
done
