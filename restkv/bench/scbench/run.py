"""Predicting SCBench's shared-context tasks: the flags and the run of ``run_scbench.py``."""

from __future__ import annotations

import os

from ..cli import add_tasks_arg
from ..datasets import Dataset, prepare_datasets, run_datasets
from ..hubdata import add_data_dir, load_records
from .tasks import MAX_NEW_TOKENS, SOURCES, TASKS, references, turns

DEFAULT_DIR = "data/scbench"


def make_task(task, records, max_turns=None):
    """The :class:`restkv.bench.datasets.Dataset` of one SCBench task: per record a context and its questions
    (the first ``max_turns`` when given)."""
    if max_turns:
        records = [{**r, "multi_turns": list(r["multi_turns"])[:max_turns]} for r in records]
    return Dataset(
        name=task,
        records=records,
        text=None,
        output=lambda r: {"id": r["id"], "answers": references(task, r), "turns": len(r["multi_turns"])},
        max_new_tokens=MAX_NEW_TOKENS[task],
        chat=True,
        key="id",
        turns=lambda r: turns(task, r),
    )


def check_record(task, record, name):
    """Raise ``ValueError`` starting with ``name`` unless ``record`` holds all a run and its scoring read: a
    context, its ``multi_turns``, each turn's ``input`` and ``answer`` (scbench_choice_eng: ``options`` holding
    the answer), and questions its template can be filled with."""
    if not record.get("multi_turns") or ("context" not in record and "input" not in record):
        raise ValueError(f"{name} lacks a context or its multi_turns")
    fields = ("input", "answer", "options") if task == "scbench_choice_eng" else ("input", "answer")
    for j, turn in enumerate(record["multi_turns"]):
        missing = [f for f in fields if not isinstance(turn, dict) or f not in turn]
        if missing:
            raise ValueError(f"{name}, turn {j + 1} lacks fields {missing}")
        if "options" in fields and turn["answer"] not in list(turn["options"]):
            raise ValueError(f"{name}, turn {j + 1}: its answer is none of its options")
    try:
        turns(task, record)
    except (ValueError, KeyError) as err:  # a template field the record lacks: KeyError
        raise ValueError(f"{name}: its questions cannot be built ({type(err).__name__}: {err})") from None


def load(task, data_dir, limit=None):
    """The records of ``task`` (``--data_dir`` first, then the hub); ids from the data when unique, else the
    records' positions.

    Raises
    ------
    ValueError
        A record that lacks a field a run or its scoring reads (:func:`check_record`).
    """

    def convert(rows, where):
        for i, r in enumerate(rows):
            check_record(task, r, f"{where}: {task} record {i + 1}")
        ids = [r.get("id") for r in rows]
        unique = None not in ids and len(set(ids)) == len(ids)
        return [{**r, "id": r["id"] if unique else i} for i, r in enumerate(rows)]

    return load_records(SOURCES[task], data_dir, DEFAULT_DIR, limit, convert)


def add_scbench_args(parser):
    """Flags of the SCBench data (besides :func:`restkv.bench.cli.add_dataset_args`)."""
    add_data_dir(parser, "SCBench's data folder (<task>.jsonl files) or a snapshot of the hub repository",
                 DEFAULT_DIR, "microsoft/SCBench, config <task>, split test")
    add_tasks_arg(parser, TASKS, "; not run: scbench_repoqa, scbench_repoqa_and_kv (RepoQA's code-similarity "
                  "scorer), scbench_summary_with_needles (two generation lengths in one task)")
    parser.add_argument(
        "--max_turns", type=int, default=None, help="the first N questions of each context only (SCBench's flag)"
    )
    return parser


def prepare(args):
    """Check the flags and load the tasks before any model work (:func:`restkv.bench.datasets.prepare_datasets`).
    Every run is query-agnostic: a context is compressed without its questions (``--query_agnostic`` implied)."""
    if args.max_turns is not None and args.max_turns < 1:
        raise ValueError(f"--max_turns must be >= 1, got {args.max_turns}")
    args.query_agnostic = True
    data_dir = args.data_dir or (DEFAULT_DIR if os.path.isdir(DEFAULT_DIR) else None)
    return prepare_datasets(
        args,
        "scbench",
        lambda: [make_task(t, load(t, data_dir, args.max_num_examples), args.max_turns) for t in args.tasks],
        {"benchmark": "scbench", "max_turns": args.max_turns},
    )


def run(args, plan=None):
    """Predict the tasks of ``args``; returns ``{(task, label): predictions file}``."""
    return run_datasets(args, plan or prepare(args))
