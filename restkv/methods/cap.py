"""CAPKV: keep the entries of largest query-weighted leverage of their values.

Paper: "CAPKV" (arXiv:2604.25975), https://arxiv.org/abs/2604.25975; code: kvpress ``CapPress``
(https://github.com/NVIDIA/kvpress, ``kvpress/presses/cap_press.py``), whose definition this is.

Per query head, the anchor ``mu`` is the mean of the prompt's queries before RoPE (every real token
but the first ``n_sink``) rotated by the RoPE averaged over the next ``n_future_positions``
positions. Each non-sink key ``k_j`` gets the weight ``w_j = exp(tau (c_j - max c))`` of its cosine
``c_j = cos(mu, k_j)``; with ``A = I + sum_j (w_j + epsilon) v_j v_j^T`` over the non-sink entries,
the score is ``w_j v_j^T A^{-1} v_j``, averaged over the query heads of each KV head. The first
``n_sink`` tokens are always kept.

Defaults are the reference's (``tau=5, n_future_positions=512, n_sink=4, epsilon=1e-6``).
Differences: the queries before RoPE are the layer's queries with its RoPE undone (the reference
recomputes them from the hidden states: equal up to the model dtype's rounding); ``A`` and its
inverse are in float32 (the reference forms ``A`` in the model dtype, then solves in float32);
future positions follow each sample's last position and the statistics run over each sample's real
tokens (the reference: the prompt length and the batch, the same without padding); the sinks' score
is the sample's largest plus one (the reference: the batch's); the observation window is always kept
(the reference keeps none; ``window_size=1`` comes closest).
"""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import F, torch
from ..scoring import observe
from ..scoring.observe import group_view
from ..scoring.rope import rotate
from .expected_attention import KNOBS as _EXPECTED_ATTENTION
from .expected_attention import keep_sinks, query_statistics

N_FUTURE_POSITIONS = next(k for k in _EXPECTED_ATTENTION if k.name == "n_future_positions")
KNOBS = (
    Knob(
        "tau",
        5.0,
        "CAPKV: temperature of the weights exp(tau cos(anchor, k))",
        rule=">= 0",
    ),
    N_FUTURE_POSITIONS,
    Knob(
        "n_sink",
        4,
        "first tokens always kept and left out of the query anchor and the leverage",
        rule=">= 0",
    ),
    Knob(
        "epsilon",
        1e-6,
        "CAPKV: added to the weights inside the capacity matrix",
        rule=">= 0",
    ),
)


def anchor(obs, n_future_positions: int, counted) -> "torch.Tensor":
    """The historical-query anchor [b, Hq, d]: the mean query before RoPE of the ``counted`` [b, L]
    positions, rotated by the averaged future RoPE."""
    if obs.rope is None:
        raise ValueError("CAPKV needs the layer's RoPE (the observation's rope)")
    hq = obs.queries.shape[1]
    block = max(1, observe.VALUE_BLOCK * obs.keys.shape[1] // hq)
    first = obs.first_query
    mu, _ = query_statistics(obs.queries, obs.rope, counted[:, first:], False, block, first)
    cos, sin = obs.rope.mean_future(n_future_positions)
    return rotate(mu, cos[:, None], sin[:, None])


def weights(obs, mu, counted, tau: float) -> "torch.Tensor":
    """``exp(tau (c_j - max c))`` [b, Hkv, g, L], ``c_j`` the cosine of the anchor and key j; 0
    where ``counted`` [b, 1 or Hkv, L] is False."""
    hkv = obs.keys.shape[1]
    n = obs.keys.shape[2]
    mu_g = F.normalize(group_view(mu, hkv), dim=-1)  # [b, Hkv, g, d]
    c = torch.empty(*mu_g.shape[:3], n, device=obs.keys.device)
    for s in range(0, n, observe.VALUE_BLOCK):
        k = F.normalize(obs.keys[:, :, s : min(n, s + observe.VALUE_BLOCK)].float(), dim=-1)
        c[..., s : s + k.shape[2]] = (mu_g @ k.transpose(-1, -2)).clamp_(-1.0, 1.0)
    mask = counted[:, :, None]
    c = c.mul_(tau).masked_fill_(~mask, observe.NEG)
    return c.sub_(c.amax(-1, keepdim=True)).clamp_min_(observe.EXP_FLOOR).exp_().mul_(mask)


def leverage(obs, w, counted, epsilon: float) -> "torch.Tensor":
    """``v_j^T A^{-1} v_j`` [b, Hkv, g, L], ``A = I + sum_j (w_j + epsilon) v_j v_j^T`` over the
    ``counted`` entries (``w`` [b, Hkv, g, L])."""
    b, hkv, n, d = obs.values.shape
    scale = (w + epsilon).mul_(counted[:, :, None])
    capacity = torch.eye(d, device=w.device).expand(b, hkv, w.shape[2], d, d).clone()
    for s in range(0, n, observe.VALUE_BLOCK):
        v = obs.values[:, :, s : min(n, s + observe.VALUE_BLOCK)].float()  # [b, Hkv, m, d]
        sv = v[:, :, None] * scale[..., s : s + v.shape[2], None]  # [b, Hkv, g, m, d]
        capacity += sv.transpose(-1, -2) @ v[:, :, None]
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(capacity))  # [b, Hkv, g, d, d]
    out = torch.empty_like(w)
    for s in range(0, n, observe.VALUE_BLOCK):
        v = obs.values[:, :, s : min(n, s + observe.VALUE_BLOCK)].float()[:, :, None]
        out[..., s : s + v.shape[3]] = ((v @ inverse) * v).sum(-1)
    return out


def score(obs, cfg):
    """``w_j v_j^T A^{-1} v_j`` averaged over each GQA group -> [b, Hkv, P] (sinks: the largest
    + 1)."""
    counted = obs.positions >= cfg.n_sink  # [b, L] real tokens after the sinks
    held = counted[:, None] & obs.entry_valid  # [b, 1 or Hkv, L]
    mu = anchor(obs, cfg.n_future_positions, counted)
    w = weights(obs, mu, held, cfg.tau)
    scores = (w * leverage(obs, w, held, cfg.epsilon)).mean(2)[..., : obs.prefix_len]
    return keep_sinks(scores, obs, counted)
