"""Exact attention over a variable-length, packed KV cache (one segment per sample and KV head).

Keys and values are packed as [N, d], segment by segment, N the sum of the per-head lengths; the
``g`` query heads of a GQA group attend to their KV head's segment. On CPU (and GPU without
flash-attn) the logits are sampled only at the N x g real pairs of a CSR pattern; with flash-attn
on CUDA its varlen kernel is used.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

try:  # optional extra
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the install
    flash_attn_varlen_func = None


def segment_offsets(lengths: Tensor) -> Tensor:
    """[S] lengths -> [S + 1] cumulative offsets (int64)."""
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0))


def varlen_attention(query: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, scaling: float) -> Tensor:
    """The newest ``q`` entries of each segment attend causally to their segment.

    Parameters
    ----------
    query : Tensor
        [S, g, q, d]: the g query heads of each segment, for its last q entries.
    keys, values : Tensor
        [N, d] packed segments.
    lengths : Tensor
        [S] int64 segment lengths (each >= q), summing to N.

    Returns
    -------
    [S, g, q, d] attention outputs in the query dtype; query i sees its segment up to entry
    ``length - q + i``.
    """
    S, g, q, d = query.shape
    if flash_attn_varlen_func is not None and query.is_cuda:
        cu_k = segment_offsets(lengths).to(torch.int32)
        cu_q = torch.arange(0, S * q + 1, q, device=query.device, dtype=torch.int32)
        out = flash_attn_varlen_func(
            query.permute(0, 2, 1, 3).reshape(S * q, g, d), keys[:, None], values[:, None], cu_q, cu_k, q,
            int(lengths.max()), softmax_scale=scaling, causal=True,
        )
        return out.view(S, q, g, d).permute(0, 2, 1, 3)
    offsets = segment_offsets(lengths)
    step = torch.arange(q, device=keys.device)
    row_len = (lengths[:, None, None] - q + 1 + step).expand(S, g, q).flatten()  # rows: (segment, head, query)
    crow = segment_offsets(row_len)
    row = torch.arange(S * g * q, device=keys.device).repeat_interleave(row_len)
    cols = offsets[row // (g * q)] + torch.arange(row.numel(), device=keys.device) - crow[row]
    rows = S * g * q
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR support is flagged as beta
        zeros = torch.zeros(row.numel(), dtype=torch.float32, device=keys.device)
        pattern = torch.sparse_csr_tensor(crow, cols, zeros, size=(rows, keys.shape[0]))
        logits = torch.sparse.sampled_addmm(pattern, query.reshape(rows, d).float(), keys.float().T, beta=0.0)
        z = logits.values() * scaling
        row_max = torch.full((rows,), float("-inf"), device=z.device).scatter_reduce(0, row, z, "amax")
        p = (z - row_max[row]).exp()
        p = p / torch.zeros(rows, device=z.device).index_add_(0, row, p)[row]
        probs = torch.sparse_csr_tensor(crow, cols, p, size=pattern.shape)
        out = torch.sparse.mm(probs, values.float())
    return out.view(S, g, q, d).to(query.dtype)
