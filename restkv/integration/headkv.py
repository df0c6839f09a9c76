"""HeadKV's head importance for any model, computed on generated needle prompts and cached per model.

HeadKV-R2 (Fu et al., "Not All Heads Matter", arXiv:2410.19258; the authors' ``retrieval_head_detection_r2.py``)
scores a head by how much of its attention lands on the needle while the model writes the answer. For
each needle prompt the model answers greedily (as many tokens as the answer has, stopping after a
newline or EOS); at each answer step t, head h attends with ``a_t`` over the cache, and with ``k`` the
needle's length in tokens and ``m`` the answer's,

    score_h = sum_t sum_{i in top-k(a_t), i in needle} 10 * a_t[i] / (k * m).

Only prompts answered right (token F1 of the answer > 0.5, the authors' ``qa_f1_score > 50``) count;
each head's importance is the mean of its scores over them. The table has the authors' format,
``{"layer-head": [one score per answered prompt]}``, which ``head_importance=FILE`` also reads.

The prompts are the needle benchmark's (:mod:`restkv.data.needles`) on the packaged essays: the
pass-key and San Francisco needles and one that takes a reasoning step (the key is named through a
second sentence), at 512 and 1024 tokens and 5 depths, each followed by the start of its answer
("The pass key is", as the authors' prompts end with "Answer:"). As in the authors' script, all but
the prompt's last token are prefilled and the answer is decoded from it, each step with eager attention
(its weights); greedy decoding in float32 makes the table deterministic. ``configure(method="headkv")``
without a file reads the table cached beside a converted registry checkpoint
(``<checkpoint>/head_importance-r2.json``) or under ``<models cache>/head_importance/``, computing it on
first use.

    python -m restkv.bench.head_scores --model_path smollm2-135m
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer
from transformers.cache_utils import DynamicCache

from ..config import CompressionConfig
from ..data.answers import qa_f1
from ..data.needles import NEEDLES, Haystack, Needle, make_case
from ..compat import cache_argument
from ..eviction.plans import plan_layers
from ..lazy import F, torch
from .attachment import attached
from .files import atomic_write
from .models import cache_dir, essays_dir

VERSION = "r2"  # in the cache file name: a change of prompts or rule gets a new name
REASONING = Needle(
    "reasoning",
    "Mira keeps her pass key in the blue box. The blue box holds the number {key}.",
    "What is Mira's pass key?",
    "{key}",
)
NEEDLES_R2 = (NEEDLES["passkey"], NEEDLES["sf"], REASONING)
# the start of the answer, put after the prompt (as the authors' "Answer:"), so the answer steps are the answer
PREFIX = {
    "passkey": "The pass key is",
    "sf": "The best thing to do in San Francisco is",
    "reasoning": "Mira's pass key is",
}
LENGTHS = (512, 1024)
DEPTHS = (0.0, 25.0, 50.0, 75.0, 100.0)


def answer_scores(attention, span, answer_tokens: int):
    """HeadKV-R2 scores of one answered prompt: ``attention`` [Hq, m, N] (float32: answer step t's attention
    over the N cache entries), ``span`` the needle's [start, end) positions -> [Hq]."""
    k = span[1] - span[0]
    top = attention.topk(min(k, attention.shape[-1]), dim=-1)
    inside = (top.indices >= span[0]) & (top.indices < span[1])
    return 10 * (top.values * inside).sum((-1, -2)) / (k * answer_tokens)


def answer_attention(model, tokenizer, ids, answer):
    """Answer greedily after ``ids`` as the authors' script does: prefill all but the last token, then decode
    from it, at most as many tokens as the answer has, stopping after a newline or EOS.

    Returns
    -------
    (tokens, attention, limit)
        The answer's token ids, per layer the attention [Hq, m, N] of its m steps over the cache (N its
        final length; each step's row zero beyond its own entries) and the answer's length in tokens.
    """
    limit = len(
        tokenizer(" " + answer, add_special_tokens=False).input_ids
    )  # as it follows the prefix
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    device = model.get_input_embeddings().weight.device
    cache = DynamicCache(config=model.config)
    model(
        input_ids=torch.tensor([ids[:-1]], device=device),
        use_cache=True,
        logits_to_keep=1,
        **{cache_argument(model): cache},
    )
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")  # the one backend that returns attention weights
    token = ids[-1]
    tokens = []
    steps = []
    try:
        for _ in range(limit):
            out = model(
                input_ids=torch.tensor([[token]], device=device),
                use_cache=True,
                output_attentions=True,
                **{cache_argument(model): cache},
            )
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            steps.append(
                [a[0, :, -1].float() for a in out.attentions]
            )  # per layer [Hq, entries so far]
            if token in stops or "\n" in tokenizer.decode([token]):
                break
    finally:
        model.set_attn_implementation(previous)
    width = len(ids) + len(tokens) - 1
    attention = [
        torch.stack([F.pad(step[layer], (0, width - step[layer].shape[-1])) for step in steps], 1)
        for layer in range(len(steps[0]))
    ]
    return tokens, attention, limit


