"""The change of a head's output when one entry is removed: ``A[n] / (1 - A[n]) * ||(o - v_n) W_O^h||``, for
every entry at once (ReST-KV's indicator, ``restkv.methods.restkv``).

``o`` is the output of an aggregated attention row over the prefix, ``R`` the W_O factor of each query head
(``observe.wo_factor``: ``||x W_O^h|| = ||x R_h||``, upper triangular), the distances projected block by block
of the values, a KV head's query heads in one product; the most attended entry, where ``o - v_n`` cancels, is
recomputed exactly (``exact_dominant``).
"""

from __future__ import annotations

from ..lazy import torch
from . import observe
from .observe import group_view

MIN_BLOCK = 1024  # entries: the fewest in a block of the distances' passes (``value_block``)
EPS = 1.1920928955078125e-07  # float32 machine epsilon
SUM_CHUNK = 256  # entries per chunk of a split weighted sum (``_split_product``)
SPLIT_FROM = 32  # chunks from which a weighted sum is split (shorter ones: one product)


def odds(a: "torch.Tensor") -> "torch.Tensor":
    """``a / (1 - a)``, finite even when attention is one-hot."""
    return a / (1.0 - a).clamp_min(EPS)


def _factor_blocks(R: "torch.Tensor", hkv: int) -> list:
    """R [Hq, m, d] (upper triangular: the R of a QR, ``observe.wo_factor``) in two blocks of its rows, each with
    the columns it reads -> [(first column c, [Hkv, d - c, g m_i])], a KV head's g query heads side by side: one
    product projects a block of values for the whole group. Row i reads the columns from i on, so the second half
    of the rows reads the second half of the columns: 3/4 of the products of a full R."""
    m, d = R.shape[-2:]
    grouped = R.view(hkv, -1, m, d)
    cuts = (0, m // 2, m)
    return [
        (c, grouped[:, :, c:e, c:].permute(0, 3, 1, 2).reshape(hkv, d - c, -1))
        for c, e in zip(cuts, cuts[1:])
        if e > c
    ]


def value_block(values: "torch.Tensor", R: "torch.Tensor | None") -> int:
    """Entries per block of the distances' passes over the values [b, Hkv, L, d]: as many as keep a block's
    projected values (half of R's rows for every query head, float32) under half the layer's K+V, so the step
    stays within 4x the layer's K+V: four blocks for ReST-KV's default (each block is a few launches on a
    GPU), and at least ``MIN_BLOCK`` entries (a short prompt in one block)."""
    b, hkv, n, d = values.shape
    per_entry = 4 * b * (hkv * d if R is None else R.shape[0] * -(-R.shape[1] // 2))
    return max(MIN_BLOCK, values.numel() * values.element_size() // per_entry)


def _block_distances(out, uo, c, v, blocks, buffer) -> None:
    """``||R_h (O_q - v_n)||^2`` into out [b, Hkv, g, r, n] for a block of values v [b, Hkv, n, d] (float32), from
    ``|x - y|^2 = |x|^2 - 2 x.y + |y|^2``: c = ||R_h O_q||^2 [b, Hkv, g, r, 1], the cross term through
    uo = R_h^T R_h O_q [b, Hkv, g, r, d], and ||R_h v_n|| a block of R's rows at a time (``_factor_blocks``;
    ``[(0, None)]``: the identity), projected into ``buffer`` (float32, reused by every block)."""
    b, hkv, n, d = v.shape
    g, r = uo.shape[2:4]
    for i, (col, W) in enumerate(blocks):
        if W is None:
            x = v.view(b, hkv, n, 1, d)
        else:
            size = b * hkv * n * W.shape[-1]
            x = torch.matmul(v[..., col:], W, out=buffer[:size].view(b, hkv, n, -1))
            x = x.view(b, hkv, n, g, -1)  # [b, Hkv, n, g, m_i]
        norm = torch.linalg.vector_norm(x, dim=-1).transpose(-1, -2)[..., None, :]  # [.., g or 1, 1, n]
        torch.addcmul(out if i else c, norm, norm, out=out)
    flat = out.view(b * hkv, g * r, n)
    flat.baddbmm_(uo.view(b * hkv, g * r, d), v.reshape(b * hkv, n, d).transpose(1, 2), alpha=-2)


def _distances(O: "torch.Tensor", blocks, P: int, R: "torch.Tensor | None") -> tuple:
    """``||R_h (O_q - v_n)||`` for every query head h, row q and entry n < P of the values ``blocks``
    (``observe.float_blocks``): O [b, Hq, r, d] -> ([b, Hq, r, P], ||R_h O_q||^2 [b, Hq, r, 1]).

    Without R (``use_wo=False``) the distance in value space. The values are projected once per block for every
    head of a GQA group, and no [P, d] difference is formed.
    """
    b, hq, r, _ = O.shape
    po = O if R is None else O @ R.transpose(-1, -2)
    uo = po if R is None else po @ R  # R_h^T R_h O_q: x.y with y = R_h v_n
    c = po.square().sum(-1, keepdim=True)
    out = None
    for s, v in blocks():
        hkv = v.shape[1]
        if out is None:  # the first block is the longest
            out = torch.empty(b, hkv, hq // hkv, r, P, device=O.device, dtype=torch.float32)
            factor = [(0, None)] if R is None else _factor_blocks(R, hkv)
            width = 0 if R is None else max(W.shape[-1] for _, W in factor)
            buffer = torch.empty(v[..., 0].numel() * width, device=O.device, dtype=torch.float32)
        at = out[..., s : s + v.shape[2]]
        _block_distances(at, group_view(uo, hkv), group_view(c, hkv), v, factor, buffer)
        del v  # before the next block is converted
    return out.clamp_min_(0).sqrt_().flatten(1, 2), c


def output_distance(o: "torch.Tensor", blocks, P: int, R: "torch.Tensor | None") -> "torch.Tensor":
    """``||(o_h - v_n) W_O^h||`` for every query head h and prefix entry n -> [b, Hq, P].

    o [b, Hq, d] (one output per head), ``blocks``: the values (``observe.float_blocks``). The extra memory is
    a few value-block-sized float32 tensors.
    """
    return _distances(o[:, :, None], blocks, P, R)[0][:, :, 0]


def output_distance_rows(
    O: "torch.Tensor", blocks, P: int, R: "torch.Tensor | None"
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """``||(O_q - v_n) W_O^h||`` for every window query q -> ([b, Hq, w, P], ||O_q W_O^h|| [b, Hq, w, 1])."""
    dist, c = _distances(O, blocks, P, R)
    return dist, c.sqrt()


def weighted_sums(weights: "torch.Tensor", blocks) -> "torch.Tensor":
    """``sum_n weights[..., n] v_n`` per query head from the values ``blocks`` (``observe.float_blocks``):
    weights [b, Hq, r, N] -> [b, Hq, r, d]."""
    b, hq, r, _ = weights.shape
    out = None
    for s, v in blocks():
        w = weights.reshape(b, v.shape[1], -1, weights.shape[-1])[..., s : s + v.shape[2]]
        part = _split_product(w, v)
        out = part if out is None else out.add_(part)
        del v  # before the next block is converted
    return out.view(b, hq, r, -1)


def _split_product(w: "torch.Tensor", v: "torch.Tensor") -> "torch.Tensor":
    """w [b, H, m, n] @ v [b, H, n, d] for few rows m: a long block of entries in chunks of ``SUM_CHUNK`` as a batch,
    then summed (one product over thousands of entries runs as a long serial loop on a GPU)."""
    b, h, m, n = w.shape
    chunks = n // SUM_CHUNK
    if chunks < SPLIT_FROM:
        return w @ v
    main = chunks * SUM_CHUNK
    split = w[..., :main].reshape(b, h, m, chunks, SUM_CHUNK).transpose(2, 3)
    out = (split @ v[:, :, :main].reshape(b, h, chunks, SUM_CHUNK, -1)).sum(2)
    return out if main == n else out.add_(w[..., main:] @ v[:, :, main:])


def dominant_entry(weights: "torch.Tensor", other_mass: "torch.Tensor | float" = 0.0) -> tuple:
    """The most attended entry of each row and what ``exact_dominant`` reads of it: weights [b, Hq, r, N] ->
    (its index [b, Hq, r, 1], its weight a, the mass of every other entry ``rest`` (summed from the small
    weights, plus ``other_mass``, the attention outside the N entries), the weights without it [b, Hq, r, N])."""
    top = weights.argmax(-1, keepdim=True)  # [b, Hq, r, 1]
    rest_w = weights.scatter(-1, top, 0.0)
    rest = rest_w.sum(-1, keepdim=True)
    if not isinstance(other_mass, float) or other_mass:
        rest = rest + other_mass
    return top, weights.gather(-1, top), rest.clamp_min_(EPS), rest_w


def exact_dominant(
    scores: "torch.Tensor",
    dominant: tuple,
    u: "torch.Tensor",
    values: "torch.Tensor",
    R: "torch.Tensor | None",
    tau: float,
) -> "torch.Tensor":
    """Recompute, per row, the score of the most attended entry without cancellation.

    With ``o = u_n + a_n v_n`` and ``1 - a_n = rest_n`` (the mass of every other entry, summed
    from the small weights rather than as ``1 - a_n``), the indicator is
    ``a_n / rest_n * ||(u_n - rest_n v_n) W_O^h||^tau``. For ``a_n`` close to 1 (near one-hot
    attention, low-precision inputs) ``1 - a_n`` and ``o - v_n`` both cancel catastrophically;
    this form stays accurate.

    scores [b, Hq, r, P] per-row scores to patch, ``dominant``: ``dominant_entry`` of the weights
    [b, Hq, r, N] (N >= P, the entries ``o`` sums over), u [b, Hq, r, d] the output of its weights without
    the entry, values [b, Hkv, L, d].
    """
    top, a, rest, rest_w = dominant
    b, hq, rows, _ = u.shape
    hkv = values.shape[1]
    d = values.shape[-1]
    P = scores.shape[-1]
    v_top = (
        values.gather(2, group_view(top, hkv).flatten(2, 3).expand(-1, -1, -1, d))
        .float()
        .view(b, hq, rows, d)
    )
    diff = u - rest * v_top
    if R is not None:
        diff = diff @ R.transpose(-1, -2)
    norm = diff.norm(dim=-1, keepdim=True)
    fixed = a / rest * (norm if tau == 1.0 else norm.pow(tau))
    if rest_w.shape[-1] == P:
        return scores.scatter(-1, top, fixed)
    where = top.clamp(max=P - 1)
    fixed = torch.where(
        top < P, fixed, scores.gather(-1, where)
    )  # the top entry may be in the window
    return scores.scatter(-1, where, fixed)


def after_indicator(
    a: "torch.Tensor",
    mass: "torch.Tensor",
    values: "torch.Tensor",
    R: "torch.Tensor | None",
    tau: float,
) -> "torch.Tensor":
    """The indicator of every prefix entry for the aggregated row a [b, Hq, 1, P] (``mass`` [b, Hq, 1, 1]: its
    attention on the window) -> ``odds(a) ||(o - v_n) W_O^h||^tau`` [b, Hq, 1, P], o the row's output over the
    prefix; the most attended entry recomputed without cancellation (``exact_dominant``). One pass over the
    values gives o and the dominant entry's u, a second the distances (one conversion to float32 when the prefix
    fits one value block)."""
    P = a.shape[-1]
    dominant = dominant_entry(a, mass)
    blocks = observe.float_blocks(values, P, value_block(values, R))
    o, u = weighted_sums(torch.cat([a, dominant[3]], -2), blocks).unbind(-2)
    s = output_distance(o, blocks, P, R)[:, :, None]
    s = (s if tau == 1.0 else s.pow_(tau)).mul_(odds(a))
    return exact_dominant(s, dominant, u[:, :, None], values, R, tau)
