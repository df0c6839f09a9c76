"""Batched greedy generation: one eviction config at a time, or several on one prefill; with the
question after compression (query-agnostic: one question, or several on one compressed context) or as part
of the compressed prompt."""

import restkv

from ..lazy import F, torch

from ..data.prompts import encode, left_pad


GREEDY = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
"""``generate()``'s greedy decoding, whatever the model's generation config says."""


def input_device(model):
    """Device of the model's input embeddings (the first device of a ``device_map`` model; CPU when offloaded)."""
    device = model.get_input_embeddings().weight.device
    return torch.device("cpu") if device.type == "meta" else device


def generate_batch(model, tokenizer, prompts, max_new_tokens):
    """Greedy-decode a batch of prompts with the model's current eviction config.

    ``prompts`` (texts or token ids) are left padded by :func:`restkv.data.prompts.left_pad`.

    Returns
    -------
    list of str
        The generated continuation of each prompt only, special tokens removed.
    """
    input_ids, mask, pad = left_pad(tokenizer, prompts, input_device(model))
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            **GREEDY,
        )
    return tokenizer.batch_decode(out[:, input_ids.shape[1] :], skip_special_tokens=True)


def sweep_batch(model, tokenizer, prompts, configs, max_new_tokens):
    """Greedy-decode a batch of prompts under several eviction configs with one prefill (``restkv.sweep``).

    Decoding is that of :func:`generate_batch` (left padding, the model's EOS, special tokens removed).

    Parameters
    ----------
    configs : list of dict
        ``restkv.configure`` kwargs, one per config.

    Returns
    -------
    list of (list of str, list)
        Per config: the continuations and the per-layer kept positions (as ``restkv.kept_positions``:
        LongTensor ``[batch, kv_heads, kept]`` or None per layer).
    """
    input_ids, mask, pad = left_pad(tokenizer, prompts, input_device(model))
    with torch.inference_mode():
        results = restkv.sweep(model, input_ids, mask, configs, max_new_tokens, pad_token_id=pad)
    return [
        (tokenizer.batch_decode(tokens, skip_special_tokens=True), kept) for tokens, kept in results
    ]


def decode_configs(
    model, tokenizer, prompts, configs, max_new_tokens, sweep=True, question_starts=None
):
    """Continuations and kept positions of a batch under each config.

    With ``sweep`` one prefill serves every config (:func:`sweep_batch`); without it each config
    is set with ``restkv.configure`` and decoded by :func:`generate_batch` (the reference path).
    Both give the same result. With ``question_starts`` (per prompt, the token where its question
    starts) the question comes after compression: :func:`answer_after_context`.

    Returns
    -------
    list of (list of str, list)
        Per config: the continuations and the per-layer kept positions.
    """
    if question_starts is not None:
        return answer_after_context(
            model, tokenizer, prompts, configs, max_new_tokens, question_starts, sweep
        )
    if sweep:
        return sweep_batch(model, tokenizer, prompts, configs, max_new_tokens)
    out = []
    for kwargs in configs:
        restkv.configure(model, **kwargs)
        out.append(
            (
                generate_batch(model, tokenizer, prompts, max_new_tokens),
                restkv.kept_positions(model),
            )
        )
    return out


def answer_after_context(
    model, tokenizer, prompts, configs, max_new_tokens, question_starts, sweep=True
):
    """Query-agnostic decoding: each prompt's context (its ids before ``question_starts``) is compressed
    without its question, then the question is read on the compressed cache and answered greedily
    (:func:`answer_questions` with one question per prompt).

    Returns
    -------
    list of (list of str, list)
        Per config: the continuations and the per-layer kept context positions (rows in prompt order,
        padded with -1 to the longest).
    """
    ids = [encode(tokenizer, p) if isinstance(p, str) else list(p) for p in prompts]
    if any(not 1 <= s < len(x) for x, s in zip(ids, question_starts)):
        raise ValueError(
            "question_starts: each must leave a context and a question of at least one token"
        )
    contexts = [x[:s] for x, s in zip(ids, question_starts)]
    questions = [[x[s:]] for x, s in zip(ids, question_starts)]
    out = answer_questions(model, tokenizer, contexts, questions, configs, max_new_tokens, sweep)
    return [([answers[0] for answers in texts], kept) for texts, kept in out]


