"""The prediction loop shared by the LongBench and InfiniteBench runners.

For every method x budget of the command line and every task, the task's
records are turned into prompts, decoded greedily in batches and appended to
``<save_dir>/<model>/<task>/<label>.jsonl``; records already there are skipped.
"""

import os
from dataclasses import dataclass
from typing import Callable

from tqdm import tqdm

from ..common import (JsonlWriter, build_prompt, encode, generate_batch, has_chat_template, load_from_args,
                      method_configs, middle_truncate, write_metadata)


@dataclass
class Task:
    """One dataset to predict.

    Parameters
    ----------
    name : str
        Folder name of its predictions.
    records : list of dict
        Its records.
    text : callable
        ``text(record, chat) -> str``: the filled prompt template; ``chat`` tells
        whether the chat template will wrap it.
    output : callable
        ``output(record) -> dict``: the fields stored beside the prediction (key field included).
    max_new_tokens : int
        Tokens to generate.
    chat : bool
        Whether the chat template may be applied (the ``--chat_template`` flag decides).
    key : str
        Record field that identifies it in the predictions file.
    """

    name: str
    records: list
    text: Callable
    output: Callable
    max_new_tokens: int
    chat: bool = True
    key: str = "_id"


def model_name(model_path):
    """Folder name of a model: the registry name or the last part of its path."""
    return os.path.basename(os.path.normpath(model_path))


def prompt_ids(tokenizer, text, max_length, chat_template, reserve=0):
    """Token ids of one prompt: middle-truncate ``text``, then apply the chat template.

    Parameters
    ----------
    tokenizer : PreTrainedTokenizer
    text : str
        The filled template.
    max_length : int
        Cap on the tokens of ``text`` plus ``reserve`` plus the chat template's own tokens.
    chat_template : {"auto", "on", "off"}
    reserve : int
        Tokens kept free (for generation).

    Returns
    -------
    list of int
    """
    overhead = len(encode(tokenizer, build_prompt(tokenizer, "", chat_template)))
    cap = max_length - reserve - overhead
    if cap < 1:
        raise ValueError(f"max_length {max_length} leaves no room for the prompt "
                         f"({reserve} new tokens, {overhead} template tokens)")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) > cap:
        text = tokenizer.decode(middle_truncate(ids, cap), skip_special_tokens=True)
    return encode(tokenizer, build_prompt(tokenizer, text, chat_template))


def run_tasks(args, tasks, extra_meta=None):
    """Predict every task for every method x budget of ``args``.

    With ``args.max_length`` set, the prompt alone is capped at it (the
    original's per-model length); otherwise prompt plus generation are capped
    at the model's max context.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed :func:`restkv.bench.common.add_common_args` flags plus
        ``max_num_examples`` and ``max_new_tokens``.
    tasks : list of Task
    extra_meta : dict, optional
        Stored in ``run_meta.json``.

    Returns
    -------
    dict
        ``{(task name, label): predictions file}``.
    """
    import restkv

    configs = method_configs(args)
    model, tokenizer, max_length = load_from_args(args)
    out_dir = os.path.join(args.save_dir, model_name(args.model_path))
    write_metadata(out_dir, args, {"labels": [c[0] for c in configs], "tasks": [t.name for t in tasks],
                                   "max_length": max_length, **(extra_meta or {})})
    files = {}
    for label, kwargs in configs:
        restkv.configure(model, **kwargs)
        for task in tasks:
            new_tokens = args.max_new_tokens or task.max_new_tokens
            reserve = 0 if args.max_length else new_tokens
            chat = args.chat_template if task.chat else "off"
            wrapped = chat == "on" or (chat == "auto" and has_chat_template(tokenizer))
            path = os.path.join(out_dir, task.name, f"{label}.jsonl")
            files[(task.name, label)] = path
            with JsonlWriter(path, (task.key,)) as writer:
                todo = [r for r in task.records if not writer.done((r[task.key],))]
                bar = tqdm(total=len(todo), desc=f"{label} {task.name}", leave=False)
                for start in range(0, len(todo), args.batch_size):
                    batch = todo[start:start + args.batch_size]
                    ids = [prompt_ids(tokenizer, task.text(r, wrapped), max_length, chat, reserve) for r in batch]
                    preds = generate_batch(model, tokenizer, ids, new_tokens)
                    for record, pred, p in zip(batch, preds, ids):
                        writer.write({**task.output(record), "pred": pred, "prompt_tokens": len(p)})
                    bar.update(len(batch))
                bar.close()
    return files


def add_loop_args(parser):
    """Flags of the shared loop: example cap and generation-length override."""
    parser.add_argument("--max_num_examples", type=int, default=None,
                        help="first N records of each dataset only")
    parser.add_argument("--max_new_tokens", type=int, default=None,
                        help="override the official number of new tokens of every dataset")
    return parser
