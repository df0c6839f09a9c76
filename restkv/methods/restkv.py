"""ReST-KV: keep the entries whose removal would change the layer's attention output the most.

Paper: "ReST-KV: Robust KV Cache Eviction with Layer-wise Output Reconstruction and
Spatial-Temporal Smoothing" (ICLR 2026); the authors' code: https://github.com/an-yongqi/rest-kv.

For one query with attention ``A`` and output ``o``, removing entry ``n`` changes the head's
contribution to the layer output by exactly ``A[n] / (1 - A[n]) * ||(o - v_n) W_O^h||``.
The score of a prefix entry is that change, smoothed over time (the window queries: ``temporal``)
and over space (``pooling="adaptive"``: a window that follows how the important positions drift).

As the authors' code: ``metric_mode="after"`` aggregates the window's attention over the prefix
columns first (not renormalised) and scores with the output of that row over the prefix;
``"before"`` scores each window query with its full output, then aggregates. ``tau`` is applied only
in after mode with ``use_wo`` (elsewhere it has no effect and is refused); ``use_norm`` only in before
mode. The drift is computed from each row's own top-(B - w) keys. ``indicator`` and ``temporal``
give the paper's ablation grid (``attn``: aggregated attention, ``attn-v``: times ``||v_n||``,
``random``; ``last`` = the last query only, ``inv-ema`` = the EMA in reverse order).

Deliberate differences, each measured or harmless: one kept set per KV head by default (the original
keeps one per query head, ``gqa_agg="none"``, g times the memory); every score in float32 (the
original computes in the model's fp16); the drift per sample (the original applies batch element
0's to every sample); the window is always kept, also with ``indicator="random"`` (the original's
random ablation draws among all positions); the adaptive shift never exceeds the half-width (with
kernel 1 and a drift of exactly 0 the original's padding shifts the whole score vector by one).
"""

from __future__ import annotations

from ..scoring import observe
from ..knobs import GQA_AGG, KERNEL_SIZE, POOLING, Knob, positive
from ..lazy import torch
from ..scoring.observe import group_view, weighted_values
from ..scoring.smoothing import TEMPORAL, RowAggregate, aggregate_rows, pool1d, shifted_box_filter
from . import expected_attention as expected
from . import random

_EPS = 1.1920928955078125e-07  # float32 machine epsilon

INDICATORS = ("reconstruction", "attn", "attn-v", "random")
_SCORED = {"indicator": INDICATORS[:3]}  # not random
_RECON = {"indicator": ("reconstruction",)}
_EXPECTED = (
    "n_future_positions",
    "n_sink",
    "use_covariance",
)  # ExpectedAttention's knobs that query_proxy reads