def answer_questions(model, tokenizer, contexts, questions, configs, max_new_tokens, sweep=True):
    """A context compressed once, several questions after it: each context is compressed without its
    questions, then each of its questions is read on the compressed cache and answered greedily.

    Rows whose questions have the same numbers of tokens go together (contexts left padded). With ``sweep``
    one context prefill builds every config's cache (``restkv.integration.sweeps.prefill_caches``) and each
    config answers on its own (``restkv.integration.context.answer``, the cache rewound before each question);
    without it each config compresses the context (``restkv.compress_context``) and ``generate`` answers each
    question. Both give the same result.

    Parameters
    ----------
    contexts : list of list of int
        Per row, the context's token ids.
    questions : list of list of list of int
        Per row, the token ids of each of its questions (each at least one token).

    Returns
    -------
    list of (list of list of str, list)
        Per config: per row the answers to its questions, and the per-layer kept context positions (rows in
        order, padded with -1 to the longest).
    """
    if any(not c for c in contexts) or any(not q for qs in questions for q in qs):
        raise ValueError("contexts and questions must each hold at least one token")
    with torch.inference_mode():
        return _answer_questions(
            model, tokenizer, contexts, questions, configs, max_new_tokens, sweep
        )


def _answer_questions(model, tokenizer, contexts, questions, configs, max_new_tokens, sweep):
    from restkv.compat import cache_argument
    from restkv.integration.context import ContextCache, answer
    from restkv.integration.sweeps import prefill_caches

    groups = {}
    for row, qs in enumerate(questions):
        groups.setdefault(tuple(len(q) for q in qs), []).append(row)
    device = input_device(model)
    texts = [[None] * len(contexts) for _ in configs]
    kept = [
        [None] * len(contexts) for _ in configs
    ]  # per config and row: (per-layer kept, the row's index there)
    for shape, rows in groups.items():
        context, mask, pad = left_pad(tokenizer, [contexts[r] for r in rows], device)
        asked = [
            torch.tensor([questions[r][j] for r in rows], device=device) for j in range(len(shape))
        ]
        if sweep:
            pre = prefill_caches(model, context, mask, configs)
            caches = [ContextCache(c, pre.logits, k) for c, k in zip(pre.caches, pre.kept)]
        for c, kwargs in enumerate(configs):
            if sweep:
                cache, caches[c] = caches[c], None
            else:
                cache = restkv.compress_context(model, context, mask, **kwargs)
            answers = []
            for question in asked:
                if sweep:
                    tokens = answer(model, cache, question, mask, max_new_tokens, pad_token_id=pad)
                else:
                    full = torch.cat([context, question], 1)
                    out = model.generate(
                        full,
                        attention_mask=torch.cat([mask, torch.ones_like(question)], 1),
                        max_new_tokens=max_new_tokens,
                        pad_token_id=pad,
                        **GREEDY,
                        **{cache_argument(model): cache},
                    )
                    tokens = out[:, full.shape[1] :]
                answers.append(tokenizer.batch_decode(tokens, skip_special_tokens=True))
            for j, r in enumerate(rows):
                texts[c][r] = [per_question[j] for per_question in answers]
                kept[c][r] = (cache.kept, j)
    return [(t, _rows_in_order(k)) for t, k in zip(texts, kept)]


def _rows_in_order(per_row):
    """Per layer, the kept positions of every row ([b, H, K], -1 padded) from each row's (kept, index)."""
    out = []
    for layer in range(len(per_row[0][0])):
        parts = [kept[layer][j] if kept[layer] is not None else None for kept, j in per_row]
        if any(p is None for p in parts):
            out.append(None)
            continue
        width = max(p.shape[-1] for p in parts)
        out.append(torch.stack([F.pad(p, (0, width - p.shape[-1]), value=-1) for p in parts]))
    return out
