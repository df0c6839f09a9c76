#!/bin/bash
# Score InfiniteBench predictions, as the original's scripts/infinite_bench/eval.sh (never runs a benchmark):
#   bash scripts/infinite_bench/eval.sh <results_dir>      (default: output_dir/results_infinite_bench)
# A run and its table in one command: bash scripts/infinite_bench/sweep.sh
set -eo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/python.sh
results_dir=${1:-output_dir/results_infinite_bench}
"$PY" eval_infinite.py --results_dir "${results_dir}"
