#!/usr/bin/env bash
# Fidelity (KL to the full cache) of ReST-KV variants and the baselines, one JSON per variant.
# MODEL=gemma3-270m SAMPLES=16 bash scripts/study/fidelity.sh
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
SAMPLES=${SAMPLES:-16}
LENGTH=${LENGTH:-2048}
BUDGETS=${BUDGETS:-"128 256 512"}
OUT=${OUT:-results/study/fidelity/$MODEL}
PY=${PY:-python}
mkdir -p "$OUT"
run() {  # run NAME ARGS...
  local name=$1; shift
  [ -f "$OUT/$name.json" ] && return 0
  "$PY" benchmarks/fidelity.py --model_path "$MODEL" --samples "$SAMPLES" --length "$LENGTH" \
    --max_capacity_prompts $BUDGETS --output "$OUT/$name.json" "$@" | tee "$OUT/$name.md"
}
run baselines --method snapkv pyramidkv h2o streamingllm adakv
run restkv_paper --method restkv
run restkv_sum_norm --method restkv --gqa_agg sum_norm
run restkv_rank --method restkv --gqa_agg rank
run restkv_mean_rows --method restkv --use_ema 0
run restkv_sum_norm_mean_rows --method restkv --gqa_agg sum_norm --use_ema 0
run restkv_sum_norm_avgpool --method restkv --gqa_agg sum_norm --pooling avgpool
run restkv_sum_norm_alpha01 --method restkv --gqa_agg sum_norm --alpha 0.1
run restkv_adakv --method restkv --head_budget adakv
run restkv_sum_norm_adakv --method restkv --gqa_agg sum_norm --head_budget adakv
