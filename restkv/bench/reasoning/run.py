"""Predicting the math data sets: the flags and the run of ``run_math.py``."""

from __future__ import annotations

import os

from ..cli import check_common
from ..datasets import Dataset, prepare_datasets, run_datasets
from ..hubdata import add_data_dir, load_records
from ..models import context_limit, model_name
from .tasks import DATASETS, MAX_NEW_TOKENS, PROMPT, SOURCES, record

DEFAULT_DIR = "data/math"
WHERE = "; ".join(f"{name}: {source.where()}" for name, source in SOURCES.items())


def make_task(dataset, records, max_new_tokens=MAX_NEW_TOKENS):
    """The :class:`restkv.bench.datasets.Dataset` of one math data set (records as :func:`.tasks.record` gives)."""
    return Dataset(
        name=dataset,
        records=records,
        text=lambda r, chat: PROMPT.format(problem=r["problem"]),
        output=lambda r: {"id": r["id"], "answers": [r["answer"]]},
        max_new_tokens=max_new_tokens,
        chat=True,
        key="id",
    )


def load(dataset, data_dir, limit=None):
    """The records of ``dataset`` (``--data_dir`` first, then the hub), in this runner's form.

    Raises
    ------
    ValueError
        A record without the fields, or two records with one id.
    """

    def convert(rows, where):
        records = [record(dataset, raw, i, where) for i, raw in enumerate(rows)]
        ids = [r["id"] for r in records]
        if len(set(ids)) != len(ids):
            twice = sorted({i for i in ids if ids.count(i) > 1})[:3]
            raise ValueError(f"{where}: {dataset} records share ids {twice}")
        return records

    return load_records(SOURCES[dataset], data_dir, DEFAULT_DIR, limit, convert)


def add_math_args(parser):
    """Flags of the math data (besides :func:`restkv.bench.cli.add_dataset_args`)."""
    add_data_dir(parser, "folder holding <dataset>.jsonl/.json/.parquet or a <dataset>/ hub snapshot per data set",
                 DEFAULT_DIR, WHERE)
    parser.add_argument(
        "--datasets",
        nargs="+",
        default=DATASETS,
        choices=DATASETS,
        metavar="DATASET",
        help=f"data sets to run (default: all): {' '.join(DATASETS)}",
    )
    return parser


def check_generation(args):
    """``--max_new_tokens`` (default 32768) must leave room for a prompt in the model's context: one line
    naming the flag otherwise, before any work."""
    new_tokens = args.max_new_tokens or MAX_NEW_TOKENS
    limit, where = context_limit(args.model_path)
    if args.max_length is None and new_tokens >= limit:
        raise ValueError(
            f"--max_new_tokens: {new_tokens} new tokens leave no room for a problem in the context of "
            f"{model_name(args.model_path)}: {limit} tokens ({where}); pass --max_new_tokens below {limit}"
        )
    return new_tokens


def prepare(args):
    """Check the flags and load the data sets of ``args`` before any model work
    (:func:`restkv.bench.datasets.prepare_datasets`)."""
    check_common(args)
    if args.query_agnostic:
        raise ValueError("--query_agnostic: a math prompt is its question, with no context to compress before it")
    if args.data_dir and os.path.isfile(args.data_dir) and len(args.datasets) > 1:
        raise ValueError("--data_dir: a single file holds one data set; name it with --datasets")
    data_dir = args.data_dir or (DEFAULT_DIR if os.path.isdir(DEFAULT_DIR) else None)
    new_tokens = check_generation(args)
    return prepare_datasets(
        args,
        "math",
        lambda: [make_task(d, load(d, data_dir, args.max_num_examples), new_tokens) for d in args.datasets],
        {"benchmark": "math"},
    )


def run(args, plan=None):
    """Predict the data sets of ``args``; returns ``{(dataset, label): predictions file}``."""
    return run_datasets(args, plan or prepare(args))
