"""The query ring: each request's most recent queries per layer, as many as an eviction reads
(``settings.query_rows``). Its memory, ``[rows, Hq, d]`` per layer for every request slot, is counted by
``restkv.vllm.memory``. No vLLM import here.
"""

from __future__ import annotations

import torch


class QueryRing:
    """The most recent queries of every request, per layer: [slots, rows, Hq, d], the query of
    position p in row ``p % rows`` (allocated on a layer's first step, on its queries' device, for
    all ``slots`` at once: its size is known before any request, ``restkv.vllm.memory``)."""

    def __init__(self, rows: int, slots: int = 1):
        self.rows = rows
        self.slots = slots
        self.buffers: dict = {}

    def write(self, layer: str, query: torch.Tensor, tokens: torch.Tensor, index: torch.Tensor) -> None:
        """query [T, Hq, d]: the step's; ``tokens`` [m] which of them, ``index`` [m] their rows."""
        buffer = self.buffers.get(layer)
        if buffer is None or buffer.shape[0] < self.slots * self.rows:
            grown = query.new_zeros(self.slots * self.rows, *query.shape[1:])
            if buffer is not None:
                grown[: buffer.shape[0]] = buffer
            buffer = self.buffers[layer] = grown
        buffer.index_copy_(0, index, query.index_select(0, tokens))

    def read(self, layer: str, slot: int, end: int, count: int) -> torch.Tensor:
        """The queries of positions ``end - count`` .. ``end - 1`` of the request in ``slot`` ->
        [count, Hq, d], oldest first."""
        buffer = self.buffers[layer]
        rows = torch.arange(end - count, end, device=buffer.device) % self.rows + slot * self.rows
        return buffer.index_select(0, rows)
