"""Merging evicted entries into the kept ones (a strategy for any scorer: ``merge``).

- ``pivot``: each evicted entry is averaged into the kept entry whose key is most similar; keys and
  values move together (one target per evicted entry), in the manner of LOOK-M / KVMerger:
  ``new_r = (r + sum_e (x_e + r) / 2) / (1 + n_r)`` for both keys and values.
- ``cam``: CaM (Zhang et al., ICML 2024): each evicted value is merged into the ``window_size``
  entries that follow it, weighted by its score over the largest kept score.
- ``value``: kvpress's ``MergingPress`` (``kvpress/presses/merging_press.py``, after Token Merging
  and D2O): each evicted value is folded into the value of the kept entry whose key is most
  cosine-similar, ``v_r <- (v_r + sum_e w_e v_e) / (1 + sum_e w_e)`` with ``w_e = max(s_e, 0)
  ||v_e|| / (||v_e|| + ||v_r|| + 1e-6)``, ``s_e`` the similarity; only the evicted entries whose
  similarity reaches ``similarity_threshold`` and, with ``merge_fraction`` < 1, lies in their head's
  top ``merge_fraction`` merge. Keys are kept as they are.
"""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import F, torch
from ..scoring.output_error import entries_per_block

KNOBS = (
    Knob(
        "merge",
        "none",
        "merge evicted entries into kept ones: pivot (into the most similar kept key, "
        "keys and values), value (values into the most similar kept key's, kvpress "
        "MergingPress) or cam (values into the following entries, CaM)",
        choices=("none", "cam", "pivot", "value"),
    ),
    Knob(
        "similarity_threshold",
        0.0,
        "merge='value': smallest cosine similarity of an evicted key to its kept target "
        "for a merge",
        rule="in [0, 1]",
        when={"merge": ("value",)},
    ),
    Knob(
        "merge_fraction",
        1.0,
        "merge='value': share of each head's evicted entries (the most similar) that merge",
        rule="in (0, 1]",
        when={"merge": ("value",)},
    ),
)
SIMILARITY_EPS = 1e-6  # the reference's _EPS: norms' floor and the weights' denominator


def check(values: dict) -> None:
    per_head = values.get("head_budget", "uniform") != "uniform"
    if values.get("merge") in ("pivot", "value") and per_head:
        raise ValueError(f"merge={values['merge']!r} needs head_budget='uniform'")
    if values.get("merge") != "none" and values.get("gqa_agg") == "none":
        raise ValueError(
            f"merge={values['merge']!r} needs per-KV-head sets: gqa_agg other than 'none'"
        )


def merge(cfg, obs, scores, idx, keys, values):
    """The kept ``keys``, ``values`` [b, Hkv, B, d] (indices ``idx`` [b, Hkv, B] of the layer's L entries) after
    the config's merging; ``scores`` [b, Hkv, P] are the selection scores."""
    b, hkv, n = obs.keys.shape[:3]
    if cfg.merge == "cam":
        kept = torch.zeros(b, hkv, n, dtype=torch.bool, device=idx.device).scatter_(2, idx, True)
        merged = cam_values(obs, scores.clamp_min(0), kept)
        return keys, merged.gather(2, idx[..., None].expand(-1, -1, -1, merged.shape[-1]))
    if cfg.merge == "pivot":
        evicted = torch.ones(b, hkv, n, dtype=torch.bool, device=idx.device).scatter_(2, idx, False)
        return pivot_merge(obs.keys, obs.values, idx, evicted & obs.key_valid[:, None])
    if cfg.merge == "value":
        evicted = torch.ones(b, hkv, n, dtype=torch.bool, device=idx.device).scatter_(2, idx, False)
        gate = (cfg.similarity_threshold, cfg.merge_fraction)
        merged = value_merge(obs.keys, obs.values, idx, evicted & obs.key_valid[:, None], *gate)
        return keys, merged
    return keys, values


def pivot_merge(keys, values, kept_idx, evicted):
    """Merge evicted entries into the kept ones.

    Parameters
    ----------
    keys, values : Tensor
        [b, Hkv, L, d], the full prefill cache.
    kept_idx : Tensor
        [b, Hkv, B] indices of the kept entries.
    evicted : Tensor
        [b, Hkv, L] bool, True on the (real) entries that are dropped.

    Returns
    -------
    The kept keys and values [b, Hkv, B, d] after merging, in the input dtype.

    The similarity to the kept keys and the sums into them are formed a block of entries at a time
    (``nearest_kept``, ``folded``), so the extra memory is the kept keys or values in float32 and blocks
    of 1/16 of the layer's K+V (``output_error.entries_per_block``).
    """
    d = keys.shape[-1]
    target = nearest_kept(keys, kept_idx)[1]
    weight = evicted.float()
    count = torch.zeros_like(kept_idx, dtype=torch.float32).scatter_add_(2, target, weight)[..., None]
    gather = kept_idx[..., None].expand(-1, -1, -1, d)

    def merged(x):  # (r (1 + n_r / 2) + sum_e x_e / 2) / (1 + n_r)
        kept = x.gather(2, gather).float()
        incoming = folded(x, target, weight, kept_idx.shape[-1])
        return ((kept * (1 + count / 2) + incoming / 2) / (1 + count)).to(x.dtype)

    return merged(keys), merged(values)


