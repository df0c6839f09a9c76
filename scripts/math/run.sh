#!/usr/bin/env bash
# Math reasoning sweep: every method x budget on MATH500, AIME 2024/2025 and GSM8K, then the accuracy table.
# Resumable: rerun the same command after an interruption. Override any variable from the environment, e.g.
#   MODEL=deepseek-ai/DeepSeek-R1-Distill-Qwen-7B BUDGETS="1024 2048" DECODE_INTERVAL=128 bash scripts/math/run.sh
# Data: data/math/<dataset>.jsonl or a hub snapshot per data set (DATA_DIR=... for another folder), else the hub.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/python.sh
MODEL=${MODEL:-smollm2-135m}
DATASETS=${DATASETS:-math500 aime24 aime25 gsm8k}
METHODS=${METHODS:-restkv snapkv streamingllm fullkv}
BUDGETS=${BUDGETS:-512 1024}
DECODE_INTERVAL=${DECODE_INTERVAL:-128}  # evict again every N generated tokens (0: at prefill only)
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-4096}
DATA_DIR=${DATA_DIR:-}
SAVE_DIR=${SAVE_DIR:-results/math}
EXTRA=${EXTRA:-}

"$PY" run_math.py --model_path "$MODEL" --datasets $DATASETS ${DATA_DIR:+--data_dir "$DATA_DIR"} \
    --method $METHODS --max_capacity_prompts $BUDGETS \
    --decode_interval "$DECODE_INTERVAL" --max_new_tokens "$MAX_NEW_TOKENS" --save_dir "$SAVE_DIR" $EXTRA
"$PY" eval_math.py --results_dir "$SAVE_DIR"