def score_heads(
    model, tokenizer, haystack_dir=None, needles=None, lengths=None, depths=None, seed=0, log=None
):
    """HeadKV-R2 importance of every head of ``model`` on the needle prompts: ``{"layer-head": [scores]}``.

    Each prompt is followed by the start of its answer (``PREFIX``: "The pass key is"), as the authors'
    prompts end with "Answer:", so that the answer steps scored are the answer's own tokens.


    Raises
    ------
    ValueError
        When the model answers none of the prompts (HeadKV counts answered prompts only).
    """
    config = model.config.get_text_config()
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    haystack = Haystack(tokenizer, haystack_dir or essays_dir())
    table = {f"{layer}-{head}": [] for layer in range(layers) for head in range(heads)}
    cells = [
        (needle, length, depth)
        for needle in needles or NEEDLES_R2
        for length in lengths or LENGTHS
        for depth in depths or DEPTHS
    ]
    answered = 0
    with (
        torch.inference_mode(),
        attached(model, plan_layers(model, CompressionConfig(method="fullkv"))),
    ):
        for needle, length, depth in cells:
            case = make_case(tokenizer, haystack, needle, length, depth, seed=seed)
            ids = (
                case.ids
                + tokenizer(PREFIX.get(needle.name, ""), add_special_tokens=False).input_ids
            )
            tokens, attention, answer_tokens = answer_attention(model, tokenizer, ids, case.answer)
            if qa_f1(tokenizer.decode(tokens, skip_special_tokens=True), case.answer) <= 0.5:
                continue
            answered += 1
            scores = torch.stack(
                [answer_scores(a, case.needle_span, answer_tokens) for a in attention]
            ).cpu()
            for layer in range(layers):
                for head in range(heads):
                    table[f"{layer}-{head}"].append(round(float(scores[layer, head]), 6))
    if log:
        log(f"HeadKV head scores: {answered} of {len(cells)} needle prompts answered")
    if not answered:
        raise ValueError(
            f"head_importance: the model answered none of the {len(cells)} needle prompts, and HeadKV's "
            "scores count answered prompts only; pass head_importance=FILE"
        )
    return table


def table_path(model) -> Path:
    """Where the table of ``model`` is cached: beside its converted registry checkpoint, else under
    ``<models cache>/head_importance/`` keyed by its checkpoint path or hub id and shape."""
    source = str(getattr(model.config, "_name_or_path", "") or "")
    root = cache_dir("_").parent
    if source and os.path.isdir(source) and Path(source).resolve().parent == root.resolve():
        return Path(source) / f"head_importance-{VERSION}.json"
    config = model.config.get_text_config()
    where = os.path.abspath(source) if os.path.isdir(source) else source
    key = hashlib.sha1(
        f"{where}|{config.num_hidden_layers}|{config.num_attention_heads}".encode()
    ).hexdigest()[:10]
    return (
        root
        / "head_importance"
        / f"{os.path.basename(os.path.normpath(source)) or 'model'}-{key}-{VERSION}.json"
    )


def cached_head_importance(model) -> str:
    """The path of ``model``'s HeadKV table (:func:`table_path`), computed and written on first use.

    Raises
    ------
    ValueError
        When none is cached and the model has no checkpoint (``config._name_or_path``) to load its
        tokenizer from, or it answers none of the prompts.
    """
    path = table_path(model)
    if path.is_file():
        return str(path)
    source = getattr(model.config, "_name_or_path", "")
    if not source:
        raise ValueError(
            "head_importance: no file given, none cached for this model, and it has no checkpoint "
            "(config._name_or_path) to load its tokenizer from; pass head_importance=FILE"
        )
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    print(
        f"HeadKV head scores of {source}: computing them once on needle prompts (into {path})",
        file=sys.stderr,
    )
    t0 = time.time()
    table = score_heads(
        model,
        tokenizer,
        log=lambda text: print(f"{text} ({time.time() - t0:.0f} s)", file=sys.stderr),
    )
    atomic_write(str(path), json.dumps(table))
    return str(path)
