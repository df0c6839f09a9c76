#!/usr/bin/env bash
# The long-generation arm (scripts/study/long_generation.py) of one model: on the choice prompts every method at
# B=128/256/512 evicting every 128 generated tokens, the main ones every 32 tokens at B=256, and ReST-KV's
# decoding knobs; on the held-out prompts the same methods and the knob the choice set picks (CHOSEN, by
# scripts/study/long_generation_table.py --rule); the cost per generated token; the greedy continuation
# (STEP=greedy) at B=128. Resumable: each step skips what its output holds. CPU-heavy, so nice'd:
#   STEP=choice bash scripts/study/long_generation.sh
#   STEP=held_out CHOSEN="restkv_w8=restkv:window_size=8" bash scripts/study/long_generation.sh
#   STEP=cost bash scripts/study/long_generation.sh
#   STEP=greedy bash scripts/study/long_generation.sh
# and MODEL=gemma3-270m for Gemma 3.
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
STEP=${STEP:-choice}
SAMPLES=${SAMPLES:-3}
OUT=${OUT:-results/study/long_generation/$MODEL}
PY=${PY:-python}
SAMPLED=(--temperature 0.6 --top_p 0.95)
MAIN="restkv rkv triattention snapkv h2o tova streamingllm keydiff expected_attention qfilter defensivekv random"
SHORT="restkv rkv triattention snapkv h2o tova"
KNOBS="restkv_w8=restkv:window_size=8 restkv_nopool=restkv:pooling=none restkv_paper=restkv:preset=paper
  restkv_adakv=restkv:head_budget=adakv restkv_refine2=restkv:refine_rounds=2,refine_pool=16"
WINDOWS="rkv_w32=rkv:window_size=32 triattention_w32=triattention:window_size=32"
run() { nice -n 10 "$PY" scripts/study/long_generation.py --model_path "$MODEL" "$@"; }
mkdir -p "$OUT"
case "$STEP" in
  choice|held_out)
    extra=$([ "$STEP" = choice ] && echo "$KNOBS" || echo "${CHOSEN:-}")
    out=(--set "$STEP" --samples "$SAMPLES" "${SAMPLED[@]}" --output "$OUT/$STEP.json")
    run "${out[@]}" --methods $MAIN $WINDOWS $extra --budgets 128 256 512 --intervals 128
    run "${out[@]}" --methods $SHORT --budgets 256 --intervals 32 ;;
  cost)
    run --set choice --samples 1 "${SAMPLED[@]}" --cost --methods $MAIN --cost_budget 256 --intervals 32 128 \
      --output "$OUT/choice.json" ;;
  greedy)
    run --set choice --samples "$SAMPLES" --methods $MAIN --budgets 128 --intervals 128 --output "$OUT/greedy.json" ;;
esac
