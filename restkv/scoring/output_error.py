"""The layer attention-output error of a kept set, and its exact change under single changes and swaps.

The error is ReST-KV's objective (ICLR 2026, Def. 3.1; https://github.com/an-yongqi/rest-kv): for a query,
``|| sum_h W_O^h (o_h - o_h^S) ||`` with ``o_h`` head h's attention output over every key, ``o_h^S`` its
output over the kept keys (the attention renormalised over them) and ``W_O^h`` the head's column block of
``o_proj`` [D, d]: the change of the layer's output that evicting the rest causes.

Shapes: ``b`` batch, ``Hq`` query heads, ``H`` the heads that keep a set (``g = Hq // H`` query heads each,
contiguous), ``r`` observed queries, ``N`` keys they see, ``P`` the evictable prefix (keys from ``P`` on
are always kept), ``d`` head dim, ``D`` hidden size. A kept set is a bool mask ``keep`` [b, H, P].
"""

from __future__ import annotations

from ..lazy import F, torch
from .observe import group_view, weighted_values

TERMS_BLOCK = (
    None  # float32 elements of a block of per-entry terms (None: a share of the layer's K+V, below)
)
TERMS_SHARE = 16  # a block's float32 term holds at most 1 / TERMS_SHARE of the bytes of the layer's K+V
MIN_BLOCK = 64  # entries


