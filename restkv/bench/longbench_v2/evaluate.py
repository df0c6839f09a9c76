"""Scoring LongBench v2 predictions: accuracy overall, by difficulty and by length (the official result.py)."""

from ..evaluation import evaluate_benchmark
from .tasks import DIFFICULTIES, LENGTHS, extract_answer

ABOUT = (
    "score: accuracy x 100 (the letter after \"The correct answer is\", as the official pred.py extracts it; "
    "none found: wrong); easy/hard/short/medium/long: the same over the questions of that difficulty or length"
)


def score_one(dataset, record):
    """1.0 when the extracted letter is the answer, else 0.0."""
    return float(extract_answer(record["pred"]) == record["answers"][0])


def evaluate(root, csv_path=None):
    """Score every LongBench v2 predictions file under ``root`` (``metrics.json`` beside them); the table:
    overall accuracy, then the difficulty and length columns."""
    return evaluate_benchmark(
        root,
        csv_path,
        "results_longbench_v2.csv",
        "longbench_v2",
        "LongBench v2",
        {"longbench_v2": "longbench_v2"},
        score_one,
        ABOUT,
        buckets=DIFFICULTIES + LENGTHS,
        bucket_of=lambda r: (r["difficulty"], r["length"]),
    )
