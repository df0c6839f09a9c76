"""What a scorer sees of one attention layer at the end of prefill.

Shapes: ``b`` batch, ``Hq`` query heads, ``Hkv`` key/value heads (``g = Hq // Hkv`` per group),
``L`` prompt length, ``w`` observation window, ``P = L - w`` evictable prefix, ``d`` head dim.
Everything a scorer returns is float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

NEG = torch.finfo(torch.float32).min


@dataclass
class Observation:
    queries: Tensor  # [b, Hq, L, d] every prefill query, after RoPE
    keys: Tensor  # [b, Hkv, L, d] after RoPE
    values: Tensor  # [b, Hkv, L, d]
    key_valid: Tensor  # [b, L] bool, False on padding
    window: int  # w
    budget: int  # entries kept per KV head in this layer, window included
    scaling: float
    softcap: float | None = None
    o_proj_weight: Tensor | None = None  # [hidden, Hq * d]

    @property
    def groups(self) -> int:
        return self.queries.shape[1] // self.keys.shape[1]

    @property
    def prefix_len(self) -> int:
        return self.keys.shape[2] - self.window

    @cached_property
    def positions(self) -> Tensor:
        """[b, L] position of each key counted from the sample's first real token, -1 on padding."""
        return relative_positions(self.key_valid)

    def attention(self, start: int, stop: int) -> Tensor:
        """Softmax attention of queries ``start:stop`` over all keys, causal and padding-masked.

        Returns [b, Hq, stop - start, L] float32. Rows of padding queries are zero.
        """
        b, hq, _, d = self.queries.shape
        hkv, n_keys = self.keys.shape[1], self.keys.shape[2]
        q = self.queries[:, :, start:stop].float().reshape(b, hkv, -1, d)  # group-major rows
        logits = (q @ self.keys.float().transpose(-1, -2)) * self.scaling  # [b, Hkv, g*q, L]
        logits = logits.view(b, hq, stop - start, n_keys)
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        q_pos = torch.arange(start, stop, device=logits.device)
        allowed = torch.arange(n_keys, device=logits.device) <= q_pos[:, None]  # [q, L]
        allowed = allowed & self.key_valid[:, None, None, :]  # [b, 1, q, L]
        probs = logits.masked_fill(~allowed, NEG).softmax(-1)
        return probs * self.key_valid[:, None, start:stop, None]

    @cached_property
    def window_attention(self) -> Tensor:
        """[b, Hq, w, L] attention of the observation window's queries."""
        n = self.keys.shape[2]
        return self.attention(n - self.window, n)

    @cached_property
    def window_output(self) -> Tensor:
        """[b, Hq, w, d] attention output of the window queries (over all keys), float32."""
        b, hq, w, n = self.window_attention.shape
        a = self.window_attention.reshape(b, self.keys.shape[1], -1, n)
        return (a @ self.values.float()).view(b, hq, w, -1)


def relative_positions(key_valid: Tensor) -> Tensor:
    """[b, L] bool validity (left padding) -> position from the sample's first real token, -1 on padding."""
    return (key_valid.long().cumsum(-1) - 1).masked_fill(~key_valid, -1)


def group_view(x: Tensor, hkv: int) -> Tensor:
    """[b, Hq, ...] -> [b, Hkv, g, ...] (query heads of one KV head are contiguous)."""
    return x.view(x.shape[0], hkv, -1, *x.shape[2:])
