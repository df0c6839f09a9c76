#!/usr/bin/env bash
# Ablation of ReST-KV's temporal smoothing: EMA weight alpha over the window queries,
# and the plain mean (use_ema false). One folder per variant.
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:-smollm2-135m}
DATA_DIR=${DATA_DIR:-data/longbench}
ROOT=${ROOT:-results/ablation_alpha}
BUDGETS=${BUDGETS:-"128 512"}
ALPHAS=${ALPHAS:-"0.1 0.2 0.3 0.5 0.7 0.9 1.0"}
DATASETS=${DATASETS:-}
EXTRA=${EXTRA:-}

run() {  # run <folder> <flags...>
  local folder=$1; shift
  python run_longbench.py --model_path "$MODEL" --data_dir "$DATA_DIR" --save_dir "$ROOT/$folder" \
      --method restkv --max_capacity_prompts $BUDGETS "$@" ${DATASETS:+--datasets $DATASETS} $EXTRA
}
for alpha in $ALPHAS; do
  run "alpha_${alpha}" --use_ema true --alpha "$alpha"
done
run mean --use_ema false
python eval.py --results_dir "$ROOT"
