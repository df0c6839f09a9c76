# Sourced by the ablation scripts: shared settings and `run <folder> <flags...>` (one ReST-KV variant: the
# paper's knobs, --preset paper, with the variant's flags over them; the runner names the knobs that differ).
# Set ROOT before sourcing; MODEL, DATA_DIR, BUDGETS, DATASETS, EXTRA may be set in the environment.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source scripts/lib/python.sh

MODEL=${MODEL:-smollm2-135m}
DATA_DIR=${DATA_DIR:-data/longbench}
BUDGETS=${BUDGETS:-"128 512"}
DATASETS=${DATASETS:-}
EXTRA=${EXTRA:-}

run() {  # run <folder> <flags...>
  local folder=$1; shift
  "$PY" run_longbench.py --model_path "$MODEL" --data_dir "$DATA_DIR" --save_dir "$ROOT/$folder" \
      --method restkv --preset paper --max_capacity_prompts $BUDGETS "$@" ${DATASETS:+--datasets $DATASETS} $EXTRA
}
