#!/usr/bin/env bash
# Regenerate docs/results.md and its plots from the study's results: the fidelity arm
# (scripts/study/fidelity.sh, per model), the needle arm (scripts/study/needle.sh) and the RULER arm
# (scripts/ruler/smollm2_4k.sh). Arms without results are left out.
set -euo pipefail
PY=${PY:-python}
NEEDLE=${NEEDLE:-results/study/needle/smollm2-135m}
RULER=${RULER:-results/ruler_smollm2_4k/smollm2-135m}
mkdir -p docs
{
  cat scripts/study/results_intro.md
  echo
  "$PY" scripts/study/report.py --fidelity results/study/fidelity/* --needle "$NEEDLE" --ruler "$RULER" --plots docs
} > docs/results.md
echo "wrote docs/results.md"
