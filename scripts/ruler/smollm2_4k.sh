#!/usr/bin/env bash
# Report table: SmolLM2-135M at 4K, all synthetic tasks, budgets 128/256/512,
# restkv (the default) and restkv_paper (the paper's knobs), snapkv pyramidkv streamingllm fullkv.
# NUM_SAMPLES=2 gives a quick estimate first.
set -euo pipefail
export MODEL=smollm2-135m LENGTHS=4096 BUDGETS="128 256 512"
export METHODS="fullkv restkv snapkv pyramidkv streamingllm"
export NUM_SAMPLES=${NUM_SAMPLES:-20}
export SAVE_DIR=${SAVE_DIR:-results/ruler_smollm2_4k}
export EXTRA=${EXTRA:---variant restkv_paper preset=paper}
here=$(dirname "$0")
bash "$here/generate.sh"
bash "$here/sweep.sh"
