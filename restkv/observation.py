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
EXP_FLOOR = -87.0  # exp(-87) ~ 1.6e-38, the smallest normal float32


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

        Returns [b, Hq, stop - start, L] float32. Rows of padding queries are zero. Built in place in
        one float32 buffer; low-precision keys are converted one KV head at a time.
        """
        b, hq, _, d = self.queries.shape
        hkv, n_keys = self.keys.shape[1], self.keys.shape[2]
        rows = hq // hkv * (stop - start)
        q = self.queries[:, :, start:stop].float().reshape(b, hkv, rows, d)  # group-major rows
        logits = torch.empty(b, hkv, rows, n_keys, device=self.keys.device)
        if self.keys.dtype == torch.float32:
            torch.matmul(q, self.keys.transpose(-1, -2), out=logits)
        else:
            for h in range(hkv):  # bounds the float32 copy of the keys to one head
                logits[:, h] = q[:, h] @ self.keys[:, h].float().transpose(-1, -2)
        probs = logits.view(b, hq, stop - start, n_keys).mul_(self.scaling)
        if self.softcap:
            probs.div_(self.softcap).tanh_().mul_(self.softcap)
        q_pos = torch.arange(start, stop, device=probs.device)
        hidden = ~((torch.arange(n_keys, device=probs.device) <= q_pos[:, None]) & self.key_valid[:, None, None, :])
        probs.masked_fill_(hidden, NEG)
        # exp below EXP_FLOOR underflows to denormals/zero, which CPUs compute many times slower;
        # those terms are < 1e-37 of the row's largest, and masked entries are set to exactly 0 after.
        probs.sub_(probs.amax(-1, keepdim=True)).clamp_min_(EXP_FLOOR).exp_().masked_fill_(hidden, 0.0)
        return probs.div_(probs.sum(-1, keepdim=True).clamp_min_(1.0))  # rows of padding queries: all 0

    @cached_property
    def window_attention(self) -> Tensor:
        """[b, Hq, w, L] attention of the observation window's queries."""
        n = self.keys.shape[2]
        return self.attention(n - self.window, n)

    @cached_property
    def window_output(self) -> Tensor:
        """[b, Hq, w, d] attention output of the window queries (over all keys), float32."""
        return weighted_values(self.window_attention, self.values)


VALUE_BLOCK = 4096  # positions converted to float32 at a time


def weighted_values(weights: Tensor, values: Tensor) -> Tensor:
    """``sum_n weights[..., n] v_n`` per query head: weights [b, Hq, r, N], values [b, Hkv, >=N, d] -> [b, Hq, r, d].

    Values are read in blocks, so low-precision values are never copied whole to float32.
    """
    b, hq, r, n = weights.shape
    hkv = values.shape[1]
    w = weights.reshape(b, hkv, hq // hkv * r, n)
    out = 0
    block = globals()["VALUE_BLOCK"]  # read at call time (tests shrink it)
    for s in range(0, n, block):
        out = out + w[..., s : s + block] @ values[:, :, s : min(n, s + block)].float()
    return out.view(b, hq, r, -1)


def relative_positions(key_valid: Tensor) -> Tensor:
    """[b, L] bool validity (left padding) -> position from the sample's first real token, -1 on padding."""
    return (key_valid.long().cumsum(-1) - 1).masked_fill(~key_valid, -1)


def group_view(x: Tensor, hkv: int) -> Tensor:
    """[b, Hq, ...] -> [b, Hkv, g, ...] (query heads of one KV head are contiguous)."""
    return x.view(x.shape[0], hkv, -1, *x.shape[2:])
