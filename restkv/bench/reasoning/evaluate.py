"""Scoring math predictions: accuracy per data set, the results table."""

from ..evaluation import evaluate_benchmark
from .answers import is_correct
from .tasks import DATASETS

ABOUT = (
    "score: accuracy x 100, the final answer extracted and graded as the reference harnesses do "
    "(MATH500/AIME: last \\boxed{} and Qwen2.5-Math's equivalence; GSM8K: lm-eval's #### / last number, "
    "exact match); avg: mean over the columns, avg s.e. its standard error"
)


def score_one(dataset, record):
    """1.0 when the prediction's final answer is right, else 0.0."""
    return float(is_correct(dataset, record["pred"], record["answers"][0]))


def evaluate(root, csv_path=None):
    """Score every math predictions file under ``root`` (``metrics.json`` per data set folder); the table."""
    return evaluate_benchmark(root, csv_path, "results_math.csv", "math", "Math reasoning", {d: d for d in DATASETS},
                              score_one, ABOUT)
