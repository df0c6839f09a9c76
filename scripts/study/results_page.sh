#!/usr/bin/env bash
# Regenerate docs/results.md and its plots from the study's results: the fidelity arm
# (scripts/study/fidelity.sh, per model), the needle and RULER arms with the question before and after
# compression (scripts/study/query_agnostic.sh, scripts/study/ruler.sh; per model) and the hindsight ceilings
# (benchmarks/ceiling.py); the long-generation arm (scripts/study/long_generation.sh) as written from its tables.
# Arms without results are left out.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lib/python.sh"
STUDY=${STUDY:-results/study}
shopt -s nullglob
mkdir -p docs
{
  cat scripts/study/results_intro.md
  echo
  "$PY" scripts/study/report.py --fidelity "$STUDY"/fidelity/* \
    --needle "$STUDY"/needle_question_aware/* --needle_query_agnostic "$STUDY"/needle_query_agnostic/* \
    --ruler "$STUDY"/ruler_question_aware/* --ruler_query_agnostic "$STUDY"/ruler_query_agnostic/* \
    --ceiling "$STUDY"/ceiling/*.json --plots docs
  # the held-out fidelity arm (SmolLM2, then Gemma 3), the query-agnostic ReST-KV, the frontier and the long
  # generations, each written from its tables
  for part in held_out gemma_held_out query_agnostic_repeat frontier long_generation; do
    if [ -f "scripts/study/results_$part.md" ]; then
      echo
      cat "scripts/study/results_$part.md"
    fi
  done
} > docs/results.md
echo "wrote docs/results.md"
