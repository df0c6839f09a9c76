"""The one integration path: every family and backend goes through ``_attention_with_eviction``.

transformers 5 dispatches attention through ``ALL_ATTENTION_FUNCTIONS`` (sdpa, flash-attention)
or each family's module-level ``eager_attention_forward``. restkv wraps those functions once; the
wrapper passes through for modules that were not configured. On a configured layer it

- at prefill (an empty cache receiving the whole prompt): runs the backend on the full cache,
  then scores the entries and swaps the layer's cache for a ``CompressedLayer``;
- when decoding on a ``CompressedLayer``: supplies the mask of the kept entries.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer
from transformers.modeling_utils import AttentionInterface

from .budgets import headkv_budgets, layer_budgets, load_head_importance
from .cache import CompressedLayer, KeptEntries, VarlenLayer, quantized_layer
from .compress import Compressed, compress
from .config import CompressionConfig
from .observation import Observation, relative_positions
from .scorers.restkv import wo_factor

SUPPORTED_BACKENDS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
FAMILIES = {
    "llama": "transformers.models.llama.modeling_llama",
    "mistral": "transformers.models.mistral.modeling_mistral",
    "qwen2": "transformers.models.qwen2.modeling_qwen2",
    "gemma": "transformers.models.gemma.modeling_gemma",
    "gemma2": "transformers.models.gemma2.modeling_gemma2",
    "gemma3": "transformers.models.gemma3.modeling_gemma3",
}


@dataclass
class LayerPlan:
    cfg: CompressionConfig
    rank: int  # index among the evicted layers
    num_evicted: int
    evicts: bool  # False on sliding-window layers
    head_budget: torch.Tensor | None = None  # HeadKV: entries per KV head, window excluded


def _attention_with_eviction(backend, implementation, module, query, key, value, attention_mask, **kwargs):
    plan: LayerPlan | None = getattr(module, "_restkv", None)
    cache = getattr(module, "_restkv_cache", None)
    if plan is None or cache is None or not plan.evicts:
        return backend(module, query, key, value, attention_mask, **kwargs)
    layer = cache.layers[module.layer_idx]
    if isinstance(layer, VarlenLayer):
        return layer.attend(query, kwargs.get("scaling") or module.head_dim**-0.5), None
    if isinstance(layer, KeptEntries):
        mask = layer.attention_mask(query.shape[2], implementation, query.dtype, query.shape[1] // key.shape[1])
        return backend(module, query, key, value, mask, **kwargs)
    out = backend(module, query, key, value, attention_mask, **kwargs)
    if type(layer) is DynamicLayer and query.shape[2] == key.shape[2]:  # prefill of a fresh cache
        evict = getattr(module, "_restkv_evict", None) or _evict  # sweep mode evaluates several configs here
        evict(module, plan, cache, query, key, value, attention_mask, kwargs)
    return out


@torch.no_grad()
def _evict(module, plan, cache, query, key, value, attention_mask, kwargs, memo=None):
    b, hkv, n, _ = key.shape
    key_valid = _key_valid(attention_mask, b, n, key.device)
    cfg = plan.cfg
    if cfg.evicts and n > cfg.max_capacity_prompt:
        budget = layer_budgets(cfg, plan.num_evicted, n)[plan.rank]
        obs = Observation(
            queries=query,
            keys=key,
            values=value,
            key_valid=key_valid,
            window=cfg.window_size,
            budget=budget,
            scaling=kwargs.get("scaling") or module.head_dim**-0.5,
            softcap=kwargs.get("softcap"),
        )
        wo = _wo_factor(module, query.device) if cfg.method == "restkv" and cfg.use_wo else None
        kept = compress(obs, cfg, wo, plan.head_budget, memo)
    else:  # nothing to evict: the whole prompt stays
        positions = relative_positions(key_valid)[:, None].expand(-1, hkv, -1)
        kept = Compressed(key, value, positions, key_valid)
    module._restkv_kept = kept.positions
    if cfg.quant_method:
        layer = quantized_layer(kept, n, cfg.quant_method, cfg.nbits, cfg.residual_length, cfg.q_group_size)
    elif kept.keys.shape[-2] == n and not kept.per_head:
        return  # the full cache stays as it is
    else:
        layer = (VarlenLayer if kept.per_head and cfg.varlen else CompressedLayer)(kept, seen=n)
    cache.layers[module.layer_idx] = layer


def _key_valid(mask, batch: int, n: int, device) -> torch.Tensor:
    """[b, n] bool: which keys are real tokens, read off whatever mask the backend received."""
    if mask is None:
        return torch.ones(batch, n, dtype=torch.bool, device=device)
    if mask.dim() == 2:  # flash-attention padding mask
        return mask[:, -n:].bool().expand(batch, n)
    row = mask[:, 0, -1, :n]  # the last query sees every real key
    row = row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2
    return row.expand(batch, n)


def _wo_factor(module, device):
    """The W_O factor R of a layer (computed once per weight), on ``device``.

    A layer offloaded by accelerate keeps its weights on the meta device between forwards; they are
    brought to ``device`` for the computation.
    """
    o_proj = module.o_proj
    offloaded = o_proj.weight.device.type == "meta"
    w = o_proj.weight
    tag = "offloaded" if offloaded else (w.data_ptr(), w._version, w.device, w.dtype)
    cached = getattr(module, "_restkv_wo", None)
    if cached is None or cached[0] != tag:
        if offloaded:
            from accelerate.utils import align_module_device

            weights_on = align_module_device(o_proj, execution_device=device)
        else:
            weights_on = contextlib.nullcontext()
        with torch.no_grad(), weights_on:
            cached = (tag, wo_factor(o_proj.weight, module.config.num_attention_heads).to(device))
        module._restkv_wo = cached
    return cached[1]


def _wrap(backend, implementation):
    if getattr(backend, "_restkv_wrapped", False):
        return backend
    wrapped = functools.partial(_attention_with_eviction, backend, implementation)
    wrapped = functools.wraps(backend)(wrapped)
    wrapped._restkv_wrapped = True
    return wrapped


def install(*modeling_modules) -> None:
    """Route sdpa / flash-attention and the given families' eager attention through restkv.

    Idempotent, and a pass-through for models that ``configure`` never touched.
    """
    for name in SUPPORTED_BACKENDS[1:]:
        backend = AttentionInterface._global_mapping.get(name)
        if backend is not None:
            AttentionInterface.register(name, _wrap(backend, name))
    for mod in modeling_modules:
        if hasattr(mod, "eager_attention_forward"):
            mod.eager_attention_forward = _wrap(mod.eager_attention_forward, "eager")


def _replace(family: str):
    def replace():
        install(importlib.import_module(FAMILIES[family]))

    replace.__name__ = f"replace_{family}"
    replace.__doc__ = f"Enable KV eviction for {family} models on every backend (idempotent)."
    return replace


replace_llama = _replace("llama")
replace_mistral = _replace("mistral")
replace_qwen2 = _replace("qwen2")
replace_gemma = _replace("gemma")
replace_gemma2 = _replace("gemma2")
replace_gemma3 = _replace("gemma3")


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a decoder, in layer order."""
    found = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    return sorted(found, key=lambda m: m.layer_idx)


