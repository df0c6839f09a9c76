#!/bin/bash
# LongBench on Llama-3.1-8B-Instruct, the original's experiments (paper Table 2 and appendix Table 5):
#   MODEL_PATH=meta-llama/Llama-3.1-8B-Instruct bash scripts/longbench/run_llama3.sh
# ReST-KV runs at the paper's knobs (--preset paper), the baselines with the original's pooling kernel 5
# (scripts/lib/original.sh, paper_knobs). One run per GPU of GPUS (default "0 1 2 3") at a time; without CUDA one after another on CPU.
# Then: bash scripts/longbench/eval.sh output_dir/results_longbench
set -eo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/original.sh
MODEL_PATH=${MODEL_PATH:-"<path_to_model>"}  # e.g., meta-llama/Llama-3.1-8B-Instruct
SAVE_DIR=${SAVE_DIR:-output_dir/results_longbench}
need_model meta-llama/Llama-3.1-8B-Instruct

RESTKV="--use_wo --use_ema --alpha 0.3 --metric_mode after --pooling adaptive --scale 2000"
# Experiment settings: "method max_capacity window_size extra_args"
EXPERIMENTS=(
    "FullKV 128 32"
    "StreamingLLM 64 32"
    "StreamingLLM 128 32"
    "StreamingLLM 512 32"
    "SnapKV 64 32"
    "SnapKV 128 32"
    "SnapKV 512 32"
    "H2O 64 32"
    "H2O 128 32"
    "H2O 512 32"
    "restkv 64 32 $RESTKV"
    "restkv 128 32 $RESTKV"
    "restkv 512 32 $RESTKV"
    "restkv 1024 32 $RESTKV"
)

run_one() {  # method capacity window [extra_args]; the original's knobs first (paper_knobs)
    local method=$1 capacity=$2 window=$3 knobs
    shift 3
    mapfile -t knobs < <(paper_knobs "$method")
    "$PY" run_longbench.py --method "$method" --model_path "$MODEL_PATH" --max_capacity_prompts "$capacity" \
        "${DEVICE_FLAGS[@]}" --save_dir "$SAVE_DIR" --use_cache True --window_size "$window" "${knobs[@]}" "$@"
}

# shellcheck disable=SC2086
run_experiments ${GPUS:-0 1 2 3}
finish "All LongBench Llama3 experiments completed."
