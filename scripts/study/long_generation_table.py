"""Tables (and a plot) of a long-generation run (scripts/study/long_generation.py): per config and budget the
KL to the full cache over the whole continuation and the top-1 agreement (mean ± s.e. over samples), the
paired difference to a reference config, the KL by position in the generation, the two intervals side by
side, and the cost per generated token.

    python scripts/study/long_generation_table.py results/study/long_generation/smollm2-135m/held_out.json \\
        --ref restkv --plot docs/long_generation_smollm2-135m.png
    python scripts/study/long_generation_table.py results/study/long_generation/smollm2-135m/choice.json \\
        --rule restkv restkv_w8 restkv_w64 restkv_nopool restkv_paper restkv_adakv restkv_refine2

``--rule`` ranks the named configs by their mean KL over the budgets at ``--interval`` (the rule that picks
one on the choice set).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from held_out_table import mean_se  # noqa: E402


def read(path: Path) -> tuple[dict, dict]:
    """``({(name, budget, interval): [per-sample {"kl": bins, "top1": bins}]}, the whole record)``, each
    interval's configs cut to the samples all of them have (sample i is the same prompt in every config)."""
    record = json.loads(path.read_text())
    table = {}
    for label, samples in record.get("results", {}).items():
        name, budget, interval = label.rsplit("|", 2)
        table[name, int(budget), int(interval)] = samples
    for interval in {i for _, _, i in table}:
        keys = [k for k in table if k[2] == interval]
        n = min(len(table[k]) for k in keys)
        for k in keys:
            table[k] = table[k][:n]
    return table, record


def overall(samples: list, key: str = "kl") -> list[float]:
    """Per sample, the mean over every position (bins of equal size)."""
    return [sum(s[key]) / len(s[key]) for s in samples]


def cell(x: list[float], digits: int = 4) -> str:
    m, se = mean_se(x)
    return f"{m:.{digits}f} ± {se:.{digits}f}"


def paired(x: list[float], y: list[float]) -> str:
    m, se = mean_se([a - b for a, b in zip(x, y)])
    mark = "**" if abs(m) > 2 * se else ""
    return f"{mark}{m:+.4f} ± {se:.4f}{mark}"


def names_budgets(table: dict, interval: int) -> tuple[list, list]:
    names = list(dict.fromkeys(n for n, _, i in table if i == interval))
    budgets = sorted({b for _, b, i in table if i == interval})
    return names, budgets


def main_table(table: dict, interval: int, ref: str) -> list[str]:
    """KL and top-1 per config and budget at ``interval`` (a budget a config was not run at left blank),
    sorted by the KL at the smallest budget each has, and the paired difference to ``ref``."""
    names, budgets = names_budgets(table, interval)
    first = {n: next(b for b in budgets if (n, b, interval) in table) for n in names}
    names.sort(key=lambda n: (first[n], sum(overall(table[n, first[n], interval]))))
    head = " | ".join(f"KL, B={b}" for b in budgets) + " | " + " | ".join(f"top-1, B={b}" for b in budgets)
    diff = " | ".join(f"- {ref}, B={b}" for b in budgets)
    lines = [f"| config | {head} | {diff} |", "|---" * (1 + 3 * len(budgets)) + "|"]
    for n in names:
        has = [(n, b, interval) in table for b in budgets]
        kl = [cell(overall(table[n, b, interval])) if h else "" for b, h in zip(budgets, has)]
        top1 = [cell(overall(table[n, b, interval], "top1"), 3) if h else "" for b, h in zip(budgets, has)]
        d = ["" if n == ref or not h or (ref, b, interval) not in table
             else paired(overall(table[n, b, interval]), overall(table[ref, b, interval]))
             for b, h in zip(budgets, has)]
        lines.append(f"| {n} | {' | '.join(kl + top1 + d)} |")
    return lines


def interval_table(table: dict, budget: int, intervals: list[int]) -> list[str]:
    """KL per config at ``budget`` for each interval, on the samples every interval has, and the paired
    difference of the first to the last."""
    names = [n for n in dict.fromkeys(n for n, _, _ in table) if all((n, budget, i) in table for i in intervals)]
    cols = " | ".join(f"KL, interval {i}" for i in intervals)
    lines = [f"| config (B={budget}) | {cols} | interval {intervals[0]} - {intervals[-1]} |",
             "|---" * (2 + len(intervals)) + "|"]
    for n in sorted(names, key=lambda n: sum(overall(table[n, budget, intervals[-1]]))):
        values = [overall(table[n, budget, i]) for i in intervals]
        values = [v[: min(map(len, values))] for v in values]
        lines.append(f"| {n} | {' | '.join(cell(v) for v in values)} | {paired(values[0], values[-1])} |")
    return lines


