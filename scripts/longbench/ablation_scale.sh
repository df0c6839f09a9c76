#!/usr/bin/env bash
# Ablation of ReST-KV's spatial smoothing: drift scale of the adaptive pooling,
# against fixed average / max pooling and no pooling. One folder per variant.
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:-smollm2-135m}
DATA_DIR=${DATA_DIR:-data/longbench}
ROOT=${ROOT:-results/ablation_scale}
BUDGETS=${BUDGETS:-"128 512"}
SCALES=${SCALES:-"250 500 1000 2000 4000 8000"}
DATASETS=${DATASETS:-}
EXTRA=${EXTRA:-}

run() {  # run <folder> <flags...>
  local folder=$1; shift
  python run_longbench.py --model_path "$MODEL" --data_dir "$DATA_DIR" --save_dir "$ROOT/$folder" \
      --method restkv --max_capacity_prompts $BUDGETS "$@" ${DATASETS:+--datasets $DATASETS} $EXTRA
}
for scale in $SCALES; do
  run "scale_${scale}" --pooling adaptive --scale "$scale"
done
for pooling in avgpool maxpool none; do
  run "$pooling" --pooling "$pooling"
done
python eval.py --results_dir "$ROOT"
