"""SimLayerKV: lazy layers keep their first and latest tokens (as StreamingLLM), the others all.

Paper: "SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction" (Zhang et al., 2024),
https://arxiv.org/abs/2410.13846; code: kvpress ``SimLayerKVPress``
(https://github.com/NVIDIA/kvpress, ``kvpress/presses/simlayerkv_press.py``), whose definition this
is.

A layer is lazy for a sample when the attention of its last ``n_last`` queries, averaged over them
and over every query head, puts more than ``lazy_threshold`` on the first ``n_initial`` tokens and
the ``n_recent`` before the last ``n_last``; a lazy layer keeps its first ``n_initial`` tokens and
its last ``n_recent - n_last`` (kvpress's slice), the others keep everything. Prompts of at most
``n_initial + n_recent + n_last`` tokens keep everything.

How much a layer keeps depends on the prompt, so the method is a scorer under the threshold budget
(``head_budget="threshold"``, ``threshold=0.5``, registered so): an entry a layer keeps scores ``1 +
a``, one it evicts ``a - 1``, ``a`` the attention of the last ``n_last`` queries (averaged over
them), which orders the kept entries only when the budget ``max_capacity_prompt`` is smaller than
what the layer keeps (with ``max_capacity_prompt`` at least the prompt's length the kept sets are
kvpress's).

Differences: the layer's laziness is decided per sample (the reference: averaged over the batch) and
counts tokens from each sample's first real one; ``lazy_threshold`` defaults to 0.9 (the reference's
recommended value for Llama 3; its default, 1.0, never evicts); the observation window is always
kept (``window_size=1`` comes closest to the reference, whose kept recent tokens include the
last).
"""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import torch

KNOBS = (
    Knob(
        "lazy_threshold",
        0.9,
        "a layer is lazy when its last queries put more attention than this on the "
        "first n_initial and the last n_recent tokens",
        check=lambda t: 0.0 <= t <= 1.0,
        rule="in [0, 1]",
    ),
    Knob(
        "n_last",
        1,
        "last queries whose attention decides laziness",
        check=lambda n: n >= 1,
        rule=">= 1",
    ),
    Knob(
        "n_recent",
        1024,
        "recent tokens a lazy layer keeps (n_recent - n_last of them, as the reference)",
        check=lambda n: n >= 1,
        rule=">= 1",
    ),
    Knob("n_initial", 4, "first tokens a lazy layer keeps", check=lambda n: n >= 0, rule=">= 0"),
)


def check(values: dict) -> None:
    if values["n_recent"] <= values["n_last"]:
        raise ValueError(
            f"n_recent must be larger than n_last ({values['n_last']}), got {values['n_recent']}"
        )


def kept_by_lazy_layer(pos: "torch.Tensor", length: "torch.Tensor", cfg) -> "torch.Tensor":
    """[b, L] bool: what a lazy layer keeps (positions ``pos`` [b, L], real lengths [b, 1])."""
    first = (pos >= 0) & (pos < cfg.n_initial)
    return first | (pos >= length - (cfg.n_recent - cfg.n_last))


def lazy(
    attention: "torch.Tensor", pos: "torch.Tensor", length: "torch.Tensor", cfg
) -> "torch.Tensor":
    """[b, 1] bool: the layer is lazy for each sample (``attention`` [b, Hq, r, L] of its last
    queries)."""
    a = attention.mean((1, 2))  # [b, L]
    last = (
        length - cfg.n_last
    )  # the reference leaves out the last n_last keys (the deciding queries')
    ends = ((pos >= 0) & (pos < cfg.n_initial)) | ((pos >= last - cfg.n_recent) & (pos < last))
    mass = (a * ends).sum(-1, keepdim=True)
    long_enough = length > cfg.n_initial + cfg.n_recent + cfg.n_last
    return (mass > cfg.lazy_threshold) & long_enough


def score(obs, cfg):
    """``1 + a`` where the layer keeps the entry, ``a - 1`` where it evicts it -> [b, Hq, P]."""
    attention = obs.recent_attention(cfg.n_last)  # [b, Hq, r, L]
    pos = obs.positions
    length = obs.key_valid.sum(-1, keepdim=True)  # [b, 1]
    evicts = lazy(attention, pos, length, cfg) & ~kept_by_lazy_layer(pos, length, cfg)  # [b, L]
    P = obs.prefix_len
    a = attention[..., :P].mean(-2)
    return torch.where(evicts[:, None, :P], a - 1.0, a + 1.0)
