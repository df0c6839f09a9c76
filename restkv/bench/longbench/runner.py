"""The prediction loop shared by the LongBench and InfiniteBench runners.

For every task, the task's records are turned into prompts and decoded greedily
in batches under every method x budget of the command line (one prefill per
batch); each config's predictions are appended to
``<save_dir>/<model>/<task>/<label>.jsonl``; records already there are skipped.
"""

import os
from dataclasses import dataclass
from typing import Callable

from tqdm import tqdm

from ..generation import decode_configs
from ..grid import configs_meta, method_configs, quant_settings
from ..meta import write_metadata
from ..models import load_from_args, model_name
from ..prompts import build_prompt, encode, has_chat_template, middle_truncate


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
    at the model's max context. Each batch is prefilled once for all configs
    (``--no_sweep``: once per config). Under ``accelerate launch`` the records
    (numbered over all tasks) are sharded over the processes and the main
    process merges their parts (see :mod:`restkv.bench.shard`).

    Parameters
    ----------
    args : argparse.Namespace
        Parsed :func:`restkv.bench.cli.add_common_args` flags plus
        ``max_num_examples`` and ``max_new_tokens``.
    tasks : list of Task
    extra_meta : dict, optional
        Stored in ``run_meta.json``.

    Returns
    -------
    dict
        ``{(task name, label): predictions file}``.
    """
    from ..shard import ResultFile, current

    configs = method_configs(args)
    shard = current()
    model, tokenizer, max_length = load_from_args(args, shard)
    out_dir = os.path.join(args.save_dir, model_name(args.model_path))
    if shard.main:
        write_metadata(out_dir, args, {"labels": [c[0] for c in configs], "configs": configs_meta(configs),
                                       "tasks": [t.name for t in tasks], "max_length": max_length,
                                       "processes": shard.size, **(extra_meta or {})})
    quant = {label: quant_settings(kw) for label, kw in configs}
    files, first = {}, 0
    for task in tasks:
        new_tokens = args.max_new_tokens or task.max_new_tokens
        reserve = 0 if args.max_length else new_tokens
        chat = args.chat_template if task.chat else "off"
        wrapped = chat == "on" or (chat == "auto" and has_chat_template(tokenizer))
        plan = [(r[task.key],) for r in task.records]
        outs = {}
        for label, _ in configs:
            files[(task.name, label)] = path = os.path.join(out_dir, task.name, f"{label}.jsonl")
            outs[label] = ResultFile(path, (task.key,), plan, shard)
        try:
            def todo(record):
                return [label for label, _ in configs if not outs[label].done((record[task.key],))]

            mine = [r for i, r in enumerate(task.records, first) if shard.mine(i) and todo(r)]
            first += len(task.records)
            bar = tqdm(total=len(mine), desc=task.name, leave=False)
            for start in range(0, len(mine), args.batch_size):
                batch = mine[start:start + args.batch_size]
                left = {label for r in batch for label in todo(r)}
                need = [(label, kw) for label, kw in configs if label in left]
                ids = [prompt_ids(tokenizer, task.text(r, wrapped), max_length, chat, reserve) for r in batch]
                results = decode_configs(model, tokenizer, ids, [kw for _, kw in need], new_tokens,
                                         sweep=not args.no_sweep)
                for (label, _), (preds, _) in zip(need, results):
                    for record, pred, p in zip(batch, preds, ids):
                        if not outs[label].done((record[task.key],)):
                            outs[label].write({**task.output(record), "pred": pred, "prompt_tokens": len(p),
                                               "quant": quant[label]})
                bar.update(len(batch))
            bar.close()
        finally:
            for out in outs.values():
                out.close()
    shard.finish(files.values())
    return files


def add_loop_args(parser):
    """Flags of the shared loop: example cap and generation-length override."""
    parser.add_argument("--max_num_examples", type=int, default=None,
                        help="first N records of each dataset only")
    parser.add_argument("--max_new_tokens", type=int, default=None,
                        help="override the official number of new tokens of every dataset")
    return parser
