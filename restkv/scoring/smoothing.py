"""Smoothing over time (the window's query rows) and over space (neighbouring key positions)."""

from __future__ import annotations

from ..lazy import F, torch


def ema_weights(n: int, alpha: float, device=None) -> "torch.Tensor":
    """Weights of an EMA over ``n`` rows as one sum: ``c_0 = x_0``, ``c_i = alpha x_i + (1 - alpha) c_{i-1}``.

    Returns [n] float32 that sums to 1; the last row (the newest query) weighs ``alpha``.
    """
    age = torch.arange(n - 1, -1, -1, device=device, dtype=torch.float32)  # n - 1 - i
    w = alpha * (1.0 - alpha) ** age
    w[0] = (1.0 - alpha) ** (n - 1)
    return w


TEMPORAL = ("last", "mean", "ema", "inv-ema", "max")


def aggregate_rows(x: "torch.Tensor", temporal: str, alpha: float | None = None) -> "torch.Tensor":
    """Reduce the query-row axis (-2) of ``x`` [..., w, P] (oldest query first) -> [..., P].

    ``last``: the newest query only; ``mean``; ``ema``: the recursion from the oldest query, the newest
    weighing ``alpha``; ``inv-ema``: the same over the rows in reverse order (the oldest weighs ``alpha``);
    ``max``: the largest over the rows (the worst case, DefensiveKV's aggregation).
    """
    if temporal == "last":
        return x[..., -1, :]
    if temporal == "mean":
        return x.mean(-2)
    if temporal == "max":
        return x.amax(-2)
    weights = ema_weights(x.shape[-2], alpha, x.device)
    return torch.matmul(weights if temporal == "ema" else weights.flip(0), x)


class RowAggregate:
    """``aggregate_rows`` of ``rows`` query rows given in blocks, oldest first: ``add(start, x)`` with x
    [..., rb, P] the rows ``start:start + rb``, then ``value`` [..., P]. One block of every row is
    ``aggregate_rows`` itself (the same result bit for bit)."""

    def __init__(self, rows: int, temporal: str, alpha: float | None = None):
        self.rows = rows
        self.temporal = temporal
        self.alpha = alpha
        self.value = None

    def add(self, start: int, x: "torch.Tensor") -> None:
        n = x.shape[-2]
        if n == self.rows:
            self.value = aggregate_rows(x, self.temporal, self.alpha)
            return
        if self.temporal == "last":
            if start + n == self.rows:
                self.value = x[..., -1, :]
            return
        if self.temporal == "max":
            part = x.amax(-2)
            self.value = part if self.value is None else torch.maximum(self.value, part)
            return
        if self.temporal == "mean":
            part = x.sum(-2) / self.rows
        else:
            weights = ema_weights(self.rows, self.alpha, x.device)
            weights = weights if self.temporal == "ema" else weights.flip(0)
            part = torch.matmul(weights[start : start + n], x)
        self.value = part if self.value is None else self.value + part


def pool1d(scores: "torch.Tensor", mode: str, kernel_size: int) -> "torch.Tensor":
    """Stride-1 pooling along the last axis with ``kernel_size // 2`` padding (SnapKV's smoothing)."""
    if mode == "none" or kernel_size == 1:
        return scores
    shape = scores.shape
    x = scores.reshape(-1, 1, shape[-1])
    if mode == "avgpool":
        x = F.avg_pool1d(x, kernel_size, stride=1, padding=kernel_size // 2)
    elif mode == "maxpool":
        x = F.max_pool1d(x, kernel_size, stride=1, padding=kernel_size // 2)
    else:
        raise ValueError(f"pooling {mode!r} is not a fixed-window pooling")
    return x.view(shape)


def replicate_index(
    n: int, pad: int, first: "torch.Tensor | None" = None, device=None
) -> "torch.Tensor":
    """Indices [pad + n + pad] (``first`` [b]: [b, 1, pad + n + pad]) that read a row of ``n`` entries with
    ``pad`` replicated at each edge: ``clamp(j - pad, first, n - 1)``, so that the entries before ``first``
    (left padding) read the first real one too."""
    j = torch.arange(-pad, n + pad, device=device)
    j = j.clamp_min(0) if first is None else torch.maximum(j, first[:, None, None])
    return j.clamp_max_(n - 1)


def shifted_box_filter(
    padded: "torch.Tensor", shift: "torch.Tensor", half: "torch.Tensor", max_pad: int
) -> "torch.Tensor":
    """Per-row average of ``x[j + shift - half : j + shift + half + 1]``, from the rows ``padded``
    [R, max_pad + P + max_pad] of x with their edges replicated (``replicate_index``).

    ``shift`` / ``half`` [R] float32 integers, ``|shift| <= half <= max_pad``. One grouped convolution for
    all rows; no host synchronisation.
    """
    rows = padded.shape[0]
    taps = torch.arange(-max_pad, max_pad + 1, device=padded.device, dtype=torch.float32)
    inside = (taps - shift[:, None]).abs_() <= half[:, None]  # [R, K]
    kernel = inside / half.mul(2).add_(1)[:, None]
    out = F.conv1d(padded.view(1, rows, -1), kernel[:, None, :], groups=rows)
    return out.view(rows, -1)
