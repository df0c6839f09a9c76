#!/bin/bash
# LongBench with one method and budget, as the original's scripts/longbench/run.sh:
#   bash scripts/longbench/run.sh <gpu_id> <method> <max_capacity> <model_path> [extra_args]
# e.g. bash scripts/longbench/run.sh 0 restkv 128 meta-llama/Llama-3.1-8B-Instruct --use_wo --use_ema
# ReST-KV runs at the paper's knobs (--preset paper; the runner names any flag given that differs), SnapKV,
# PyramidKV, AdaKV and HeadKV with the original's pooling kernel 5 (scripts/lib/original.sh, paper_knobs).
# Without a CUDA device it runs on CPU (one-line note). Data: data/longbench/<dataset>.jsonl (or --data_dir).
set -eo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/original.sh
if (( $# < 4 )); then
    echo "usage: bash $0 <gpu_id> <method> <max_capacity> <model_path> [extra_args]" >&2
    exit 2
fi
use_gpu "$1"
method=$2
max_capacity_prompts=$3
model_path=$4
shift 4
mapfile -t knobs < <(paper_knobs "$method")  # the paper's knobs for restkv; the flags given after them win

"$PY" run_longbench.py \
    --method "${method}" \
    --model_path "${model_path}" \
    --max_capacity_prompts "${max_capacity_prompts}" \
    "${DEVICE_FLAGS[@]}" \
    --save_dir "${SAVE_DIR:-output_dir/results_longbench}" \
    --use_cache True \
    "${knobs[@]}" \
    "$@"
