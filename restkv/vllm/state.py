"""A request on a worker: its state across steps (``RequestState``) and its part of one step
(``Scheduled``). No vLLM import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .counting import Eviction


@dataclass
class RequestState:
    """One request's state on a worker."""

    slot: int  # its row in the query ring
    cfg: object  # the config it runs (``per_request``; None: it keeps all)
    offset: int = 0  # entries evicted so far (logical - held)
    evicted: bool = False  # it evicted before (``settings.eviction``'s ``evicted``)
    sums: dict = field(default_factory=dict)  # layer name -> [Hq or Hkv, n] summed chunk scores
    pages: dict = field(default_factory=dict)  # layer name -> its heads' pages (per-head budgets, once evicted)
    free: list = field(default_factory=list)  # pages of its blocks no head of any layer holds (shared by ``pages``)
    placed: int = 0  # its blocks whose pages ``pages`` and ``free`` hold


@dataclass
class Scheduled:
    """One request's part of a step."""

    req_id: str
    state: RequestState
    start: int  # its first token in the step's batch
    count: int  # its tokens in the step
    computed: int  # tokens computed before the step (logical)
    prompt_len: int
    blocks: np.ndarray  # its block ids
    eviction: Eviction | None
    sums: bool  # its prefill adds a SUMMED method's chunk scores
    held_slots: torch.Tensor | None = (
        None  # [held] the slots of the entries it holds, on the device
    )
    kept_slots: torch.Tensor | None = None  # [budget] where its kept entries go
    scores: dict = field(default_factory=dict)  # layer name -> [1, Hkv, P] its selection scores (deferred)
    kept_pages: list = field(default_factory=list)  # per-head budgets: every page of the blocks it keeps
    # per-head budgets: layer name -> the page slots [Hkv, width] its observation read from its heads' pages
    # (none: from the blocks it held), where its kept entries are moved from as stored
    read_from: dict = field(default_factory=dict)
    dropped: int = 0  # positions its eviction dropped so far in the step, over its layers and KV heads
    heads: int = 0  # the (layer, KV head) pairs ``dropped`` sums over

    @property
    def end(self) -> int:
        return self.computed + self.count

    @property
    def cfg(self):
        return self.state.cfg
