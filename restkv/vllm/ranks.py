"""Tensor parallelism as the eviction sees it (no vLLM import: the hooks give the collectives).

Each rank holds some KV heads of every layer (rank r the r-th run of them). Where a head's count depends
on the other heads' (``settings.sized_across_heads``: AdaKV, HeadKV, LU-KV, a budget shared across
layers), every rank gathers the scores of all the heads, computes the split ``restkv.configure`` computes
on one device (``head_sizes``, ``shared_sizes``), and keeps its own heads' part; a score that reads every
head gathers those terms through the same ``gather`` (``Observation.every_head``). Every rank makes the
same calls in the same order (the same requests, layers and steps), as collectives need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..strategies.budgets import fits, shared_sizes
from ..strategies.head_budgets import head_sizes


@dataclass(frozen=True)
class Ranks:
    """This rank among ``size`` tensor-parallel ranks."""

    rank: int
    size: int
    gather: Callable  # [n, h, P] on every rank -> [n, size * h, P], the ranks' heads in rank order
    most: Callable  # a list of host ints -> the largest of each over every rank
    share: Callable  # a host object -> every rank's, in rank order (``restkv.vllm.outcome.merged``)

    def own(self, heads: int) -> slice:
        """This rank's ``heads`` among every rank's."""
        return slice(self.rank * heads, (self.rank + 1) * heads)


def padded(scores: torch.Tensor, width: int) -> torch.Tensor:
    """[..., P] -> [..., width], -inf past P (slots no head holds, never kept)."""
    return torch.nn.functional.pad(scores, (0, width - scores.shape[-1]), value=float("-inf"))


def layer_sizes(ranks: Ranks, obs, cfg, scores: torch.Tensor, table=None) -> tuple[bool, torch.Tensor | None]:
    """One layer's split among every rank's heads -> (whether every head keeps all it holds, this rank's
    heads' prefix entries [1, h] or None then). ``scores`` [1, h, P] this rank's (``entry_scores``),
    ``table`` the layer's HeadKV row or LU-KV curve (every head's). The layer's width is its widest head's
    over every rank (each head's older entries first, so a head's slots past its own are padding)."""
    (width,) = ranks.most([obs.prefix_len])
    if fits(cfg, width + obs.window, obs.budget):
        return True, None
    every = ranks.gather(padded(scores, width))
    held = torch.ones(1, width + obs.window, dtype=torch.bool, device=scores.device)
    sizes = head_sizes(cfg, every, obs.budget - obs.window, table, held, obs.window)
    return False, sizes[:, ranks.own(scores.shape[1])].clamp(max=obs.prefix_len)


def layers_sizes(ranks: Ranks, cfg, scores: list, budget: int) -> tuple[list, list]:
    """A budget shared across layers (``layer_budget="global"``) among every rank's heads -> (per layer:
    whether every head keeps all it holds, this rank's heads' prefix entries [1, h]). ``scores`` one
    [1, h, P] per layer, this rank's."""
    widths = ranks.most([s.shape[-1] for s in scores])
    width = max(widths)
    every = ranks.gather(torch.cat([padded(s, width) for s in scores]))  # [layers, H, width]
    sizes = shared_sizes(cfg, list(every[:, None]), budget)
    h = scores[0].shape[1]
    fit = [fits(cfg, w + cfg.window_size, budget) for w in widths]
    return fit, [size[:, ranks.own(h)].clamp(max=s.shape[-1]) for size, s in zip(sizes, scores)]
