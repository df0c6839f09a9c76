"""The evaluators' one skeleton (LongBench, LongBench-E, LongBench v2, InfiniteBench, math, SCBench): find the
prediction files, score each prompt, write ``metrics.json`` beside each task's files, print and write the
table."""

from __future__ import annotations

import json
import os
from typing import Callable

from ..lazy import require
from .cli import ArgumentParser, other_results, results_dir, startup
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
        Extra columns after ``avg`` (LongBench-E's lengths): a record's bucket ``bucket_of(record)`` (or its
        buckets, a tuple: LongBench v2's difficulty and length); each column the mean over tasks of that
        bucket's score.

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


def evaluate_benchmark(
    root, csv_path, csv_name: str, benchmark: str, title: str, names: dict, score: Callable, about: str, **buckets
):
    """:func:`evaluate_files` of one benchmark's results under ``root``: the table at ``csv_path`` (default
    ``<root>/<csv_name>``); no predictions: an error saying so and naming the results of other benchmarks
    found there (``run_meta.json``'s ``benchmark`` other than ``benchmark``)."""
    missing = f"no {title} predictions under {root}{other_results(root, benchmark)}"
    csv_path = csv_path or os.path.join(root, csv_name)
    return evaluate_files(root, names, score, title, csv_path, about, missing, **buckets)


def bucket_scores(scores: list, of: list, buckets: tuple) -> dict:
    """``{bucket: mean score x 100}`` of the prompts in each bucket (None for an empty one); a prompt's entry of
    ``of`` is its bucket or a tuple of its buckets."""
    of = [k if isinstance(k, tuple) else (k,) for k in of]
    return {b: percent([s for s, k in zip(scores, of) if b in k]) for b in buckets}


def evaluator_main(description, evaluate, csv_name, layout, argv=None, needs=()):
    """An evaluator script's ``main``: ``--results_dir`` (its ``layout``: where the predictions are below it) and
    ``--csv``; the scorers' packages (``needs``, of the bench extra) and the folder checked, then
    ``evaluate(results_dir, csv)`` (a malformed record: one line naming its file and line). Returns the table."""
    parser = ArgumentParser(description=description)
    parser.add_argument("--results_dir", default="results", help=f"root of {layout} files")
    parser.add_argument("--csv", default=None, help=f"table path (default: <results_dir>/{csv_name})")
    args = parser.parse_args(argv)
    startup(parser, lambda a: (require(*needs, needed_by=parser.prog), results_dir(a.results_dir)), args)
    return startup(parser, lambda a: evaluate(a.results_dir, a.csv), args)
