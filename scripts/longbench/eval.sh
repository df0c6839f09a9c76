#!/usr/bin/env bash
# bash scripts/longbench/eval.sh <results_dir>: score a results folder (as the original's script).
# LongBench sweep: every method x budget on all 21 datasets, then the results table.
# Override any variable from the environment, e.g.
#   MODEL=gemma3-270m BUDGETS="128 512" DATASETS="qasper hotpotqa" bash scripts/longbench/eval.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

# The original's usage: bash scripts/longbench/eval.sh <results_dir> scores that folder only.
if (( $# > 0 )); then
    exec "${PY:-python3}" eval.py --results_dir "$1"
fi

MODEL=${MODEL:-smollm2-135m}
DATA_DIR=${DATA_DIR:-data/longbench}
SAVE_DIR=${SAVE_DIR:-results/longbench}
METHODS=${METHODS:-"restkv snapkv pyramidkv h2o streamingllm cam fullkv"}
BUDGETS=${BUDGETS:-"128 256 512 1024 2048"}
ATTN=${ATTN:-sdpa}
BATCH=${BATCH:-1}
DATASETS=${DATASETS:-}
EXTRA=${EXTRA:-}

python run_longbench.py --model_path "$MODEL" --data_dir "$DATA_DIR" --save_dir "$SAVE_DIR" \
    --method $METHODS --max_capacity_prompts $BUDGETS --attn_implementation "$ATTN" \
    --batch_size "$BATCH" ${DATASETS:+--datasets $DATASETS} $EXTRA
python eval.py --results_dir "$SAVE_DIR"
