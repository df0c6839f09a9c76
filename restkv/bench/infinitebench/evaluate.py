"""Scoring InfiniteBench predictions and writing the results table."""

import os

from ..cli import other_results
from ..evaluation import evaluate_files, percent
from .metrics import score_record
from .tasks import TASKS


ABOUT = (
    "score: each task's official scorer x 100 (exact match, accuracy or ROUGE, as "
    "InfiniteBench's compute_scores.py), mean over its prompts; avg: mean over the columns, "
    "avg s.e. its standard error"
)


def score_task(task, records):
    """Mean score x 100 (2 decimals) of one task's prediction records."""
    return percent([score_one(task, r) for r in records])


def evaluate(root, csv_path=None):
    """Score every InfiniteBench predictions file under ``root``; ``metrics.json`` per task folder.

    Returns
    -------
    list of list
        The table, header first.
    """
    missing = f"no InfiniteBench predictions under {root}{other_results(root, 'infinite_bench')}"
    csv_path = csv_path or os.path.join(root, "results_infinite.csv")
    return evaluate_files(
        root, {t: t for t in TASKS}, score_one, "InfiniteBench", csv_path, ABOUT, missing
    )


def score_one(task, record):
    """One prompt's score in [0, 1] under its task's scorer."""
    return score_record(task, record["pred"], record["answers"])
