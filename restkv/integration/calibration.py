"""What a config needs computed from the model before its layer plans: HeadKV's head importance
(when no file is given) and the per-layer constants of the methods that read them (``obs.data``:
Q-Filters' filters, Expected Attention's query statistics, DuoAttention's streaming heads). Each is
computed once per model and cached (``restkv.integration.headkv``, ``restkv.integration.qfilters``,
``restkv.integration.computed``).
"""

from __future__ import annotations

from ..eviction.plans import plan_layers
from ..methods import duo_attention, expected_attention_stats, fastkvzip, kvzap, qfilter, triattention
from . import duo_heads, qfilters, query_stats, trained, triattention_stats
from .headkv import cached_head_importance

# a scorer module -> ``layer_data(cfg, model) -> {layer index: constants}``; a method that reads constants
# computed from the model adds its line here
LAYER_DATA = {
    qfilter: qfilters.layer_data,
    expected_attention_stats: query_stats.layer_data,
    duo_attention: duo_heads.layer_data,
    kvzap: trained.kvzap_data,
    fastkvzip: trained.fastkvzip_data,
    triattention: triattention_stats.layer_data,
}


def layer_plans(model, cfg) -> list:
    """``plan_layers(model, cfg)`` with what it needs computed from ``model``."""
    needs_table = cfg.get("head_budget") == "headkv" and cfg.head_importance is None
    importance = cached_head_importance(model) if needs_table else None
    compute = LAYER_DATA.get(cfg.scorer.module) if cfg.evicts else None
    data = compute(cfg, model) if compute is not None else None
    return plan_layers(model, cfg, importance, data)
