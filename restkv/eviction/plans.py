"""Which layers a config evicts and how: ``plan_layers`` checks a config against a model (backend, layers,
sliding windows, HeadKV table) before any work and gives each attention layer its ``LayerPlan``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from ..strategies.budgets import check_layers, headkv_budgets, load_head_importance, load_lukv_curve
from ..strategies.layers import evicted_layers
from ..config import CompressionConfig
from ..strategies.think import pruned_channels
from .compose import first_stage


@dataclass(frozen=True)
class LayerPlan:
    """What one attention layer does at prefill under a config."""

    cfg: CompressionConfig
    rank: int  # index among the evicted layers; -1: not evicted (sliding-window)
    num_evicted: int
    # HeadKV: entries per KV head, window excluded [Hkv]; LU-KV: the layer's prune ratios [99, Hkv]
    table: torch.Tensor | None = None
    window: int | None = (
        None  # the sliding window of an evicted sliding-window layer (None: full attention)
    )
    data: object = None  # the method's constants of this layer (``plan_layers``' ``layer_data``), read as ``obs.data``

    @property
    def evicts(self) -> bool:
        return self.rank >= 0

    @property
    def deferred(self) -> bool:
        """The selection waits for every layer's prefill: a global layer budget, or passes after the prefill."""
        return is_deferred(self.cfg)


def is_deferred(cfg) -> bool:
    """Whether ``cfg``'s selection waits for every layer's prefill (``restkv.eviction.deferred``)."""
    return cfg.evicts and (cfg.get("layer_budget") == "global" or cfg.scorer.replays)


SUPPORTED_BACKENDS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")


def backend_kind(implementation: str) -> str | None:
    """ "eager", "sdpa" or "flash": the attention ``implementation`` is, by the mask function transformers
    registered for it (a flash kernel from the hub, e.g. "kernels-community/flash-attn2", registers flash's);
    None: a backend restkv does not attend through."""
    if implementation in ("eager", "sdpa"):
        return implementation
    masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    flash = masks.get("flash_attention_2")
    return "flash" if flash is not None and masks.get(implementation) is flash else None


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a decoder, in layer order."""
    found = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    return sorted(found, key=lambda m: m.layer_idx)


def plan_layers(
    model: nn.Module,
    cfg: CompressionConfig,
    head_importance: str | None = None,
    layer_data: dict | None = None,
) -> list[LayerPlan]:
    """Each attention layer's plan under ``cfg``, checked against the model (backend, layers, HeadKV table).

    ``head_importance``: the HeadKV table file to use when ``cfg`` names none; ``layer_data``: the method's
    constants of each layer (``{layer index: data}``, read as ``obs.data``), computed from the model
    (``restkv.integration.calibration``).
    """
    config = model.config.get_text_config()
    implementation = model.config._attn_implementation
    if backend_kind(implementation) is None:
        raise ValueError(
            f"attn_implementation {implementation!r} is not supported; use one of "
            f"{', '.join(SUPPORTED_BACKENDS)} or a flash kernel from the hub"
        )
    modules = attention_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no attention module with layer_idx and o_proj"
        )
    windows = evicted_layers(config, [m.layer_idx for m in modules])
    evicted = list(windows)
    if cfg.evicts and not evicted:
        raise ValueError(
            "the model has no layer to evict from (no full-attention layer, no sliding window size)"
        )
    if cfg.evicts and cfg.get("gqa_agg") == "none" and any(windows.values()):
        raise ValueError(
            "gqa_agg='none' (one set per query head, the packed layout) cannot bound decoding by the "
            "sliding window of this model's layers; use another gqa_agg"
        )
    if cfg.evicts and cfg.get("decode_interval") and any(windows.values()):
        raise ValueError(
            "decode_interval: eviction while decoding is not supported on a model with sliding-window "
            "layers (it evicts among the window's entries at prefill); set decode_interval=0"
        )
    if (
        cfg.evicts
        and any(windows.values())
        and (is_deferred(cfg) or cfg.get("pruning_ratio") is not None)
    ):
        knob = (
            "pruning_ratio"
            if cfg.get("pruning_ratio") is not None
            else ("layer_budget" if cfg.get("layer_budget") == "global" else "method")
        )
        raise ValueError(
            f"{knob}={cfg.get(knob)!r} is not supported on a model whose evicted layers are "
            "sliding-window (it evicts among the window's entries at prefill)"
        )
    if cfg.evicts:
        cfg.scorer.check_layers(cfg, len(evicted))
        check_layers(cfg, len(evicted))
        cfg.scorer.check_model(cfg, model)
        _check_first_stage(cfg, model, len(evicted))
    if cfg.get("pruning_ratio") is not None:
        pruned_channels(cfg.pruning_ratio, modules[0].head_dim)
    table = None
    if cfg.get("head_budget") == "headkv":
        path = cfg.head_importance or head_importance
        if path is None:
            raise ValueError(
                "head_importance: HeadKV budgets need a head-importance file; "
                "restkv.configure computes the model's own (restkv.integration.headkv)"
            )
        importance = load_head_importance(
            path, len(modules), config.num_attention_heads, config.num_key_value_heads
        )
        rows = [
            m.layer_idx for m in modules if m.layer_idx in evicted
        ]  # the pool is the evicted layers' only
        shared = headkv_budgets(
            importance[rows], cfg.max_capacity_prompt - cfg.window_size, cfg.headkv_beta
        )
        table = dict(zip(rows, shared))
    if cfg.get("head_budget") == "lukv":  # indexed by layer, as kvpress: every layer has a row
        curve = load_lukv_curve(
            cfg.lukv_curve, config.num_hidden_layers, config.num_key_value_heads
        )
        table = {m.layer_idx: curve[:, m.layer_idx] for m in modules}
    data = layer_data or {}
    return [
        LayerPlan(
            cfg,
            evicted.index(m.layer_idx) if m.layer_idx in evicted else -1,
            len(evicted),
            on_device(None if table is None else table.get(m.layer_idx), _device(m)),
            windows.get(m.layer_idx),
            on_device(data.get(m.layer_idx), _device(m)),
        )
        for m in modules
    ]


def _device(module: nn.Module) -> torch.device:
    """Where ``module``'s weights are (its layer's, with ``device_map="auto"``)."""
    return next(module.parameters()).device


def on_device(data, device: torch.device):
    """``data`` (None, a tensor, or tuples, lists and dicts of them) on ``device``: a layer's
    constants moved once, when the layer is planned, not at every eviction."""
    if isinstance(data, dict):
        return {key: on_device(x, device) for key, x in data.items()}
    if isinstance(data, (tuple, list)):
        return type(data)(on_device(x, device) for x in data)
    if isinstance(data, torch.Tensor) and device.type != "meta":  # offloaded: moved when scored
        return data.to(device)
    return data


def _check_first_stage(cfg, model, num_layers: int) -> None:
    """``compose``'s method checked against the model as the config's own is."""
    if cfg.get("compose") is None:
        return
    first = first_stage(cfg.compose, cfg.window_size, cfg.window_size + 1)
    try:
        first.scorer.check_layers(first, num_layers)
        first.scorer.check_model(first, model)
    except ValueError as e:
        raise ValueError(f"compose={cfg.compose!r}: {e}") from None
