"""Hindsight selections of one layer's kept set, and the layer-output error they are judged by.

Shapes: ``b`` batch, ``Hq`` / ``Hkv`` query / KV heads (``g = Hq // Hkv``, the query heads of a KV head
contiguous), ``r`` observed queries, ``N`` keys they see, ``P`` the evictable prefix (the first ``P``
keys; every key from ``P`` on is always kept), ``d`` head dim, ``D`` hidden size. A kept set is a bool
mask ``keep`` [b, H, P] with H = Hkv (one set per KV head) or Hq.

The error is ReST-KV's objective (ICLR 2026, Def. 3.1; https://github.com/an-yongqi/rest-kv): for a query,
``|| sum_h W_O^h (o_h - o_h^S) ||`` with ``o_h`` head h's attention output over every key, ``o_h^S`` its
output over the kept keys (the attention renormalised over them) and ``W_O^h`` the head's column block
of ``o_proj`` [D, d]: the change of the layer's output that evicting the rest causes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from restkv.cache import CompressedLayer
from restkv.observe import group_view, weighted_values
from restkv.select import Kept, reduce_groups


def kept_keys(keep: Tensor, n_keys: int, hq: int) -> Tensor:
    """Prefix mask [b, H, P] -> mask of every key [b, Hq, 1, N] (keys from P on kept)."""
    full = F.pad(keep, (0, n_keys - keep.shape[-1]), value=True)
    return full.repeat_interleave(hq // keep.shape[1], 1)[:, :, None]


def output_change(attention: Tensor, values: Tensor, keep: Tensor, o_proj_weight: Tensor):
    """The layer-output change of a kept set and the kept outputs.

    Parameters
    ----------
    attention : [b, Hq, r, N] softmax attention of the queries over every key they see (rows sum to 1)
    values : [b, Hkv, N, d]
    keep : [b, H, P] bool
    o_proj_weight : [D, Hq * d]

    Returns
    -------
    (delta [b, r, D] = sum_h W_O^h (o_h - o_h^S), kept outputs o^S [b, Hq, r, d], kept mass z [b, Hq, r]), float32.
    """
    b, hq, r, n = attention.shape
    kept = attention * kept_keys(keep, n, hq)
    z = kept.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    o_kept = weighted_values(kept / z, values)
    diff = weighted_values(attention - kept / z, values)  # o - o^S in one pass (no difference of two outputs)
    delta = diff.transpose(1, 2).reshape(b, r, -1) @ o_proj_weight.float().T
    return delta, o_kept, z[..., 0]


def layer_output_error(attention: Tensor, values: Tensor, keep: Tensor, o_proj_weight: Tensor) -> Tensor:
    """``|| sum_h W_O^h (o_h - o_h^S) ||`` per query -> [b, r] float32 (arguments as ``output_change``)."""
    return output_change(attention, values, keep, o_proj_weight)[0].norm(dim=-1)


def future_attention(attention: Tensor, hkv: int, prefix: int) -> Tensor:
    """[b, Hq, r, N] -> [b, Hkv, P]: each prefix key's attention, mean over the queries, then over the GQA group."""
    return reduce_groups(attention[..., :prefix].float().mean(-2), hkv, "mean")


