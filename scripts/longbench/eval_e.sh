#!/usr/bin/env bash
# LongBench-E sweep: every method x budget on the 13 datasets, then the table with length buckets.
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:-smollm2-135m}
DATA_DIR=${DATA_DIR:-data/longbench}
SAVE_DIR=${SAVE_DIR:-results/longbench_e}
METHODS=${METHODS:-"restkv snapkv pyramidkv h2o streamingllm fullkv"}
BUDGETS=${BUDGETS:-"128 512 2048"}
ATTN=${ATTN:-sdpa}
BATCH=${BATCH:-1}
EXTRA=${EXTRA:-}

python run_longbench.py --e --model_path "$MODEL" --data_dir "$DATA_DIR" --save_dir "$SAVE_DIR" \
    --method $METHODS --max_capacity_prompts $BUDGETS --attn_implementation "$ATTN" --batch_size "$BATCH" $EXTRA
python eval.py --e --results_dir "$SAVE_DIR"
