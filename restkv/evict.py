"""The eviction step of one layer at the end of prefill: observe, score, budget, select, cache layer.

``evict_layer`` is a function of the layer's prefill tensors and its plan only: ``configure()`` runs
it on the model's own cache, sweep mode runs it once per config on the same tensors.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, replace

import torch

from .budgets import layer_budgets, sample_budgets
from .cache import CompressedLayer, cache_layer
from .config import CompressionConfig
from .observe import Observation, relative_positions, wo_factor
from .rope import Rope
from .select import Kept, select, stack_samples


@dataclass(frozen=True)
class LayerPlan:
    """What one attention layer does at prefill under a config."""

    cfg: CompressionConfig
    rank: int  # index among the evicted layers; -1: not evicted (sliding-window)
    num_evicted: int
    table: torch.Tensor | None = None  # HeadKV: entries per KV head, window excluded [Hkv]
    window: int | None = None  # the sliding window of an evicted sliding-window layer (None: full attention)

    @property
    def evicts(self) -> bool:
        return self.rank >= 0


@torch.no_grad()
def evict_layer(plan: LayerPlan, module, query, key, value, attention_mask, kwargs, memo: dict | None = None,
                rope: Rope | None = None):
    """Select what the layer keeps from its prefill tensors.

    Parameters
    ----------
    plan : LayerPlan
    module : nn.Module
        The attention module (its ``o_proj`` gives ReST-KV's W_O factor, computed when a score reads it).
    query, key, value : Tensor
        [b, Hq, L, d], [b, Hkv, L, d], [b, Hkv, L, d] as the attention backend received them.
    attention_mask, kwargs
        The backend's mask and keyword arguments (``scaling``, ``softcap``).
    memo : dict, optional
        Shared by every config evaluated on this layer and prompt (window attention, scores).
    rope : Rope, optional
        The layer's RoPE over the prompt (``restkv.rope``), for scores that need the queries before RoPE.

    Returns
    -------
    (layer, positions)
        The cache layer to put in place of the layer's full one (None: keep the full one) and the kept
        positions [b, Hkv, kept] (from each sample's first real token, -1 on kept padding).

    On a sliding-window layer (``plan.window`` W) only the last W - 1 prompt entries can still be
    attended by the first decoded token; they are the ones scored and kept from (all of them when
    the prompt is shorter), and when nothing is evicted the model's own sliding-window layer stays.
    """
    b, hkv, n, _ = key.shape
    key_valid = _key_valid(attention_mask, b, n, key.device)
    seen, start = n, 0 if plan.window is None else max(0, n - plan.window + 1)
    if start:  # the entries older than the window are out of reach: evict among the visible ones
        offset = key_valid[:, :start].sum(-1)  # [b] real tokens before them
        query, key, value, key_valid = query[:, :, start:], key[:, :, start:], value[:, :, start:], key_valid[:, start:]
        n = n - start
    cfg, memo = plan.cfg, {} if memo is None else memo
    by_ratio = cfg.get("max_capacity_prompt_ratio") is not None
    lengths = key_valid.sum(-1).tolist() if by_ratio else [n]  # one host read per layer with a ratio
    budgets = sample_budgets(cfg, lengths)
    # this layer's budget per sample (each sample on its own real tokens when budgets differ by sample)
    starts = [0] if len(set(budgets)) == 1 else [n - length for length in lengths]
    layer_budget = [layer_budgets(cfg, plan.num_evicted, n - s, B)[plan.rank] for s, B in zip(starts, budgets)]

    def observe(sample=slice(None), first=0, i=0, shared=memo):
        return observation(plan, module, query[sample, :, first:], key[sample, :, first:], value[sample, :, first:],
                           key_valid[sample, first:], layer_budget[i], kwargs, shared,
                           rope=None if rope is None else rope.part(sample, first))

    whole = not cfg.evicts or all(length <= budget for length, budget in zip(lengths, budgets))
    if whole:
        kept = Kept(key, value, relative_positions(key_valid)[:, None].expand(-1, hkv, -1), key_valid)
    elif len(starts) == 1:
        kept = select(observe(), cfg, plan.table)
    else:  # budgets that differ by sample (a ratio): each sample on its own real tokens
        kept = stack_samples([select(observe(slice(i, i + 1), starts[i], i, memo.setdefault(i, {})), cfg, plan.table)
                              for i in range(b)])
    if not start:
        layer = cache_layer(kept, seen, cfg)
        if cfg.get("decode_interval"):
            from .decode import arm

            arm(layer, plan, layer_budget * (b if len(starts) == 1 else 1), query, rope)
        return layer, kept.positions
    kept = replace(kept, positions=torch.where(kept.positions >= 0, kept.positions + offset[:, None, None], -1))
    if whole and not cfg.quant_method:
        return None, kept.positions  # the model's sliding-window layer holds exactly these
    if kept.per_head and kept.kv_heads is None:  # the masked layout: its mask also bounds the window
        return CompressedLayer(kept, seen=seen), kept.positions
    return cache_layer(kept, seen, cfg), kept.positions


def observation(plan: LayerPlan, module, queries, keys, values, key_valid, budget: int, kwargs, memo: dict,
                rope: Rope | None = None, head_valid=None) -> Observation:
    """What the layer's scorer sees: queries [b, Hq, Lq, d] of the last Lq positions, keys/values [b, H, L, d],
    key_valid [b, L] (head_valid [b, H, L] when heads hold different entries), this layer's budget and RoPE."""
    return Observation(
        queries=queries, keys=keys, values=values, key_valid=key_valid, window=plan.cfg.window_size, budget=budget,
        scaling=kwargs.get("scaling") or module.head_dim**-0.5, softcap=kwargs.get("softcap"),
        wo_factor=lambda: layer_wo_factor(module, keys.device), wo_weight=lambda: layer_wo_weight(module, keys.device),
        rope=rope, layer=plan.rank, num_layers=plan.num_evicted, memo=memo, head_valid=head_valid,
    )


def _key_valid(mask, batch: int, n: int, device) -> torch.Tensor:
    """[b, n] bool: which keys are real tokens, read off whatever mask the backend received at prefill."""
    if mask is None:
        return torch.ones(batch, n, dtype=torch.bool, device=device)
    if mask.dim() == 2:  # flash-attention padding mask
        return mask[:, -n:].bool().expand(batch, n)
    # each query sees its own key unless that key is padding (the last row would miss keys beyond a sliding window)
    row = mask[:, 0, -n:, :n].diagonal(dim1=-2, dim2=-1)
    row = row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2
    return row.expand(batch, n)


_WO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # o_proj -> (weight tag, R)


def _weights_on(module, device):
    """A context in which ``module``'s weights are on ``device``: accelerate keeps an offloaded layer's
    weights on the meta device between forwards."""
    if module.weight.device.type != "meta":
        return contextlib.nullcontext()
    from accelerate.utils import align_module_device

    return align_module_device(module, execution_device=device)


def layer_wo_factor(module, device) -> torch.Tensor:
    """The W_O factor R [Hq, d, d] of an attention module (computed once per weight), on ``device``."""
    o_proj = module.o_proj
    w = o_proj.weight
    tag = "offloaded" if w.device.type == "meta" else (w.data_ptr(), w._version, w.device, w.dtype)
    cached = _WO.get(o_proj)
    if cached is None or cached[0] != tag:
        with torch.no_grad(), _weights_on(o_proj, device):
            cached = (tag, wo_factor(o_proj.weight, module.config.num_attention_heads))
        _WO[o_proj] = cached
    return cached[1].to(device)


def layer_wo_weight(module, device) -> torch.Tensor:
    """The o_proj weight W_O [hidden, Hq d] of an attention module, on ``device``."""
    with torch.no_grad(), _weights_on(module.o_proj, device):
        return module.o_proj.weight.detach().to(device)