def _is_sliding(config, layer_idx: int) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[layer_idx] != "full_attention"
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def _capture_cache(module, args, kwargs):
    module._restkv_cache = kwargs.get("cache", kwargs.get("past_key_values"))


def _release_cache(module, args, kwargs, output):
    module._restkv_cache = None


def configure(model: nn.Module, **knobs) -> CompressionConfig:
    """Set the eviction method and knobs of ``model`` (see ``CompressionConfig``).

    Every knob is validated before anything changes; the next prefill (a fresh ``generate()``) uses it.
    """
    cfg = CompressionConfig.from_kwargs(**knobs)
    config = model.config.get_text_config()
    implementation = model.config._attn_implementation
    if implementation not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"attn_implementation {implementation!r} is not supported; use one of {', '.join(SUPPORTED_BACKENDS)}"
        )
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no attention module with layer_idx and o_proj")
    evicted = [m for m in modules if not _is_sliding(config, m.layer_idx)]
    if cfg.evicts and not evicted:
        raise ValueError("the model has no full-attention layer to evict from (every layer is sliding-window)")
    head_budgets = _headkv_table(cfg, config, len(modules)) if cfg.head_budget == "headkv" else None
    install(*{sys.modules[type(m).__module__] for m in modules})
    for m in modules:
        rank = evicted.index(m) if m in evicted else -1
        row = head_budgets[m.layer_idx] if head_budgets is not None else None
        m._restkv = LayerPlan(cfg, rank, len(evicted), evicts=rank >= 0, head_budget=row)
        m._restkv_kept = None
        if not getattr(m, "_restkv_hooked", False):
            m.register_forward_pre_hook(_capture_cache, with_kwargs=True)
            m.register_forward_hook(_release_cache, with_kwargs=True)
            m._restkv_hooked = True
    model._restkv_config = cfg
    return cfg


def _headkv_table(cfg, config, num_layers):
    """HeadKV budgets [layers, Hkv] (window excluded) from the importance file, checked against the model."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    importance = load_head_importance(cfg.head_importance, num_layers, heads, kv_heads)
    return headkv_budgets(importance, cfg.max_capacity_prompt - cfg.window_size, cfg.headkv_beta)


def kept_positions(model: nn.Module) -> list[torch.Tensor | None]:
    """Per layer, the prompt positions kept by the last prefill: LongTensor [batch, kv_heads, kept].

    Positions count from each sample's first real token; -1 marks kept padding. None for layers
    that are not evicted (sliding-window) or before any prefill.
    """
    return [getattr(m, "_restkv_kept", None) for m in attention_modules(model)]
