"""A score table's ``avg`` column as curves: against the KV budget, or against a knob swept over folders.

    python -m visualization.curve results/longbench/results.csv              # one line per config
    python -m visualization.curve results/ablation_alpha/results.csv --x alpha
    python -m visualization.curve results/ruler/ruler_results.csv --out ruler.png

Reads the CSV of ``eval.py``, ``eval_infinite.py`` (a ``label`` column) or ``eval_ruler.py`` (``model``,
``context_length``, ``method``). Each row's name holds its x value: the budget of its run label
(``restkv_128``), or with ``--x NAME`` a ``NAME_<value>`` folder or ``NAME=<value>`` label part
(``alpha_0.3/...``, ``...-scale=500.0``). Rows with the same name once the x value is taken out are one
line; a row without an x value (``fullkv``; an ablation's ``mean`` or ``avgpool`` folder) is a dashed level.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
from collections import defaultdict


def row_names(path, column="avg"):
    """``[(name, value)]`` of the table at ``path``: the row's name (``label``, or ``model/length/method``)
    and its ``column``, for the rows that have one."""
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    out = []
    for row in rows:
        if row.get(column) in (None, ""):
            continue
        if "label" in row:
            name = row["label"]
        else:
            name = "/".join(row[k] for k in ("model", "context_length", "method") if row.get(k))
        out.append((name, float(row[column])))
    return out


def per_cell(path):
    """The prompts per cell of the table at ``path`` over its rows (``eval.py``'s ``prompts`` column,
    ``eval_ruler.py``'s ``samples``): ``"20"`` or ``"1-20"``; None when the table has neither."""
    with open(path, newline="", encoding="utf-8") as fh:
        cells = [row.get("prompts") or row.get("samples") or "" for row in csv.DictReader(fh)]
    counts = [int(n) for cell in cells for n in cell.split("-") if n.strip()]
    if not counts:
        return None
    return str(min(counts)) if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"


def _pattern(x):
    if x == "budget":  # the budget of a run label: restkv_128, restkv_128-kernel_size=5, restkv_paper_128
        return re.compile(r"_(?P<v>\d+)(?=-|$)")
    return re.compile(rf"(?:^|[/_-]){re.escape(x)}[_=](?P<v>-?\d+(?:\.\d+)?(?:e-?\d+)?)(?=$|[/-])")


def series(named, x="budget"):
    """``(lines, levels)``: ``{line name: {x: value}}`` and ``{name: value}`` of the rows without an x value.

    Every ``x`` part of a name is taken out (a folder ``alpha_0.3`` and a label part ``-alpha=0.3`` alike);
    the path folders every name shares are left out of the line names.
    """
    pattern = _pattern(x)
    parts = [name.split("/") for name, _ in named]
    shared = 0
    while parts and all(len(p) > shared + 1 and p[shared] == parts[0][shared] for p in parts):
        shared += 1
    lines, levels = defaultdict(dict), {}
    for (name, value), split in zip(named, parts):
        name = "/".join(split[shared:])
        found = [m.group("v") for m in pattern.finditer(name)]
        if not found:
            levels[name] = value
            continue
        key = pattern.sub("", name).strip("/")
        lines[key or x][float(found[0])] = value
    return dict(lines), levels


def draw(lines, levels, path, x="budget", ylabel="avg", title=None, n=None):
    """One line per entry of ``lines`` (x ascending), a dashed level per entry of ``levels``; the budget on a
    log2 axis; ``n``, the prompts per cell (:func:`per_cell`), in the title. Returns ``path``."""
    from visualization.plots import _save, plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.set_prop_cycle(color=plt.cm.tab20.colors)
    points = sorted({v for line in lines.values() for v in line})
    for name in sorted(lines):
        xs = sorted(lines[name])
        ax.plot(xs, [lines[name][v] for v in xs], marker="o", label=name)
    for i, (name, value) in enumerate(sorted(levels.items())):
        ax.axhline(value, color=plt.cm.Greys(0.9 - 0.15 * (i % 4)), ls=(0, (4, 2 + i)), lw=1, label=name)
    if x == "budget" and points and min(points) > 0:
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
    if points:
        ax.set_xticks(points, [f"{v:g}" for v in points])
    ax.set_xlabel("KV budget per head (max_capacity_prompt)" if x == "budget" else x)
    ax.set_ylabel(ylabel)
    count = f" · n={n} prompt{'s' * (n != '1')} per cell" if n else ""
    ax.set_title(title or f"{ylabel} against {'the KV budget' if x == 'budget' else x}{count}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6 if len(lines) + len(levels) > 8 else 8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, path)


def main(argv=None):
    """Draw a score table's curves (see the module docstring); prints the PNG's path."""
    parser = argparse.ArgumentParser(prog="python -m visualization.curve", description=main.__doc__)
    parser.add_argument("table", help="results.csv of eval.py / eval_infinite.py, or ruler_results.csv")
    parser.add_argument("--x", default="budget", help="budget (default), or a knob swept over folders or labels")
    parser.add_argument("--column", default="avg", help="the score column (default: avg)")
    parser.add_argument("--out", default=None, help="the PNG (default: beside the table, <table>_<x>.png)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.table):
        parser.error(f"table: {args.table} is not a file (eval.py writes <results_dir>/results.csv)")
    named = row_names(args.table, args.column)
    lines, levels = series(named, args.x)
    if not lines:
        parser.error(f"--x {args.x}: no row of {args.table} names a value of it")
    out = args.out or f"{os.path.splitext(args.table)[0]}_{args.x}.png"
    print(draw(lines, levels, out, args.x, args.column, n=per_cell(args.table)))
    return out


if __name__ == "__main__":
    main()
