"""Turn the study's fidelity JSONs into a results page (markdown) with paired comparisons.

    python scripts/study/report.py results/study/fidelity/smollm2-135m [more model folders] > docs/results.md

With ``--plots DIR`` it also draws, per model, the KL of every config against the budget (PNG).

For every budget: each config's mean KL to the full cache with its standard error, and for each
ReST-KV variant the paired difference to the best baseline (same samples, so the sample-to-sample
variation cancels); a difference is called a win/loss only when it exceeds twice its standard error.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch


def load(folder: Path) -> dict[str, dict[int, list[float]]]:
    """{config name: {budget: per-sample KL}} from every JSON in ``folder``."""
    table = {}
    for path in sorted(folder.glob("*.json")):
        for label, values in json.loads(path.read_text())["kl"].items():
            method, budget = label.split("-", 1)[0].rsplit("_", 1)
            name = path.stem if method == "restkv" else method
            table.setdefault(name, {})[int(budget)] = values
    return table


def mean_se(values) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return float(t.mean()), float(t.std() / math.sqrt(len(t))) if len(t) > 1 else float("nan")


def report(folder: Path) -> str:
    table = load(folder)
    budgets = sorted({b for per in table.values() for b in per})
    baselines = [n for n in table if not n.startswith("restkv")]
    samples = sorted({len(v) for per in table.values() for v in per.values()})
    lines = [f"### {folder.name} ({'/'.join(map(str, samples))} samples): KL to the full cache (lower is better)", "",
             "| config | " + " | ".join(f"B={b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for name in sorted(table, key=lambda n: (not n.startswith("restkv"), n)):
        cells = [("%.4f ± %.4f" % mean_se(table[name][b])) if b in table[name] else "" for b in budgets]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    def best_baseline(b):
        present = [n for n in baselines if b in table[n]]
        return min(present, key=lambda n: mean_se(table[n][b])[0]) if present else None

    lines += paired(table, budgets, best_baseline, "the best baseline at each budget")
    if "restkv_paper" in table:
        lines += paired(table, budgets, lambda b: "restkv_paper", "ReST-KV with the paper's knobs")
    return "\n".join(lines) + "\n"


def paired(table, budgets, reference, what: str) -> list[str]:
    """Rows of paired differences (same samples) of every ReST-KV variant to ``reference(budget)``."""
    lines = ["", f"Paired difference to {what} (negative: the variant is closer to the full cache; "
             "bold when |diff| > 2 s.e.):", "",
             "| variant | " + " | ".join(f"B={b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for name in sorted(n for n in table if n.startswith("restkv")):
        cells = []
        for b in budgets:
            ref = reference(b)
            if b not in table[name] or ref is None or b not in table[ref] or ref == name:
                cells.append("")
                continue
            m, se = mean_se((torch.tensor(table[name][b]) - torch.tensor(table[ref][b])).tolist())
            text = f"{m:+.4f} ± {se:.4f} vs {ref}"
            cells.append(f"**{text}**" if abs(m) > 2 * se and abs(m) > 1e-9 else text)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def plot(folder: Path, out_dir: Path) -> Path:
    """KL vs budget for every config of one model (log-log), written to ``out_dir/fidelity_<model>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = load(folder)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in sorted(table):
        budgets = sorted(table[name])
        means = [mean_se(table[name][b])[0] for b in budgets]
        ax.plot(budgets, means, marker="o", linestyle="-" if name.startswith("restkv") else "--", label=name)
    ax.set(xscale="log", yscale="log", xlabel="budget (entries per KV head)", ylabel="KL to full cache",
           title=folder.name)
    ax.legend(fontsize=6)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"fidelity_{folder.name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


if __name__ == "__main__":
    args = sys.argv[1:]
    plots = None
    if "--plots" in args:
        i = args.index("--plots")
        plots, args = Path(args[i + 1]), args[:i] + args[i + 2:]
    args = [f for f in args if any(Path(f).glob("*.json"))]  # models with results
    print("\n".join(report(Path(f)) for f in args))
    for f in args if plots else []:
        print(f"![{Path(f).name}]({plot(Path(f), plots).name})\n")
