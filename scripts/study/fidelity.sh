#!/usr/bin/env bash
# Fidelity (KL to the full cache) of the baselines and the ReST-KV variants, all on the same samples in one
# run (one prefill per sample, shared by every config); resumes after an interruption.
# MODEL=gemma3-270m SAMPLES=12 bash scripts/study/fidelity.sh
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
SAMPLES=${SAMPLES:-16}
LENGTH=${LENGTH:-2048}
BUDGETS=${BUDGETS:-"128 256 512"}
OUT=${OUT:-results/study/fidelity/$MODEL}
PY=${PY:-python}
mkdir -p "$OUT"
P=preset=paper
"$PY" benchmarks/fidelity.py --model_path "$MODEL" --samples "$SAMPLES" --length "$LENGTH" \
  --max_capacity_prompts $BUDGETS --output "$OUT/study.json" \
  --method snapkv pyramidkv h2o streamingllm adakv \
  --variant restkv_paper "$P" \
  --variant restkv_sum_norm "$P,gqa_agg=sum_norm" \
  --variant restkv_rank "$P,gqa_agg=rank" \
  --variant restkv_mean_rows "$P,use_ema=0" \
  --variant restkv_sum_norm_mean_rows "$P,gqa_agg=sum_norm,use_ema=0" \
  --variant restkv_sum_norm_avgpool "$P,gqa_agg=sum_norm,pooling=avgpool" \
  --variant restkv_sum_norm_alpha01 "$P,gqa_agg=sum_norm,alpha=0.1" \
  --variant restkv_adakv "$P,head_budget=adakv" \
  --variant restkv_sum_norm_adakv "$P,gqa_agg=sum_norm,head_budget=adakv" \
  --variant restkv_sum_norm_mean_rows_adakv "$P,gqa_agg=sum_norm,use_ema=0,head_budget=adakv" \
  | tee "$OUT/study.md"
