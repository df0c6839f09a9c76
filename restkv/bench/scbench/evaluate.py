"""Scoring SCBench predictions: per task the mean over its contexts of the mean over their questions."""

from ..evaluation import evaluate_benchmark
from .metrics import score_turns
from .tasks import TASKS

ABOUT = (
    "score: SCBench's scorer of each task x 100 (string match, accuracy, character F1, ROUGE-Lsum), mean over "
    "each context's questions then over the contexts; avg: mean over the columns, avg s.e. its standard error"
)


def score_one(task, record):
    """One context's score in [0, 1]: the mean over its questions."""
    return score_turns(task, record["pred"], record["answers"])


def evaluate(root, csv_path=None):
    """Score every SCBench predictions file under ``root`` (``metrics.json`` per task folder); the table."""
    return evaluate_benchmark(root, csv_path, "results_scbench.csv", "scbench", "SCBench", {t: t for t in TASKS},
                              score_one, ABOUT)
