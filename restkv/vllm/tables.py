"""The model's budgets per layer and per KV head, from the config and what ``bind_model`` read of the
model: HeadKV's head-importance table, LU-KV's budget curve, PyramidKV's and ``layer_ratios``' layer
schedules, and the bounds of a request's kept entries the scheduler counts from them (``largest``,
``most_kept``, ``mean_kept``); the tensor-parallel ranks sharing the heads (``rank_share``). No vLLM import here.
"""

from __future__ import annotations

import math

import torch

from ..config import CompressionConfig
from ..strategies.budgets import check_layers, layer_budgets, ratio_budgets
from ..strategies.head_budgets import headkv_budgets, load_head_importance, load_lukv_curve, lukv_sizes
from .plugin_config import UNBOUNDED, budget_knobs, deferred, per_layer, sized_across_heads

_TABLES: dict = {}  # config -> (the model's layers, heads, KV heads; HeadKV's counts [layers, Hkv] or
# LU-KV's curve [99, layers, Hkv] for it)
_LAYERS: dict = {}  # config -> the model's attention layers (``bind_model``)
_RANKS: dict = {}  # config -> its tensor-parallel ranks (``bind_model``)


def bind_model(cfg: CompressionConfig, layers: int, heads: int, kv_heads: int, ranks: int = 1) -> None:
    """Read what the config needs of the model before any request: its ``layers`` attention layers
    (PyramidKV's schedule over them), HeadKV's head-importance table, shared among their ``kv_heads``
    heads (``heads`` query heads; every rank's), as ``restkv.configure`` shares it, LU-KV's budget curve;
    ``ranks`` the tensor-parallel ranks sharing the heads. A file that does not fit the model raises a
    one-line ValueError."""
    model = (layers, heads, kv_heads)
    check_layers(cfg, layers)
    _LAYERS[cfg] = layers
    _RANKS[cfg] = ranks
    if _TABLES.get(cfg, (None,))[0] == model:
        return
    if cfg.get("head_budget") == "headkv":
        importance = load_head_importance(cfg.head_importance, layers, heads, kv_heads)
        base = cfg.max_capacity_prompt - cfg.window_size
        _TABLES[cfg] = (model, headkv_budgets(importance, base, cfg.headkv_beta))
    if cfg.get("head_budget") == "lukv":
        _TABLES[cfg] = (model, load_lukv_curve(cfg.lukv_curve, layers, kv_heads))


def head_table(cfg: CompressionConfig):
    """HeadKV's prefix entries per head [layers, Hkv] (window excluded), or LU-KV's curve [99, layers, Hkv],
    from ``bind_model``."""
    if cfg not in _TABLES:
        raise RuntimeError(f"restkv.vllm: {budget_knobs(cfg)} before settings.bind_model read its table")
    return _TABLES[cfg][1]


def layer_budget(cfg: CompressionConfig, budget: int, prompt_len: int, layer: int, layers: int) -> int:
    """Entries each KV head of attention layer ``layer`` (of ``layers``) keeps at ``budget`` in an
    eviction whose schedule is read at ``prompt_len`` (``schedule_length``), as ``restkv.configure``
    shares it among the layers."""
    if not per_layer(cfg):
        return budget
    return layer_budgets(cfg, layers, prompt_len, budget)[layer]


