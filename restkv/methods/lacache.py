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
        rule=">= 2",
    ),
    Knob(
        "overlap",
        0,
        "overlap between the spans of successive ladder steps",
        rule=">= 0",
    ),
    Knob(
        "sink_tokens",
        None,
        "first tokens always kept (None: the reference's LongBench rule)",
        nullable=True,
        of=int,
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


def ladder_mask(place, length, cache: int, start, rungs: tuple) -> "torch.Tensor":
    """[b, n] bool: which of the places ``place`` [b, n] (0: the sample's first token) a layer keeps
    of each sample's ``length`` [b, 1] tokens, with ``start`` [b, 1] sinks and cache size ``cache``:
    the reference's compaction, on the device. ``rungs``: (layers, layer, span, overlap).

    With ``need = length - cache`` tokens to remove: nothing when need <= 0; with no room for one
    rung beyond the sinks and the layers, the sinks and the most recent tokens; else the sinks, one
    ladder pass (``steps`` groups of g tokens, a tokens kept of each at the layer's phase) and the
    rest; when one pass removes too few (``cap``), the kept ones thinned again by a second ladder
    over their order, of longer groups read with a stride (``times``).
    """
    layers, layer, span, overlap = rungs
    group, after, removable = _steps(layers, span, overlap)
    real = (place >= 0) & (place < length)
    need = length - cache
    room = cache - start - layers
    fit = room.div(after, rounding_mode="floor")
    cap = fit * removable
    one_pass = need <= cap
    steps = torch.where(one_pass, _ceil_div(need, removable), fit)
    phase = layer % (removable + 1)
    first = (place < start) | (place >= start + group * steps)
    first = real & (first | _on_rungs(place - start - phase, group, steps, 1, after))
    rest = need - cap
    times = _ceil_div(rest, cap.clamp_min(1)).clamp_min(1)
    group2 = group + (times - 1) * (group - 1)
    steps2 = _ceil_div(rest, group2 - after)
    phase2 = torch.remainder(torch.full_like(group2, layer), group2 - after + 1)
    rank = first.long().cumsum(-1) - 1  # the place's index among the first pass's kept
    second = (rank < start) | (rank >= start + group2 * steps2)
    second = first & (second | _on_rungs(rank - start - phase2, group2, steps2, times, after))
    recent = place >= length - (cache - start).clamp_min(0)
    no_room = real & ((place < torch.clamp(start, max=cache)) | recent)
    kept = torch.where(one_pass, first, second)
    kept = torch.where(room < after, no_room, kept)
    return torch.where(need <= 0, real, kept)


def _ceil_div(a, b):
    """ceil(a / b) of integer tensors, ``b`` > 0."""
    return -torch.div(-a, b, rounding_mode="floor")


def _on_rungs(offset, size, count, stride, after: int):
    """Whether ``offset`` (from the first rung's first token) is ``size * j + stride * k`` for some
    ``j < count`` and ``k < after``."""
    hit = torch.zeros_like(offset, dtype=torch.bool)
    for k in range(after):
        q = offset - stride * k
        rung = q.div(size, rounding_mode="floor")
        hit |= (q >= 0) & (torch.remainder(q, size) == 0) & (rung < count)
    return hit


def score(obs, cfg):
    """Sinks first, then the layer's ladder (newest first), then the rest by recency -> [b, 1, P];
    each sample's ladder from its length, on the device."""
    n = obs.keys.shape[2]
    P = obs.prefix_len
    pos = obs.positions.float()  # [b, L], -1 on padding
    length = (obs.positions >= 0).sum(-1, keepdim=True)  # [b, 1]
    if cfg.sink_tokens is None:
        room = min(128, obs.budget - obs.num_layers - 1)
        start = (length - obs.num_layers - 1).clamp(max=room).clamp(min=1)
    else:
        start = torch.full_like(length, cfg.sink_tokens)
    place = torch.arange(n, device=length.device) - (n - length)  # the last ``length`` slots
    rungs = (obs.num_layers, obs.layer, cfg.span, cfg.overlap)
    on_ladder = ladder_mask(place, length, obs.budget, start, rungs)
    s = pos / max(n, 1)  # recency in [0, 1)
    s = torch.where(on_ladder, 2.0 + s, s)
    s = torch.where((pos >= 0) & (pos < start), torch.full_like(s, 4.0), s)
    return s[:, None, :P]
