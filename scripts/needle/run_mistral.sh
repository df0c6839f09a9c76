#!/bin/bash
# Needle-in-a-Haystack on Mistral-7B-Instruct-v0.3 at budgets 128 and 1024 (paper Figure 3, appendix
# Figure 6), the original's experiments:
#   MODEL_PATH=mistralai/Mistral-7B-Instruct-v0.3 bash scripts/needle/run_mistral.sh
# Lengths 1000-32000 in steps of 200 (--s_len/--e_len/--step); each run prints its table and draws its
# plots; python -m restkv.bench.needle.report <results.jsonl> tabulates a results file again.
# ReST-KV runs at the paper's knobs (--preset paper, as the original's needle runner sets them), SnapKV
# with its pooling kernel 5 (scripts/lib/original.sh). One run per GPU of GPUS (default "0 1 2 3") at a time; without CUDA one after another on CPU.
set -eo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/original.sh
MODEL_PATH=${MODEL_PATH:-"<path_to_model>"}  # e.g., mistralai/Mistral-7B-Instruct-v0.3
SAVE_DIR=${SAVE_DIR:-results_needle}
need_model mistralai/Mistral-7B-Instruct-v0.3

EXPERIMENTS=(
    # method capacity model_provider
    "full 128 Mistral"
    "StreamingLLM 128 Mistral"
    "SnapKV 128 Mistral"
    "restkv 128 Mistral"
    "full 1024 Mistral"
    "StreamingLLM 1024 Mistral"
    "SnapKV 1024 Mistral"
    "restkv 1024 Mistral"
)

run_one() {  # method capacity provider; the original's knobs (paper_knobs)
    local method=$1 capacity=$2 provider=$3 knobs
    mapfile -t knobs < <(paper_knobs "$method")
    "$PY" -u run_needle_in_haystack.py \
        --s_len 1000 --e_len 32001 \
        --model_provider "$provider" \
        --model_name "$MODEL_PATH" \
        "${DEVICE_FLAGS[@]}" \
        --step 200 \
        --method "$method" \
        --max_capacity_prompt "$capacity" \
        --save_dir "$SAVE_DIR" \
        --model_version "Mistral_${method}_${capacity}" \
        "${knobs[@]}"
}

# shellcheck disable=SC2086
run_experiments ${GPUS:-0 1 2 3}
finish "All Needle Mistral experiments completed."
