"""Scoring LongBench predictions: per dataset, per LongBench-E length bucket, per row."""

import json
import os

from ..cli import other_results
from .metrics import score_record
from .results import find_predictions, load_predictions, write_table
from .tasks import DATASETS, LONGBENCH_E

BUCKETS = ("0-4k", "4-8k", "8k+")
ABOUT = ("score: each dataset's official metric x 100 (qa F1, ROUGE-L, classification/retrieval "
         "accuracy, code edit similarity), mean over its prompts; avg: mean over the columns, avg s.e. "
         "its standard error")


def bucket(length):
    """LongBench-E bucket of a record's ``length`` (words or characters, as in the data)."""
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"


def score_dataset(dataset, records):
    """Mean score x 100 (2 decimals) of one dataset's prediction records."""
    scores = [score_record(dataset, r["pred"], r["answers"], r.get("all_classes")) for r in records]
    return round(100 * sum(scores) / len(scores), 2) if scores else None


def score_dataset_e(dataset, records):
    """``{bucket: mean score x 100}`` over LongBench-E's length buckets (None for an empty bucket)."""
    groups = {b: [] for b in BUCKETS}
    for r in records:
        groups[bucket(r["length"])].append(score_record(dataset, r["pred"], r["answers"], r.get("all_classes")))
    return {b: round(100 * sum(s) / len(s), 2) if s else None for b, s in groups.items()}


def evaluate(root, longbench_e=False, csv_path=None):
    """Score every predictions file under ``root`` and write the results table.

    Per dataset folder, ``metrics.json`` holds the scores of each label. For
    LongBench-E the table also has the three bucket columns after ``avg``,
    each the mean over datasets of that bucket's score.

    Returns
    -------
    list of list
        The table, header first.
    """
    names = {f"{d}_e": d for d in LONGBENCH_E} if longbench_e else {d: d for d in DATASETS}
    found = find_predictions(root, names)
    if not found:
        benchmark = "longbench_e" if longbench_e else "longbench"
        raise FileNotFoundError(f"no LongBench{'-E' if longbench_e else ''} predictions under {root}"
                                f"{other_results(root, benchmark)}")
    rows, per_folder, stats = {}, {}, {}
    for label, files in found.items():
        rows[label] = {}
        stats[label] = {}
        per_bucket = {b: [] for b in BUCKETS}
        for task, path in files.items():
            dataset, records = names[task], load_predictions(path)
            stats[label][task] = [100 * score_record(dataset, r["pred"], r["answers"],
                                                     r.get("all_classes")) for r in records]
            entry = {"score": score_dataset(dataset, records), "n": len(records)}
            rows[label][task] = entry["score"]
            if longbench_e:
                entry["buckets"] = score_dataset_e(dataset, records)
                for b, s in entry["buckets"].items():
                    if s is not None:
                        per_bucket[b].append(s)
            per_folder.setdefault(os.path.dirname(path), {})[os.path.basename(path)[:-len(".jsonl")]] = entry
        if longbench_e:
            rows[label].update({b: round(sum(s) / len(s), 2) if s else None for b, s in per_bucket.items()})
    for folder, scores in per_folder.items():
        with open(os.path.join(folder, "metrics.json"), "w", encoding="utf-8") as fh:
            json.dump(scores, fh, ensure_ascii=False, indent=2)
    order = [t for t in names if any(t in files for files in found.values())]
    csv_path = csv_path or os.path.join(root, "results_e.csv" if longbench_e else "results.csv")
    return write_table(rows, order, csv_path, "LongBench-E" if longbench_e else "LongBench",
                       extra=BUCKETS if longbench_e else (), stats=stats, about=ABOUT)
