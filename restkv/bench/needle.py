"""Needle-in-a-Haystack.

A needle sentence is inserted at a sentence boundary at a given depth of a
haystack cut to a given length, the model answers a question about it
greedily, and the answer is scored with ROUGE-1 F (as the original) and a
graded score (numeric needles: fraction of the digits right, in order).
"""

import hashlib
import json
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .generation import decode_configs
from .grid import configs_meta, method_configs, quant_settings
from .meta import write_metadata
from .models import essays_dir, load_from_args, model_name
from .prompts import build_prompt, encode, middle_truncate
from .results import read_jsonl

PROMPT = ("You are a helpful AI bot that answers questions for a user. Keep your response short and direct.\n\n"
          "<document>\n{context}\n</document>\n\n"
          "Question: {question} Don't give information outside the document or repeat your findings.\nAnswer:")

KEY_FIELDS = ("needle", "label", "config_id", "length", "depth")


@dataclass(frozen=True)
class Needle:
    """A needle, its question and expected answer; ``{key}`` in ``text`` and ``answer`` is a per-case number."""

    name: str
    text: str
    question: str
    answer: str

    def fill(self, key):
        """``(needle text, answer)`` with ``{key}`` replaced."""
        return self.text.format(key=key).strip(), self.answer.format(key=key).strip()


NEEDLES = {
    "sf": Needle("sf",
                 "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
                 "What is the best thing to do in San Francisco?",
                 "eat a sandwich and sit in Dolores Park on a sunny day"),
    "passkey": Needle("passkey", "The pass key is {key}. Remember it. {key} is the pass key.",
                      "What is the pass key?", "{key}"),
}


def parse_range(items, kind=int):
    """Expand ``["1000", "2000:4000:3"]`` into ``[1000, 2000, 3000, 4000]``.

    Each item is a number or ``start:stop:num`` (``num`` evenly spaced values,
    both ends included, rounded for ints). Order is kept, repeats dropped.
    """
    out = []
    for item in items:
        parts = str(item).split(":")
        if len(parts) == 1:
            values = [kind(float(parts[0]))]
        elif len(parts) == 3:
            start, stop, num = float(parts[0]), float(parts[1]), int(parts[2])
            if num < 1:
                raise ValueError(f"range {item!r}: num must be >= 1")
            values = [kind(round(v)) if kind is int else kind(round(v, 6)) for v in np.linspace(start, stop, num)]
        else:
            raise ValueError(f"expected a number or start:stop:num, got {item!r}")
        out += [v for v in values if v not in out]
    return out


class Haystack:
    """Token ids of the concatenated ``.txt`` files of a folder (sorted by name, cycled when too short).

    Raises
    ------
    FileNotFoundError
        The folder does not exist or holds no ``.txt`` file.
    """

    def __init__(self, tokenizer, folder):
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"haystack folder {folder} does not exist")
        self.files = sorted(folder.glob("*.txt"))
        if not self.files:
            raise FileNotFoundError(f"haystack folder {folder} holds no .txt file")
        self.folder, self.tokenizer = folder, tokenizer
        self._ids, self._read, self._boundary = [], 0, {}

    def ids(self, n):
        """The first ``n`` token ids."""
        while len(self._ids) < n:
            text = self.files[self._read % len(self.files)].read_text(encoding="utf-8", errors="replace")
            self._ids += self.tokenizer(text.strip() + "\n\n", add_special_tokens=False).input_ids
            self._read += 1
        return self._ids[:n]

    def is_boundary(self, token_id):
        """Whether a token ends a sentence (its text ends with ``.``, ``!`` or ``?``)."""
        if token_id not in self._boundary:
            self._boundary[token_id] = self.tokenizer.decode([token_id]).rstrip().endswith((".", "!", "?"))
        return self._boundary[token_id]