KNOBS = (
    Knob(
        "indicator",
        "reconstruction",
        "what is scored: reconstruction (the output change, ReST-KV), attn (aggregated "
        "window attention), attn-v (attention times ||v_n||) or random (the paper's ablation)",
        choices=INDICATORS,
    ),
    Knob(
        "metric_mode",
        "after",
        "after: aggregate the window's attention over time first, then score; before: "
        "score each window query, then aggregate",
        choices=("after", "before"),
        when=_RECON,
    ),
    Knob(
        "use_wo",
        True,
        "measure the output change after the head's slice of o_proj (else in value space)",
        when=_RECON,
    ),
    Knob(
        "use_norm",
        False,
        "divide each query's indicator by ||O_q W_O^h||",
        when={**_RECON, "metric_mode": ("before",)},
    ),
    Knob(
        "tau",
        1.0,
        "exponent of the output distance ||(o - v_n) W_O^h||",
        check=positive,
        rule="> 0",
        when={**_RECON, "metric_mode": ("after",), "use_wo": (True,)},
    ),
    Knob(
        "temporal",
        "mean",
        "smoothing over the window queries: last (the newest only), mean, ema (the paper: "
        "the newest weighs alpha), inv-ema (the oldest weighs alpha) or max (the worst case over the queries; "
        "not in after mode, whose row must be a distribution)",
        choices=TEMPORAL,
        when=_SCORED,
    ),
    Knob(
        "alpha",
        0.3,
        "EMA weight",
        check=lambda a: 0 < a <= 1,
        rule="in (0, 1]",
        when={**_SCORED, "temporal": ("ema", "inv-ema")},
    ),
    POOLING.but(
        default="adaptive",
        choices=("adaptive", "avgpool", "maxpool", "none"),
        when=_SCORED,
        help="spatial smoothing: adaptive (a window that follows the drift of the top positions), "
        "avgpool, maxpool or none",
    ),
    KERNEL_SIZE,
    Knob(
        "scale",
        2000.0,
        "adaptive pooling: positions of drift per pooling step",
        check=positive,
        rule="> 0",
        when={"pooling": ("adaptive",)},
    ),
    random.KNOBS[0].but(when={"indicator": ("random",)}),
    GQA_AGG,
    Knob(
        "query_window",
        0,
        "queries observed (scored against): the last query_window positions, only the "
        "window_size newest kept; older queries see only the keys before them (0: window_size)",
        check=lambda n: n >= 0,
        rule=">= 0",
        when=_SCORED,
    ),
    Knob(
        "query_proxy",
        "window",
        "stand-in for the future queries' attention row: window (the observed queries'), "
        "expected (expected from the prompt's query statistics at future positions, as ExpectedAttention) or "
        "both (the mean of the two rows)",
        choices=("window", "expected", "both"),
        when={**_RECON, "metric_mode": ("after",)},
    ),
    *(
        k.but(when={"query_proxy": ("expected", "both")})
        for k in expected.KNOBS
        if k.name in _EXPECTED
    ),
)
ALIASES = {
    "use_ema": ("temporal", {True: "ema", False: "mean"}),
    "ts": ("temporal", {"none": "last", "mean": "mean", "ema": "ema", "inv-ema": "inv-ema"}),
}


def check(values: dict) -> None:
    if values.get("temporal") == "max" and values.get("metric_mode") == "after":
        raise ValueError(
            "temporal='max' needs metric_mode='before' (or an attn indicator): in after mode the "
            "aggregated row is an attention distribution, and a maximum over queries is not one"
        )


def uses_budget(cfg) -> bool:
    """The adaptive window's drift reads the layer's budget (its top-(B - w) positions)."""
    return cfg.get("pooling") == "adaptive"


def odds(a: "torch.Tensor") -> "torch.Tensor":
    """``a / (1 - a)``, finite even when attention is one-hot."""
    return a / (1.0 - a).clamp_min(_EPS)


def _project(x: "torch.Tensor", R: "torch.Tensor | None", r: int, hkv: int) -> "torch.Tensor":
    """x [b, Hkv, n, d] mapped by R of group member r of every KV head (identity without W_O)."""
    if R is None:
        return x
    return x @ group_view(R[None], hkv)[0, :, r].transpose(-1, -2)  # [Hkv, d, d]


def _distances(
    po: "torch.Tensor", values: "torch.Tensor", P: int, R: "torch.Tensor | None"
) -> "torch.Tensor":
    """``||R_h (o - v_n)||`` for outputs po = R_h o [b, Hkv, g, r, d] -> [b, Hkv, g, r, P].

    Uses ``|x - y|^2 = |x|^2 - 2 x.y + |y|^2`` block by block over the values (converted to float32
    a block at a time), so no [P, d] difference tensor is formed.
    """
    b, hkv, g, rows, _ = po.shape
    out = torch.empty(b, hkv, g, rows, P, device=po.device)
    po_sq = po.pow(2).sum(-1, keepdim=True)
    block = observe.VALUE_BLOCK
    for s in range(0, P, block):
        v = values[:, :, s : min(P, s + block)].float()
        for r in range(g):
            pv = _project(v, R, r, hkv)  # [b, Hkv, n, d]
            sq = torch.linalg.vector_norm(pv, dim=-1).square_()[:, :, None, :]  # [b, Hkv, 1, n]
            sq = sq - 2 * po[:, :, r] @ pv.transpose(-1, -2) + po_sq[:, :, r]
            out[:, :, r, :, s : s + v.shape[2]] = sq.clamp_min_(0).sqrt_()
    return out


def _project_outputs(O: "torch.Tensor", R: "torch.Tensor | None", hkv: int) -> "torch.Tensor":
    """Outputs O [b, Hq, r, d] -> R_h O [b, Hkv, g, r, d]."""
    O = group_view(O, hkv)
    if R is None:
        return O
    return torch.einsum("bkgrd,kged->bkgre", O, group_view(R[None], hkv)[0])


