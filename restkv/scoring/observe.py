"""What a scorer sees of one attention layer at the end of prefill (or of what it holds, while decoding).

Shapes: ``b`` batch, ``Hq`` query heads, ``Hkv`` key/value heads (``g = Hq // Hkv`` per group),
``L`` prompt length, ``w`` observation window, ``P = L - w`` evictable prefix, ``d`` head dim.
Everything a scorer returns is float32. While decoding (``restkv.eviction.decode``) the keys are the entries held,
only the window's queries are there (``first_query``) and heads may hold different entries (``head_valid``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..lazy import torch

NEG = -3.4028234663852886e38  # the most negative float32
EXP_FLOOR = -87.0  # exp(-87) ~ 1.6e-38, the smallest normal float32
VALUE_BLOCK = 4096  # positions converted to float32 at a time
QUERY_BLOCK = (
    None  # query rows of a block of a long query window (None: about the layer's K+V, see below)
)
LONG_WINDOW = 256  # a window of more queries (a repeat pass's) is attended in blocks of this many rows
PROJECTION_BLOCK = (
    1 << 22
)  # float32 elements of a block of W_O-projected values ([b, Hkv, n, hidden])


@dataclass
class Observation:
    """One layer's prefill tensors, plus the quantities several scorers share (computed once).

    ``memo`` holds the shared quantities; configs scored on the same layer and prompt (sweep mode)
    pass one dict, so the window attention is computed once for all of them.
    """

    queries: "torch.Tensor"  # [b, Hq, Lq, d] the queries of the last Lq positions, after RoPE (Lq = L at prefill)
    keys: "torch.Tensor"  # [b, Hkv, L, d] after RoPE
    values: "torch.Tensor"  # [b, Hkv, L, d]
    key_valid: "torch.Tensor"  # [b, L] bool, False on padding
    window: int  # w
    budget: int  # entries kept per KV head in this layer, window included
    scaling: float
    softcap: float | None = None
    wo_factor: Any = (
        None  # R [Hq, d, d] of the layer's o_proj (``wo``), or a function that computes it
    )
    wo_weight: Any = (
        None  # the layer's o_proj weight [hidden, Hq d] (``o_proj``), or a function that returns it
    )
    wo_gram: Any = None  # a function heads -> M_ac = W_O^a^T W_O^c [H, g, g, d, d] (``output_error.wo_gram``)
    rope: Any = None  # restkv.scoring.rope.Rope of the layer's prompt (cos/sin, next position, other positions)
    layer: int = 0  # index among the model's evicted layers
    num_layers: int = 1  # evicted layers of the model
    memo: dict = field(default_factory=dict)
    head_valid: "torch.Tensor | None" = (
        None  # [b, H, L] bool when heads hold different entries (decoding)
    )
    data: Any = None  # the method's constants of this layer (``restkv.integration.calibration``: Q-Filters' filters)
    query_weights: "torch.Tensor | None" = (
        None  # [b, Lq] a weight per query (KVgrad: the objective's gradient)
    )
    hidden: "torch.Tensor | None" = (
        None  # [b, L, D] the layer's attention input (after its input norm), for a method that reads it
    )
    gather_heads: Any = None  # x [b, h, ...] -> [b, H, ...]: every device's heads where each holds some (vLLM's ranks)

    def every_head(self, x: "torch.Tensor") -> "torch.Tensor":
        """[b, h, ...] of the heads this observation holds -> [b, H, ...] of every head of the layer: ``x``
        itself on one device; under tensor parallelism every rank's, in rank order (``gather_heads``), so a
        score that reads every head computes on every rank what it computes on one device."""
        return x if self.gather_heads is None else self.gather_heads(x)

    @property
    def prefix_len(self) -> int:
        return self.keys.shape[2] - self.window

    @property
    def first_query(self) -> int:
        """Position of the first query held: 0 at prefill (every query), ``L - w`` when decoding (the window)."""
        return self.keys.shape[2] - self.queries.shape[2]

    @property
    def entry_valid(self) -> "torch.Tensor":
        """[b, 1 or H, L] bool: which entries each head holds (``key_valid`` for every head unless ``head_valid``)."""
        return self.key_valid[:, None] if self.head_valid is None else self.head_valid

    def shared(self, name: str, compute):
        """``compute()``, once per layer and window (kept in ``memo``)."""
        key = (name, self.window)
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    @property
    def positions(self) -> "torch.Tensor":
        """[b, L] position of each key counted from the sample's first real token, -1 on padding."""
        return self.shared("positions", lambda: relative_positions(self.key_valid))

    @property
    def wo(self) -> "torch.Tensor":
        """R_h [Hq, d, d] with ``||W_O^h x|| = ||R_h x||`` for the layer's ``o_proj``, upper triangular (see
        ``wo_factor``)."""
        if self.wo_factor is None:
            raise ValueError("this observation carries no W_O factor (wo_factor)")
        return self.shared(
            "wo", lambda: self.wo_factor() if callable(self.wo_factor) else self.wo_factor
        )

    @property
    def o_proj(self) -> "torch.Tensor":
        """The layer's o_proj weight W_O [hidden, Hq d] (see ``wo_weight``), on the values' device."""
        if self.wo_weight is None:
            raise ValueError("this observation carries no o_proj weight (wo_weight)")
        return self.shared(
            "wo_weight", lambda: self.wo_weight() if callable(self.wo_weight) else self.wo_weight
        )

    def projected_value_norms(self, norm: str = "l1") -> "torch.Tensor":
        """``||W_O^h v_n||`` [b, Hq, P] for every query head h and prefix entry n, float32.

        ``l1``: the L1 norm over the hidden dimension (CriticalKV's), which needs the projection itself,
        formed a block of positions and one member of every GQA group at a time (``PROJECTION_BLOCK``);
        ``l2``: the L2 norm, exactly ``||R_h v_n||`` with the d x d factor ``wo`` (hidden / d times cheaper).
        """
        return self.shared(f"value_norms_{norm}", lambda: _projected_norms(self, norm))

    def attention(self, start: int, stop: int) -> "torch.Tensor":
        """Softmax attention of queries ``start:stop`` (positions >= ``first_query``) over all keys, causal
        and padding-masked (per head with ``head_valid``).

        Returns [b, Hq, stop - start, L] float32. Rows of padding queries are zero. Built in place in
        one float32 buffer; low-precision keys are converted one KV head at a time. Queries fewer than
        the keys are those of the last positions (a pass after the prefill: its keys follow the cache's).
        """
        b, hq, _, d = self.queries.shape
        hkv = self.keys.shape[1]
        n_keys = self.keys.shape[2]
        rows = hq // hkv * (stop - start)
        first = self.first_query
        q = (
            self.queries[:, :, start - first : stop - first].float().reshape(b, hkv, rows, d)
        )  # group-major rows
        logits = torch.empty(b, hkv, rows, n_keys, device=self.keys.device)
        if self.keys.dtype == torch.float32:
            torch.matmul(q, self.keys.transpose(-1, -2), out=logits)
        else:
            for h in range(hkv):  # bounds the float32 copy of the keys to one head
                logits[:, h] = q[:, h] @ self.keys[:, h].float().transpose(-1, -2)
        probs = logits.view(b, hq, stop - start, n_keys).mul_(self.scaling)
        if self.softcap:
            probs.div_(self.softcap).tanh_().mul_(self.softcap)
        q_pos = torch.arange(start, stop, device=probs.device)
        valid = self.entry_valid  # [b, 1 or H, L] -> [b, 1 or Hq, 1, L]
        valid = (valid.repeat_interleave(hq // valid.shape[1], 1) if valid.shape[1] > 1 else valid)[
            :, :, None
        ]
        hidden = ~((torch.arange(n_keys, device=probs.device) <= q_pos[:, None]) & valid)
        probs.masked_fill_(hidden, NEG)
        # exp below EXP_FLOOR underflows to denormals/zero, which CPUs compute many times slower;
        # those terms are < 1e-37 of the row's largest, and masked entries are set to exactly 0 after.
        probs.sub_(probs.amax(-1, keepdim=True)).clamp_min_(EXP_FLOOR).exp_().masked_fill_(
            hidden, 0.0
        )
        return probs.div_(
            probs.sum(-1, keepdim=True).clamp_min_(1.0)
        )  # rows of padding queries: all 0

    @property
    def window_attention(self) -> "torch.Tensor":
        """[b, Hq, w, L] attention of the observation window's queries."""
        n = self.keys.shape[2]
        return self.shared("window_attention", lambda: self.attention(n - self.window, n))

    def recent_attention(self, rows: int) -> "torch.Tensor":
        """[b, Hq, r, L] attention of the ``rows`` most recent queries (r: at most the queries held); the
        window's when ``rows`` is 0 or the window size. Queries older than the window see only the keys before them."""
        n = self.keys.shape[2]
        rows = min(rows or self.window, self.queries.shape[2])
        if rows == self.window:
            return self.window_attention
        return self.shared(f"recent_attention_{rows}", lambda: self.attention(n - rows, n))

    def recent_attention_blocks(self, rows: int):
        """The ``recent_attention(rows)`` rows in blocks, oldest first: yields (first row, [b, Hq, rb, L]).

        The window's (shared) is one block when it has at most ``LONG_WINDOW`` queries; longer query
        windows, and a repeat pass's queries, come in blocks of about the layer's K+V in float32
        attention (at least the window or ``LONG_WINDOW`` rows; ``QUERY_BLOCK`` rows when set), so that
        no [b, Hq, r, L] tensor is formed.
        """
        rows = min(rows or self.window, self.queries.shape[2])
        if rows == self.window <= LONG_WINDOW:
            yield 0, self.window_attention
            return
        yield from self.attention_blocks(rows, least=min(self.window, LONG_WINDOW))

    def attention_blocks(self, rows: int, least: int = 1):
        """The attention of the ``rows`` most recent queries in blocks, oldest first: yields (first row,
        [b, Hq, rb, L]), rb rows of about the layer's K+V in float32 attention (at least ``least``;
        ``QUERY_BLOCK`` rows when set), never the whole [b, Hq, r, L]."""
        n = self.keys.shape[2]
        b, hq = self.queries.shape[:2]
        hkv = self.keys.shape[1]
        d = self.keys.shape[-1]
        block = globals()["QUERY_BLOCK"] or max(
            least, 2 * hkv * d * self.keys.element_size() // (4 * hq)
        )
        for start in range(n - rows, n, block):
            yield start - (n - rows), self.attention(start, min(n, start + block))

    @property
    def window_output(self) -> "torch.Tensor":
        """[b, Hq, w, d] attention output of the window queries (over all keys), float32."""
        return self.shared(
            "window_output", lambda: weighted_values(self.window_attention, self.values)
        )


def attention_received(blocks, prefix: int, reduce: str = "max") -> "torch.Tensor":
    """[b, Hq, prefix]: the largest (``reduce="max"``) or summed (``"sum"``) attention each of the
    first ``prefix`` keys receives from the queries of ``blocks`` (``attention_blocks``' pairs of
    (first row, [b, Hq, r, n])), one block at a time."""
    out = None
    for _, attention in blocks:
        part = attention[..., :prefix]
        part = part.amax(-2) if reduce == "max" else part.sum(-2)
        if out is None:
            out = part
        elif reduce == "max":
            torch.maximum(out, part, out=out)
        else:
            out += part
    return out


def weighted_values(weights: "torch.Tensor", values: "torch.Tensor") -> "torch.Tensor":
    """``sum_n weights[..., n] v_n`` per query head: weights [b, Hq, r, N], values [b, Hkv, >=N, d] -> [b, Hq, r, d].

    Values are read in blocks, so low-precision values are never copied whole to float32.
    """
    b, hq, r, n = weights.shape
    hkv = values.shape[1]
    w = weights.reshape(b, hkv, hq // hkv * r, n)
    out = 0
    block = globals()["VALUE_BLOCK"]  # read at call time (tests shrink it)
    for s in range(0, n, block):
        out = out + w[..., s : s + block] @ values[:, :, s : min(n, s + block)].float()
    return out.view(b, hq, r, -1)


def float_blocks(values: "torch.Tensor", stop: int, block: int | None = None):
    """The values of entries ``0:stop`` in float32, ``block`` (default ``VALUE_BLOCK``) entries at a time, for several
    passes: a function of no arguments that yields (start, [b, Hkv, n, d]). Entries that fit one block are converted
    once, for every pass; longer prefixes a block at a time in each pass (no float32 copy of them all is held)."""
    block = block or globals()["VALUE_BLOCK"]  # read at call time (tests shrink it)
    if stop <= block:
        one = ((0, values[:, :, :stop].float()),)
        return lambda: iter(one)
    return lambda: (
        (s, values[:, :, s : min(stop, s + block)].float()) for s in range(0, stop, block)
    )


def _projected_norms(obs: Observation, norm: str) -> "torch.Tensor":
    b, hkv, _, d = obs.values.shape
    hq = obs.queries.shape[1]
    P = obs.prefix_len
    g = hq // hkv
    out = torch.empty(b, hkv, g, P, device=obs.values.device)
    if norm == "l2":
        R = group_view(obs.wo[None], hkv)[0]  # [Hkv, g, d, d]
        block = max(1, VALUE_BLOCK // g)  # the projected block is [b, Hq, block, d]
        for s in range(0, P, block):
            v = obs.values[:, :, s : min(P, s + block)].float()
            out[..., s : s + v.shape[2]] = torch.linalg.vector_norm(
                v[:, :, None] @ R.transpose(-1, -2), dim=-1
            )
        return out.view(b, hq, P)
    W = obs.o_proj
    hidden = W.shape[0]
    block = max(1, PROJECTION_BLOCK // (b * hkv * hidden))
    heads = W.view(hidden, hkv, g, d)  # query head k g + r of KV head k
    for r in range(g):
        w_r = heads[:, :, r].permute(1, 2, 0).float()  # [Hkv, d, hidden]
        for s in range(0, P, block):
            v = obs.values[:, :, s : min(P, s + block)].float()
            out[:, :, r, s : s + v.shape[2]] = torch.linalg.vector_norm(v @ w_r, ord=1, dim=-1)
    return out.view(b, hq, P)


def relative_positions(key_valid: "torch.Tensor") -> "torch.Tensor":
    """[b, L] bool validity (left padding) -> position from the sample's first real token, -1 on padding."""
    return (key_valid.long().cumsum(-1) - 1).masked_fill(~key_valid, -1)


def group_view(x: "torch.Tensor", hkv: int) -> "torch.Tensor":
    """[b, Hq, ...] -> [b, Hkv, g, ...] (query heads of one KV head are contiguous)."""
    return x.view(x.shape[0], hkv, -1, *x.shape[2:])


def wo_factor(o_proj_weight: "torch.Tensor", num_heads: int) -> "torch.Tensor":
    """R_h [Hq, d, d] with ``||W_O^h x|| = ||R_h x||`` (R of the QR of each head's column block of o_proj: upper
    triangular, which ReST-KV's distances use).

    Using R (not the [heads, L, hidden] product) keeps every W_O term at the size of the values.
    """
    hidden = o_proj_weight.shape[0]
    w = o_proj_weight.float().view(hidden, num_heads, -1).transpose(0, 1)  # [Hq, hidden, d]
    return torch.linalg.qr(w, mode="r").R
