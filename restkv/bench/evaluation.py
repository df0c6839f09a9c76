"""The evaluators' one skeleton (LongBench, LongBench-E, InfiniteBench): find the prediction files, score
each prompt, write ``metrics.json`` beside each task's files, print and write the table."""

from __future__ import annotations

import json
import os
from typing import Callable

from .longbench.results import find_predictions, load_predictions, write_table


def percent(scores: list) -> float | None:
    """Mean x 100 of per-prompt scores in [0, 1], to 2 decimals (None without prompts)."""
    return round(100 * sum(scores) / len(scores), 2) if scores else None


def evaluate_files(
    root,
    names: dict,
    score: Callable,
    title: str,
    csv_path: str,
    about: str,
    missing: str,
    buckets: tuple = (),
    bucket_of: Callable | None = None,
):
    """Score every ``<task>/<label>.jsonl`` under ``root`` and write the table.

    Parameters
    ----------
    names : dict
        ``{task folder: the task its scorer knows}``, in column order.
    score : callable
        ``score(task, record) -> float`` in [0, 1], one prompt's score.
    missing : str
        The error's text when ``root`` holds no predictions.
    buckets, bucket_of : optional
        Extra columns after ``avg`` (LongBench-E's lengths): a record's bucket ``bucket_of(record)``; each
        column the mean over tasks of that bucket's score.

    Returns
    -------
    list of list
        The table, header first.
    """
    found = find_predictions(root, names)
    if not found:
        raise FileNotFoundError(missing)
    rows = {}
    per_folder = {}
    stats = {}
    for label, files in found.items():
        rows[label] = {}
        stats[label] = {}
        per_bucket = {b: [] for b in buckets}
        for task, path in files.items():
            records = load_predictions(path)
            scores = [score(names[task], r) for r in records]
            stats[label][task] = [100 * s for s in scores]
            entry = {"score": percent(scores), "n": len(records)}
            rows[label][task] = entry["score"]
            if buckets:
                entry["buckets"] = bucket_scores(scores, [bucket_of(r) for r in records], buckets)
                for b, s in entry["buckets"].items():
                    if s is not None:
                        per_bucket[b].append(s)
            stem = os.path.basename(path)[: -len(".jsonl")]
            per_folder.setdefault(os.path.dirname(path), {})[stem] = entry
        rows[label].update(
            {b: round(sum(s) / len(s), 2) if s else None for b, s in per_bucket.items()}
        )
    for folder, entries in per_folder.items():
        with open(os.path.join(folder, "metrics.json"), "w", encoding="utf-8") as fh:
            json.dump(entries, fh, ensure_ascii=False, indent=2)
    order = [t for t in names if any(t in files for files in found.values())]
    return write_table(rows, order, csv_path, title, extra=buckets, stats=stats, about=about)


def bucket_scores(scores: list, of: list, buckets: tuple) -> dict:
    """``{bucket: mean score x 100}`` of the prompts in each bucket (None for an empty one)."""
    return {b: percent([s for s, k in zip(scores, of) if k == b]) for b in buckets}
