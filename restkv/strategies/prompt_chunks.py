"""Uniform compression over the prompt (``prompt_chunk``): each chunk keeps its share of the budget.

kvpress's ``ChunkPress`` (``kvpress/presses/chunk_press.py``, after FINCH: "Prompt-guided Key-Value
Cache Compression for Large Language Models", Corallo and Papotti, TACL 2024,
https://direct.mit.edu/tacl/article/doi/10.1162/tacl_a_00716/125280): the prompt is cut into chunks
of ``chunk_length`` tokens (1,024 there) and each chunk keeps its own top ``int(n_c (1 - r))``
entries, so no region of the prompt is emptied for another.

Here the evictable prefix is cut into chunks of ``prompt_chunk`` consecutive positions, counted from
each sample's first real token, and a head keeping k of the prefix's N real entries keeps, in the
chunk whose real entries end at the c-th, ``floor(C_c k / N) - floor(C_{c-1} k / N)`` (C_c: the real
entries up to the end of chunk c): the chunks' shares of k, exactly k in all, each chunk's best by
the ranking key (the method's scores, or the ranking strategy's before this one, e.g. CriticalKV's).
Any per-head budget (AdaKV, HeadKV, global) is shared the same way, head by head.

Where restkv differs from kvpress: the scores are the method's over the whole prompt (the window's
queries observe every chunk, as FINCH's question does), where kvpress scores each chunk on its own
(for SnapKV: by the chunk's own last queries); for scorers that read each entry alone (L2Norm,
Random, ...) the two are the same. The window stays kept apart from the chunks, and each chunk's
share comes from the budget (kvpress: ``max(1, int(n_c (1 - r)))`` per chunk, not exactly the budget
in all).
"""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import torch

KNOBS = (
    Knob(
        "prompt_chunk",
        None,
        "kvpress's ChunkPress (chunk_length 1024 there): cut the prefix into chunks of this many "
        "positions, each keeping its share of the budget by the scores (None or 0: off)",
        nullable=True,
        of=int,
        rule=">= 1 (or 0: off)",
        stage="select",
    ),
)


def check(values: dict) -> None:
    if values.get("prompt_chunk") and values.get("chunk_size"):
        raise ValueError(
            "prompt_chunk (a share of the budget per chunk) and chunk_size (the best chunks whole) "
            "are two ways to use chunks; give one of them"
        )


def applies(cfg) -> bool:
    return bool(cfg.get("prompt_chunk"))


def chunk_shares(positions: "torch.Tensor", size: int, keep) -> "torch.Tensor":
    """[b, H, n_chunks] entries each head keeps in each chunk.

    positions [b, P] from each sample's first real token (-1 on padding); ``keep`` an int or [b, H].
    """
    b, P = positions.shape
    valid = positions >= 0
    chunk = positions.clamp_min(0) // size
    n_chunks = -(-P // size)
    counts = torch.zeros(b, n_chunks, dtype=torch.long, device=positions.device)
    counts = counts.scatter_add_(1, chunk, valid.long())
    through = counts.cumsum(1)  # [b, n_chunks] real entries up to each chunk's end
    real = through[:, -1:].clamp_min(1)  # [b, 1]
    if isinstance(keep, int):
        keep = torch.full((b, 1), keep, dtype=torch.long, device=positions.device)
    upto = torch.div(through[:, None] * keep[..., None], real[..., None], rounding_mode="floor")
    return upto - torch.nn.functional.pad(upto, (1, 0))[..., :-1]


def rank(obs, cfg, scores: "torch.Tensor", key: "torch.Tensor", keep) -> "torch.Tensor":
    """The selection hook: a key [b, H, P] whose top ``keep`` holds each chunk's share, by ``key``.

    An entry's key is its chunk's share minus its place among its chunk's entries (by ``key``,
    padding last): the entries within their chunk's share are exactly the positive ones.
    """
    positions = obs.positions[:, : obs.prefix_len]
    b, heads, P = key.shape
    chunk = (positions.clamp_min(0) // cfg.prompt_chunk)[:, None].expand(b, heads, P)
    shares = chunk_shares(positions, cfg.prompt_chunk, keep).expand(b, heads, -1)
    valid = (positions >= 0)[:, None].expand(b, heads, P)
    order = key.masked_fill(~valid, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    by_chunk = chunk.gather(-1, order).argsort(dim=-1, stable=True)  # chunks in order, each by key
    order = order.gather(-1, by_chunk)
    sorted_chunk = chunk.gather(-1, order)
    first = torch.searchsorted(sorted_chunk.contiguous(), sorted_chunk.contiguous())
    place = torch.arange(P, device=key.device).expand(b, heads, P) - first
    place = torch.empty_like(place).scatter_(-1, order, place)
    out = (shares.gather(-1, chunk) - place).float()
    return out.masked_fill(~valid, float("-inf"))
