"""One request's eviction in one layer, from the tensors vLLM's attention backend receives (no vLLM
import).

The observation and selection are restkv's own (``restkv.scoring.observe.Observation``,
``restkv.eviction.select.select``), so the kept entries are those ``restkv.configure`` keeps for the same
prompt, layer and config.
"""

from __future__ import annotations

import torch

from ..strategies.budgets import layer_budgets
from ..config import CompressionConfig
from ..scoring.observe import Observation, wo_factor
from ..cache import Kept
from ..eviction.select import select


@torch.no_grad()
def kept_entries(
    cfg: CompressionConfig,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    softcap: float | None,
    layer: int,
    num_layers: int,
    o_proj_weight=None,
    wo=None,
) -> Kept:
    """What one request keeps in one layer.

    Parameters
    ----------
    query, key, value : Tensor
        [L, Hq, d], [L, Hkv, d], [L, Hkv, d]: the request's prompt as the backend received it (after
        RoPE).
    scale, softcap
        The layer's attention scale and logit softcap (None: none).
    layer, num_layers
        The layer's index and the model's number of attention layers (for per-layer budgets and
        scores).
    o_proj_weight : callable, optional
        Returns the layer's o_proj weight [hidden, Hq d] (ReST-KV's W_O terms), called only if a
        score reads it.
    wo : callable, optional
        Returns the W_O factor R [Hq, d, d] (``restkv.scoring.observe.wo_factor`` of that weight; by default
        computed here).

    Returns
    -------
    Kept
        keys / values [1, Hkv, B, d], positions [1, Hkv, B]: B = the layer's budget, window
        included.
    """
    n, hq, _ = query.shape
    budget = layer_budgets(cfg, num_layers, n)[layer]
    obs = Observation(
        queries=query.transpose(0, 1)[None],
        keys=key.transpose(0, 1)[None],
        values=value.transpose(0, 1)[None],
        key_valid=torch.ones(1, n, dtype=torch.bool, device=key.device),
        window=cfg.window_size,
        budget=budget,
        scaling=scale,
        softcap=softcap or None,
        layer=layer,
        num_layers=num_layers,
        wo_factor=wo
        or (None if o_proj_weight is None else (lambda: wo_factor(o_proj_weight(), hq))),
        wo_weight=o_proj_weight,
    )
    return select(obs, cfg)


def slot_rows(kept: Kept) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept keys and values as vLLM writes tokens: [B, Hkv, d] each, row j holding every head's
    j-th entry."""
    return kept.keys[0].transpose(0, 1).contiguous(), kept.values[0].transpose(0, 1).contiguous()
