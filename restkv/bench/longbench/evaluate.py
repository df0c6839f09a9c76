"""Scoring LongBench predictions: per dataset, per LongBench-E length bucket, per row."""

import os

from ..cli import other_results
from ..evaluation import evaluate_files, percent
from .metrics import score_record
from .tasks import DATASETS, LONGBENCH_E

BUCKETS = ("0-4k", "4-8k", "8k+")
ABOUT = (
    "score: each dataset's official metric x 100 (qa F1, ROUGE-L, classification/retrieval "
    "accuracy, code edit similarity), mean over its prompts; avg: mean over the columns, avg s.e. "
    "its standard error"
)


def bucket(length):
    """LongBench-E bucket of a record's ``length`` (words or characters, as in the data)."""
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"


def score_dataset(dataset, records):
    """Mean score x 100 (2 decimals) of one dataset's prediction records."""
    return percent([score_one(dataset, r) for r in records])


def score_dataset_e(dataset, records):
    """``{bucket: mean score x 100}`` over LongBench-E's length buckets (None for an empty bucket)."""
    groups = {b: [] for b in BUCKETS}
    for r in records:
        groups[bucket(r["length"])].append(score_one(dataset, r))
    return {b: percent(s) for b, s in groups.items()}


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
    benchmark = "longbench_e" if longbench_e else "longbench"
    title = "LongBench-E" if longbench_e else "LongBench"
    missing = f"no {title} predictions under {root}{other_results(root, benchmark)}"
    csv_path = csv_path or os.path.join(root, "results_e.csv" if longbench_e else "results.csv")
    return evaluate_files(
        root,
        names,
        score_one,
        title,
        csv_path,
        ABOUT,
        missing,
        buckets=BUCKETS if longbench_e else (),
        bucket_of=lambda r: bucket(r["length"]),
    )


def score_one(dataset, record):
    """One prompt's score in [0, 1] under its dataset's metric."""
    return score_record(dataset, record["pred"], record["answers"], record.get("all_classes"))