def folded(x, target, weight, size: int):
    """``sum_e weight_e x_e`` into row ``target_e``: [b, H, size, d] float32 from ``x`` [b, H, L, d] and
    ``target``, ``weight`` [b, H, L], a block of entries at a time (``entries_per_block``)."""
    b, h, n, d = x.shape
    out = torch.zeros(b, h, size, d, device=x.device)
    block = entries_per_block(b * h * d, x, n)
    for s in range(0, n, block):
        e = min(n, s + block)
        into = target[..., s:e, None].expand(-1, -1, -1, d)
        out.scatter_add_(2, into, x[:, :, s:e].float() * weight[..., s:e, None])
    return out


def nearest_kept(keys, kept_idx):
    """For every entry of ``keys`` [b, Hkv, L, d], the cosine similarity to its most similar kept
    key and that key's index among the kept ones -> ([b, Hkv, L] float32, [b, Hkv, L] long), a
    block of entries at a time (``entries_per_block``: the [b, Hkv, block, B] similarity and the
    block's keys in float32 hold 1/16 of the layer's K+V at most)."""
    b, hkv, n, d = keys.shape
    kept_k = keys.gather(2, kept_idx[..., None].expand(-1, -1, -1, d)).float()
    pivots = F.normalize(kept_k, dim=-1, eps=SIMILARITY_EPS).transpose(-1, -2)
    similarity = torch.empty(keys.shape[:3], device=keys.device)
    target = torch.empty(keys.shape[:3], dtype=torch.long, device=keys.device)
    block = entries_per_block(b * hkv * max(kept_idx.shape[-1], d), keys, n)
    for s in range(0, n, block):
        e = min(n, s + block)
        sim = F.normalize(keys[:, :, s:e].float(), dim=-1, eps=SIMILARITY_EPS) @ pivots
        similarity[..., s:e], target[..., s:e] = sim.max(-1)
    return similarity, target


def value_merge(keys, values, kept_idx, evicted, threshold: float, fraction: float):
    """kvpress MergingPress's merge: the kept values [b, Hkv, B, d] (input dtype) after folding each
    ``evicted`` [b, Hkv, L] entry's value into its most cosine-similar kept entry's (``kept_idx``
    [b, Hkv, B]); ``threshold`` and ``fraction`` gate which evicted entries merge."""
    d = values.shape[-1]
    similarity, target = nearest_kept(keys, kept_idx)
    ok = evicted & (similarity >= threshold)
    if fraction < 1.0:  # the (1 - fraction) quantile of each head's evicted similarities
        candidates = similarity.masked_fill(~ok, float("-inf")).masked_fill(~evicted, float("nan"))
        floor = candidates.nanquantile(1.0 - fraction, dim=-1, keepdim=True)
        ok &= similarity >= floor
    kept_v = values.gather(2, kept_idx[..., None].expand(-1, -1, -1, d)).float()
    norms = torch.linalg.vector_norm(values, dim=-1, dtype=torch.float32)  # [b, Hkv, L]
    target_norms = torch.linalg.vector_norm(kept_v, dim=-1).gather(2, target)
    weight = similarity.clamp_min(0) * ok * norms / (norms + target_norms + SIMILARITY_EPS)
    count = torch.zeros_like(kept_v[..., 0]).scatter_add_(2, target, weight)
    incoming = folded(values, target, weight, kept_v.shape[2])
    merged = ((kept_v + incoming) / (1 + count[..., None])).to(values.dtype)
    unmerged = values.gather(2, kept_idx[..., None].expand(-1, -1, -1, d))
    return torch.where(count[..., None] > 0, merged, unmerged)


def cam_values(obs, scores, kept):
    """Values of all L positions after CaM's merging of the evicted prefix entries -> [b, Hkv, L, d].

    ``scores`` [b, Hkv, P] (the selection scores), ``kept`` [b, Hkv, L] bool. Position j receives
    ``sum_{e in [j - m, j - 1], evicted} p_e v_e / m`` with ``m = window_size`` and ``p_e`` the evicted
    entry's score over the largest kept score. The original draws each merge with probability ``p_e``
    (Bernoulli, token by token, cascading); this is its expectation, on the original values (no
    cascade) and on a copy: the values that produced the prefill output are never modified.
    """
    m = obs.window
    P = obs.prefix_len
    values = obs.values.float()
    s = scores.clamp_min(0)
    top = s.masked_fill(~kept[..., :P], 0).amax(-1, keepdim=True)
    p = (s / top.clamp_min(torch.finfo(torch.float32).tiny)).clamp(max=1.0)
    p = p * (~kept[..., :P]) * obs.key_valid[:, None, :P]
    src = torch.zeros_like(values[..., 0])
    src[..., :P] = p
    contrib = values * src[..., None] / m  # [b, Hkv, L, d]
    csum = F.pad(contrib.cumsum(2), (0, 0, 1, 0))  # csum[j] = sum_{e < j}
    j = torch.arange(values.shape[2], device=values.device)
    lo = (j - m).clamp_min(0)
    incoming = csum[:, :, j] - csum[:, :, lo]
    return (values + incoming).to(obs.values.dtype)
