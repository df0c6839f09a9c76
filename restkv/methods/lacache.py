"""LaCache: a ladder-shaped cache, each layer keeping its own staggered spans of the older tokens.

Paper: "LaCache: Ladder-Shaped KV Caching for Efficient Long-Context Modeling of Large Language
Models" (Shi et al., ICML 2025), https://arxiv.org/abs/2507.14204; code:
https://github.com/GATECH-EIC/LaCache (``lacache/kv_cache.py``).

Score-free. Beyond ``sink_tokens`` first tokens, the older part of the prompt is cut into groups of
``g = 1 + ceil((N - span) / (span - overlap))`` tokens (N layers) and layer ``i`` keeps ``a =
min(ceil(span / (span - overlap)), g)`` consecutive tokens of each group, starting ``i mod (g - a + 1)``
into it: successive layers shift by one, a ladder. The most recent tokens stay whole. When the budget
cannot hold one ladder pass, the reference compacts again ("startover"): the older ladder is thinned
with a stride, so the oldest tokens grow sparser. This is that compaction, once, at the end of prefill,
with cache size B. Differences from the reference's call: no ``floor((g - a) / 2)`` extra entries (the
reference adds them to match its average size over streaming; here a layer holds exactly B); the window
is always kept, and when the reference's recent tail is shorter than the window, the oldest ladder
entries give way to it. ``sink_tokens=None`` is the reference's LongBench rule:
``min(128, L - N - 1, B - N - 1)`` (at least 1).
"""

from __future__ import annotations

import math

from ..knobs import Knob
from ..lazy import torch

KNOBS = (
    Knob(
        "span",
        16,
        "layers over which one token position stays cached (the ladder's span)",
        check=lambda s: s >= 2,
        rule=">= 2",
    ),
    Knob(
        "overlap",
        0,
        "overlap between the spans of successive ladder steps",
        check=lambda o: o >= 0,
        rule=">= 0",
    ),
    Knob(
        "sink_tokens",
        None,
        "first tokens always kept (None: the reference's LongBench rule)",
        nullable=True,
        of=int,
        check=lambda n: n >= 0,
        rule=">= 0",
    ),
)


def uses_budget(cfg) -> bool:
    """The ladder is sized by the layer's budget."""
    return True


def check(cfg):
    if cfg["overlap"] >= cfg["span"]:
        raise ValueError(f"overlap must be smaller than span ({cfg['span']}), got {cfg['overlap']}")


def check_layers(cfg, num_layers: int) -> None:
    if _steps(num_layers, cfg["span"], cfg["overlap"])[2] < 1:
        raise ValueError(
            f"span ({cfg['span']}) must be smaller than the model's evicted layers ({num_layers}) "
            f"for LaCache to remove anything"
        )


def _steps(layers: int, span: int, overlap: int) -> tuple[int, int, int]:
    """(g tokens per ladder group, a kept per layer and group, g - a removed)."""
    group = 1 + math.ceil((layers - span) / (span - overlap))
    after = min(math.ceil(span / (span - overlap)), group)
    return group, after, group - after


def ladder(
    length: int, cache: int, start: int, layers: int, layer: int, span: int, overlap: int
) -> list[int]:
    """Positions layer ``layer`` keeps of ``length`` tokens: the reference's compaction with cursor ``start``."""
    group, after, removable = _steps(layers, span, overlap)
    need = length - cache
    if need <= 0:
        return list(range(length))
    room = cache - start - layers
    if room < after:  # no room for one rung: the sinks and the most recent tokens (as StreamingLLM)
        return list(range(min(start, cache))) + list(range(length - max(0, cache - start), length))
    cap = (room // after) * removable
    steps = math.ceil(need / removable) if need <= cap else room // after

    def rungs(first, size, n, stride, phase):
        return [first + phase + size * j + stride * k for j in range(n) for k in range(after)]

    kept = (
        list(range(start))
        + rungs(start, group, steps, 1, layer % (removable + 1))
        + list(range(start + group * steps, length))
    )
    if need <= cap:
        return kept
    rest = need - cap  # startover: thin the ladder again with a stride
    once = ((cache - start - layers) // after) * removable
    times = math.ceil(rest / once)
    group2 = group + (times - 1) * (group - 1)
    steps2 = math.ceil(rest / (group2 - after))
    keep = (
        list(range(start))
        + rungs(start, group2, steps2, times, layer % (group2 - after + 1))
        + list(range(start + group2 * steps2, len(kept)))
    )
    return [kept[i] for i in keep]


def score(obs, cfg):
    """Sinks first, then the layer's ladder (newest first), then the rest by recency -> [b, 1, P]."""
    n = obs.keys.shape[2]
    P = obs.prefix_len
    pos = obs.positions.float()  # [b, L], -1 on padding
    out = []
    for row in range(pos.shape[0]):
        length = int((pos[row] >= 0).sum())
        start = cfg.sink_tokens
        if start is None:
            start = max(1, min(128, length - obs.num_layers - 1, obs.budget - obs.num_layers - 1))
        keep = torch.tensor(
            ladder(length, obs.budget, start, obs.num_layers, obs.layer, cfg.span, cfg.overlap)
        )
        s = pos[row] / max(n, 1)  # recency in [0, 1)
        ladder_pos = torch.zeros(n, dtype=torch.bool)
        ladder_pos[n - length + keep] = True
        s = torch.where(ladder_pos.to(s.device), 2.0 + s, s)
        s = torch.where((pos[row] >= 0) & (pos[row] < start), torch.full_like(s, 4.0), s)
        out.append(s[:P])
    return torch.stack(out)[:, None]
