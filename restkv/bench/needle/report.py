"""The needle sweep's results: a summary table per metric, and the plots.

``python -m restkv.bench.needle.report results/needle/<model>/results.jsonl`` prints the tables, writes them
as ``results.csv`` beside the file and draws the plots of a results file again (every record in it).
"""

from __future__ import annotations

import csv
import os

from ...lazy import LazyModule

np = LazyModule("numpy")

# What each metric of a record is, for the printed tables.
METRICS = {
    "score": "graded answer in [0, 1]: passkey = the fraction of the key's digits right, in order; "
    "sf = ROUGE-1 recall of the answer",
    "rouge1_f": "ROUGE-1 F of the response against the needle sentence (the original's score)",
}
# Their names on the plots.
METRIC_NAMES = {"score": "graded score", "rouge1_f": "ROUGE-1 F"}
NEEDLE_NAMES = {
    "passkey": "a 5-digit pass key ('The pass key is 71432. Remember it. ...')",
    "sf": "the San Francisco needle ('The best thing to do in San Francisco is eat a sandwich "
    "and sit in Dolores Park on a sunny day.')",
}


def _order(records):
    order = {
        r["label"]: (r["method"] == "fullkv", r["method"], r["budget"] or 0, r["label"])
        for r in records
    }
    return sorted(order, key=order.get)


