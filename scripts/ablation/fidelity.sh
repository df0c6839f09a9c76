#!/usr/bin/env bash
# The paper's ablation rows on the local fidelity arm (KL of next-token distributions to the full cache on
# essay windows of the packaged model), one run, one prefill per sample; resumes after an interruption.
# MODEL=gemma3-270m SAMPLES=16 BUDGET=256 bash scripts/ablation/fidelity.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-smollm2-135m}
SAMPLES=${SAMPLES:-16}
LENGTH=${LENGTH:-2048}
BUDGET=${BUDGET:-128}
OUT=${OUT:-results/ablation/fidelity/$MODEL}
source scripts/lib/python.sh
mkdir -p "$OUT"
eval "set -- $("$PY" scripts/ablation/table.py variants)"
"$PY" benchmarks/fidelity.py --model_path "$MODEL" --samples "$SAMPLES" --length "$LENGTH" \
  --max_capacity_prompts "$BUDGET" --output "$OUT/ablation.json" "$@" > "$OUT/fidelity.md"
"$PY" scripts/ablation/table.py fidelity "$OUT/ablation.json" "$BUDGET" | tee "$OUT/ablation.md"