def output_distance(
    o: "torch.Tensor", values: "torch.Tensor", P: int, R: "torch.Tensor | None"
) -> "torch.Tensor":
    """``||(o_h - v_n) W_O^h||`` for every query head h and prefix entry n -> [b, Hq, P].

    o [b, Hq, d] (one output per head), values [b, Hkv, L, d]. The extra memory is a few
    value-block-sized float32 tensors.
    """
    po = _project_outputs(o[:, :, None], R, values.shape[1])
    return _distances(po, values, P, R)[:, :, :, 0].flatten(1, 2)


def output_distance_rows(
    O: "torch.Tensor", values: "torch.Tensor", P: int, R: "torch.Tensor | None"
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """``||(O_q - v_n) W_O^h||`` for every window query q -> ([b, Hq, w, P], ||O_q W_O^h|| [b, Hq, w, 1])."""
    po = _project_outputs(O, R, values.shape[1])
    return _distances(po, values, P, R).flatten(1, 2), po.norm(dim=-1, keepdim=True).flatten(1, 2)


def exact_dominant(
    scores: "torch.Tensor",
    weights: "torch.Tensor",
    values: "torch.Tensor",
    R: "torch.Tensor | None",
    tau: float,
    other_mass: "torch.Tensor | float" = 0.0,
) -> "torch.Tensor":
    """Recompute, per row, the score of the most attended entry without cancellation.

    With ``o = u_n + a_n v_n`` and ``1 - a_n = rest_n`` (the mass of every other entry, summed
    from the small weights rather than as ``1 - a_n``), the indicator is
    ``a_n / rest_n * ||(u_n - rest_n v_n) W_O^h||^tau``. For ``a_n`` close to 1 (near one-hot
    attention, low-precision inputs) ``1 - a_n`` and ``o - v_n`` both cancel catastrophically;
    this form stays accurate.

    scores [b, Hq, r, P] per-row scores to patch, weights [b, Hq, r, N] (N >= P, the entries
    ``o`` sums over), values [b, Hkv, L, d], ``other_mass`` attention outside the N entries.
    """
    b, hq, rows, _ = weights.shape
    hkv = values.shape[1]
    d = values.shape[-1]
    P = scores.shape[-1]
    top = weights.argmax(-1, keepdim=True)  # [b, Hq, r, 1]
    a = weights.gather(-1, top)
    rest_w = weights.scatter(-1, top, 0.0)
    rest = (rest_w.sum(-1, keepdim=True) + other_mass).clamp_min(_EPS)
    u = weighted_values(rest_w, values)  # [b, Hq, r, d]
    v_top = (
        values.gather(2, group_view(top, hkv).flatten(2, 3).expand(-1, -1, -1, d))
        .float()
        .view(b, hq, rows, d)
    )
    diff = u - rest * v_top
    if R is not None:
        diff = torch.einsum("bhrd,hed->bhre", diff, R)
    fixed = a / rest * diff.norm(dim=-1, keepdim=True).pow(tau)
    where = top.clamp(max=P - 1)
    fixed = torch.where(
        top < P, fixed, scores.gather(-1, where)
    )  # the top entry may be in the window
    return scores.scatter(-1, where, fixed)


def window_drift(window_attention: "torch.Tensor", top: int) -> "torch.Tensor":
    """Drift t [b, Hq] of the important positions over the window, as the original defines it.

    Every window query (row) takes its own top-``top`` key positions over all keys; ``t`` is the mean of
    those positions over the rows of the window's first (older) half and their top keys, minus the
    same mean over the second half. Per sample (the original uses batch element 0 for every sample).
    """
    return drift_of(top_mean_positions(window_attention, top))


def top_mean_positions(attention: "torch.Tensor", top: int) -> "torch.Tensor":
    """Mean position of each row's top-``top`` keys: attention [b, Hq, r, L] -> [b, Hq, r]."""
    top = max(1, min(top, attention.shape[-1]))
    return attention.topk(top, dim=-1, sorted=False).indices.float().mean(-1)


def drift_of(mean_pos: "torch.Tensor") -> "torch.Tensor":
    """``window_drift`` from the rows' mean top positions [b, Hq, r] -> [b, Hq]."""
    w = mean_pos.shape[-1]
    return mean_pos[..., : w // 2].mean(-1) - mean_pos[..., w // 2 :].mean(-1)


def adaptive_pool(
    scores: "torch.Tensor",
    drift: "torch.Tensor",
    kernel_size: int,
    scale: float,
    n_pad: "torch.Tensor | None" = None,
    reach: int | None = None,
    bounded: bool = False,
) -> "torch.Tensor":
    """Average pooling whose width and shift follow the drift, per sample and head.

    kernel ``k = max(kernel_size, 2 floor(|t| / scale) + 1)``, shift ``s = floor(t / scale)`` (+1
    when ``t <= 0``), replicate padding ``k // 2 - s`` on the left and ``k // 2 + s`` on the right.
    ``n_pad`` [b] left-padding lengths: each sample is padded from its first real entry. ``reach``:
    a bound of ``|t|`` (the keys the drift's positions range over); when ``reach / scale`` cannot
    widen the kernel, its width is known without the host read of the widest; with ``bounded`` the
    widest kernel ``reach`` allows is laid out instead of reading it (the same averages: the taps
    past a row's own window weigh 0).
    """
    if n_pad is not None:
        first = n_pad.clamp(max=scores.shape[-1] - 1)[:, None, None].expand(-1, scores.shape[1], 1)
        is_pad = torch.arange(scores.shape[-1], device=scores.device) < n_pad[:, None, None]
        scores = torch.where(is_pad, scores.gather(-1, first), scores)
    steps = torch.floor(drift.abs() / scale).long()
    half = torch.clamp(steps, min=kernel_size // 2)  # k // 2 with k = max(kernel_size, 2 steps + 1)
    shift = torch.floor(drift / scale).long() + (drift <= 0).long()
    shift = torch.maximum(torch.minimum(shift, half), -half)
    if reach is not None and reach // scale <= kernel_size // 2:  # every head's half is k // 2
        max_pad = 2 * (kernel_size // 2)
    elif reach is not None and bounded:  # half <= reach // scale, + 1 for float32's rounding
        max_pad = 2 * (int(reach // scale) + 1)
    else:
        max_pad = 2 * int(half.max())  # one host read per layer
    left = (half - shift).flatten()
    right = (half + shift).flatten()
    out = shifted_box_filter(scores.reshape(-1, scores.shape[-1]), left, right, max_pad)
    return out.view(scores.shape)


def over_time(x: "torch.Tensor", obs, cfg) -> "torch.Tensor":
    """The observed query rows of x [b, H, r, N] reduced by ``temporal`` -> [b, H, N] (``over_time_blocks``)."""
    agg = RowAggregate(x.shape[-2], cfg.temporal, cfg.get("alpha"))
    agg.add(0, x)
    return renormalised(agg.value, x.shape[-2], obs, cfg)


def renormalised(s: "torch.Tensor", rows: int, obs, cfg) -> "torch.Tensor":
    """The rows' aggregate s [b, H, N] with the rows of padding queries (a query window longer than a sample)
    left out by renormalising the weights of the real ones."""
    if rows == obs.window:  # the window (as the original): no renormalisation, no host sync
        return s
    real = obs.key_valid[:, obs.keys.shape[2] - rows :]  # [b, r]
    return s / aggregate_rows(
        real.float()[:, None, :, None], cfg.temporal, cfg.get("alpha")
    ).clamp_min(_EPS)


def row_terms(obs, cfg, A: "torch.Tensor") -> dict:
    """What the score aggregates over the observed rows, from a block of them A [b, Hq, rb, L]: per name
    [b, Hq, rb, P or 1]."""
    P = obs.prefix_len
    if cfg.indicator != "reconstruction":
        return {"s": A[..., :P]}
    if cfg.metric_mode == "after":
        if cfg.query_proxy == "expected":
            return {}
        return {"a": A[..., :P], "mass": A[..., P:].sum(-1, keepdim=True)}
    R = obs.wo if cfg.use_wo else None
    shared = obs.memo.get(("window_attention", obs.window))  # read, never formed here
    out = obs.window_output if A is shared else weighted_values(A, obs.values)
    dist, o_norm = output_distance_rows(out, obs.values, P, R)
    rows = exact_dominant(dist.mul_(odds(A[..., :P])), A, obs.values, R, 1.0)
    return {"s": rows / o_norm.clamp_min(_EPS) if cfg.use_norm else rows}


def over_time_blocks(obs, cfg, rows: int, top: int | None) -> tuple[dict, "torch.Tensor | None"]:
    """``row_terms`` of the ``rows`` observed queries reduced by ``temporal``, a block of rows at a time
    (``Observation.recent_attention_blocks``) -> ({name: [b, Hq, P or 1]}, the adaptive drift [b, Hq] or None
    when ``top`` is None)."""
    sums: dict = {}
    mean_pos = []
    for start, A in obs.recent_attention_blocks(rows):
        for name, x in row_terms(obs, cfg, A).items():
            sums.setdefault(name, RowAggregate(rows, cfg.temporal, cfg.get("alpha"))).add(start, x)
        if top is not None:
            mean_pos.append(top_mean_positions(A, top))
    drift = None if top is None else drift_of(torch.cat(mean_pos, -1))
    return {name: renormalised(agg.value, rows, obs, cfg) for name, agg in sums.items()}, drift


def proxy_row(
    obs, cfg, observed: dict
) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor | None"]:
    """The aggregated attention row standing for the future queries -> (a [b, Hq, 1, P], its mass on the
    window [b, Hq, 1, 1], counted [b, L] or None): the observed rows over time (``observed``: "a" and "mass"),
    ExpectedAttention's row, or their mean."""
    rows = []
    if cfg.query_proxy != "expected":
        rows.append((observed["a"], observed["mass"]))
    counted = None
    if cfg.query_proxy != "window":
        P = obs.prefix_len
        e, counted = expected.expected_attention(
            obs, cfg.n_future_positions, cfg.n_sink, cfg.use_covariance
        )
        rows.append((e[..., :P], e[..., P:].sum(-1, keepdim=True)))
    a, mass = (sum(r) / len(rows) for r in zip(*rows))
    return a[:, :, None], mass[..., None], counted


def score(obs, cfg):
    """ReST-KV's score of every prefix entry, per query head -> [b, Hq, P] ([b, Hkv, P] for ``random``)."""
    if cfg.indicator == "random":
        return random.score(obs, cfg)
    P = obs.prefix_len
    rows = min(cfg.query_window or obs.window, obs.queries.shape[2])
    top = obs.budget - obs.window if cfg.pooling == "adaptive" else None
    observed, drift = over_time_blocks(
        obs, cfg, rows, top
    )  # no [b, Hq, r, L] tensor for a long query window
    counted = None
    if cfg.indicator != "reconstruction":
        s = observed["s"]
        if cfg.indicator == "attn-v":  # times ||v_n||, each query head with its KV head's values
            norms = torch.linalg.vector_norm(obs.values[:, :, :P], dim=-1, dtype=torch.float32)
            s = s * norms.repeat_interleave(s.shape[1] // norms.shape[1], 1)
    elif cfg.metric_mode == "after":
        R, tau = (obs.wo, cfg.tau) if cfg.use_wo else (None, 1.0)
        a, window_mass, counted = proxy_row(obs, cfg, observed)  # [b, Hq, 1, P], [b, Hq, 1, 1]
        o = weighted_values(a, obs.values)[
            :, :, 0
        ]  # [b, Hq, d] output of the aggregated row, prefix only
        s = output_distance(o, obs.values, P, R).pow_(tau).mul_(odds(a[:, :, 0]))
        s = exact_dominant(s[:, :, None], a, obs.values, R, tau, window_mass)[:, :, 0]
    else:  # before: every observed query with its full output, then over time
        s = observed["s"]
    if cfg.pooling == "adaptive":
        n_pad = (~obs.key_valid[:, :P]).sum(-1)
        reach = obs.keys.shape[2]
        bounded = obs.first_query > 0  # the window's queries only (decoding): no read per layer
        s = adaptive_pool(s, drift, cfg.kernel_size, cfg.scale, n_pad, reach, bounded)
    else:
        s = pool1d(s, cfg.pooling, cfg.get("kernel_size", 1))
    return s if counted is None else expected.keep_sinks(s, obs, counted)