def mean_se(values):
    """``(mean, standard error)`` of ``values`` (s.e. 0 for a single value, nan for none)."""
    values = [float(v) for v in values]
    if not values:
        return float("nan"), float("nan")
    se = float(np.std(values, ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0
    return float(np.mean(values)), se


def table_rows(records, metric="score"):
    """``(lengths, rows)``: per label (in table order) ``(label, cells)``, each cell ``(mean, standard error,
    prompts)`` of ``metric`` over depths and needles, one per length then the label's ``all``."""
    lengths = sorted({r["length"] for r in records})
    rows = []
    for label in _order(records):
        mine = [r for r in records if r["label"] == label]
        groups = [[r[metric] for r in mine if r["length"] == L] for L in lengths] + [[r[metric] for r in mine]]
        rows.append((label, [(*mean_se(values), len(values)) for values in groups]))
    return lengths, rows


def _cell(mean, se, n):
    """A table cell: ``0.500 ± 0.289``; one prompt: its score alone (no standard error)."""
    return f"{mean:.3f} ± {se:.3f}" if n > 1 else f"{mean:.3f}"


def summary_table(records, metric="score"):
    """Mean ``metric`` ± its standard error per label (rows) and length (columns), over depths and needles,
    plus an ``all`` column (a cell of one prompt: its score alone), each header over its column's means; the
    header above says how many prompts each cell holds."""
    lengths, rows = table_rows(records, metric)
    table = [["method", *map(str, lengths), "all"]] + [[label, *(_cell(*c) for c in cells)] for label, cells in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(f"{v:<{w}}" for v, w in zip(row, widths)).rstrip() for row in table)


def write_csv(records, path):
    """The tables of every metric as CSV: ``metric, label, <each length>, all, all_se, prompts`` (``all_se``
    empty for one prompt). Returns ``path``."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        out = csv.writer(fh)
        for i, metric in enumerate(METRICS):
            lengths, rows = table_rows(records, metric)
            if i == 0:
                out.writerow(["metric", "label", *lengths, "all", "all_se", "prompts"])
            for label, cells in rows:
                mean, se, n = cells[-1]
                out.writerow([metric, label, *(round(c[0], 4) for c in cells[:-1]), round(mean, 4),
                              round(se, 4) if n > 1 else "", n])
    return path


def cell_sizes(records):
    """``(prompts per length cell, prompts per label)`` of ``records`` (the most any label has)."""
    per_cell = {}
    per_label = {}
    for r in records:
        per_cell[(r["label"], r["length"])] = per_cell.get((r["label"], r["length"]), 0) + 1
        per_label[r["label"]] = per_label.get(r["label"], 0) + 1
    return max(per_cell.values(), default=0), max(per_label.values(), default=0)


def explain(records):
    """The lines above the tables: what the needles are."""
    needles = sorted({r["needle"] for r in records})
    return [f"needle {n}: {NEEDLE_NAMES.get(n, 'custom (--needle)')}" for n in needles]


def distinct_labels(records):
    """``records`` with each label made unique per config: a label that several configs of the file share
    (other settings: ``config_id``) becomes ``<label>#<config_id>``."""
    ids = {}
    for r in records:
        ids.setdefault(r["label"], set()).add(r.get("config_id"))
    shared = {label for label, found in ids.items() if len(found) > 1}
    return [
        {**r, "label": f"{r['label']}#{r['config_id']}"} if r["label"] in shared else r
        for r in records
    ]


def show(path, records, plots=True):
    """Print the results file and the summary tables of ``records`` (this run's), and write them beside it
    (``results.csv``, when its folder exists); draw the plots beside the file from every record in it
    (each config of the folder, as :func:`distinct_labels` names them): ``heatmaps.png`` (every config side
    by side) and ``budget_curve.png`` (several budgets) or ``scores.png`` (one bar per config).

    Returns
    -------
    list of str
        The PNGs drawn (none without records or with ``plots`` off).
    """
    print(f"\nresults: {path}")
    if not records:
        return []
    print("\n".join(explain(records)))
    per_cell, per_label = cell_sizes(records)
    for metric, what in METRICS.items():
        print(
            f"\n{metric}: {what}\nmean ± standard error over depths and needles (a cell of one prompt: its "
            f"score); {per_cell} prompt{'s' * (per_cell != 1)} per length cell, {per_label} per label (all)"
            f"\n{summary_table(records, metric)}"
        )
    if os.path.isdir(os.path.dirname(path) or "."):
        print(f"\ntable written to {write_csv(records, os.path.join(os.path.dirname(path), 'results.csv'))}")
    if not plots:
        return []
    from visualization.plots import (
        budget_bars,
        budget_curve,
        needle_heatmaps,
    )  # matplotlib is optional

    from ..results import read_jsonl

    every = distinct_labels(list(read_jsonl(path))) if os.path.exists(path) else records
    out_dir = os.path.dirname(path)
    budgets = {r["budget"] for r in every if r.get("budget") is not None}
    name = METRIC_NAMES["score"]
    if len(budgets) > 1:
        summary = budget_curve(every, os.path.join(out_dir, "budget_curve.png"), name=name)
    else:
        summary = budget_bars(every, os.path.join(out_dir, "scores.png"), name=name)
    heatmaps = needle_heatmaps(every, os.path.join(out_dir, "heatmaps.png"), name=name, order=_order(every))
    pngs = [heatmaps, summary]
    print(
        f"\nplots (every record of {os.path.basename(path)}: {len(every)} records, "
        f"{len({r['label'] for r in every})} configs):\n" + "\n".join(pngs)
    )
    return pngs


def main(argv=None):
    """Print the tables and draw the plots of a needle results file."""
    from ..cli import ArgumentParser
    from ..results import read_jsonl

    parser = ArgumentParser(prog="python -m restkv.bench.needle.report", description=main.__doc__)
    parser.add_argument(
        "results", help="a needle results.jsonl (e.g. results/needle/smollm2-135m/results.jsonl)"
    )
    parser.add_argument("--no_plots", action="store_true", help="tables only")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.results):
        parser.error(
            f"results: {args.results} is not a file (a needle run writes <save_dir>/<model>/results.jsonl)"
        )
    try:
        records = distinct_labels(list(read_jsonl(args.results)))
    except ValueError as err:
        parser.error(str(err))
    if not records:
        parser.error(f"results: {args.results} holds no records (a needle run appends one per prompt it answers)")
    return show(args.results, records, plots=not args.no_plots)


if __name__ == "__main__":
    main()
