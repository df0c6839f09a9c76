#!/usr/bin/env bash
# The long-generation arm (scripts/study/long_generation.py) of one model, as docs/results.md reports it:
#   choice:   on the choice prompts the MAIN methods at B=128 and 512 evicting every 128 generated tokens,
#             ReST-KV's decoding knobs and R-KV's/TriAttention's window of 32 (KNOBS) at B=128, and the
#             SHORT methods every 32 tokens at B=128;
#   held_out: on the held-out prompts the HELD methods and the knob the choice set picks (CHOSEN, by
#             scripts/study/long_generation_table.py --rule) at B=128 every 128 tokens;
#   cost:     the CPU time per generated token of the MAIN methods at B=256 against the full cache.
# Continuations sampled as R-KV and TriAttention evaluate (temperature 0.6, top-p 0.95): the packaged models'
# greedy continuations fall into loops. Resumable: each step skips what its output holds. CPU-heavy, so nice'd:
#   STEP=choice bash scripts/study/long_generation.sh
#   STEP=held_out CHOSEN="restkv_w8=restkv:window_size=8" bash scripts/study/long_generation.sh
#   STEP=cost bash scripts/study/long_generation.sh
# Gemma 3 (about three times SmolLM2's time per token, its vocabulary being 5x larger), as reported:
#   MODEL=gemma3-270m SAMPLES=2 MAIN="restkv rkv triattention snapkv h2o tova streamingllm keydiff" KNOBS= \
#     SHORT= STEP=choice bash scripts/study/long_generation.sh
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
STEP=${STEP:-choice}
SAMPLES=${SAMPLES:-3}
OUT=${OUT:-results/study/long_generation/$MODEL}
source "$(dirname "${BASH_SOURCE[0]}")/../lib/python.sh"
SAMPLED=(--temperature 0.6 --top_p 0.95)
MAIN=${MAIN-restkv rkv triattention snapkv h2o tova streamingllm keydiff expected_attention qfilter defensivekv random}
KNOBS=${KNOBS-restkv_w8=restkv:window_size=8 restkv_nopool=restkv:pooling=none restkv_paper=restkv:preset=paper
  rkv_w32=rkv:window_size=32 triattention_w32=triattention:window_size=32}
SHORT=${SHORT-restkv rkv snapkv h2o}
HELD=${HELD-restkv rkv triattention snapkv h2o tova defensivekv}
run() { nice -n 10 "$PY" scripts/study/long_generation.py --model_path "$MODEL" "$@"; }
mkdir -p "$OUT"
case "$STEP" in
  choice)
    out=(--set choice --samples "$SAMPLES" "${SAMPLED[@]}" --output "$OUT/choice.json")
    run "${out[@]}" --methods $MAIN --budgets 128 512 --intervals 128
    if [ -n "$KNOBS" ]; then run "${out[@]}" --methods $KNOBS --budgets 128 --intervals 128; fi
    if [ -n "$SHORT" ]; then run "${out[@]}" --methods $SHORT --budgets 128 --intervals 32; fi ;;
  held_out)
    run --set held_out --samples "$SAMPLES" "${SAMPLED[@]}" --output "$OUT/held_out.json" \
      --methods $HELD ${CHOSEN:-} --budgets 128 --intervals 128 ;;
  cost)
    run --set choice --samples 1 "${SAMPLED[@]}" --cost --methods $MAIN --cost_budget 256 --intervals 32 128 \
      --output "$OUT/choice.json" ;;
  *) echo "STEP=$STEP: expected choice, held_out or cost" >&2; exit 2 ;;
esac
