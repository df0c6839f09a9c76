"""Prediction runs over datasets of records filled into prompt templates (LongBench, LongBench v2,
InfiniteBench, the math sets, SCBench).

Each config's predictions of a dataset go to ``<save_dir>/<model>/<dataset>/<label>.jsonl``, one
record per dataset record (keyed by its id field), through the shared loop of :mod:`restkv.bench.loop`.
A record with several questions on one context (SCBench) is one unit: its context is compressed once per
config and each question answered on it (``Dataset.turns``); its record holds the list of answers.
"""

import os
import sys
from dataclasses import dataclass, field
from typing import Callable

from .cli import check_backend, check_common, prompt_settings
from .generation import answer_questions
from .grid import announce, configs_meta, method_configs
from .loop import Predictor, Task, per_label
from .meta import check_args_rerun
from .models import check_context
from ..data.prompts import build_prompt, context_and_questions, encode, has_chat_template, prompt_ids


@dataclass
class Dataset:
    """One dataset to predict.

    Parameters
    ----------
    name : str
        Folder name of its predictions.
    records : list of dict
        Its records.
    text : callable or None
        ``text(record, chat) -> str``: the filled prompt template; ``chat`` tells
        whether the chat template will wrap it (None with ``turns``).
    output : callable
        ``output(record) -> dict``: the fields stored beside the prediction (key field included).
    max_new_tokens : int
        Tokens to generate.
    chat : bool
        Whether the chat template may be applied (the ``--chat_template`` flag decides).
    key : str
        Record field that identifies it in the predictions file.
    question : callable, optional
        ``question(record, chat) -> str``: the end of ``text`` that is its question (the template's text
        after the context), for ``--query_agnostic``.
    turns : callable, optional
        ``turns(record) -> (context, [question, ...])``: a shared context and the questions read after it
        (:func:`restkv.data.prompts.context_and_questions`), instead of ``text``: the context is compressed
        once per config and each question answered on it (query-agnostic by construction).
    """

    name: str
    records: list
    text: Callable | None
    output: Callable
    max_new_tokens: int
    chat: bool = True
    key: str = "_id"
    question: Callable | None = None
    turns: Callable | None = None


def dataset_task(predictor, dataset):
    """The loop's :class:`restkv.bench.loop.Task` of ``dataset`` in ``predictor``.

    With ``--max_length`` set, the prompt alone is capped at it (the original's per-model
    length); otherwise prompt plus generation are capped at the model's max context.
    """
    args = predictor.args
    new_tokens = args.max_new_tokens or dataset.max_new_tokens
    shared = dataset.turns is not None
    agnostic = predictor.query_agnostic and dataset.question is not None
    prompt = prompt_builder(args, dataset, predictor.tokenizer, predictor.max_length, agnostic)

    def record(rec, prompt, out):
        return {
            **dataset.output(rec),
            "pred": out.text,
            "prompt_tokens": len(prompt[0]),
            **({"question_tokens": [len(q) for q in prompt[1]]} if shared else {}),
            "quant": predictor.quant[out.label],
        }

    return Task(
        dataset.name,
        dataset.records,
        prompt,
        record,
        new_tokens,
        per_label(os.path.join(predictor.out_dir, dataset.name), predictor.labels, dataset.key),
        **(
            {"question_start": _context_length, "decode": decode_turns}  # a context compressed once
            if shared
            else {"ids": _first, "question_start": _second if agnostic else None}
        ),
    )


def prompt_builder(args, dataset, tokenizer, max_length, agnostic):
    """``prompt(record)``: the token ids of a record of ``dataset`` (``(ids, where the question starts)``, the
    start with ``agnostic`` only; with ``dataset.turns``: ``(context ids, [question ids])``), capped at
    ``max_length`` (generation included unless ``--max_length`` is given)."""
    new_tokens = args.max_new_tokens or dataset.max_new_tokens
    reserve = 0 if args.max_length else new_tokens
    chat = args.chat_template if dataset.chat else "off"
    wrapped = chat == "on" or (chat == "auto" and has_chat_template(tokenizer))

    def prompt(record):
        if dataset.turns is not None:
            context, questions = dataset.turns(record)
            return context_and_questions(tokenizer, context, questions, max_length, chat, reserve)
        text = dataset.text(record, wrapped)
        if not agnostic:
            return prompt_ids(tokenizer, text, max_length, chat, reserve), None
        return prompt_ids(tokenizer, text, max_length, chat, reserve, dataset.question(record, wrapped))

    return prompt


