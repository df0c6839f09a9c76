#!/bin/bash
# Score RULER predictions, as the original's scripts/ruler/eval.sh:
#   bash scripts/ruler/eval.sh <results_dir>      (e.g. output_dir/results_ruler)
set -eo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/python.sh
results_dir=${1:-output_dir/results_ruler}
"$PY" eval_ruler.py --results_dir "${results_dir}"
