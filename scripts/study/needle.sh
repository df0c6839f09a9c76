#!/usr/bin/env bash
# Needle arm of the study: the baselines and the main ReST-KV variants on the same needles (one prefill per
# needle, shared by every config); resumes after an interruption.
# DEPTHS=0:100/41 LENGTHS="2048" bash scripts/study/needle.sh
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
LENGTHS=${LENGTHS:-2048}
DEPTHS=${DEPTHS:-0:100/41}
BUDGETS=${BUDGETS:-"128 256 512"}
OUT=${OUT:-results/study/needle}
source "$(dirname "${BASH_SOURCE[0]}")/../lib/python.sh"
"$PY" run_needle_in_haystack.py --model_path "$MODEL" --needles passkey --context_lengths $LENGTHS \
  --depth_percents $DEPTHS --max_capacity_prompts $BUDGETS --save_dir "$OUT" --no_plots \
  --method fullkv restkv snapkv adakv pyramidkv streamingllm h2o \
  --variant restkv_paper preset=paper \
  --variant restkv_sum_norm_mean_rows preset=paper,gqa_agg=sum_norm,use_ema=0
