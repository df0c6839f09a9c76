"""Predicting RULER: the flags and the run of ``run_ruler.py``.

Reads folders of ``<task>/validation.jsonl`` and appends predictions to
``<save_dir>/<model>/<max_seq_length>/<task>/<label>.jsonl`` through the shared loop of
:mod:`restkv.bench.loop`.
"""

import os
from dataclasses import dataclass

from restkv.bench.cli import check_backend, check_common, prompt_settings
from restkv.bench.grid import announce, configs_meta, method_configs
from restkv.bench.loop import Predictor, Task, per_label
from restkv.bench.models import check_context
from restkv.bench.meta import check_args_rerun
from restkv.data.prompts import build_prompt, encode, middle_truncate, split_prompt
from restkv.bench.ruler.data import GENERATE, find_tasks, load_task
from restkv.bench.ruler.tasks import FAMILIES, family_of, question_offset

KEPT = ("index", "outputs", "length", "max_seq_length", "answer_prefix")


def prompt_ids(tokenizer, record, chat_template, cap, task=None):
    """Token ids of chat(input) + answer prefix, the input middle-truncated to fit ``cap``.

    Returns
    -------
    tuple of (list of int, bool), or (list of int, bool, int) with ``task``
        Ids, whether the input was truncated, and the token where the question starts
        (:func:`restkv.bench.ruler.tasks.question_offset`; the answer prefix follows it).
    """
    text = record["input"]
    ids = encode(tokenizer, build_prompt(tokenizer, text, chat_template) + record["answer_prefix"])
    excess = len(ids) - cap
    if excess > 0:
        body = tokenizer(text, add_special_tokens=False).input_ids
        if excess >= len(body):
            raise ValueError(
                f"record {record['index']}: prompt exceeds {cap} tokens even without its input"
            )
        text = tokenizer.decode(middle_truncate(body, len(body) - excess), skip_special_tokens=True)
        ids = encode(
            tokenizer, build_prompt(tokenizer, text, chat_template) + record["answer_prefix"]
        )
    if task is None:
        return ids, excess > 0
    prompt = build_prompt(tokenizer, text, chat_template) + record["answer_prefix"]
    try:
        char = prompt.rfind(text) + question_offset(text, task)
    except ValueError as err:
        raise ValueError(f"record {record['index']}: {err}") from None
    return ids, excess > 0, split_prompt(tokenizer, prompt, char)[1]


def load_data(data_dirs, tasks, num_samples, context_length):
    """``[(task, records)]`` of every data folder, validated before any model work.

    Raises
    ------
    ValueError
        When two folders hold the same task at the same length (they would share a results file).
    """
    out = []
    seen = {}
    for data_dir in data_dirs:
        names = tasks or find_tasks(data_dir)
        for task in names:
            family_of(task)
            path = os.path.join(data_dir, task, "validation.jsonl")
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"--data_dir: {path} missing (task {task} in {data_dir}); {GENERATE}"
                )
            records = load_task(path, context_length)[:num_samples]
            where = (records[0]["max_seq_length"], task)
            if where in seen:
                raise ValueError(
                    f"{path}: task {task} at length {where[0]} is also in {seen[where]}"
                )
            seen[where] = path
            out.append((task, records))
    return out


def add_ruler_args(parser):
    """Flags of the RULER data and generation length."""
    action = parser.add_argument(
        "--data_dir",
        nargs="+",
        default=["data/ruler"],
        help="one or more folders of <task>/validation.jsonl (e.g. one per length), "
        "made by scripts/ruler/generate.sh",
    )
    action.example = "data/ruler/smollm2-135m/4096 data/ruler/smollm2-135m/8192"
    parser.add_argument(
        "--tasks", nargs="+", default=None, help="tasks to run (default: every task folder)"
    )
    parser.add_argument(
        "--num_samples", type=int, default=None, help="first N samples of each task only"
    )
    parser.add_argument(
        "--max_new_tokens",
        type=int,
        default=None,
        help="override RULER's tokens to generate (niah 128, cwe 120, fwe 50, qa 32, vt 30)",
    )
    parser.add_argument(
        "--context_length",
        type=int,
        default=None,
        help="requested length of files lacking max_seq_length (RULER's own output)",
    )
    return parser


def _ids(prompt):
    return prompt[0]


def _start(prompt):
    return prompt[2]


def ruler_task(predictor, task, records):
    """The loop's :class:`restkv.bench.loop.Task` of one RULER task at one length."""
    args = predictor.args
    new_tokens = args.max_new_tokens or FAMILIES[family_of(task)]["tokens_to_generate"]
    length = records[0]["max_seq_length"]

    def prompt(record):
        return prompt_ids(
            predictor.tokenizer,
            record,
            args.chat_template,
            predictor.max_length - new_tokens,
            task if predictor.query_agnostic else None,
        )

    def record(rec, prompt, out):
        ids, cut = prompt[:2]
        return {
            **{k: rec[k] for k in KEPT},
            "task": task,
            "method": out.label,
            "model": predictor.name,
            "pred": out.text,
            "prompt_tokens": len(ids),
            "truncated": cut,
        }

    store = per_label(os.path.join(predictor.out_dir, str(length), task), predictor.labels, "index")
    return Task(
        f"{length} {task}",
        records,
        prompt,
        record,
        new_tokens,
        store,
        ids=_ids,
        question_start=_start,
    )


@dataclass
class RulerPlan:
    """Everything a RULER run checks before the model loads."""

    configs: list  # (label, configure kwargs)
    data: list  # (task, records)


def prepare(args):
    """Check the flags and the data of a RULER run before any model work; print its record count (stderr).

    Every folder's ``max_seq_length`` (prompt and generation, as RULER sizes its samples) and
    ``--max_length`` must fit the model's context.

    Raises
    ------
    ValueError
        Naming the flag, or the file and record of malformed data.
    FileNotFoundError
        A missing data folder or task file, or a registry model that is not installed.
    """
    check_common(args)
    configs = method_configs(args)
    check_args_rerun(args, configs, prompt_settings(args))
    data = load_data(args.data_dir, args.tasks, args.num_samples, args.context_length)
    length, task = max((r["max_seq_length"], task) for task, records in data for r in records)
    check_context(
        args.model_path,
        [
            ("--context_length", args.context_length, 0),
            (f"--data_dir ({task}: max_seq_length)", length, 0),
            ("--max_length", args.max_length, 0),
        ],
    )
    check_backend(args)
    announce("ruler", [("samples", sum(len(records) for _, records in data))], configs)
    return RulerPlan(configs, data)


def run(args, plan=None):
    """Predict every sample of the data folders of ``args`` for every method x budget.

    The flags and the data are checked (:func:`prepare`, unless its ``plan`` is given) before the model loads.

    Returns
    -------
    dict
        ``{(max_seq_length, task, label): predictions file}``.
    """
    plan = plan or prepare(args)
    configs = plan.configs
    data = plan.data
    predictor = Predictor(args, configs)
    predictor.write_metadata(
        {
            "benchmark": "ruler",
            "labels": predictor.labels,
            "configs": configs_meta(configs),
            "tasks": sorted({t for t, _ in data}),
            "max_length": predictor.max_length,
            "processes": predictor.shard.size,
            "settings": prompt_settings(args),
        }
    )
    tasks = {
        (records[0]["max_seq_length"], task): ruler_task(predictor, task, records)
        for task, records in data
    }
    predictor.predict(list(tasks.values()))
    predictor.say_where("ruler")
    return {
        (length, task, label): path
        for (length, task), t in tasks.items()
        for label, path in t.store.paths.items()
    }
