"""Predicting LongBench v2: the flags and the run of ``run_longbench_v2.py``."""

from __future__ import annotations

import os

from ..datasets import Dataset, prepare_datasets, run_datasets
from ..hubdata import add_data_dir, load_records
from .tasks import FIELDS, MAX_NEW_TOKENS, SOURCE, make_prompt, question_text

DEFAULT_DIR = "data/longbench_v2"
KEPT = ("_id", "domain", "sub_domain", "difficulty", "length")


def make_task(records):
    """The :class:`restkv.bench.datasets.Dataset` of LongBench v2."""
    return Dataset(
        name="longbench_v2",
        records=records,
        text=lambda r, chat: make_prompt(r),
        output=lambda r: {**{k: r[k] for k in KEPT}, "answers": [r["answer"]]},
        max_new_tokens=MAX_NEW_TOKENS,
        chat=True,
        key="_id",
        question=lambda r, chat: question_text(r),
    )


def load(data_dir, limit=None):
    """The records (``--data_dir`` first, then the hub), each checked to hold the official fields."""

    def convert(rows, where):
        for i, r in enumerate(rows):
            missing = [f for f in FIELDS if r.get(f) is None]
            if missing:
                raise ValueError(f"{where}: record {i + 1} lacks fields {missing}")
        return rows

    return load_records(SOURCE, data_dir, DEFAULT_DIR, limit, convert)


def add_longbench_v2_args(parser):
    """Flags of the LongBench v2 data (besides :func:`restkv.bench.cli.add_dataset_args`)."""
    add_data_dir(parser, "the official data.json (or longbench_v2.jsonl/.parquet), or a folder holding it",
                 DEFAULT_DIR, SOURCE.where())
    return parser


def prepare(args):
    """Check the flags and load the data before any model work (:func:`restkv.bench.datasets.prepare_datasets`)."""
    data_dir = args.data_dir or (DEFAULT_DIR if os.path.isdir(DEFAULT_DIR) else None)
    return prepare_datasets(
        args,
        "longbench_v2",
        lambda: [make_task(load(data_dir, args.max_num_examples))],
        {"benchmark": "longbench_v2"},
    )


def run(args, plan=None):
    """Predict LongBench v2; returns ``{("longbench_v2", label): predictions file}``."""
    return run_datasets(args, plan or prepare(args))
