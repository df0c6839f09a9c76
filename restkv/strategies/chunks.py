"""ChunkKV's chunk selection, a strategy for any scorer (``chunk_size``), and its entropy gate.

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

EntropyGatedChunkKV (``low_entropy_chunk_length``; kvpress ``EntropyGatedChunkKVPress``,
``kvpress/presses/entropy_gated_chunkkv_press.py``, on the ChunkKV paper): a chunk scored at or above the
median chunk score whose scores (summed over heads) have a normalised entropy below the median keeps only
its ``low_entropy_chunk_length`` best entries (by that sum) in its place in the chunk order; its other
entries come after every chunk (the reference's top-up with the best remaining entries). Differences, as
above: the window apart (the reference's window chunks take part in the chunk order and the medians), each
head's exact budget, and inside a partly kept chunk (or among the leftovers) each head's own order (the
reference: the sum over heads).
"""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import torch

KNOBS = (
    Knob(
        "chunk_size",
        None,
        "ChunkKV: keep whole chunks of this many consecutive positions, ranked by the mean "
        "over the chunk of the score summed over heads (None or 0: off)",
        nullable=True,
        of=int,
        rule=">= 1 (or 0: off)",
        stage="select",
    ),
    Knob(
        "low_entropy_chunk_length",
        None,
        "EntropyGatedChunkKV: a chunk scored at or above the median whose "
        "scores' entropy is below the median keeps only this many of its best entries (None or 0: off)",
        nullable=True,
        of=int,
        rule=">= 1 (or 0: off)",
        stage="select",
    ),
)


def check(values: dict) -> None:
    if values.get("chunk_size") and values.get("critical"):
        raise ValueError(
            "chunk_size and critical are two ways to rank the entries; give one of them"
        )
    gate = values.get("low_entropy_chunk_length")
    if gate and not 1 <= gate < (values.get("chunk_size") or 0):
        raise ValueError(
            f"low_entropy_chunk_length must be in [1, chunk_size), got {gate} with chunk_size "
            f"{values.get('chunk_size')}"
        )


def chunk_order(
    scores: "torch.Tensor", positions: "torch.Tensor", size: int, gate: int | None = None
) -> "torch.Tensor":
    """The ranking key [b, H, P]: entries ordered by their chunk's rank, then by their own score.

    scores [b, H, P] (padding ``-inf``), positions [b, P] from each sample's first real token (-1 on padding).
    The key is ``-(place in that order)``, so a top-k keeps the best chunks whole, then the next chunk's best.
    ``gate`` (EntropyGatedChunkKV): a gated chunk (``entropy_gated``) is ranked by its ``gate`` best entries
    only (by the score summed over heads); its other entries come after every chunk.
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
    entry_rank = chunk_rank.gather(1, chunk)
    if gate:
        spare = entropy_gated(total, chunk, valid, chunk_score, counts).gather(1, chunk) & (
            rank_in_chunk(total, chunk, valid) >= gate
        )
        entry_rank = entry_rank.masked_fill(spare, n_chunks)  # after every chunk
    entry_rank = entry_rank.masked_fill(~valid, n_chunks + 1)  # padding last
    by_score = scores.argsort(-1, descending=True)  # within a chunk, each head's own order
    ranks = entry_rank[:, None].expand(b, heads, P).gather(-1, by_score)
    order = by_score.gather(-1, ranks.argsort(dim=-1, stable=True))
    place = torch.arange(P, device=scores.device, dtype=torch.float32).expand(b, heads, P)
    return torch.empty_like(place).scatter_(-1, order, -place)


def rank_in_chunk(
    total: "torch.Tensor", chunk: "torch.Tensor", valid: "torch.Tensor"
) -> "torch.Tensor":
    """[b, P] each real entry's place (0: best) among its chunk's real entries by ``total`` [b, P]."""
    b, P = total.shape
    order = total.masked_fill(~valid, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    by_chunk = chunk.gather(1, order).argsort(dim=-1, stable=True)  # chunks in order, each by score
    order = order.gather(1, by_chunk)
    sorted_chunk = chunk.gather(1, order)
    first = torch.searchsorted(
        sorted_chunk, sorted_chunk, right=False
    )  # where each chunk's run starts
    place = torch.arange(P, device=total.device).expand(b, P) - first
    return torch.empty_like(place).scatter_(1, order, place)


def entropy_gated(
    total: "torch.Tensor",
    chunk: "torch.Tensor",
    valid: "torch.Tensor",
    chunk_score: "torch.Tensor",
    counts: "torch.Tensor",
) -> "torch.Tensor":
    """[b, n_chunks] bool: chunks scored at or above the median chunk score whose normalised entropy is below
    the median entropy (EntropyGatedChunkKV's spiky chunks).

    A chunk's scores ``total`` [b, P] are shifted by their minimum when it is negative, made a distribution
    ``p``; its entropy ``-sum p log(p + 1e-8)`` is divided by the log of its number of entries (0 for one
    entry) and clamped to [0, 1]. Medians are torch's (the lower of the two middle values), over the chunks
    holding real entries.
    """
    b, n_chunks = chunk_score.shape
    eps = 1e-8
    present = counts > 0
    low = torch.full((b, n_chunks), float("inf"), device=total.device)
    low = low.scatter_reduce(1, chunk, total.masked_fill(~valid, float("inf")), "amin")
    shifted = (total - low.clamp(max=0.0).gather(1, chunk)).masked_fill(~valid, 0.0)
    mass = torch.zeros(b, n_chunks, device=total.device).scatter_add_(1, chunk, shifted)
    p = shifted / (mass.gather(1, chunk) + eps)
    h = torch.zeros(b, n_chunks, device=total.device).scatter_add_(1, chunk, -(p * (p + eps).log()))
    norm = counts.clamp_min(2).log()
    entropy = torch.where(counts > 1, h / norm, torch.zeros_like(h)).clamp(0.0, 1.0)
    high = chunk_score >= _median(chunk_score, present)
    return present & high & (entropy < _median(entropy, present))


def _median(x: "torch.Tensor", present: "torch.Tensor") -> "torch.Tensor":
    """[b, 1] the lower median of each row's ``present`` values of x [b, n] (torch.median's convention)."""
    ranked = x.masked_fill(~present, float("inf")).sort(-1).values
    middle = ((present.sum(-1, keepdim=True) - 1) // 2).clamp_min(0)
    return ranked.gather(1, middle)


def applies(cfg) -> bool:
    return bool(cfg.get("chunk_size"))


def rank(obs, cfg, scores: "torch.Tensor", key: "torch.Tensor", keep) -> "torch.Tensor":
    """The selection hook: the chunks' key [b, H, P] from the scores [b, H, P]."""
    return chunk_order(
        scores,
        obs.positions[:, : obs.prefix_len],
        cfg.chunk_size,
        cfg.get("low_entropy_chunk_length"),
    )