def position_table(table: dict, budget: int, interval: int, names: list[str], group: int,
                   bin_size: int) -> list[str]:
    """Mean KL in windows of ``group`` bins of the generation (``bin`` positions each), per config."""
    rows = [n for n in names if (n, budget, interval) in table]
    bins = len(table[rows[0], budget, interval][0]["kl"])
    cols = [(s, min(bins, s + group)) for s in range(0, bins, group)]
    lines = [f"| config (B={budget}, interval {interval}) | "
             + " | ".join(f"tokens {a * bin_size + 1}-{b * bin_size}" for a, b in cols) + " |", "|---" * (1 + len(cols)) + "|"]
    for n in rows:
        per = table[n, budget, interval]
        lines.append(f"| {n} | " + " | ".join(
            f"{mean_se([sum(s['kl'][a:b]) / (b - a) for s in per])[0]:.4f}" for a, b in cols) + " |")
    return lines


def cost_table(record: dict) -> list[str]:
    cost = record.get("cost", {})
    full = cost.get("fullkv")
    if not full:
        return []
    args = record.get("cost_args", {})
    lines = ["| config | B | every N tokens | ms per generated token | x full cache |", "|---|---|---|---|---|"]
    for label, seconds in sorted(cost.items(), key=lambda kv: kv[1]):
        name, budget, interval = (label.split("|") + ["", ""])[:3]
        lines.append(f"| {name} | {budget} | {interval} | {seconds * 1e3:.1f} | {seconds / full:.2f} |")
    lines.insert(0, f"Cost: {args.get('cost_tokens')} tokens decoded one at a time after the first prompt, "
                    f"{args.get('threads')} thread, CPU time of the process.\n")
    return lines


def plot(table: dict, budget: int, interval: int, names: list[str], bin_size: int, title: str, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for n in names:
        if (n, budget, interval) not in table:
            continue
        per = table[n, budget, interval]
        curve = [mean_se([s["kl"][b] for s in per])[0] for b in range(len(per[0]["kl"]))]
        ax.plot([(b + 0.5) * bin_size for b in range(len(curve))], curve, label=n)
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("KL(full || evicted), mean per bin")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def pick(parser, flag: str, value, usual: int, held: set) -> int:
    """``value`` when the run holds it (else a one-line error naming ``flag`` and what it holds); unset:
    ``usual`` when held, else the largest held."""
    if value is None:
        return usual if usual in held else max(held)
    if value not in held:
        parser.error(f"{flag} {value}: the run has {', '.join(map(str, sorted(held)))}")
    return value


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--ref", default="restkv")
    p.add_argument("--interval", type=int, default=None,
                   help="the interval of the main table (default: 128 when the run has it, else its largest)")
    p.add_argument("--position_budget", type=int, default=None,
                   help="the budget of the position and interval tables (default: 256 when the run has it at "
                        "--interval, else its largest there)")
    p.add_argument("--positions", nargs="+", default=["restkv", "rkv", "triattention", "snapkv", "h2o", "tova",
                                                      "streamingllm", "random"])
    p.add_argument("--group", type=int, default=4, help="bins per column of the position table")
    p.add_argument("--rule", nargs="+", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    if not args.run.is_file():
        p.error(f"{args.run}: no such file (a run's --output of scripts/study/long_generation.py)")
    table, record = read(args.run)
    if not table:
        p.error(f"{args.run}: no results yet (a cost run alone, or no sample finished)")
    args.interval = pick(p, "--interval", args.interval, 128, {i for _, _, i in table})
    args.position_budget = pick(p, "--position_budget", args.position_budget, 256,
                                {b for _, b, i in table if i == args.interval})
    n = len(next((v for (_, _, i), v in table.items() if i == args.interval), []))
    a = record.get("args", {})
    print(f"{a.get('model_path')}, {args.run.stem} set: {n} prompts of {a.get('prompt')} tokens, "
          f"{a.get('tokens')} generated tokens (temperature {a.get('temperature')}, top-p {a.get('top_p')})\n")
    if args.rule:
        _, budgets = names_budgets(table, args.interval)
        budgets = [b for b in budgets if all((r, b, args.interval) in table for r in args.rule)]
        ranked = sorted((sum(sum(overall(table[r, b, args.interval])) / len(table[r, b, args.interval])
                             for b in budgets) / len(budgets), r) for r in args.rule)
        print(f"Rule (mean KL over the budgets {', '.join(map(str, budgets))}, interval {args.interval}): "
              + ", ".join(f"{r} {v:.4f}" for v, r in ranked) + "\n")
    print("\n".join(main_table(table, args.interval, args.ref)) + "\n")
    intervals = sorted({i for _, b, i in table if b == args.position_budget})
    if len(intervals) > 1:
        print("\n".join(interval_table(table, args.position_budget, intervals)) + "\n")
    if any((n, args.position_budget, args.interval) in table for n in args.positions):
        lines = position_table(table, args.position_budget, args.interval, args.positions, args.group,
                               a.get("bin", 128))
        print("\n".join(lines) + "\n")
    print("\n".join(cost_table(record)))
    if args.plot:
        title = f"{a.get('model_path')}, B={args.position_budget}, interval {args.interval} ({args.run.stem})"
        plot(table, args.position_budget, args.interval, args.positions, a.get("bin", 128), title, args.plot)


if __name__ == "__main__":
    main()
