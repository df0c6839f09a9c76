#!/usr/bin/env bash
# Ablation of ReST-KV's spatial smoothing: drift scale of the adaptive pooling,
# against fixed average / max pooling and no pooling. One folder per variant.
ROOT=${ROOT:-results/ablation_scale}
source "$(dirname "$0")/ablation_common.sh"
SCALES=${SCALES:-"250 500 1000 2000 4000 8000"}
for scale in $SCALES; do
  run "scale_${scale}" --pooling adaptive --scale "$scale"
done
for pooling in avgpool maxpool none; do
  run "$pooling" --pooling "$pooling"
done
"$PY" eval.py --results_dir "$ROOT"