def entries_per_block(per_entry: int, values: "torch.Tensor", prefix: int) -> int:
    """Prefix entries per block of a float32 term of ``per_entry`` elements per entry: ``TERMS_BLOCK``
    elements when set (tests shrink it), else 1 / ``TERMS_SHARE`` of the bytes of the layer's K+V
    (2 b H P d as stored), at least ``MIN_BLOCK``: the few such terms alive at once stay under the K+V."""
    forced = globals()["TERMS_BLOCK"]
    if forced:
        return max(1, forced // per_entry)
    b, heads, _, d = values.shape
    kv_bytes = 2 * b * heads * prefix * d * values.element_size()
    return max(MIN_BLOCK, kv_bytes // (4 * TERMS_SHARE * per_entry))


def kept_keys(keep: "torch.Tensor", n_keys: int, hq: int) -> "torch.Tensor":
    """Prefix mask [b, H, P] -> mask of every key [b, Hq, 1, N] (keys from P on kept)."""
    full = F.pad(keep, (0, n_keys - keep.shape[-1]), value=True)
    return full.repeat_interleave(hq // keep.shape[1], 1)[:, :, None]


def output_change(attention, values, keep, o_proj_weight):
    """The layer-output change of a kept set and the kept outputs.

    Parameters
    ----------
    attention : [b, Hq, r, N] softmax attention of the queries over every key they see (rows sum to 1)
    values : [b, H, N, d]
    keep : [b, H, P] bool
    o_proj_weight : [D, Hq * d]

    Returns
    -------
    (delta [b, r, D] = sum_h W_O^h (o_h - o_h^S), kept outputs o^S [b, Hq, r, d], kept mass z [b, Hq, r]), float32.
    """
    b, hq, r, n = attention.shape
    kept = attention * kept_keys(keep, n, hq)  # one [b, Hq, r, N] buffer, reused in place
    z = kept.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    o_kept = weighted_values(kept.div_(z), values)
    diff = weighted_values(
        torch.sub(attention, kept, out=kept), values
    )  # o - o^S in one pass (no difference of two outputs)
    del kept
    delta = diff.transpose(1, 2).reshape(b, r, -1) @ o_proj_weight.float().T
    return delta, o_kept, z[..., 0]


def layer_output_error(attention, values, keep, o_proj_weight) -> "torch.Tensor":
    """``|| sum_h W_O^h (o_h - o_h^S) ||`` per query -> [b, r] float32 (arguments as ``output_change``)."""
    return output_change(attention, values, keep, o_proj_weight)[0].norm(dim=-1)


def group_weights(o_proj_weight, heads: int, head_dim: int) -> "torch.Tensor":
    """W_O^h by group [H, g, D, d]: a view of ``o_proj_weight`` [D, Hq d] as stored (its readers convert it
    to float32 for one product at a time, so that no float32 copy is held through a search)."""
    g = o_proj_weight.shape[1] // head_dim // heads
    return o_proj_weight.view(-1, heads, g, head_dim).permute(1, 2, 0, 3)


def wo_gram(o_proj_weight, heads: int, head_dim: int) -> "torch.Tensor":
    """``M_ac = W_O^a^T W_O^c`` [H, g, g, d, d] float32, a and c query heads of one of the ``heads``
    groups. Cost O(H g^2 D d^2): a constant of the layer's weight (``restkv.eviction.observation``
    computes it once per weight)."""
    W = group_weights(o_proj_weight, heads, head_dim).float()
    return torch.einsum("kaex,kcey->kacxy", W, W)


def group_terms(values, o_proj_weight, prefix: int, gram=None) -> tuple:
    """The terms of ``layer_terms`` without the per-entry ones: W_O^h by group [H, g, D, d] as stored, ``M_ac``
    [H, g, g, d, d] (``gram`` when given, else ``wo_gram``), the prefix values as stored [b, H, P, d] and
    None for ``v_n^T M_ac v_n``, which ``swap_errors_at`` then computes for the pooled entries only."""
    hkv = values.shape[1]
    d = values.shape[-1]
    W = group_weights(o_proj_weight, hkv, d)
    M = wo_gram(o_proj_weight, hkv, d) if gram is None else gram
    return W, M, values[:, :, :prefix], None


def entry_quadratic(v, M) -> "torch.Tensor":
    """``v_n^T M_ac v_n`` for v [b, H, n, d] (float32) and M [H, g, g, d, d] -> [g, g, b, H, n]."""
    return (torch.einsum("bknx,kacxy->acbkny", v, M) * v[None, None]).sum(-1)


def layer_terms(values, o_proj_weight, prefix: int, gram=None) -> tuple:
    """What the swap errors of a layer read that no swap changes: W_O^h by group [H, g, D, d] as stored,
    ``M_ac = W_O^a^T W_O^c`` [H, g, g, d, d], the prefix values v [b, H, P, d] as stored and
    ``v_n^T M_ac v_n`` [g, g, b, H, P] (a, c: query heads of one group), a block of entries at a time
    (converted to float32 there). Cost O(b H g^2 P d^2). ``gram``: ``M_ac`` when already computed
    (``wo_gram``)."""
    W, M, v, _ = group_terms(values, o_proj_weight, prefix, gram)
    hkv = values.shape[1]
    d = values.shape[-1]
    g = M.shape[1]
    vMv = torch.empty(g, g, v.shape[0], hkv, prefix, device=v.device)
    block = entries_per_block(g * g * v.shape[0] * hkv * d, v, prefix)  # no [g, g, b, H, P, d] whole
    for s in range(0, prefix, block):
        vMv[..., s : s + block] = entry_quadratic(v[:, :, s : s + block].float(), M)
    return W, M, v, vMv


def state_products(layer: tuple, delta, o_kept, z) -> tuple:
    """What every entry's terms read of the current set (``output_change``'s delta, o^S = u, z), once per
    set: ``t_a = W_O^a^T delta`` [g, b, H, r, d], ``<t_a, u_a>`` [g, b, H, r, 1], ``u_a^T M_ac``
    [g, g, b, H, r, d], ``u_a^T M_ac u_c`` [g, g, b, H, r, 1] and z [g, b, H, r, 1].
    Cost O(b r D Hq d + b H g^2 r d^2); W_O is converted to float32 for the product only."""
    W, M, _, _ = layer
    hkv, g, hidden, d = W.shape
    u = group_view(o_kept, hkv).movedim(2, 0)  # [g, b, H, r, d]
    w_o = W.permute(2, 0, 1, 3).reshape(hidden, -1).float()  # o_proj [D, Hq d], converted for this product
    t = (delta @ w_o).view(*delta.shape[:2], hkv, g, d).permute(3, 0, 2, 1, 4)  # W_O^a^T delta
    uM = torch.einsum("abkqx,kacxy->acbkqy", u, M)  # (u_a^T M_ac) [g, g, b, H, r, d]
    uMu = torch.einsum("acbkqy,cbkqy->acbkq", uM, u)[..., None]
    return t, (t * u).sum(-1, keepdim=True), uM, uMu, group_view(z, hkv).movedim(2, 0)[..., None]


def entry_terms(products: tuple, attention, values) -> tuple:
    """Per entry n of ``values`` [b, H, n, d] (any dtype), with its attention [b, Hq, r, n], over the group's
    heads: a [g, b, H, r, n], ``c = <delta, W_O^a (v_n - u_a)>`` [g, b, H, r, n], ``u_a^T M_ac v_n``
    [g, g, b, H, r, n], then ``u_a^T M_ac u_c`` and z (``state_products``). Cost O(b H g^2 r n d)."""
    t, tu, uM, uMu, z = products
    hkv = values.shape[1]
    v = values.float()
    a = group_view(attention, hkv).movedim(2, 0)
    c = torch.einsum("abkqx,bknx->abkqn", t, v) - tu
    uMv = torch.einsum("acbkqy,bkny->acbkqn", uM, v)
    return a, c, uMv, uMu, z


def state_terms(attention, layer: tuple, delta, o_kept, z) -> tuple:
    """Per prefix entry n of the current set (``output_change``'s delta, o^S = u, z), over the group's heads:
    attention a [g, b, H, r, P], ``c = <delta, W_O^a (v_n - u_a)>`` [g, b, H, r, P], ``u_a^T M_ac v_n``
    [g, g, b, H, r, P], ``u_a^T M_ac u_c`` [g, g, b, H, r, 1] and z [g, b, H, r, 1]. Cost O(b H g^2 r P d)."""
    v = layer[2]
    products = state_products(layer, delta, o_kept, z)
    return entry_terms(products, attention[..., : v.shape[2]], v)


def _take(x, idx, rows: bool = True):
    """x [..., b, H, r, P] (without r: ``rows=False``) at the entries idx [b, H, n] -> [..., b, H, (r,) n]."""
    return x.gather(-1, (idx[:, :, None] if rows else idx).expand(*x.shape[:-1], idx.shape[-1]))


def _quadratic(delta, pairs):
    """||delta||^2 [b, r] + pairs [b, H, r, ...] -> mean error over the queries [b, H, ...]."""
    sq = (
        delta.pow(2).sum(-1).view(delta.shape[0], 1, delta.shape[1], *[1] * (pairs.dim() - 3))
        + pairs
    )
    return sq.clamp_min(0).sqrt().mean(2)


def single_errors(terms: tuple, layer: tuple, delta, keep) -> "torch.Tensor":
    """Mean error over the queries after one entry alone changes side, exactly: [b, H, P] float32.

    A kept entry n is evicted (``o_h - o_h^S' = (o_h - u_h) + x_h (v_n - u_h)``, ``x_h = a_hn / (z_h - a_hn)``),
    an evicted one kept (``- y_h (v_n - u_h)``, ``y_h = a_hn / (z_h + a_hn)``).
    """
    a, c, uMv, uMu, z = terms
    side = torch.where(keep, 1.0, -1.0)[:, :, None]  # [b, H, 1, P]
    coef = side * a / (z - side * a)
    K = layer[3][..., None, :] - uMv.transpose(0, 1)  # (v_n - u_a)^T M_ac (v_n - u_c), in place:
    K.sub_(uMv).add_(uMu)  # one [g, g, b, H, r, P] term at a time
    pairs = (coef[:, None] * coef).mul_(K)
    return _quadratic(delta, 2 * (coef * c).sum(0) + pairs.sum((0, 1)))


def swap_errors(terms: tuple, layer: tuple, delta, removals, additions) -> "torch.Tensor":
    """Mean error over the queries after each single swap, exactly: [b, H, R, A] float32.

    Swap (i, j) in head k evicts the kept entry ``removals[..., i]`` and keeps ``additions[..., j]``
    instead (every other head unchanged). With ``a_h`` the attention of query head h and ``u_h = o_h^S``,
    ``o_h - o_h^S' = (o_h - u_h) + x_h (v_i - u_h) - y_h (v_j - u_h)``, ``x_h = a_hi / z'_h``,
    ``y_h = a_hj / z'_h``, ``z'_h = z_h - a_hi + a_hj``, so the new change is ``delta + sum_h W_O^h (...)``
    and its squared norm a quadratic form in (x, y) over ``M_ac`` (``layer_terms``, ``state_terms``): no
    [R, A, D] tensor is formed. Cost O(b H g^2 r R A + b H g^2 R A d).
    """
    a, c, uMv, uMu, z = terms
    _, M, v, vMv = layer
    d = v.shape[-1]
    a_i, a_j, c_i, c_j, uMv_i, uMv_j = (
        _take(x, idx) for x in (a, c, uMv) for idx in (removals, additions)
    )
    K_i = _take(vMv, removals, rows=False)[..., None, :] - uMv_i.transpose(0, 1) - uMv_i + uMu
    K_j = _take(vMv, additions, rows=False)[..., None, :] - uMv_j.transpose(0, 1) - uMv_j + uMu
    v_i, v_j = (
        v.gather(2, idx[..., None].expand(-1, -1, -1, d)).float() for idx in (removals, additions)
    )
    K_ij = (
        torch.einsum("bkix,kacxy,bkjy->acbkij", v_i, M, v_j)[..., None, :, :]
        - uMv_i.transpose(0, 1)[..., None]
    )  # [g, g, b, H, r, R, A], completed in place (as are the quadratic's terms below)
    K_ij.sub_(uMv_j[..., None, :]).add_(uMu[..., None])
    z_new = z[..., None] - a_i[..., None] + a_j[..., None, :]
    x = a_i[..., None] / z_new  # [g, b, H, r, R, A]
    y = a_j[..., None, :] / z_new
    linear = (x * c_i[..., None] - y * c_j[..., None, :]).sum(0)
    quad = (x[:, None] * x).mul_(K_i[..., None])
    quad.add_((y[:, None] * y).mul_(K_j[..., None, :]))
    quad.sub_((2 * x[:, None] * y).mul_(K_ij))
    return _quadratic(delta, 2 * linear + quad.sum((0, 1)))


def single_errors_blocked(
    attention, layer: tuple, state: tuple, keep, products: tuple | None = None
) -> "torch.Tensor":
    """``single_errors(state_terms(...))`` [b, H, P] a block of prefix entries at a time, so that no [g, g, b, H,
    r, P] term is formed whole (``entries_per_block``). ``state``: (delta, o^S, z) of
    ``output_change``; ``products``: its ``state_products`` when already computed."""
    delta = state[0]
    W, M, v, vMv = layer
    b, heads, P = keep.shape
    g = M.shape[1]
    r = attention.shape[2]
    products = state_products(layer, *state) if products is None else products
    block = entries_per_block(g * g * b * heads * r, v, P)
    out = torch.empty(b, heads, P, device=keep.device)
    for s in range(0, P, block):
        e = min(P, s + block)
        part = (W, M, v[:, :, s:e], vMv[..., s:e])
        terms = entry_terms(products, attention[..., s:e], part[2])
        out[..., s:e] = single_errors(terms, part, delta, keep[..., s:e])
    return out


def swap_errors_at(
    attention, layer: tuple, state: tuple, removals, additions, products: tuple | None = None
) -> "torch.Tensor":
    """``swap_errors`` [b, H, R, A] from the terms of the pooled entries only (``removals`` [b, H, R],
    ``additions`` [b, H, A]): O(b H g^2 r (R + A)) memory, whatever the prompt length. ``layer``: as
    ``layer_terms``, or ``group_terms`` (the pooled entries' ``v_n^T M_ac v_n`` computed here);
    ``products``: the state's ``state_products`` when already computed."""
    delta = state[0]
    W, M, v, vMv = layer
    b, heads, n_out = removals.shape
    g = M.shape[1]
    r = attention.shape[2]
    d = v.shape[-1]
    cols = torch.cat([removals, additions], -1)  # [b, H, R + A]
    m = cols.shape[-1]
    a = group_view(attention, heads).gather(-1, cols[:, :, None, None].expand(-1, -1, g, r, -1))
    v_cols = v.gather(2, cols[..., None].expand(-1, -1, -1, d)).float()
    if vMv is None:  # group_terms: the per-entry terms of the pooled entries only
        vMv_cols = entry_quadratic(v_cols, M)
    else:
        vMv_cols = vMv.gather(-1, cols.expand(g, g, -1, -1, -1))
    part = (W, M, v_cols, vMv_cols)
    products = state_products(layer, *state) if products is None else products
    terms = entry_terms(products, a.flatten(1, 2), v_cols)
    at = torch.arange(m, device=cols.device).expand(b, heads, m)
    return swap_errors(terms, part, delta, at[..., :n_out], at[..., n_out:])
