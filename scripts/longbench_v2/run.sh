#!/usr/bin/env bash
# LongBench v2 sweep: every method x budget on its 503 questions, then the table (overall, difficulty, length).
# Resumable: rerun the same command after an interruption. Override any variable from the environment, e.g.
#   MODEL=meta-llama/Llama-3.1-8B-Instruct BUDGETS="1024 2048" bash scripts/longbench_v2/run.sh
# Data: data/longbench_v2/data.json (the official release; DATA_DIR=... for another place), else the hub.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/python.sh
MODEL=${MODEL:-smollm2-135m}
METHODS=${METHODS:-restkv snapkv pyramidkv streamingllm fullkv}
BUDGETS=${BUDGETS:-1024 2048}
DATA_DIR=${DATA_DIR:-}
SAVE_DIR=${SAVE_DIR:-results/longbench_v2}
EXTRA=${EXTRA:-}  # e.g. "--max_num_examples 50 --query_agnostic"

"$PY" run_longbench_v2.py --model_path "$MODEL" ${DATA_DIR:+--data_dir "$DATA_DIR"} --method $METHODS \
    --max_capacity_prompts $BUDGETS \
    --save_dir "$SAVE_DIR" $EXTRA
"$PY" eval_longbench_v2.py --results_dir "$SAVE_DIR"
