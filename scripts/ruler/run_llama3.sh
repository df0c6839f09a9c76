#!/bin/bash
# RULER on Llama-3.1-8B-Instruct at 4K-128K, budget 1024 (paper Table 3 left), the original's experiments:
#   MODEL_PATH=meta-llama/Llama-3.1-8B-Instruct bash scripts/ruler/run_llama3.sh
# The data: MODEL=$MODEL_PATH LENGTHS="4096 8192 16384 32768 65536 131072" bash scripts/ruler/generate.sh
# ReST-KV runs at the paper's knobs (--preset paper) with the original script's kernel 21 (the runner
# says so in one line), the baselines with the original's pooling kernel 5 (scripts/lib/original.sh).
# (read from DATA_DIR/<length>, default data/ruler/<model folder name>). One run per GPU of GPUS
# (default "0 1 2 3") at a time; without CUDA one after another on CPU.
# Then: bash scripts/ruler/eval.sh output_dir/results_ruler
set -eo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/original.sh
MODEL_PATH=${MODEL_PATH:-"<path_to_model>"}  # e.g., meta-llama/Llama-3.1-8B-Instruct
SAVE_DIR=${SAVE_DIR:-output_dir/results_ruler}
LENGTHS=${LENGTHS:-"4096 8192 16384 32768 65536 131072"}
need_model meta-llama/Llama-3.1-8B-Instruct
DATA_DIR=${DATA_DIR:-data/ruler/$(basename "$MODEL_PATH")}
DATA_DIRS=()
for length in $LENGTHS; do
    DATA_DIRS+=("$DATA_DIR/$length")
done

EXPERIMENTS=(
    "FullKV 1024 32"
    "StreamingLLM 1024 32"
    "SnapKV 1024 32"
    "pyramidkv 1024 32"
    "restkv 1024 32 --use_wo --use_ema --alpha 0.3 --metric_mode after --pooling adaptive --scale 2000 --kernel_sizes 21"
)

run_one() {  # method capacity window [extra_args]; the original's knobs first (paper_knobs)
    local method=$1 capacity=$2 window=$3 knobs
    shift 3
    mapfile -t knobs < <(paper_knobs "$method")
    "$PY" run_ruler.py --method "$method" --model_path "$MODEL_PATH" --max_capacity_prompts "$capacity" \
        --data_dir "${DATA_DIRS[@]}" "${DEVICE_FLAGS[@]}" --save_dir "$SAVE_DIR" --use_cache True \
        --window_size "$window" "${knobs[@]}" "$@"
}

# shellcheck disable=SC2086
run_experiments ${GPUS:-0 1 2 3}
finish "All RULER Llama3 experiments completed."
