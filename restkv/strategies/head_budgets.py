"""Each KV head's share of its layer's budget (AdaKV, HeadKV, a threshold, LU-KV) and the global split
across layers; the head-importance table and LU-KV's budget curve read from their files.

``head_budget="lukv"`` is kvpress's ``LUKVPress`` (LU-KV, https://arxiv.org/abs/2602.08585, code
https://github.com/baidu-baige/LU-KV): each KV head of a layer keeps its count from a budget curve, the user's
``lukv_curve`` (.npy [99, layers, Hkv] of per-head prune ratios, made offline by LU-KV's scripts). Per layer and
per sample, the compression ratio is ``r = 1 - B / L`` (B the layer's budget, L the sample's real prompt
length; while decoding, the entries the layer holds) and picks the curve's row ``round(100 r) - 1``; the counts
are rounded as kvpress does (``lukv_sizes``). The first ``lukv_sink`` tokens (kvpress's ``sink=4``) score
above every other entry; kvpress's ``window`` (1 token) is restkv's ``window_size``, always kept and counted
in the head's count (``method="lukv"`` sets 1; with another method the config's, 32 by default). Where restkv
differs: a head whose count is below its window keeps the window (kvpress: its sinks, then the oldest window
tokens), and when its count is below sinks plus window, which sinks it keeps is the top-k's choice (kvpress:
the first); ties between fractional parts go to the lower head (kvpress: ``torch.topk``'s order); the counts
are computed in float64 (kvpress: float32, which can differ by one entry where ``(1 - ratio) L`` is within
float32 rounding of an integer).
"""

from __future__ import annotations

import json
import os

import numpy as np

from ..lazy import torch


def largest_remainder(exact, total):
    """Round non-negative reals [..., n] to ints that sum to ``total`` (an int, or [...]) along the last
    dimension: the floors, plus one for the largest fractional parts (ties: the lower index first)."""
    sizes = exact.floor()
    leftover = total - sizes.sum(-1)
    order = (exact - sizes).argsort(dim=-1, descending=True, stable=True)
    return (sizes + (order.argsort(dim=-1) < leftover[..., None])).long()


def adakv_budgets(scores, base: int, floor: float, normalize: bool):
    """AdaKV: share ``base * heads`` entries among the KV heads of a layer by their scores.

    Each head first keeps its top ``floor * base``; the other slots go to the best remaining
    entries over all heads (one top-k). ``scores`` [b, Hkv, P] -> budgets [b, Hkv] (window excluded).
    With ``normalize``, each head's scores are weighted by the share of its mass inside its top-``base``.
    """
    b, hkv, P = scores.shape
    base = min(base, P)
    ranked = scores.sort(-1, descending=True).values
    if normalize:
        mass = ranked.clamp_min(0)
        ranked = ranked * (
            mass[..., :base].sum(-1, keepdim=True) / mass.sum(-1, keepdim=True).clamp_min(1e-30)
        )
    guaranteed = int(base * floor)
    pool = ranked[..., guaranteed:].reshape(b, -1)
    chosen = pool.topk(hkv * (base - guaranteed), dim=-1).indices // (P - guaranteed)
    extra = torch.zeros(b, hkv, dtype=torch.long, device=scores.device).scatter_add_(
        1, chosen, torch.ones_like(chosen)
    )
    return guaranteed + extra