def top_set(scores: Tensor, count: int) -> Tensor:
    """Scores [b, H, P] -> mask [b, H, P] of each head's ``count`` highest."""
    idx = scores.topk(count, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


def positions_mask(positions: Tensor, prefix: int) -> Tensor:
    """Kept positions [b, H, K] (-1: none, those >= P ignored) -> mask [b, H, P]."""
    idx = positions.masked_fill((positions < 0) | (positions >= prefix), prefix)
    out = torch.zeros(*positions.shape[:2], prefix + 1, dtype=torch.bool, device=positions.device)
    return out.scatter_(-1, idx, True)[..., :prefix]


def cache_layer(keep: Tensor, keys: Tensor, values: Tensor) -> CompressedLayer:
    """The cache layer that holds a kept set: keep [b, Hkv, P] (the same count in every head), the prompt's
    keys / values [b, Hkv, L, d] (its last L - P entries always kept)."""
    b, hkv, n, d = keys.shape
    full = F.pad(keep, (0, n - keep.shape[-1]), value=True)
    idx = torch.arange(n, device=keys.device).expand(b, hkv, n)[full].view(b, hkv, -1)  # position order

    def gather(x):
        return x.gather(2, idx[..., None].expand(-1, -1, -1, d))

    valid = torch.ones(b, idx.shape[-1], dtype=torch.bool, device=keys.device)
    return CompressedLayer(Kept(gather(keys), gather(values), idx, valid), seen=n)


def layer_terms(values: Tensor, o_proj_weight: Tensor, prefix: int) -> tuple:
    """What the swap errors of a layer read that no swap changes: W_O^h by group [Hkv, g, D, d],
    ``M_ac = W_O^a^T W_O^c`` [Hkv, g, g, d, d], the prefix values v [b, Hkv, P, d] and ``v_n^T M_ac v_n``
    [g, g, b, Hkv, P] (a, c: query heads of one group). Cost O(b Hkv g^2 P d^2)."""
    hkv, d = values.shape[1], values.shape[-1]
    g = o_proj_weight.shape[1] // d // hkv
    W = o_proj_weight.float().view(-1, hkv, g, d).permute(1, 2, 0, 3)
    M = torch.einsum("kaex,kcey->kacxy", W, W)
    v = values[:, :, :prefix].float()
    return W, M, v, torch.einsum("bknx,kacxy,bkny->acbkn", v, M, v)


def state_terms(attention: Tensor, layer: tuple, delta: Tensor, o_kept: Tensor, z: Tensor) -> tuple:
    """Per prefix entry n of the current set (``output_change``'s delta, o^S = u, z), over the group's heads:
    attention a [g, b, Hkv, r, P], ``c = <delta, W_O^a (v_n - u_a)>`` [g, b, Hkv, r, P], ``u_a^T M_ac v_n``
    [g, g, b, Hkv, r, P], ``u_a^T M_ac u_c`` [g, g, b, Hkv, r, 1] and z [g, b, Hkv, r, 1]. Cost O(b Hkv g^2 r P d)."""
    W, M, v, _ = layer
    hkv, prefix = v.shape[1], v.shape[2]
    a = group_view(attention[..., :prefix], hkv).movedim(2, 0)
    u = group_view(o_kept, hkv).movedim(2, 0)  # [g, b, Hkv, r, d]
    t = torch.einsum("bqe,kaex->abkqx", delta, W)  # W_O^a^T delta
    c = torch.einsum("abkqx,bknx->abkqn", t, v) - (t * u).sum(-1, keepdim=True)
    uM = torch.einsum("abkqx,kacxy->acbkqy", u, M)  # (u_a^T M_ac) [g, g, b, Hkv, r, d]
    uMv = torch.einsum("acbkqy,bkny->acbkqn", uM, v)
    uMu = torch.einsum("acbkqy,cbkqy->acbkq", uM, u)[..., None]
    return a, c, uMv, uMu, group_view(z, hkv).movedim(2, 0)[..., None]


def _take(x: Tensor, idx: Tensor, rows: bool = True) -> Tensor:
    """x [..., b, Hkv, r, P] (without r: ``rows=False``) at the entries idx [b, Hkv, n] -> [..., b, Hkv, (r,) n]."""
    return x.gather(-1, (idx[:, :, None] if rows else idx).expand(*x.shape[:-1], idx.shape[-1]))


def _quadratic(delta: Tensor, pairs: Tensor) -> Tensor:
    """||delta||^2 [b, r] + pairs [b, Hkv, r, ...] -> mean error over the queries [b, Hkv, ...]."""
    sq = delta.pow(2).sum(-1).view(delta.shape[0], 1, delta.shape[1], *[1] * (pairs.dim() - 3)) + pairs
    return sq.clamp_min(0).sqrt().mean(2)


def single_errors(terms: tuple, layer: tuple, delta: Tensor, keep: Tensor) -> Tensor:
    """Mean error over the queries after one entry alone changes side, exactly: [b, Hkv, P] float32.

    A kept entry n is evicted (``o_h - o_h^S' = (o_h - u_h) + x_h (v_n - u_h)``, ``x_h = a_hn / (z_h - a_hn)``),
    an evicted one kept (``- y_h (v_n - u_h)``, ``y_h = a_hn / (z_h + a_hn)``).
    """
    a, c, uMv, uMu, z = terms
    side = torch.where(keep, 1.0, -1.0)[:, :, None]  # [b, Hkv, 1, P]
    coef = side * a / (z - side * a)
    K = layer[3][..., None, :] - uMv.transpose(0, 1) - uMv + uMu  # (v_n - u_a)^T M_ac (v_n - u_c)
    return _quadratic(delta, 2 * (coef * c).sum(0) + (coef[:, None] * coef * K).sum((0, 1)))


def swap_errors(terms: tuple, layer: tuple, delta: Tensor, removals: Tensor, additions: Tensor) -> Tensor:
    """Mean error over the queries after each single swap, exactly: [b, Hkv, R, A] float32.

    Swap (i, j) in KV head k evicts the kept entry ``removals[..., i]`` and keeps ``additions[..., j]``
    instead (every other head unchanged). With ``a_h`` the attention of query head h and ``u_h = o_h^S``,
    ``o_h - o_h^S' = (o_h - u_h) + x_h (v_i - u_h) - y_h (v_j - u_h)``, ``x_h = a_hi / z'_h``,
    ``y_h = a_hj / z'_h``, ``z'_h = z_h - a_hi + a_hj``, so the new change is ``delta + sum_h W_O^h (...)``
    and its squared norm a quadratic form in (x, y) over ``M_ac`` (``layer_terms``, ``state_terms``): no
    [R, A, D] tensor is formed. Cost O(b Hkv g^2 r R A + b Hkv g^2 R A d).
    """
    a, c, uMv, uMu, z = terms
    _, M, v, vMv = layer
    d = v.shape[-1]
    a_i, a_j, c_i, c_j, uMv_i, uMv_j = (_take(x, idx) for x in (a, c, uMv) for idx in (removals, additions))
    K_i = _take(vMv, removals, rows=False)[..., None, :] - uMv_i.transpose(0, 1) - uMv_i + uMu
    K_j = _take(vMv, additions, rows=False)[..., None, :] - uMv_j.transpose(0, 1) - uMv_j + uMu
    v_i, v_j = (v.gather(2, idx[..., None].expand(-1, -1, -1, d)) for idx in (removals, additions))
    K_ij = (torch.einsum("bkix,kacxy,bkjy->acbkij", v_i, M, v_j)[..., None, :, :]
            - uMv_i.transpose(0, 1)[..., None] - uMv_j[..., None, :] + uMu[..., None])  # [g, g, b, Hkv, r, R, A]
    z_new = z[..., None] - a_i[..., None] + a_j[..., None, :]
    x, y = a_i[..., None] / z_new, a_j[..., None, :] / z_new  # [g, b, Hkv, r, R, A]
    linear = (x * c_i[..., None] - y * c_j[..., None, :]).sum(0)
    quad = (x[:, None] * x * K_i[..., None] + y[:, None] * y * K_j[..., None, :] - 2 * x[:, None] * y * K_ij).sum((0, 1))
    return _quadratic(delta, 2 * linear + quad)


def _disjoint_best(gain: Tensor, m: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per head, up to ``m`` swaps of the largest gain sharing no entry: (i, j [b, Hkv, m], gain [b, Hkv, m])."""
    gain = gain.clone()
    rows, cols, gains = [], [], []
    n_add = gain.shape[-1]
    for _ in range(min(m, *gain.shape[-2:])):
        best, flat = gain.flatten(-2).max(-1)
        i, j = flat // n_add, flat % n_add
        rows.append(i), cols.append(j), gains.append(best)
        gain.masked_fill_(F.one_hot(i, gain.shape[-2]).bool()[..., None], float("-inf"))
        gain.masked_fill_(F.one_hot(j, n_add).bool()[..., None, :], float("-inf"))
    return torch.stack(rows, -1), torch.stack(cols, -1), torch.stack(gains, -1)


def _swapped(attention, values, o_proj_weight, state, removed, added, use):
    """The state (delta, o^S, z) after evicting ``removed`` and keeping ``added`` ([b, Hkv, m] prefix indices,
    where ``use``), from the changed entries only: ``u - u' = ((s_out - m_out u) - (s_in - m_in u)) / z'``
    with m the attention mass and s the attention-weighted values of each side."""
    delta, o_kept, z = state
    b, hq, r, _ = attention.shape
    hkv, d = values.shape[1], values.shape[-1]
    u, z_old = group_view(o_kept, hkv), group_view(z, hkv)

    def side(idx):
        a = group_view(attention, hkv).gather(-1, idx[:, :, None, None].expand(-1, -1, hq // hkv, r, -1))
        a = a * use[:, :, None, None]
        v = values.gather(2, idx[..., None].expand(-1, -1, -1, d)).float()
        mass = a.sum(-1, keepdim=True)
        return mass, torch.einsum("bkgqm,bkmd->bkgqd", a, v) - mass * u

    (m_out, s_out), (m_in, s_in) = side(removed), side(added)
    z_new = z_old - m_out[..., 0] + m_in[..., 0]
    change = ((s_out - s_in) / z_new[..., None]).flatten(1, 2)  # u - u' [b, Hq, r, d]
    delta = delta + change.transpose(1, 2).reshape(b, r, -1) @ o_proj_weight.float().T
    return delta, o_kept - change, z_new.flatten(1, 2)


def swap_search(attention: Tensor, values: Tensor, keep: Tensor, scores: Tensor, o_proj_weight: Tensor,
                rounds: int = 64, pool: int = 32, batch: int = 32, pool_by: str = "effect",
                layer: tuple | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Lower the mean layer-output error of the observed queries by swapping kept and evicted entries.

    Each round takes per KV head a pool of ``pool`` kept and ``pool`` evicted entries, computes every
    single swap's exact error (``swap_errors``), picks per head up to ``m`` improving swaps that share no
    entry and applies them together in every head; the result is kept only if the measured error falls,
    else with m/2, m/4, ... swaps per head, then the best single swap of the best head. ``m`` starts at
    ``batch`` and is twice the last accepted count after. It stops after ``rounds`` rounds or when no
    swap of the pools improves. Every head keeps its count; every accepted step lowers the measured error
    (measured from the changed entries; the returned error is measured afresh).

    Pools (``pool_by``): ``effect``, the entries whose side change alone lowers the error most or raises it
    least (``single_errors``, exact); ``score``, the kept entries of lowest ``scores`` and evicted of highest.

    Cost: once O(b Hkv g^2 P d^2) (``layer_terms``); per round O(b Hkv g^2 r (P d + R A)) for the errors
    of all single swaps and changes, and up to log2(batch) + 2 trials of O(b Hq r m d + b r Hq d D) each;
    one ``output_change`` (O(b Hq r N d)) at the start and the end.

    Parameters
    ----------
    attention, values, o_proj_weight : as ``output_change``
    keep : [b, Hkv, P] bool, the starting set (the same count in every head)
    scores : [b, Hkv, P] ranking the candidate pools with ``pool_by="score"``
    layer : ``layer_terms(values, o_proj_weight, P)``, computed when not given (it serves every budget)

    Returns
    -------
    (keep [b, Hkv, P], error per query [b, r], swaps applied [b])
    """
    if pool_by not in ("effect", "score"):
        raise ValueError(f"pool_by must be effect or score, got {pool_by!r}")
    b, hkv, P = keep.shape
    count = int(keep[0, 0].sum())
    n_rem, n_add = min(pool, count), min(pool, P - count)
    if n_rem and n_add and rounds and layer is None:
        layer = layer_terms(values, o_proj_weight, P)
    delta, o_kept, z = output_change(attention, values, keep, o_proj_weight)
    swaps = torch.zeros(b, dtype=torch.long, device=keep.device)
    m = batch
    for _ in range(rounds if n_rem and n_add else 0):
        error = delta.norm(dim=-1).mean(-1)  # [b]
        terms = state_terms(attention, layer, delta, o_kept, z)
        rank = single_errors(terms, layer, delta, keep) if pool_by == "effect" else None
        removals = (scores if rank is None else rank).masked_fill(~keep, float("inf")).topk(n_rem, largest=False).indices
        additions = (-scores if rank is None else rank).masked_fill(keep, float("inf")).topk(n_add, largest=False).indices
        gain = error[:, None, None, None] - swap_errors(terms, layer, delta, removals, additions)
        i, j, best = _disjoint_best(gain, m)
        ok = best > 1e-6 * error[:, None, None]
        if not bool(ok.any()):
            break
        head = F.one_hot(best[..., 0].argmax(-1), hkv).bool()[..., None]  # the best single swap's head
        trials = [(k, ok[..., :k]) for k in sorted({max(1, m >> s) for s in range(m.bit_length())}, reverse=True)]
        trials.append((1, ok[..., :1] & head))
        accepted = torch.zeros(b, dtype=torch.bool, device=keep.device)
        for k, use in trials:
            removed, added = removals.gather(-1, i[..., :k]), additions.gather(-1, j[..., :k])
            trial = _swapped(attention, values, o_proj_weight, (delta, o_kept, z), removed, added, use)
            take = ~accepted & (trial[0].norm(dim=-1).mean(-1) < error)
            out = keep & ~torch.zeros_like(keep).scatter_(-1, removed, use)
            out |= torch.zeros_like(keep).scatter_(-1, added, use)
            keep = torch.where(take[:, None, None], out, keep)
            delta, o_kept, z = (torch.where(take.view(-1, *[1] * (x.dim() - 1)), t, x)
                                for t, x in zip(trial, (delta, o_kept, z)))
            swaps += take * use.sum((1, 2))
            accepted |= take
            if bool(accepted.all()):
                m = min(batch, 2 * k)
                break
        if not bool(accepted.any()):
            break
    if int(swaps.sum()):  # the changes were applied one by one: the returned error is measured afresh
        delta = output_change(attention, values, keep, o_proj_weight)[0]
    return keep, delta.norm(dim=-1), swaps
