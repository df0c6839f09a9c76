"""Scoring InfiniteBench predictions and writing the results table."""

import json
import os

from ..cli import other_results
from ..longbench.results import find_predictions, load_predictions, write_table
from .metrics import score_record
from .tasks import TASKS


ABOUT = ("score: each task's official scorer x 100 (exact match, accuracy or ROUGE, as "
         "InfiniteBench's compute_scores.py), mean over its prompts; avg: mean over the columns, "
         "avg s.e. its standard error")


def score_task(task, records):
    """Mean score x 100 (2 decimals) of one task's prediction records."""
    scores = [score_record(task, r["pred"], r["answers"]) for r in records]
    return round(100 * sum(scores) / len(scores), 2) if scores else None


def evaluate(root, csv_path=None):
    """Score every InfiniteBench predictions file under ``root``; ``metrics.json`` per task folder.

    Returns
    -------
    list of list
        The table, header first.
    """
    found = find_predictions(root, set(TASKS))
    if not found:
        raise FileNotFoundError(f"no InfiniteBench predictions under {root}"
                                f"{other_results(root, 'infinite_bench')}")
    rows, per_folder, stats = {}, {}, {}
    for label, files in found.items():
        rows[label] = {}
        stats[label] = {}
        for task, path in files.items():
            records = load_predictions(path)
            stats[label][task] = [100 * score_record(task, r["pred"], r["answers"]) for r in records]
            rows[label][task] = score_task(task, records)
            per_folder.setdefault(os.path.dirname(path), {})[os.path.basename(path)[:-len(".jsonl")]] = {
                "score": rows[label][task], "n": len(records)}
    for folder, scores in per_folder.items():
        with open(os.path.join(folder, "metrics.json"), "w", encoding="utf-8") as fh:
            json.dump(scores, fh, ensure_ascii=False, indent=2)
    order = [t for t in TASKS if any(t in files for files in found.values())]
    csv_path = csv_path or os.path.join(root, "results_infinite.csv")
    return write_table(rows, order, csv_path, "InfiniteBench", stats=stats, about=ABOUT)
