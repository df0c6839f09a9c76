"""Tables of a fidelity run with a held-out set (scripts/study/fidelity_held_out.sh): per config
and budget the mean KL ± its standard error, and the paired difference to a reference config ± its
standard error.

    python scripts/study/held_out_table.py \\
        results/study/fidelity_held_out/smollm2-135m/choice.json --ref restkv
    python scripts/study/held_out_table.py --dir results/study/fidelity_held_out \\
        --model gemma3-270m choice.json --ref restkv layer_defensivekv --side_by_side \\
        --rule restkv_worst restkv_boundary1 restkv_boundary4 restkv_global

``--side_by_side`` puts the paired differences to every ``--ref`` in one table (one row per config);
``--rule`` ranks the named candidates by their mean KL over the budgets (the rule that picks one on
the choice set).
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


def paired(row: dict, ref_row: dict, budget: int) -> str:
    """The cell ``mean ± s.e.`` of the paired difference at ``budget``, bold beyond 2 s.e."""
    d = [x - y for x, y in zip(row[budget], ref_row[budget])]
    m, se = mean_se(d)
    mark = "**" if abs(m) > 2 * se else ""
    return f"{mark}{m:+.4f} ± {se:.4f}{mark}"


def read_table(paths: list[Path]) -> tuple[dict, int]:
    """``{config: {budget: per-sample KL}}`` over files of one set, cut to the samples all have."""
    values: dict = {}
    for f in paths:
        values.update(json.loads(f.read_text())["kl"])
    n = min(len(v) for v in values.values())
    table: dict = {}
    for label, v in values.items():
        name, budget = split(label)
        table.setdefault(name, {})[budget] = v[:n]
    return table, n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="fidelity.py --output files of one set (same windows)")
    p.add_argument(
        "--ref", nargs="+", default=["restkv"], help="configs the paired differences are to"
    )
    p.add_argument(
        "--dir", default=None, help="folder of the model folders (files are relative to it)"
    )
    p.add_argument("--model", default=None, help="with --dir: the model's folder in it")
    p.add_argument(
        "--side_by_side", action="store_true", help="one table of differences to every ref"
    )
    p.add_argument(
        "--rule", nargs="*", default=None, help="candidates ranked by mean KL over budgets"
    )
    args = p.parse_args(argv)
    if args.model is not None and args.dir is None:
        p.error("--model needs --dir")
    folder = Path(args.dir) / (args.model or "") if args.dir else Path()
    table, n = read_table([folder / f for f in args.files])
    for ref in args.ref:
        if ref not in table:
            p.error(f"--ref {ref}: no such config in the files")
    budgets = sorted({b for row in table.values() for b in row})
    print(f"{n} samples\n")
    head = " | ".join(f"B={b}" for b in budgets)
    print(f"| config | {head} |\n|---|" + "---|" * len(budgets))
    for name, row in sorted(table.items(), key=lambda kv: mean_se(kv[1][budgets[0]])[0]):
        cells = ["{:.4f} ± {:.4f}".format(*mean_se(row[b])) if b in row else "" for b in budgets]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.side_by_side:
        print(
            "\npaired differences (negative: closer to the full cache; ** when |diff| > 2 s.e.)\n"
        )
        heads = [
            f"to `{r}`, B={b}" if i == 0 else f"B={b}"
            for r in args.ref
            for i, b in enumerate(budgets)
        ]
        print("| config | " + " | ".join(heads) + " |\n|---|" + "---|" * len(heads))
        for name, row in sorted(table.items()):
            if name == args.ref[0]:
                continue  # its differences to the others are their rows' first columns, negated
            cells = [
                "" if name == r else paired(row, table[r], b) for r in args.ref for b in budgets
            ]
            print(f"| {name} | " + " | ".join(cells) + " |")
    else:
        for ref in args.ref:
            print(
                f"\npaired difference to {ref} "
                "(negative: closer to the full cache; ** when |diff| > 2 s.e.)\n"
            )
            print(f"| config | {head} |\n|---|" + "---|" * len(budgets))
            for name, row in sorted(table.items()):
                if name != ref:
                    print(
                        f"| {name} | "
                        + " | ".join(paired(row, table[ref], b) for b in budgets)
                        + " |"
                    )
    if args.rule is not None:
        names = args.rule or sorted(table)
        means = {
            name: sum(mean_se(table[name][b])[0] for b in budgets) / len(budgets) for name in names
        }
        print("\nmean KL over the budgets (the rule: lowest first)\n")
        for name, m in sorted(means.items(), key=lambda kv: kv[1]):
            print(f"- {name}: {m:.4f}")


if __name__ == "__main__":
    main()
