#!/usr/bin/env bash
# LongBench-E sweep: every method x budget on the 13 datasets, then the table with length buckets
# (scripts/longbench/sweep.sh with E=1; the same variables).
set -euo pipefail
E=1 METHODS=${METHODS:-"restkv snapkv pyramidkv h2o streamingllm fullkv"} BUDGETS=${BUDGETS:-"128 512 2048"} \
    exec bash "$(dirname "$0")/sweep.sh"
