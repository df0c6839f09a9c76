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
from ..knobs import GQA_AGG, KERNEL_SIZE, POOLING, Knob
from ..lazy import torch
from ..scoring.observe import weighted_values
from ..scoring.output_change import (
    EPS,
    after_indicator,
    dominant_entry,
    exact_dominant,
    odds,
    output_distance_rows,
    value_block,
)
from ..scoring.smoothing import (
    TEMPORAL,
    RowAggregate,
    aggregate_rows,
    pool1d,
    replicate_index,
    shifted_box_filter,
)
from . import expected_attention as expected
from . import random


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


def window_drift(window_attention: "torch.Tensor", top: int) -> "torch.Tensor":
    """Drift t [b, Hq] of the important positions over the window, as the original defines it.

    Every window query (row) takes its own top-``top`` key positions over all keys; ``t`` is the mean of
    those positions over the rows of the window's first (older) half and their top keys, minus the
    same mean over the second half. Per sample (the original uses batch element 0 for every sample).
    """
    return drift_of(top_mean_positions(window_attention, top))


def top_mean_positions(attention: "torch.Tensor", top: int) -> "torch.Tensor":
    """Mean position of each row's top-``top`` keys: attention [b, Hq, r, L] -> [b, Hq, r].

    Attention is never negative, so its bits read as int32 order as the floats do (ties too): the selection
    is the same and int32 keys compare faster."""
    top = max(1, min(top, attention.shape[-1]))
    keys = attention.view(torch.int32)
    return keys.topk(top, dim=-1, sorted=False).indices.float().mean(-1)


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
    q = drift / scale  # float32 integers below, exact
    half = q.abs().floor_().clamp_min_(kernel_size // 2)  # k // 2, k = max(kernel_size, 2 steps + 1)
    shift = torch.minimum(q.floor() + (drift <= 0), half)  # >= -half: floor(q) + 1 >= -floor(|q|)
    if reach is not None and reach // scale <= kernel_size // 2:  # every head's half is k // 2
        max_pad = 2 * (kernel_size // 2)
    elif reach is not None and bounded:  # half <= reach // scale, + 1 for float32's rounding
        max_pad = 2 * (int(reach // scale) + 1)
    else:
        max_pad = 2 * int(half.max())  # one host read per layer
    index = replicate_index(scores.shape[-1], max_pad, n_pad, scores.device)
    padded = scores.gather(-1, index.expand(*scores.shape[:-1], -1))
    rows = padded.shape[0] * padded.shape[1]
    out = shifted_box_filter(padded.view(rows, -1), shift.flatten(), half.flatten(), max_pad)
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
    ).clamp_min(EPS)


def row_terms(obs, cfg, A: "torch.Tensor") -> dict:
    """What the score aggregates over the observed rows, from a block of them A [b, Hq, rb, L]: per name
    [b, Hq, rb, P, L or 1]."""
    P = obs.prefix_len
    if cfg.indicator != "reconstruction":
        return {"s": A[..., :P]}
    if cfg.metric_mode == "after":
        if cfg.query_proxy == "expected":
            return {}
        return {"row": A}  # every key's: the prefix's row and its mass on the window in one
    R = obs.wo if cfg.use_wo else None
    shared = obs.memo.get(("window_attention", obs.window))  # read, never formed here
    out = obs.window_output if A is shared else weighted_values(A, obs.values)
    dominant = dominant_entry(A)
    u = weighted_values(dominant[3], obs.values)
    blocks = observe.float_blocks(obs.values, P, value_block(obs.values, R))
    dist, o_norm = output_distance_rows(out, blocks, P, R)
    rows = exact_dominant(dist.mul_(odds(A[..., :P])), dominant, u, obs.values, R, 1.0)
    return {"s": rows / o_norm.clamp_min(EPS) if cfg.use_norm else rows}


def over_time_blocks(obs, cfg, rows: int, top: int | None) -> tuple[dict, "torch.Tensor | None"]:
    """``row_terms`` of the ``rows`` observed queries reduced by ``temporal``, a block of rows at a time
    (``Observation.recent_attention_blocks``) -> ({name: [b, Hq, P, L or 1]}, the adaptive drift [b, Hq] or None
    when ``top`` is None)."""
    sums: dict = {}
    mean_pos = []
    for start, A in obs.recent_attention_blocks(rows):
        for name, x in row_terms(obs, cfg, A).items():
            sums.setdefault(name, RowAggregate(rows, cfg.temporal, cfg.get("alpha"))).add(start, x)
        if top is not None:
            mean_pos.append(top_mean_positions(A, top))
    observed = {name: renormalised(agg.value, rows, obs, cfg) for name, agg in sums.items()}
    if top is None:
        return observed, None
    return observed, drift_of(mean_pos[0] if len(mean_pos) == 1 else torch.cat(mean_pos, -1))


def proxy_row(
    obs, cfg, observed: dict
) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor | None"]:
    """The aggregated attention row standing for the future queries -> (a [b, Hq, 1, P], its mass on the
    window [b, Hq, 1, 1], counted [b, L] or None): the observed rows over time (``observed``: "row", over every
    key), ExpectedAttention's row, or their mean."""
    P = obs.prefix_len
    rows = []
    if cfg.query_proxy != "expected":
        row = observed["row"]
        rows.append((row[..., :P], row[..., P:].sum(-1, keepdim=True)))
    counted = None
    if cfg.query_proxy != "window":
        e, counted = expected.expected_attention(
            obs, cfg.n_future_positions, cfg.n_sink, cfg.use_covariance
        )
        rows.append((e[..., :P], e[..., P:].sum(-1, keepdim=True)))
    a, mass = rows[0] if len(rows) == 1 else (sum(r) / len(rows) for r in zip(*rows))
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
        s = after_indicator(a, window_mass, obs.values, R, tau)[:, :, 0]
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