def largest(cfg: CompressionConfig, budget: int, held: int = UNBOUNDED) -> int:
    """Entries per KV head, on average over its heads, of the layer that keeps the most at ``budget``,
    from the config alone: ``budget``; HeadKV's table's largest layer average; PyramidKV's first layer at
    most ``window + ceil(2 (B - window) - (B - window) / beta)``; ``layer_ratios``' and LU-KV's largest
    over every prompt of at most ``held`` entries (``lukv_largest``); ``UNBOUNDED`` for ``DEFERRED``."""
    if deferred(cfg):
        return UNBOUNDED
    if cfg.get("head_budget") == "lukv":
        return lukv_largest(cfg, budget, held)
    most = budget
    if cfg.get("head_budget") == "headkv":
        table = head_table(cfg)
        most = cfg.window_size + -(-int(table.sum(-1).max()) // table.shape[-1])
    if cfg.get("layer_ratios") is not None:
        return max(ratio_budgets(cfg, held))  # its layers' budgets over a prompt of ``held``
    if per_layer(cfg):
        base = budget - cfg.window_size
        most = max(most, cfg.window_size + math.ceil(2 * base - base / cfg.beta))
    return most


def layer_table(cfg: CompressionConfig, layer: int, device):
    """HeadKV's counts [Hkv] or LU-KV's curve [99, Hkv] of attention layer ``layer`` on ``device``, or None
    for other configs."""
    if cfg.get("head_budget") == "headkv":
        return head_table(cfg)[layer].to(device)
    if cfg.get("head_budget") == "lukv":
        return head_table(cfg)[:, layer].to(device)
    return None


def most_kept(cfg: CompressionConfig, budget: int, max_len: int) -> int:
    """Entries per KV head, on average over every layer and head, a request keeps at most over prompts of
    up to ``max_len`` entries: ``budget`` where the layers and heads share it (uniform, AdaKV, HeadKV,
    PyramidKV, a threshold, a budget shared across layers), else the largest layer's bound over those
    prompts (LU-KV's curve, ``layer_ratios``: ``largest``), at most ``max_len``."""
    if cfg.get("head_budget") == "lukv" or cfg.get("layer_ratios") is not None:
        return min(max_len, largest(cfg, budget, max_len))
    return min(max_len, budget)


def lukv_kept(cfg: CompressionConfig, budget: int, prompt_len: int) -> int:
    """Entries LU-KV's heads keep at the prompt's end, summed over every layer and head (window included,
    ``lukv_sizes`` of each layer at its budget over ``prompt_len`` entries, as the worker selects)."""
    curve, w = head_table(cfg), cfg.window_size
    layers = curve.shape[1]
    budgets = layer_budgets(cfg, layers, prompt_len, budget) if per_layer(cfg) else [budget] * layers
    length = torch.tensor([prompt_len])
    return sum(int((lukv_sizes(curve[:, i], length, b, w) + w).sum()) for i, b in enumerate(budgets))


def lukv_largest(cfg: CompressionConfig, budget: int, held: int) -> int:
    """Entries per KV head, on average over its heads, that LU-KV's largest layer keeps at ``budget`` over
    any prompt of at most ``held`` entries (``held`` with PyramidKV's layer budgets, or ``UNBOUNDED``).
    A prompt of L entries reads the curve's row ``round(100 (1 - B / L)) - 1``; over the lengths of one
    row a layer's total grows with L, so each row's last length holding at most ``held`` gives its largest
    (``lukv_sizes`` there, as the worker selects); a prompt within the budget keeps all it holds."""
    if held >= UNBOUNDED or per_layer(cfg):
        return held
    curve, w = head_table(cfg), cfg.window_size
    most = min(held, budget)
    if held <= budget:
        return most
    lengths = torch.arange(budget + 1, held + 1, dtype=torch.float64)
    rows = ((1.0 - budget / lengths) * 100).round().long().sub(1).clamp(0, 98)
    last = torch.zeros(99, dtype=torch.float64).scatter_reduce(0, rows, lengths, "amax")
    last = last[last > 0].long()  # [rows] each row's last length
    for layer in range(curve.shape[1]):
        kept = lukv_sizes(curve[:, layer], last, budget, w) + w  # [rows, Hkv]
        most = max(most, -(-int(kept.sum(-1).max()) // kept.shape[-1]))
    return most


def mean_kept(cfg: CompressionConfig, budget: int, prompt_len: int, layers: int) -> int:
    """Entries per KV head a request keeps at ``budget``, on average over its ``layers`` layers and their
    heads, from the config alone (rounded up): ``budget`` where a layer's heads share ``Hkv * budget``
    (AdaKV) or keep ``budget`` each; HeadKV's table's mean; PyramidKV's schedule's mean over its layers
    (``layers * budget`` in all, uniform for a prompt within the budget); LU-KV's counts from its
    curve at ``prompt_len`` (``lukv_kept``); ``UNBOUNDED`` for ``DEFERRED`` (measured by the worker)."""
    if deferred(cfg):
        return UNBOUNDED
    if cfg.get("head_budget") == "lukv":
        heads = head_table(cfg).shape[1] * head_table(cfg).shape[2]
        return -(-lukv_kept(cfg, budget, prompt_len) // heads)
    if cfg.get("head_budget") == "headkv":
        table = head_table(cfg)
        return cfg.window_size + -(-int(table.sum()) // table.numel())
    if per_layer(cfg):
        return -(-sum(layer_budgets(cfg, layers, prompt_len, budget)) // layers)
    return budget


def layers_of(cfg: CompressionConfig) -> int:
    """The model's attention layers, as ``bind_model`` read them."""
    if cfg not in _LAYERS:
        raise RuntimeError("restkv.vllm: a per-layer budget before settings.bind_model read the model")
    return _LAYERS[cfg]



def rank_share(cfg: CompressionConfig) -> int:
    """How many times the mean over every head one rank's heads may hold: the ranks where the heads' split is
    across them (``sized_across_heads``: all of it may be one rank's), else 1."""
    return _RANKS.get(cfg, 1) if sized_across_heads(cfg) else 1
