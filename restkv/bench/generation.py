"""Batched greedy generation: one eviction config at a time, or several on one prefill."""

import restkv

from ..lazy import torch

from .prompts import left_pad


def input_device(model):
    """Device of the model's input embeddings (the first device of a ``device_map`` model; CPU when offloaded)."""
    device = model.get_input_embeddings().weight.device
    return torch.device("cpu") if device.type == "meta" else device


def generate_batch(model, tokenizer, prompts, max_new_tokens):
    """Greedy-decode a batch of prompts with the model's current eviction config.

    ``prompts`` (texts or token ids) are left padded by :func:`restkv.bench.prompts.left_pad`.

    Returns
    -------
    list of str
        The generated continuation of each prompt only, special tokens removed.
    """
    input_ids, mask, pad = left_pad(tokenizer, prompts, input_device(model))
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad)
    return tokenizer.batch_decode(out[:, input_ids.shape[1]:], skip_special_tokens=True)


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
    return [(tokenizer.batch_decode(tokens, skip_special_tokens=True), kept) for tokens, kept in results]


def decode_configs(model, tokenizer, prompts, configs, max_new_tokens, sweep=True):
    """Continuations and kept positions of a batch under each config.

    With ``sweep`` one prefill serves every config (:func:`sweep_batch`); without it each config
    is set with ``restkv.configure`` and decoded by :func:`generate_batch` (the reference path).
    Both give the same result.

    Returns
    -------
    list of (list of str, list)
        Per config: the continuations and the per-layer kept positions.
    """
    if sweep:
        return sweep_batch(model, tokenizer, prompts, configs, max_new_tokens)
    out = []
    for kwargs in configs:
        restkv.configure(model, **kwargs)
        out.append((generate_batch(model, tokenizer, prompts, max_new_tokens), restkv.kept_positions(model)))
    return out
