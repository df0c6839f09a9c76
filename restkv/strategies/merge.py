"""Merging evicted entries into the kept ones (a strategy for any scorer: ``merge``).

- ``pivot``: each evicted entry is averaged into the kept entry whose key is most similar; keys and
  values move together (one target per evicted entry), in the manner of LOOK-M / KVMerger:
  ``new_r = (r + sum_e (x_e + r) / 2) / (1 + n_r)`` for both keys and values.
- ``cam``: CaM (Zhang et al., ICML 2024): each evicted value is merged into the ``window_size``
  entries that follow it, weighted by its score over the largest kept score.
"""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import F, torch

MERGE_BLOCK = 1 << 22  # float32 elements of a block of the [L, B] key similarity of pivot merging
KNOBS = (
    Knob(
        "merge",
        "none",
        "merge evicted entries into kept ones: pivot (into the most similar kept key, "
        "keys and values) or cam (values into the following entries, CaM)",
        choices=("none", "cam", "pivot"),
    ),
)


def check(values: dict) -> None:
    if values.get("merge") == "pivot" and values.get("head_budget", "uniform") != "uniform":
        raise ValueError("merge='pivot' needs head_budget='uniform'")
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

    The similarity of every entry to the kept keys is formed a block of entries at a time
    (``MERGE_BLOCK`` float32 elements per KV head), so the extra memory stays a few kept-set sizes.
    """
    d = keys.shape[-1]
    gather = kept_idx[..., None].expand(-1, -1, -1, d)
    kept_k = keys.gather(2, gather).float()
    kept_v = values.gather(2, gather).float()
    pivots = F.normalize(kept_k, dim=-1, eps=1e-6).transpose(-1, -2)
    count = torch.zeros_like(kept_k[..., 0])  # n_r
    incoming_k = torch.zeros_like(kept_k)
    incoming_v = torch.zeros_like(kept_v)
    block = max(
        1, globals()["MERGE_BLOCK"] // max(1, kept_idx.shape[-1])
    )  # read at call time (tests shrink it)
    for s in range(0, keys.shape[2], block):
        e = min(keys.shape[2], s + block)
        target = (F.normalize(keys[:, :, s:e].float(), dim=-1, eps=1e-6) @ pivots).argmax(
            -1
        )  # [b, Hkv, block]
        weight = evicted[..., s:e].float()
        count.scatter_add_(2, target, weight)
        into = target[..., None].expand(-1, -1, -1, d)
        incoming_k.scatter_add_(2, into, keys[:, :, s:e].float() * weight[..., None])
        incoming_v.scatter_add_(2, into, values[:, :, s:e].float() * weight[..., None])

    def merge(kept, incoming):
        return (kept * (1 + count[..., None] / 2) + incoming / 2) / (1 + count[..., None])

    return merge(kept_k, incoming_k).to(keys.dtype), merge(kept_v, incoming_v).to(values.dtype)


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
