"""How many entries each layer keeps: uniform, or the PyramidKV schedule (same total)."""

from __future__ import annotations

import math


def pyramid_budgets(budget: int, window: int, num_layers: int, beta: float, prompt_len: int) -> list[int]:
    """Per-layer budgets (window included) that fall linearly from the first layer to the last.

    PyramidKV: the non-window part goes from ``max_num`` down to ``min_num = (budget - window) / beta``
    with ``max_num + min_num = 2 (budget - window)``, so the layers keep ``num_layers * budget`` in all
    (exactly: rounding leftovers go to the layers with the largest fractions). ``max_num`` is capped
    at the prefix length, as in the original.
    """
    if num_layers == 1:
        return [budget]
    base = budget - window
    min_num = base / beta
    max_num = 2 * base - min_num
    if max_num > prompt_len - window:
        max_num = prompt_len - window
        min_num = 2 * base - max_num
    step = (max_num - min_num) / (num_layers - 1)
    exact = [max_num - i * step for i in range(num_layers)]
    sizes = [math.floor(x) for x in exact]
    leftover = num_layers * base - sum(sizes)
    by_fraction = sorted(range(num_layers), key=lambda i: exact[i] - sizes[i], reverse=True)
    for i in by_fraction[: max(0, leftover)]:
        sizes[i] += 1
    return [max(0, s) + window for s in sizes]


def layer_budgets(cfg, num_layers: int, prompt_len: int) -> list[int]:
    """Budget of each evicted layer for a prompt of ``prompt_len`` tokens."""
    if cfg.pyramid:
        return pyramid_budgets(cfg.max_capacity_prompt, cfg.window_size, num_layers, cfg.beta, prompt_len)
    return [cfg.max_capacity_prompt] * num_layers
