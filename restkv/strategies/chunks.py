"""ChunkKV's chunk selection, a strategy for any scorer (``chunk_size``).

Paper: "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference"
(Liu et al., 2025), https://arxiv.org/abs/2502.00299; code: kvpress ``ChunkKVPress``
(https://github.com/NVIDIA/kvpress, ``kvpress/presses/chunkkv_press.py``).

The prefix is cut into chunks of ``chunk_size`` consecutive positions, counted from each sample's first
real token. A chunk's score is the mean over its tokens of the score summed over the heads (the reference's
rule); every head takes the best chunks, the same ones for all heads. Differences from the reference, which
keeps whole chunks (a multiple of the chunk size, not exactly the budget) and chunks the window with the
rest: each head keeps exactly its budget of prefix entries, the best chunks whole and then the best entries
(by its own score) of the next chunk; the window stays kept apart from the chunks, so the prefix's last chunk
may be partial (it is scored by the mean of its own tokens, as the reference scores its partial last chunk);
the choice is per sample (the reference applies batch element 0's to every sample).
"""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import torch

KNOBS = (
    Knob("chunk_size", None, "ChunkKV: keep whole chunks of this many consecutive positions, ranked by the mean "
         "over the chunk of the score summed over heads (None or 0: off)", nullable=True, of=int,
         check=lambda c: c >= 0, rule=">= 1 (or 0: off)", stage="select"),
)


def check(values: dict) -> None:
    if values.get("chunk_size") and values.get("critical"):
        raise ValueError("chunk_size and critical are two ways to rank the entries; give one of them")


def chunk_order(scores: "torch.Tensor", positions: "torch.Tensor", size: int) -> "torch.Tensor":
    """The ranking key [b, H, P]: entries ordered by their chunk's rank, then by their own score.

    scores [b, H, P] (padding ``-inf``), positions [b, P] from each sample's first real token (-1 on padding).
    The key is ``-(place in that order)``, so a top-k keeps the best chunks whole, then the next chunk's best.
    """
    b, heads, P = scores.shape
    valid = positions >= 0
    chunk = positions.clamp_min(0) // size  # [b, P]
    n_chunks = -(-P // size)
    total = scores.masked_fill(~valid[:, None], 0.0).sum(1)  # [b, P] summed over heads
    sums = torch.zeros(b, n_chunks, device=scores.device).scatter_add_(1, chunk, total * valid)
    counts = torch.zeros(b, n_chunks, device=scores.device).scatter_add_(1, chunk, valid.float())
    chunk_score = (sums / counts.clamp_min(1)).masked_fill(counts == 0, float("-inf"))
    chunk_rank = chunk_score.argsort(-1, descending=True).argsort(-1)
    entry_rank = chunk_rank.gather(1, chunk).masked_fill(~valid, n_chunks)  # padding last
    by_score = scores.argsort(-1, descending=True)  # within a chunk, each head's own order
    ranks = entry_rank[:, None].expand(b, heads, P).gather(-1, by_score)
    order = by_score.gather(-1, ranks.argsort(dim=-1, stable=True))
    place = torch.arange(P, device=scores.device, dtype=torch.float32).expand(b, heads, P)
    return torch.empty_like(place).scatter_(-1, order, -place)


def applies(cfg) -> bool:
    return bool(cfg.get("chunk_size"))


def rank(obs, cfg, scores: "torch.Tensor", key: "torch.Tensor", keep) -> "torch.Tensor":
    """The selection hook: the chunks' key [b, H, P] from the scores [b, H, P]."""
    return chunk_order(scores, obs.positions[:, : obs.prefix_len], cfg.chunk_size)
