#!/usr/bin/env bash
# Methods x budgets x lengths on data made by scripts/ruler/generate.sh, then the score table.
# Resumable: rerun the same command after an interruption.
# Usage: MODEL=smollm2-135m LENGTHS="4096 8192" BUDGETS="128 256 512" bash scripts/ruler/sweep.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lib/python.sh"
MODEL=${MODEL:-smollm2-135m}
LENGTHS=${LENGTHS:-4096}
METHODS=${METHODS:-fullkv restkv snapkv pyramidkv streamingllm}
BUDGETS=${BUDGETS:-128 256 512}
NUM_SAMPLES=${NUM_SAMPLES:-20}
DATA_DIR=${DATA_DIR:-data/ruler/$(basename "$MODEL")}
SAVE_DIR=${SAVE_DIR:-results/ruler}
EXTRA=${EXTRA:-}  # e.g. "--window_size 32 --attn_implementation eager"

DIRS=()
for length in $LENGTHS; do DIRS+=("$DATA_DIR/$length"); done
"$PY" run_ruler.py --model_path "$MODEL" --data_dir "${DIRS[@]}" --method $METHODS \
    --max_capacity_prompts $BUDGETS --num_samples "$NUM_SAMPLES" --save_dir "$SAVE_DIR" $EXTRA
"$PY" eval_ruler.py --results_dir "$SAVE_DIR"
