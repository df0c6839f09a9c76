#!/usr/bin/env bash
# Generate RULER data offline for one model and several lengths.
# Usage: MODEL=smollm2-135m LENGTHS="4096 8192" NUM_SAMPLES=20 bash scripts/ruler/generate.sh
# qa_1/qa_2 too: TASKS=all SQUAD=path/dev-v2.0.json HOTPOTQA=path/hotpot_dev_distractor_v1.json
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lib/python.sh"
MODEL=${MODEL:-smollm2-135m}
LENGTHS=${LENGTHS:-4096}
TASKS=${TASKS:-synthetic}
NUM_SAMPLES=${NUM_SAMPLES:-20}
SEED=${SEED:-42}
DATA_DIR=${DATA_DIR:-data/ruler/$(basename "$MODEL")}
QA_ARGS=()
[[ -n "${SQUAD:-}" ]] && QA_ARGS+=(--squad "$SQUAD")
[[ -n "${HOTPOTQA:-}" ]] && QA_ARGS+=(--hotpotqa "$HOTPOTQA")

"$PY" -m restkv.bench.ruler.generate --model_path "$MODEL" --lengths $LENGTHS --tasks $TASKS \
    --num_samples "$NUM_SAMPLES" --seed "$SEED" --out_dir "$DATA_DIR" "${QA_ARGS[@]}"
