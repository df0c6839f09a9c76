"""Tables of a fidelity run with a held-out set (scripts/study/fidelity_held_out.sh): per config and budget the
mean KL ± its standard error, and the paired difference to a reference config ± its standard error.

    python scripts/study/held_out_table.py results/study/fidelity_held_out/smollm2-135m/choice.json --ref restkv
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path


def mean_se(x: list[float]) -> tuple[float, float]:
    n = len(x)
    m = sum(x) / n
    if n < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in x) / (n - 1)
    return m, math.sqrt(var / n)


def split(label: str) -> tuple[str, int]:
    """``restkv_refine_128`` -> ("restkv_refine", 128)."""
    m = re.fullmatch(r"(.+)_(\d+)", label)
    return m.group(1), int(m.group(2))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="fidelity.py --output files of one set (same windows)")
    p.add_argument("--ref", nargs="+", default=["restkv"], help="configs the paired differences are to")
    args = p.parse_args(argv)
    values: dict = {}
    for f in args.files:
        values.update(json.loads(Path(f).read_text())["kl"])
    n = min(len(v) for v in values.values())
    table: dict = {}
    for label, v in values.items():
        name, budget = split(label)
        table.setdefault(name, {})[budget] = v[:n]
    budgets = sorted({b for row in table.values() for b in row})
    print(f"{n} samples\n")
    head = " | ".join(f"B={b}" for b in budgets)
    print(f"| config | {head} |\n|---|" + "---|" * len(budgets))
    for name, row in sorted(table.items(), key=lambda kv: mean_se(kv[1][budgets[0]])[0]):
        cells = ["{:.4f} ± {:.4f}".format(*mean_se(row[b])) if b in row else "" for b in budgets]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for ref in args.ref:
        print(f"\npaired difference to {ref} (negative: closer to the full cache; ** when |diff| > 2 s.e.)\n")
        print(f"| config | {head} |\n|---|" + "---|" * len(budgets))
        for name, row in sorted(table.items()):
            if name == ref:
                continue
            cells = []
            for b in budgets:
                d = [x - y for x, y in zip(row[b], table[ref][b])]
                m, se = mean_se(d)
                mark = "**" if abs(m) > 2 * se else ""
                cells.append(f"{mark}{m:+.4f} ± {se:.4f}{mark}")
            print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
