"""Tables of the query-agnostic arms: each config's mean ± s.e. per budget and the paired difference of
every config to a reference (KVzip by default), on the samples every label has.

    python scripts/study/qa_repeat_table.py --needle results/study/qa_repeat/needle_query_agnostic/smollm2-135m \\
        --ruler results/study/qa_repeat/ruler_query_agnostic/smollm2-135m --reference kvzip
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from report import _paired_table, load_needle, load_ruler, mean_se


def needle_kept(folder: Path) -> dict:
    """{config: {budget: the fraction of the needle's tokens kept, per needle}} (mean over layers and heads)."""
    rows = {}
    for line in (folder / "results.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows.setdefault(r["label"], {})[(r["needle"], r["length"], r["depth"])] = float(r["needle_kept"])
    return _paired_table(rows)


def table(title: str, scores: dict, reference: str, digits: int, what: str = "higher is better") -> str:
    """Markdown: {config: {budget: per-sample values}} -> means ± s.e. and paired differences to ``reference``."""
    budgets = sorted(b for b in {b for per in scores.values() for b in per} if b is not None)
    n = sorted({len(v) for per in scores.values() for v in per.values()})
    fmt = f"%.{digits}f ± %.{digits}f"
    lines = [f"#### {title} ({'/'.join(map(str, n))} samples, {what})", "",
             "| config | " + " | ".join(f"B={b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    order = sorted(scores, key=lambda c: (c != "fullkv", c != "kvzip", not c.startswith("restkv"), c))
    for name in order:
        per = scores[name]
        cells = [fmt % mean_se(per[None if None in per else b]) if (None in per or b in per) else ""
                 for b in budgets]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Paired difference to {reference} (positive: the config scores higher; bold when |diff| > 2 s.e.;"
              " wins / ties / losses over the samples):", "",
              "| config | " + " | ".join(f"B={b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for name in order:
        if name in (reference, "fullkv"):
            continue
        cells = []
        for b in budgets:
            if b not in scores[name] or b not in scores.get(reference, {}):
                cells.append("")
                continue
            diff = torch.tensor(scores[name][b], dtype=torch.float64) - torch.tensor(scores[reference][b],
                                                                                     dtype=torch.float64)
            m, se = mean_se(diff.tolist())
            text = f"{m:+.{digits}f} ± {se:.{digits}f}"
            text = f"**{text}**" if abs(m) > 2 * se and round(m, digits) != 0 else text
            counts = f"{int((diff > 0).sum())}/{int((diff == 0).sum())}/{int((diff < 0).sum())}"
            cells.append(f"{text} ({counts})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--needle", nargs="*", default=[], type=Path, help="needle runner model folders")
    p.add_argument("--ruler", nargs="*", default=[], type=Path, help="run_ruler.py model folders")
    p.add_argument("--reference", default="kvzip")
    p.add_argument("--kept", action="store_true", help="also the needle's tokens kept (needle folders)")
    args = p.parse_args()
    for folder in args.needle:
        print(table(f"Needle (pass key), {folder.name}: graded score", load_needle(folder), args.reference, 3))
        if args.kept:
            print(table(f"Needle (pass key), {folder.name}: fraction of the needle's tokens kept",
                        needle_kept(folder), args.reference, 3, "over layers and KV heads"))
    for folder in args.ruler:
        print(table(f"RULER, {folder.name}: string_match_all x100", load_ruler(folder), args.reference, 2))


if __name__ == "__main__":
    main()
