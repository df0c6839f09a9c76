#!/usr/bin/env bash
# InfiniteBench retrieval tasks only (passkey, number_string, kv_retrieval): the quickest sweep.
set -euo pipefail
cd "$(dirname "$0")/../.."
TASKS="passkey number_string kv_retrieval" SAVE_DIR=${SAVE_DIR:-results/infinite_bench_retrieval} \
    bash scripts/infinite_bench/sweep.sh
