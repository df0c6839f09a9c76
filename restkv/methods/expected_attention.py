"""Expected Attention: keep the entries that future queries are expected to attend to most.

Paper: "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries Distribution"
(Devoto et al., 2025), https://arxiv.org/abs/2510.00636; code: kvpress ``ExpectedAttentionPress``
(https://github.com/NVIDIA/kvpress, ``kvpress/presses/expected_attention_press.py``).

The prompt's queries before RoPE (every real token but the first ``n_sink``) give a mean ``mu`` and a
covariance ``S`` per query head; the next ``n_future_positions`` positions give the averaged rotation
``R = mean_p R_p``. A future query ``q ~ N(R mu, R S R^T)`` attends to key ``k`` with the expected weight
``E exp(s q.k) = exp(s (R mu).k + s^2 k^T R S R^T k / 2)`` (``s`` the attention scaling); the score is
the softmax of that exponent over the non-sink keys, then ``(a + epsilon) ||v||_2`` (``use_vnorm``).
The first ``n_sink`` tokens are always kept.

Defaults are the reference's (``n_future_positions=512, n_sink=4, use_covariance=True, use_vnorm=True,
epsilon=0``). Its evaluation registry runs it under AdaKV with ``epsilon=1e-2``: ``head_budget="adakv",
epsilon=0.01``; with CriticalKV (``critical=True``) it disables the value norm: ``use_vnorm=False``.
Differences: the queries before RoPE are the layer's queries with its RoPE undone (the reference recomputes
them from the hidden states: equal up to the model dtype's rounding); the softmax is in float32 (the
reference: the model dtype); ``s`` is the layer's attention scaling (the reference: ``1 / sqrt(d)``, the
same in every supported family's default); future positions follow each sample's last position (the
reference: the prompt length, the same without padding); the sinks' score is the sample's largest plus
one (the reference: the batch's); the observation window is always kept (the reference keeps none;
``window_size=1`` comes closest).
"""

from __future__ import annotations

from ..scoring import observe
from ..knobs import GQA_AGG, Knob
from ..lazy import torch
from ..scoring.observe import NEG, group_view
from ..scoring.rope import rotate_back

KNOBS = (
    Knob(
        "n_future_positions",
        512,
        "future positions whose RoPE is averaged",
        rule=">= 1",
    ),
    Knob(
        "n_sink",
        4,
        "first tokens always kept and left out of the query statistics and the softmax",
        rule=">= 0",
    ),
    Knob("use_covariance", True, "include the queries' covariance in the expected attention"),
    Knob("use_vnorm", True, "weight the expected attention by the value norm ||v||_2"),
    Knob(
        "epsilon",
        0.0,
        "added to the expected attention before the value-norm weighting",
        rule=">= 0",
        when={"use_vnorm": (True,)},
    ),
    GQA_AGG,
)


def query_statistics(queries, rope, rows, covariance: bool, block: int, first: int = 0):
    """Mean [b, Hq, d] and biased covariance [b, Hq, d, d] (None without ``covariance``) of the queries
    [b, Hq, n, d] of positions ``first:first + n`` before RoPE over the positions where ``rows`` [b, n] is
    True; ``block`` positions at a time."""
    n = queries.shape[2]
    w = rows.float()[:, None, :, None]  # [b, 1, L, 1]
    count = w.sum(2).clamp_min(1.0)  # [b, 1, 1]
    total = 0
    for s in range(0, n, block):
        e = min(n, s + block)
        total = total + rope.unrotate(queries[:, :, s:e], first + s, first + e).mul_(
            w[:, :, s:e]
        ).sum(2)
    mu = total / count
    if not covariance:
        return mu, None
    cov = 0
    for s in range(0, n, block):
        e = min(n, s + block)
        centred = rope.unrotate(queries[:, :, s:e], first + s, first + e).sub_(mu[:, :, None])
        centred = centred.mul_(w[:, :, s:e])
        cov = cov + centred.transpose(-1, -2) @ centred
    return mu, cov / count[..., None]


