#!/usr/bin/env bash
# Fidelity (KL to the full cache) of every method and the main ReST-KV variants, all on the same samples in
# one run (one prefill per sample, shared by every config); resumes after an interruption.
# MODEL=gemma3-270m SAMPLES=12 bash scripts/study/fidelity.sh
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
SAMPLES=${SAMPLES:-16}
LENGTH=${LENGTH:-2048}
BUDGETS=${BUDGETS:-"128 256 512"}
OUT=${OUT:-results/study/fidelity/$MODEL}
source "$(dirname "${BASH_SOURCE[0]}")/../lib/python.sh"
METHODS=${METHODS:-"restkv snapkv pyramidkv h2o streamingllm adakv headkv cam l2norm tova lacache random
  expected_attention keydiff criticalkv critical_adakv chunkkv defensivekv rkv triattention"}
mkdir -p "$OUT"
"$PY" benchmarks/fidelity.py --model_path "$MODEL" --samples "$SAMPLES" --length "$LENGTH" \
  --max_capacity_prompts $BUDGETS --output "$OUT/study.json" \
  --method $METHODS \
  --variant restkv_paper preset=paper \
  --variant restkv_paper_per_query_head preset=paper,gqa_agg=none \
  --variant restkv_ema temporal=ema \
  --variant restkv_adakv head_budget=adakv \
  --variant restkv_critical critical=True \
  | tee "$OUT/study.md"
