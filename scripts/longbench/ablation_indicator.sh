#!/usr/bin/env bash
# Ablation of ReST-KV's indicator: output distance after W_O or in value space (use_wo),
# attention aggregated before or after the distance (metric_mode). One folder per variant.
ROOT=${ROOT:-results/ablation_indicator}
source "$(dirname "$0")/ablation_common.sh"
for use_wo in true false; do
  for mode in after before; do
    run "wo_${use_wo}_${mode}" --use_wo "$use_wo" --metric_mode "$mode"
  done
done
"$PY" eval.py --results_dir "$ROOT"