def insert_needle(context, needle, depth, is_boundary):
    """Insert ``needle`` into ``context`` (token id lists) at ``depth`` percent.

    The insertion point moves back to just after the nearest sentence end;
    ``depth >= 100`` appends at the end.

    Returns
    -------
    (list of int, int)
        The new ids and the needle's first index.
    """
    if depth >= 100:
        pos = len(context)
    else:
        pos = int(len(context) * depth / 100)
        while pos > 0 and not is_boundary(context[pos - 1]):
            pos -= 1
    return context[:pos] + needle + context[pos:], pos


@dataclass
class Case:
    """One prompt: its token ids, where the needle lies in them, and what the answer should be."""

    ids: list
    needle_text: str
    answer: str
    needle_span: tuple  # [start, end) token positions in ``ids``, None if truncated away
    truncated: bool


def passkey(seed, length, depth):
    """The 5-digit key of one (length, depth) cell: the same for every method."""
    return random.Random(f"{seed}:{length}:{depth}").randint(10000, 99999)


def make_case(tokenizer, haystack, needle, length, depth, chat_template="auto", max_length=None, seed=0):
    """Build the prompt of one (needle, length, depth) cell.

    ``length`` is the prompt's total size in tokens (template, question and
    needle included); the haystack fills what is left. Prompts longer than
    ``max_length`` are truncated in the middle.
    """
    needle_text, answer = needle.fill(passkey(seed, length, depth))
    needle_ids = tokenizer("\n" + needle_text + "\n", add_special_tokens=False).input_ids
    shell = build_prompt(tokenizer, PROMPT.format(context="", question=needle.question), chat_template)
    room = length - len(encode(tokenizer, shell)) - len(needle_ids)
    if room < 1:
        raise ValueError(f"context length {length} leaves no room for the haystack")
    ctx, _ = insert_needle(haystack.ids(room), needle_ids, depth, haystack.is_boundary)
    context = tokenizer.decode(ctx)
    prompt = build_prompt(tokenizer, PROMPT.format(context=context, question=needle.question), chat_template)
    ids, offsets = encode(tokenizer, prompt, offsets=True)
    c0 = prompt.find(needle_text, prompt.find("<document>"))
    c1 = c0 + len(needle_text)
    inside = [i for i, (a, b) in enumerate(offsets) if b > a and a < c1 and b > c0]
    span = (inside[0], inside[-1] + 1)
    truncated = bool(max_length) and len(ids) > max_length
    if truncated:
        head, cut = (max_length + 1) // 2, len(ids) - max_length // 2
        moved = [p if p < head else p - cut + head for p in range(*span) if p < head or p >= cut]
        ids = middle_truncate(ids, max_length)
        span = (moved[0], moved[-1] + 1) if moved else None
    return Case(ids, needle_text, answer, span, truncated)


_ROUGE = None


def rouge1(target, prediction):
    """ROUGE-1 (precision, recall, F) of ``prediction`` against ``target``, stemmed, as the original."""
    global _ROUGE
    if _ROUGE is None:
        from rouge_score import rouge_scorer

        _ROUGE = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
    return _ROUGE.score(target, prediction)["rouge1"]


def digit_score(response, answer):
    """Fraction of ``answer``'s digits that the response's best digit run has at the same place.

    Digit runs may contain ``,`` or spaces between digit groups; a run of a
    different length is divided by the longer length.
    """
    runs = [re.sub(r"\D", "", r) for r in re.findall(r"\d(?:[\d,]|\s(?=\d))*", response)]
    best = 0.0
    for run in runs:
        best = max(best, sum(a == b for a, b in zip(run, answer)) / max(len(run), len(answer)))
    return best


def _words(text):
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def score(response, needle_text, answer):
    """Scores of one response.

    Returns
    -------
    dict
        ``rouge1_f`` (response vs the needle sentence), ``score`` (graded:
        :func:`digit_score` for numeric answers, else ROUGE-1 recall of the
        answer) and ``exact`` (1.0 when the answer appears verbatim, words or
        digits).
    """
    if answer.isdigit():
        graded = digit_score(response, answer)
        exact = float(answer in re.findall(r"\d+", re.sub(r"(?<=\d)[, ](?=\d)", "", response)))
    else:
        graded = rouge1(answer, response).recall
        exact = float(f" {_words(answer)} " in f" {_words(response)} ")
    return {"rouge1_f": rouge1(needle_text, response).fmeasure, "score": graded, "exact": exact}


