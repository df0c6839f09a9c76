#!/usr/bin/env bash
# Regenerate docs/results.md and its plots from the study's results: the fidelity arm
# (scripts/study/fidelity.sh, per model) and the needle arm with the question before and after compression
# (scripts/study/query_agnostic.sh). Arms without results are left out.
set -euo pipefail
PY=${PY:-python}
STUDY=${STUDY:-results/study}
MODEL=${MODEL:-smollm2-135m}
mkdir -p docs
{
  cat scripts/study/results_intro.md
  echo
  "$PY" scripts/study/report.py --fidelity "$STUDY"/fidelity/* --needle "$STUDY/needle_question_aware/$MODEL" \
    --needle_query_agnostic "$STUDY/needle_query_agnostic/$MODEL" --ceiling "$STUDY"/ceiling/*.json --plots docs
} > docs/results.md
echo "wrote docs/results.md"
