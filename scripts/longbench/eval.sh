#!/bin/bash
# Score LongBench predictions, as the original's scripts/longbench/eval.sh (never runs a benchmark):
#   bash scripts/longbench/eval.sh <results_dir>      (default: output_dir/results_longbench)
# A run and its table in one command: bash scripts/longbench/sweep.sh
set -eo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/python.sh
results_dir=${1:-output_dir/results_longbench}
"$PY" eval.py --results_dir "${results_dir}"
