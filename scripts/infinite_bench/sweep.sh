#!/usr/bin/env bash
# InfiniteBench sweep: every method x budget on the 12 tasks, then the results table (restkv's defaults;
# scripts/infinite_bench/run_llama3.sh runs the paper's experiment). Resumable: rerun the same command.
# math_calc (30000 new tokens) is left out of the default TASKS; add it with TASKS="... math_calc".
# Scoring a results folder alone: bash scripts/infinite_bench/eval.sh <results_dir>
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/python.sh

MODEL=${MODEL:-smollm2-135m}
DATA_DIR=${DATA_DIR:-data/infinite_bench}
SAVE_DIR=${SAVE_DIR:-results/infinite_bench}
METHODS=${METHODS:-"restkv snapkv pyramidkv h2o streamingllm fullkv"}
BUDGETS=${BUDGETS:-"1024 2048"}
TASKS=${TASKS:-"passkey number_string kv_retrieval longbook_sum_eng longbook_choice_eng longbook_qa_eng longbook_qa_chn longdialogue_qa_eng math_find code_run code_debug"}
ATTN=${ATTN:-sdpa}
BATCH=${BATCH:-1}
EXTRA=${EXTRA:-}

"$PY" run_infinite_bench.py --model_path "$MODEL" --data_dir "$DATA_DIR" --save_dir "$SAVE_DIR" \
    --tasks $TASKS --method $METHODS --max_capacity_prompts $BUDGETS --attn_implementation "$ATTN" \
    --batch_size "$BATCH" $EXTRA
"$PY" eval_infinite.py --results_dir "$SAVE_DIR"
