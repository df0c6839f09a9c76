#!/usr/bin/env bash
# The paper's RULER sweep: Llama-3.1-8B-Instruct, 13 tasks, budgets 128-2048, lengths 4K-128K.
# Needs the model locally (MODEL=/path/to/Llama-3.1-8B-Instruct) and SQuAD/HotpotQA files for qa_1/qa_2.
# The original's knobs: ReST-KV (labelled restkv_<budget>) at the paper's knobs with the original RULER
# script's kernel 21 (the runner says so in one line), the other methods with its pooling kernel 5.
set -euo pipefail
export MODEL=${MODEL:?set MODEL to a local Llama-3.1-8B-Instruct folder}
export LENGTHS=${LENGTHS:-4096 8192 16384 32768 65536 131072}
export BUDGETS=${BUDGETS:-128 256 512 1024 2048}
export METHODS=${METHODS:-fullkv snapkv pyramidkv streamingllm h2o cam l2norm}
export TASKS=${TASKS:-all}
export NUM_SAMPLES=${NUM_SAMPLES:-100}
export EXTRA="--kernel_size 5 --variant restkv preset=paper,kernel_size=21 ${EXTRA:---dtype bfloat16 --device cuda}"
here=$(dirname "$0")
bash "$here/generate.sh"
bash "$here/sweep.sh"
