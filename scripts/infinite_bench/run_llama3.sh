#!/bin/bash
# InfiniteBench on Llama-3.1-8B-Instruct at budget 1024 (paper appendix Table 14), the original's experiments:
#   MODEL_PATH=meta-llama/Llama-3.1-8B-Instruct bash scripts/infinite_bench/run_llama3.sh
# ReST-KV runs at the paper's knobs (--preset paper) with the original script's kernel 21 (the runner says
# so in one line), SnapKV with the original's pooling kernel 5 (scripts/lib/original.sh).
# Data: data/infinite_bench/<task>.jsonl (or data/InfiniteBench/). One run per GPU of GPUS (default "0 1")
# at a time; without CUDA one after another on CPU.
# Then: bash scripts/infinite_bench/eval.sh output_dir/results_infinite_bench
set -eo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/original.sh
MODEL_PATH=${MODEL_PATH:-"<path_to_model>"}  # e.g., meta-llama/Llama-3.1-8B-Instruct
SAVE_DIR=${SAVE_DIR:-output_dir/results_infinite_bench}
need_model meta-llama/Llama-3.1-8B-Instruct

EXPERIMENTS=(
    "SnapKV 1024 32"
    "restkv 1024 32 --use_wo --use_ema --alpha 0.3 --metric_mode after --pooling adaptive --scale 2000 --kernel_sizes 21"
)

run_one() {  # method capacity window [extra_args]; the original's knobs first (paper_knobs)
    local method=$1 capacity=$2 window=$3 knobs
    shift 3
    mapfile -t knobs < <(paper_knobs "$method")
    "$PY" run_infinite_bench.py --method "$method" --model_path "$MODEL_PATH" --max_capacity_prompts "$capacity" \
        "${DEVICE_FLAGS[@]}" --save_dir "$SAVE_DIR" --use_cache True --window_size "$window" "${knobs[@]}" "$@"
}

# shellcheck disable=SC2086
run_experiments ${GPUS:-0 1}
finish "All InfiniteBench Llama3 experiments completed."