def global_sizes(scores, total: int):
    """Prefix entries each (layer, KV head) keeps under ``layer_budget="global"``.

    ``scores`` one [b, Hkv, P] per evicted layer (-inf on padding), ``total`` the entries shared by them all
    per sample (window excluded). One top-k over the layers x heads x positions of each sample; -inf
    entries are never counted. Returns one [b, Hkv] per layer.
    """
    b, hkv, P = scores[0].shape
    flat = torch.stack(scores, 1).reshape(b, -1)  # [b, layers * Hkv * P], layer-major
    top = flat.topk(min(total, flat.shape[1]), dim=-1)
    counts = torch.zeros(b, len(scores) * hkv, dtype=torch.long, device=flat.device)
    counts.scatter_add_(1, top.indices // P, torch.isfinite(top.values).long())
    return list(counts.view(b, len(scores), hkv).unbind(1))


def head_sizes(cfg, scores, base: int, table=None, key_valid=None, window: int = 0):
    """Entries each KV head keeps [b, Hkv] (window excluded), or None when heads share the budget evenly.

    ``scores`` [b, Hkv, P] of the layer, ``base`` the per-head budget, ``table`` the layer's HeadKV row [Hkv]
    or LU-KV curve [99, Hkv]; LU-KV reads ``key_valid`` [b, L] (each sample's real tokens) and the ``window``.
    """
    if cfg.get("head_budget") == "lukv":
        return lukv_sizes(table, key_valid.sum(-1), base + window, window)
    if cfg.get("head_budget") == "adakv":
        return adakv_budgets(scores, base, cfg.floor, cfg.normalize)
    if cfg.get("head_budget") == "headkv":
        return table.to(scores.device).clamp(max=scores.shape[-1]).expand(*scores.shape[:2])
    if cfg.get("head_budget") == "threshold":
        return (scores >= cfg.threshold).sum(-1).clamp_max(base)
    return None


def headkv_budgets(importance, base: int, beta: float):
    """HeadKV: per-head budgets [layers, Hkv] from importance [layers, Hkv] (window excluded).

    Every head keeps ``base - base // beta``; the pool ``base // beta`` per head, over all layers, is
    shared in proportion to importance. The total is exactly ``layers * Hkv * base``.
    """
    pool = (base // beta) * importance.numel()
    share = importance / importance.sum()
    shared = largest_remainder((share * pool).flatten(), int(pool)).view(share.shape)
    return shared + int(base - base // beta)


def lukv_sizes(curve, lengths, budget: int, window: int):
    """LU-KV: prefix entries each KV head keeps [b, Hkv] (window excluded), as kvpress's ``LUKVPress``.

    ``curve`` [99, Hkv] the layer's prune ratios, ``lengths`` [b] each sample's real tokens L, ``budget`` B
    (window included). A sample's compression ratio is ``r = 1 - B / L``; its row is ``round(100 r) - 1``
    (clamped to [0, 98]). The heads keep ``(1 - ratio) L`` rounded by largest remainder: the total
    ``round(sum)`` (at least Hkv, at most Hkv L), the floors, one more for the largest fractional parts; each
    head then in [1, L]. The window is part of that count and always kept (a head keeps at least it).
    float64, on the lengths' device, no host read.
    """
    n = lengths.to(torch.float64)[:, None]  # [b, 1]
    r = 1.0 - n.new_full(n.shape, budget) / n  # Python's 1 - B / L (a scalar / tensor is B * (1 / L))
    row = ((r * 100).round().long() - 1).clamp(0, 98)[:, 0]
    exact = (1.0 - curve.to(lengths.device)[row]).clamp(0.0, 1.0) * n  # [b, Hkv]
    hkv = exact.shape[1]
    total = torch.minimum(exact.sum(-1).round().clamp_min(hkv), hkv * n[:, 0])
    keep = torch.minimum(largest_remainder(exact, total).clamp_min(1), n.long())
    keep = torch.where(r > 0, keep, n.long())  # kvpress: a ratio <= 0 keeps everything
    return (keep - window).clamp_min(0)


def load_lukv_curve(path: str, num_layers: int, num_kv_heads: int):
    """An LU-KV budget curve (``.npy``, [99, layers, Hkv] prune ratios) as float64; ValueError naming
    ``lukv_curve`` for a missing or unreadable file, another shape or values that are not finite."""
    try:
        curve = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"lukv_curve: cannot read {path} as .npy ({type(e).__name__}: {e})") from None
    shape = (99, num_layers, num_kv_heads)
    if curve.shape != shape or not np.issubdtype(curve.dtype, np.number):
        raise ValueError(
            f"lukv_curve: {path} has shape {curve.shape} ({curve.dtype}), the model needs {shape} numbers"
        )
    curve = torch.from_numpy(curve.astype(np.float64))
    if not torch.isfinite(curve).all():
        raise ValueError(f"lukv_curve: {path} holds values that are not finite")
    return curve


def load_head_importance(path: str, num_layers: int, num_heads: int, num_kv_heads: int):
    """Read a head-importance table and return it per KV head [layers, Hkv] (float64, mean over a GQA group).

    Accepts ``{"layer-head": [scores...] or score}`` (the HeadKV authors' format) or ``[[...], ...]``
    (layers x heads). A missing file or a shape that does not fit the model raises a ValueError.
    """
    if not os.path.isfile(path):
        raise ValueError(f"head_importance file not found: {path}")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if isinstance(data, dict):
        table = torch.full((num_layers, num_heads), float("nan"), dtype=torch.float64)
        for key, value in data.items():
            try:
                layer, head = (int(x) for x in key.split("-"))
                table[layer, head] = (
                    float(sum(value) / len(value)) if isinstance(value, list) else float(value)
                )
            except (ValueError, IndexError, TypeError, ZeroDivisionError):
                raise ValueError(
                    f"{path}: entry {key!r} does not fit a model of {num_layers} layers x {num_heads} heads"
                ) from None
        if torch.isnan(table).any():
            raise ValueError(
                f"{path}: {int(torch.isnan(table).sum())} of {num_layers}x{num_heads} heads have no score"
            )
    else:
        table = torch.tensor(data, dtype=torch.float64)
        if table.shape not in ((num_layers, num_heads), (num_layers, num_kv_heads)):
            raise ValueError(
                f"{path}: table of shape {tuple(table.shape)} does not fit a model of {num_layers} layers x "
                f"{num_heads} heads ({num_kv_heads} KV heads)"
            )
    if (table < 0).any():
        raise ValueError(f"{path}: head scores must be non-negative")
    if table.shape[1] != num_kv_heads:
        table = table.view(num_layers, num_kv_heads, -1).mean(-1)
    return table
