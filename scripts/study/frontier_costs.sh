#!/usr/bin/env bash
# Costs of the frontier plot (scripts/study/frontier.py). The compression step of every config of
# the held-out fidelity tables on one Llama-3-8B-shaped layer (benchmarks/compress_step.py, L=4096,
# B=512, one thread, CPU time), with the forward of that layer as a reference row; the passes after
# the prefill of the methods that run their own (benchmarks/deferred_cost.py, SmolLM2-135M); then
# the combined cost file. A step whose JSON is already in OUT is not run again.
#   bash scripts/study/frontier_costs.sh       (OUT=results/study/frontier by default)
set -euo pipefail
OUT=${OUT:-results/study/frontier}
source "$(dirname "${BASH_SOURCE[0]}")/../lib/python.sh"
LENGTH=${LENGTH:-4096}
PASS_LENGTH=${PASS_LENGTH:-2048}
PASS_REPS=${PASS_REPS:-2}
REPS=${REPS:-3}
BUDGET=${BUDGET:-512}
mkdir -p "$OUT"
if [ ! -s "$OUT/compress_step.json" ]; then
  OMP_NUM_THREADS=1 "$PY" benchmarks/compress_step.py --lengths "$LENGTH" --reps "$REPS" \
    --threads 1 --budget "$BUDGET" --json "$OUT/compress_step.json" --methods restkv snapkv \
    restkv_refine=restkv:refine_rounds=8 \
    restkv_boundary1=restkv:refine_rounds=1,refine_candidates=boundary \
    restkv_boundary4=restkv:refine_rounds=4,refine_candidates=boundary \
    restkv_worst=restkv:metric_mode=before,temporal=max,gqa_agg=max \
    restkv_global=restkv:layer_budget=global \
    layer_defensivekv layer_defensivekv_l2=layer_defensivekv:value_norm=l2 kvzip \
    cur leverage lagkv noncausal simlayerkv qfilter finch kvcompose kvgrad entropy_gated_chunkkv \
    compactor cap expected_attention_stats kvzap fastkvzip restkv_repeat \
    dms_w64=dms:window_size=64 duo_attention layer_forward | tee "$OUT/compress_step.md"
fi
if [ ! -s "$OUT/passes.json" ]; then
  OMP_NUM_THREADS=1 "$PY" benchmarks/deferred_cost.py --length "$PASS_LENGTH" --budget "$BUDGET" \
    --reps "$PASS_REPS" --threads 1 --methods kvzip kvcompose kvgrad restkv_repeat dms_w64 \
    --memory fullkv --json "$OUT/passes.json" | tee "$OUT/passes.md"
fi
"$PY" scripts/study/frontier.py costs --step "$OUT/compress_step.json" --passes "$OUT/passes.json" \
  --output "$OUT/costs.json"
