"""Score RULER predictions: one row per model x context length x method, one column per task."""

import csv
import re
from collections import defaultdict
from pathlib import Path

from restkv.bench.cli import other_results
from restkv.bench.longbench.results import avg_stats, se_text
from restkv.bench.results import read_jsonl
from restkv.bench.ruler.metrics import score
from restkv.bench.ruler.tasks import FAMILIES, family_of, task_order

REQUIRED = ("task", "method", "max_seq_length", "pred", "outputs")


def natural_key(label):
    """Sort ``fullkv`` first, then by text with numbers compared as numbers (snapkv_128 < snapkv_1024)."""
    return (label != "fullkv", [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", label)])


def collect(results_dir):
    """``{(model, length, method, task): (preds, refs)}`` of every ``*.jsonl`` under ``results_dir``."""
    files = sorted(Path(results_dir).rglob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"--results_dir: no *.jsonl under {results_dir}")
    cells = defaultdict(lambda: ([], []))
    for path in files:
        for n, rec in enumerate(read_jsonl(path), 1):
            missing = [f for f in REQUIRED if f not in rec]
            if missing:
                raise ValueError(
                    f"{path} record {n}: missing field(s) {missing} of a RULER prediction"
                    f"{other_results(results_dir, 'ruler')}"
                )
            preds, refs = cells[
                (rec.get("model", ""), int(rec["max_seq_length"]), rec["method"], rec["task"])
            ]
            preds.append(rec["pred"])
            refs.append(rec["outputs"])
    return cells


def table(cells):
    """Rows of scores with the per-row average over its tasks.

    Returns
    -------
    tuple of (list of str, list of list)
        Header and rows: model, context_length, method, samples (fewest per
        task), one score per task (blank when missing), avg.
    """
    tasks = task_order({k[3] for k in cells})
    rows = {}
    for (model, length, method, task), (preds, refs) in cells.items():
        metric = FAMILIES[family_of(task)]["metric"]
        rows.setdefault((model, length, method), {})[task] = (
            score(preds, refs, metric),
            len(preds),
        )
    header = ["model", "context_length", "method", "samples", *tasks, "avg"]
    out = []
    for model, length, method in sorted(rows, key=lambda k: (k[0], k[1], natural_key(k[2]))):
        row = rows[(model, length, method)]
        values = [row[t][0] for t in tasks if t in row]
        out.append(
            [
                model,
                length,
                method,
                min(n for _, n in row.values()),
                *[round(row[t][0], 2) if t in row else "" for t in tasks],
                round(sum(values) / len(values), 2),
            ]
        )
    return header, out


def avg_errors(cells):
    """``{(model, length, method): "±s.e."}`` of each row's avg (from its samples' scores, as
    :func:`restkv.bench.longbench.results.avg_stats`; ``n=1`` for single samples)."""
    per_row = defaultdict(dict)
    for (model, length, method, task), (preds, refs) in cells.items():
        metric = FAMILIES[family_of(task)]["metric"]
        per_row[(model, length, method)][task] = [
            score([p], [r], metric) for p, r in zip(preds, refs)
        ]
    return {key: se_text(*avg_stats(tasks)) for key, tasks in per_row.items()}


def evaluate(results_dir, csv_path=None):
    """Score every prediction file under ``results_dir``, print the table and write it as CSV.

    Returns
    -------
    tuple of (list of str, list of list)
    """
    cells = collect(results_dir)
    header, rows = table(cells)
    csv_path = Path(csv_path or Path(results_dir) / "ruler_results.csv")
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "w", newline="") as fh:
        csv.writer(fh).writerows([header, *rows])
    errors = avg_errors(cells)
    shown = [[*header, "avg s.e."]] + [[*row, errors[tuple(row[:3])]] for row in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(*shown)]
    print(
        "score: RULER's string_match_all (niah, vt, cwe, fwe: share of the expected strings in the "
        "answer) or string_match_part (qa: any one of them) x 100, mean over the task's samples; "
        "samples: the fewest of any task in the row; avg s.e.: the standard error of avg (n=1: single samples, "
        "which have none)"
    )
    for line in shown:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    print(f"written {csv_path}")
    return header, rows
