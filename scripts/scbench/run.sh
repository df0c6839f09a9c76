#!/usr/bin/env bash
# SCBench sweep (a context compressed once, several questions): every method x budget on its tasks, then the table.
# Resumable: rerun the same command after an interruption. Override any variable from the environment, e.g.
#   MODEL=meta-llama/Llama-3.1-8B-Instruct TASKS="scbench_kv scbench_qa_eng" bash scripts/scbench/run.sh
# Data: data/scbench/<task>.jsonl or a snapshot of microsoft/SCBench (DATA_DIR=... for another folder), else the hub.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/python.sh
MODEL=${MODEL:-smollm2-135m}
TASKS=${TASKS:-}  # default: every task run here
METHODS=${METHODS:-restkv snapkv streamingllm fullkv}
BUDGETS=${BUDGETS:-1024 4096}
DATA_DIR=${DATA_DIR:-}
SAVE_DIR=${SAVE_DIR:-results/scbench}
EXTRA=${EXTRA:-}  # e.g. "--max_turns 2 --max_num_examples 20"

"$PY" run_scbench.py --model_path "$MODEL" ${TASKS:+--tasks $TASKS} ${DATA_DIR:+--data_dir "$DATA_DIR"} \
    --method $METHODS --max_capacity_prompts $BUDGETS --save_dir "$SAVE_DIR" $EXTRA
"$PY" eval_scbench.py --results_dir "$SAVE_DIR"