def needle_kept(kept, span, index=0):
    """Fraction of the needle's tokens kept, averaged over layers and KV heads.

    None when no layer reports kept positions or the needle was truncated away.
    """
    layers = [k[index] for k in (kept or []) if k is not None]
    if not layers or span is None:
        return None
    pos = torch.arange(*span, device=layers[0].device)
    return float(torch.stack([(k.unsqueeze(-1) == pos).any(-2).float().mean() for k in layers]).mean())


def config_id(kwargs, settings):
    """Short hash of everything besides (needle, length, depth) that changes a record."""
    blob = json.dumps({"configure": kwargs, **settings}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:10]


def needles_from_args(args):
    if args.needle:
        if not args.retrieval_question or not args.answer:
            raise ValueError("--needle needs --retrieval_question and --answer")
        return [Needle("custom", args.needle, args.retrieval_question, args.answer)]
    unknown = [n for n in args.needles if n not in NEEDLES]
    if unknown:
        raise ValueError(f"needles: unknown {unknown}; choose from {sorted(NEEDLES)}")
    return [NEEDLES[n] for n in args.needles]


def add_needle_args(parser):
    """Flags of the needle sweep (besides :func:`restkv.bench.cli.add_common_args`)."""
    g = parser.add_argument_group("needle in a haystack")
    g.add_argument("--haystack_dir", default=None, help="folder of .txt files (default: the packaged essays)")
    g.add_argument("--needles", nargs="+", default=["passkey", "sf"], help=f"presets: {sorted(NEEDLES)}")
    g.add_argument("--needle", default=None, help="custom needle sentence ({key}: a random 5-digit number)")
    g.add_argument("--retrieval_question", default=None, help="question of the custom needle")
    g.add_argument("--answer", default=None, help="expected answer of the custom needle (may use {key})")
    g.add_argument("--context_lengths", nargs="+", default=["1024", "2048"],
                   help="prompt lengths in tokens: numbers or start:stop:num ranges")
    g.add_argument("--depth_percents", nargs="+", default=["0:100:3"],
                   help="needle depths in percent: numbers or start:stop:num ranges")
    g.add_argument("--max_new_tokens", type=int, default=32)
    g.add_argument("--no_plots", action="store_true", help="skip the PNGs")
    parser.set_defaults(save_dir=os.path.join("results", "needle"), default_methods=["restkv", "snapkv", "fullkv"])
    return parser


