#!/usr/bin/env bash
# Ablation of ReST-KV's temporal smoothing: EMA weight alpha over the window queries,
# and the plain mean (use_ema false). One folder per variant.
ROOT=${ROOT:-results/ablation_alpha}
source "$(dirname "$0")/ablation_common.sh"
ALPHAS=${ALPHAS:-"0.1 0.2 0.3 0.5 0.7 0.9 1.0"}
for alpha in $ALPHAS; do
  run "alpha_${alpha}" --use_ema true --alpha "$alpha"
done
run mean --use_ema false
"$PY" eval.py --results_dir "$ROOT"
