#!/usr/bin/env bash
# LongBench sweep: every method x budget on all 21 datasets, then the results table (restkv's defaults;
# scripts/longbench/run_llama3.sh runs the paper's experiments). Resumable: rerun the same command.
# Override any variable from the environment, e.g.
#   MODEL=gemma3-270m BUDGETS="128 512" DATASETS="qasper hotpotqa" bash scripts/longbench/sweep.sh
# E=1: LongBench-E (13 datasets, the table with length buckets; scripts/longbench/eval_e.sh).
# Scoring a results folder alone: bash scripts/longbench/eval.sh <results_dir>
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/python.sh

E=${E:-}
MODEL=${MODEL:-smollm2-135m}
DATA_DIR=${DATA_DIR:-data/longbench}
SAVE_DIR=${SAVE_DIR:-results/longbench${E:+_e}}
METHODS=${METHODS:-"restkv snapkv pyramidkv h2o streamingllm cam fullkv"}
BUDGETS=${BUDGETS:-"128 256 512 1024 2048"}
ATTN=${ATTN:-sdpa}
BATCH=${BATCH:-1}
DATASETS=${DATASETS:-}
EXTRA=${EXTRA:-}

"$PY" run_longbench.py ${E:+--e} --model_path "$MODEL" --data_dir "$DATA_DIR" --save_dir "$SAVE_DIR" \
    --method $METHODS --max_capacity_prompts $BUDGETS --attn_implementation "$ATTN" \
    --batch_size "$BATCH" ${DATASETS:+--datasets $DATASETS} $EXTRA
"$PY" eval.py ${E:+--e} --results_dir "$SAVE_DIR"
