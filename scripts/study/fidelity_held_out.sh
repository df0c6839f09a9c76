#!/usr/bin/env bash
# Fidelity with a held-out set: configs are chosen on the essay windows of seed SEED_A (SET=choice) and
# reported on those of seed SEED_B (SET=held_out), which overlap none of the first 32 windows of SEED_A
# (benchmarks/fidelity.py --disjoint --held_out_from). Every config of a set on the same windows (one
# prefill per window); resumes after an interruption; more samples extend a set without changing its first.
# The runs of docs/results.md (SmolLM2, 6 samples each; OMP_NUM_THREADS=1 on a shared CPU):
#   SET=choice SAMPLES=6 bash scripts/study/fidelity_held_out.sh
#   SET=held_out SAMPLES=6 METHODS="restkv snapkv layer_defensivekv" CONFIGS="--variant restkv_worst
#     metric_mode=before,temporal=max,gqa_agg=max --variant restkv_boundary1 refine_rounds=1,refine_candidates=boundary
#     --variant restkv_boundary4 refine_rounds=4,refine_candidates=boundary" bash scripts/study/fidelity_held_out.sh
#   and restkv_global on the held-out windows in its own file: python benchmarks/fidelity.py --samples 6
#     --length 1024 --disjoint --seed 2 --held_out_from 1 --max_capacity_prompts 128 256 512
#     --output $OUT/held_out_global.json --variant restkv_global layer_budget=global
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
SET=${SET:-choice}
SEED_A=${SEED_A:-1}
SEED_B=${SEED_B:-2}
SAMPLES=${SAMPLES:-8}
LENGTH=${LENGTH:-1024}
BUDGETS=${BUDGETS:-"128 256 512"}
CONFIGS=${CONFIGS:-all}
OUT=${OUT:-results/study/fidelity_held_out/$MODEL}
source "$(dirname "${BASH_SOURCE[0]}")/../lib/python.sh"
if [ "$SET" = choice ]; then
  sets=(--seed "$SEED_A")
else
  sets=(--seed "$SEED_B" --held_out_from "$SEED_A")
fi
# the library's default, its refinement, and the best methods of the earlier study
METHODS=${METHODS:-"restkv snapkv layer_defensivekv kvzip"}
base=(--method $METHODS
  --variant layer_defensivekv_l2 method=layer_defensivekv,value_norm=l2
  --variant restkv_refine refine_rounds=8)
# cheap candidates: worst case over the window's queries (DefensiveKV's aggregation on ReST-KV's indicator),
# one or four rounds of swaps at the top-B boundary, budgets across heads / layers from the output change
candidates=(
  --variant restkv_worst metric_mode=before,temporal=max,gqa_agg=max
  --variant restkv_boundary1 refine_rounds=1,refine_candidates=boundary
  --variant restkv_boundary4 refine_rounds=4,refine_candidates=boundary
  --variant restkv_global layer_budget=global)
if [ "$CONFIGS" = all ]; then
  configs=("${base[@]}" "${candidates[@]}")
else
  configs=("${base[@]}" $CONFIGS)
fi
mkdir -p "$OUT"
"$PY" benchmarks/fidelity.py --model_path "$MODEL" --samples "$SAMPLES" --length "$LENGTH" --disjoint \
  "${sets[@]}" --max_capacity_prompts $BUDGETS --output "$OUT/$SET.json" "${configs[@]}" | tee "$OUT/$SET.md"
