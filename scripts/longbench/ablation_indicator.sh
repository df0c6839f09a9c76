#!/usr/bin/env bash
# Ablation of ReST-KV's indicator: output distance after W_O or in value space (use_wo),
# attention aggregated before or after the distance (metric_mode). One folder per variant.
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:-smollm2-135m}
DATA_DIR=${DATA_DIR:-data/longbench}
ROOT=${ROOT:-results/ablation_indicator}
BUDGETS=${BUDGETS:-"128 512"}
DATASETS=${DATASETS:-}
EXTRA=${EXTRA:-}

for use_wo in true false; do
  for mode in after before; do
    python run_longbench.py --model_path "$MODEL" --data_dir "$DATA_DIR" \
        --save_dir "$ROOT/wo_${use_wo}_${mode}" --method restkv --max_capacity_prompts $BUDGETS \
        --use_wo "$use_wo" --metric_mode "$mode" ${DATASETS:+--datasets $DATASETS} $EXTRA
  done
done
python eval.py --results_dir "$ROOT"