def check_max_length(args, datasets):
    """With ``--max_length``: build the first prompt of each data set (the model's tokenizer, no model) and
    raise ``ValueError`` naming the flag when it leaves no room for them."""
    if not args.max_length:
        return
    from .ruler.generate import load_tokenizer

    tokenizer = load_tokenizer(args.model_path)
    for dataset in datasets:
        if not dataset.records:
            continue
        agnostic = bool(getattr(args, "query_agnostic", False)) and dataset.question is not None
        try:
            prompt_builder(args, dataset, tokenizer, args.max_length, agnostic)(dataset.records[0])
        except ValueError:
            chat = args.chat_template if dataset.chat else "off"
            shell = len(encode(tokenizer, build_prompt(tokenizer, "", chat)))
            raise ValueError(
                f"--max_length {args.max_length} leaves no room for {dataset.name}'s prompts (its first "
                f"one: the chat template alone takes {shell} tokens, then its question and some context)"
            ) from None


def _context_length(prompt):
    return len(prompt[0])


def decode_turns(model, tokenizer, prompts, configs, max_new_tokens, sweep=True, question_starts=None):
    """The loop's decoder of ``(context ids, [question ids])`` prompts: per config, per prompt the answers
    (:func:`restkv.bench.generation.answer_questions`); ``question_starts`` (the context lengths) is implied."""
    return answer_questions(
        model, tokenizer, [p[0] for p in prompts], [p[1] for p in prompts], configs, max_new_tokens, sweep
    )


def _first(pair):
    return pair[0]


def _second(pair):
    return pair[1]


def default_data_dir(ours, original):
    """``--data_dir``'s default: ``ours``, or the original's folder when only that one exists."""
    return original if not os.path.isdir(ours) and os.path.isdir(original) else ours


@dataclass
class DatasetPlan:
    """Everything a run over datasets checks before the model loads."""

    configs: list  # (label, configure kwargs)
    datasets: list  # Dataset
    meta: dict = field(default_factory=dict)  # stored in run_meta.json


def prepare_datasets(args, name, load, meta=None):
    """Check the flags of a run over datasets, then load them (``load() -> list of Dataset``), before any
    model work; print the record count (stderr).

    Raises
    ------
    ValueError
        Naming the flag (a config, ``--max_length`` beyond the model's context), the file and line of
        malformed data, or the run folder's ``run_meta.json`` when its results were made with other knobs or
        settings (:func:`restkv.bench.meta.check_rerun`).
    FileNotFoundError
        A missing data file (with where to get it) or a registry model that is not installed.
    """
    check_common(args)
    configs = method_configs(args)
    check_context(args.model_path, [("--max_length", args.max_length, 0)])
    check_args_rerun(args, configs, prompt_settings(args))
    datasets = load()
    check_max_length(args, datasets)
    check_backend(args)
    print(f"{name}: {', '.join(f'{d.name} ({len(d.records)})' for d in datasets)}", file=sys.stderr)
    announce(name, [("records", sum(len(d.records) for d in datasets))], configs)
    return DatasetPlan(configs, datasets, dict(meta or {}))


def run_datasets(args, plan):
    """Predict every dataset of ``plan`` (:func:`prepare_datasets`) for every method x budget of ``args``.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed :func:`restkv.bench.cli.add_common_args` and :func:`restkv.bench.cli.add_dataset_args` flags.
    plan : DatasetPlan

    Returns
    -------
    dict
        ``{(dataset name, label): predictions file}``.
    """
    configs = plan.configs
    datasets = plan.datasets
    predictor = Predictor(args, configs)
    predictor.write_metadata(
        {
            "labels": predictor.labels,
            "configs": configs_meta(configs),
            "tasks": [d.name for d in datasets],
            "max_length": predictor.max_length,
            "processes": predictor.shard.size,
            "settings": prompt_settings(args),
            **plan.meta,
        }
    )
    tasks = [dataset_task(predictor, d) for d in datasets]
    predictor.predict(tasks)
    predictor.say_where(plan.meta.get("benchmark"))
    return {(t.name, label): path for t in tasks for label, path in t.store.paths.items()}
