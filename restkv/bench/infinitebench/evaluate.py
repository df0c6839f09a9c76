"""Scoring InfiniteBench predictions and writing the results table."""

from ..evaluation import evaluate_benchmark, percent
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
    return evaluate_benchmark(root, csv_path, "results_infinite.csv", "infinite_bench", "InfiniteBench",
                              {t: t for t in TASKS}, score_one, ABOUT)


def score_one(task, record):
    """One prompt's score in [0, 1] under its task's scorer."""
    return score_record(task, record["pred"], record["answers"])