def expected_logits(keys, mu, cov, cos, sin, scaling: float, block: int):
    """``s (R mu).k + s^2 k^T R S R^T k / 2`` [b, Hq, L] for keys [b, Hkv, L, d] (after RoPE), the
    statistics before RoPE, and the averaged rotation ``R`` as cos, sin [b, d]. Uses ``R^T k``."""
    b, hkv, n, d = keys.shape
    hq = mu.shape[1]
    out = torch.empty(b, hkv, hq // hkv, n, device=keys.device)
    mu_g = group_view(mu, hkv)  # [b, Hkv, g, d]
    cov_g = None if cov is None else group_view(cov, hkv)  # [b, Hkv, g, d, d]
    c = cos[:, None, None]
    s_ = sin[:, None, None]
    for s in range(0, n, block):
        k = rotate_back(keys[:, :, s : min(n, s + block)].float(), c, s_)  # [b, Hkv, m, d]
        z = (mu_g @ k.transpose(-1, -2)).mul_(scaling)
        if cov_g is not None:
            kk = k[:, :, None]
            z += (kk @ cov_g).mul_(kk).sum(-1).mul_(0.5 * scaling**2)
        out[..., s : s + k.shape[2]] = z
    return out.view(b, hq, n)


def expected_attention(obs, n_future_positions: int, n_sink: int, covariance: bool, stats=None):
    """Attention expected from the future queries over every key -> ([b, Hq, L] float32, counted [b, L]).

    The queries' mean and covariance before RoPE (over the prompt's real tokens after the first
    ``n_sink``; ``stats``: given, [b, Hq, d] and [b, Hq, d, d] or None), rotated by the RoPE
    averaged over the next ``n_future_positions`` positions; the softmax runs over the counted keys
    only (the sinks and padding get 0).
    """
    if obs.rope is None:
        raise ValueError("the expected attention needs the layer's RoPE (the observation's rope)")
    hq = obs.queries.shape[1]
    hkv = obs.keys.shape[1]
    block = max(1, observe.VALUE_BLOCK * hkv // hq)  # [b, Hq, block, d] float32 at a time
    counted = (
        obs.positions >= n_sink
    )  # [b, L] real tokens after the sinks: query statistics and softmax
    first = (
        obs.first_query
    )  # the queries held: every prompt position's, or the window's while decoding
    if stats is None:
        rows = counted[:, first:]
        mu, cov = query_statistics(obs.queries, obs.rope, rows, covariance, block, first)
    else:
        mu, cov = stats
    cos, sin = obs.rope.mean_future(n_future_positions)
    z = expected_logits(obs.keys, mu, cov, cos, sin, obs.scaling, block)
    z = z.masked_fill_(~counted[:, None], NEG)
    a = z.sub_(z.amax(-1, keepdim=True)).clamp_min_(observe.EXP_FLOOR).exp_().mul_(counted[:, None])
    return a.div_(a.sum(-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)), counted


def keep_sinks(scores, obs, counted):
    """Scores [b, H, P] with the sinks (real tokens not ``counted``) above every other entry."""
    P = obs.prefix_len
    sinks = (obs.positions[:, :P] >= 0) & ~counted[:, :P]
    top = scores.masked_fill(~counted[:, None, :P], 0.0).amax(dim=(1, 2), keepdim=True) + 1.0
    return torch.where(sinks[:, None], top, scores)


def score(obs, cfg, stats=None):
    """The expected attention of every prefix entry, per query head -> [b, Hq, P] (sinks: the
    largest + 1); ``stats``: the queries' statistics, given (see ``expected_attention``)."""
    hq = obs.queries.shape[1]
    hkv = obs.keys.shape[1]
    P = obs.prefix_len
    args = (cfg.n_future_positions, cfg.n_sink, cfg.use_covariance, stats)
    a, counted = expected_attention(obs, *args)
    a = a[..., :P]
    if cfg.use_vnorm:
        norms = torch.linalg.vector_norm(obs.values[:, :, :P], dim=-1, dtype=torch.float32)
        a = (a + cfg.epsilon) * norms.repeat_interleave(hq // hkv, 1)
    return keep_sinks(a, obs, counted)
