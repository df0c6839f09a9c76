#!/usr/bin/env bash
# The RULER arm twice on the same samples: the question inside the compressed prompt (as the paper evaluates)
# and read only after compression (--query_agnostic). Every method, data generated here (offline, sized with
# the model's tokenizer), one prefill per sample and mode; resumes after an interruption.
# MODEL=gemma3-270m NUM_SAMPLES=3 BUDGETS="128 256" TASKS="niah_single_1 vt" bash scripts/study/ruler.sh
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
LENGTH=${LENGTH:-2048}
TASKS=${TASKS:-synthetic}
NUM_SAMPLES=${NUM_SAMPLES:-3}
BUDGETS=${BUDGETS:-256}
NEW_TOKENS=${NEW_TOKENS:-48}  # RULER asks 128 for niah; every synthetic answer here fits 48 (stated on the page)
OUT=${OUT:-results/study}
source "$(dirname "${BASH_SOURCE[0]}")/../lib/python.sh"
MODES=${MODES:-"question_aware query_agnostic"}  # MODES=query_agnostic: that mode alone
VARIANTS=${VARIANTS-"--variant restkv_paper preset=paper --variant restkv_both query_proxy=both"}
EXTRA=${EXTRA:-}  # more runner flags, e.g. EXTRA="--seed 7"
DATA_DIR=${DATA_DIR:-data/ruler/$MODEL}
METHODS=${METHODS:-"fullkv restkv snapkv pyramidkv h2o streamingllm cam l2norm adakv headkv random tova lacache
  expected_attention keydiff criticalkv critical_adakv chunkkv defensivekv layer_defensivekv kvzip rkv triattention"}
MODEL="$MODEL" LENGTHS="$LENGTH" TASKS="$TASKS" NUM_SAMPLES="$NUM_SAMPLES" DATA_DIR="$DATA_DIR" PY="$PY" \
  bash "$(dirname "$0")/../ruler/generate.sh"
RUN_TASKS=()
[[ "$TASKS" != synthetic && "$TASKS" != all ]] && RUN_TASKS=(--tasks $TASKS)
for mode in $MODES; do
  flag=$([ "$mode" = query_agnostic ] && echo --query_agnostic || true)
  "$PY" run_ruler.py --model_path "$MODEL" --data_dir "$DATA_DIR/$LENGTH" "${RUN_TASKS[@]}" --num_samples "$NUM_SAMPLES" \
    --max_new_tokens "$NEW_TOKENS" --max_capacity_prompts $BUDGETS --save_dir "$OUT/ruler_$mode" \
    --method $METHODS $VARIANTS $EXTRA $flag
done