def run(args):
    """Run every (method x budget, needle, length, depth) record not yet in the results file.

    Each batch of cells is prefilled once for all configs (``--no_sweep``: once per config).
    Under ``accelerate launch`` the cells are sharded over the processes and the main process
    merges their parts (see :mod:`restkv.bench.shard`).

    Returns
    -------
    (str, list of dict)
        The results file and the records of this configuration (old and new); no records on
        the other processes of a sharded run.
    """
    from .shard import ResultFile, current

    configs = method_configs(args)
    needles = needles_from_args(args)
    lengths, depths = parse_range(args.context_lengths), parse_range(args.depth_percents, float)
    haystack_dir = Path(args.haystack_dir) if args.haystack_dir else essays_dir()
    if not haystack_dir.is_dir():
        raise FileNotFoundError(f"haystack folder {haystack_dir} does not exist")
    shard = current()
    model, tokenizer, max_length = load_from_args(args, shard)
    cap = args.max_length or max_length - args.max_new_tokens
    haystack = Haystack(tokenizer, haystack_dir)
    out_dir = os.path.join(args.save_dir, model_name(args.model_path))
    settings = {"model": model_name(args.model_path), "chat_template": args.chat_template, "max_length": cap,
                "max_new_tokens": args.max_new_tokens, "haystack": str(haystack_dir), "seed": args.seed,
                "dtype": args.dtype, "attn_implementation": args.attn_implementation, "prompt": PROMPT}
    ids = {label: config_id(kw, settings) for label, kw in configs}
    quant = {label: quant_settings(kw) for label, kw in configs}
    if shard.main:
        write_metadata(out_dir, args, {"benchmark": "needle", "labels": ids, "configs": configs_meta(configs),
                                       "max_length": cap, "lengths": lengths, "depths": depths,
                                       "needles": [asdict(n) for n in needles], "processes": shard.size})
    path = os.path.join(out_dir, "results.jsonl")
    cells = [(n, L, d) for n in needles for L in lengths for d in depths]
    plan = [(n.name, label, ids[label], L, d) for n, L, d in cells for label, _ in configs]
    with ResultFile(path, KEY_FIELDS, plan, shard) as out:
        def todo(cell):
            n, L, d = cell
            return [(label, kw) for label, kw in configs if not out.done((n.name, label, ids[label], L, d))]

        mine = [c for i, c in enumerate(cells) if shard.mine(i) and todo(c)]
        where = f" (process {shard.rank} of {shard.size})" if shard.size > 1 else ""
        print(f"needle{where}: {sum(len(todo(c)) for c in mine)} records to run", file=sys.stderr)
        bar = tqdm(total=len(mine), desc="needle", unit="cell")
        for start in range(0, len(mine), args.batch_size):
            batch = mine[start:start + args.batch_size]
            left = {label for c in batch for label, _ in todo(c)}
            need = [(label, kw) for label, kw in configs if label in left]
            cases = [make_case(tokenizer, haystack, n, L, d, args.chat_template, cap, args.seed) for n, L, d in batch]
            t0 = time.time()
            results = decode_configs(model, tokenizer, [c.ids for c in cases], [kw for _, kw in need],
                                     args.max_new_tokens, sweep=not args.no_sweep)
            seconds = (time.time() - t0) / (len(batch) * len(need))
            for i, ((n, L, d), case) in enumerate(zip(batch, cases)):
                for (label, kwargs), (responses, kept) in zip(need, results):
                    if out.done((n.name, label, ids[label], L, d)):
                        continue
                    out.write({
                        "needle": n.name, "label": label, "config_id": ids[label], "length": L, "depth": d,
                        "method": kwargs["method"], "budget": kwargs.get("max_capacity_prompt"),
                        "quant": quant[label], "model": settings["model"], "prompt_tokens": len(case.ids),
                        "needle_span": case.needle_span, "truncated": case.truncated, "answer": case.answer,
                        "response": responses[i], **score(responses[i], case.needle_text, case.answer),
                        "needle_kept": needle_kept(kept, case.needle_span, i), "seconds": round(seconds, 3)})
            bar.update(len(batch))
        bar.close()
    shard.finish([path])
    if not shard.main:
        return path, []
    grid = {(n.name, L, d) for n in needles for L in lengths for d in depths}
    records = [r for r in read_jsonl(path)
               if ids.get(r["label"]) == r["config_id"] and (r["needle"], r["length"], r["depth"]) in grid]
    return path, records


def summary_table(records, metric="score"):
    """Mean ``metric`` per label (rows) and length (columns), over depths and needles, plus an ``all`` column."""
    lengths = sorted({r["length"] for r in records})
    order = {r["label"]: (r["method"] == "fullkv", r["method"], r["budget"] or 0) for r in records}
    labels = sorted(order, key=order.get)
    width = max([len("method")] + [len(s) for s in labels])
    lines = [f"{'method':<{width}} " + " ".join(f"{L:>7}" for L in lengths) + f" {'all':>7}"]
    for label in labels:
        rows = [r for r in records if r["label"] == label]
        cells = [np.mean([r[metric] for r in rows if r["length"] == L] or [np.nan]) for L in lengths]
        lines.append(f"{label:<{width}} " + " ".join(f"{c:7.3f}" for c in cells)
                     + f" {np.mean([r[metric] for r in rows]):7.3f}")
    return "\n".join(lines)
