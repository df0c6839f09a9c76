"""LaCache's ladder computed on the device (``ladder_mask``, no host read) against the reference's
compaction written as lists of positions, one sample at a time (``lacache/kv_cache.py``'s loop)."""

from __future__ import annotations

import math

import torch

from restkv.config import CompressionConfig
from restkv.methods import lacache
from restkv.scoring.observe import Observation

GEOMETRIES = [(3, 2, 0), (4, 2, 0), (8, 4, 1), (8, 3, 0), (32, 16, 0), (12, 5, 2)]  # layers, span, overlap


def ladder(length, cache, start, layers, layer, span, overlap) -> list[int]:
    """The positions ``lacache.ladder_mask`` keeps of one sample, as a list."""
    kept = lacache.ladder_mask(
        torch.arange(length)[None],
        torch.tensor([[length]]),
        cache,
        torch.tensor([[start]]),
        (layers, layer, span, overlap),
    )
    return kept[0].nonzero().flatten().tolist()


def reference_ladder(length, cache, start, layers, layer, span, overlap) -> list[int]:
    """The positions a layer keeps, as lists: the reference's compaction with cursor ``start``."""
    group = 1 + math.ceil((layers - span) / (span - overlap))
    after = min(math.ceil(span / (span - overlap)), group)
    removable = group - after
    need = length - cache
    if need <= 0:
        return list(range(length))
    room = cache - start - layers
    if room < after:
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
    rest = need - cap
    times = math.ceil(rest / cap)
    group2 = group + (times - 1) * (group - 1)
    steps2 = math.ceil(rest / (group2 - after))
    keep = (
        list(range(start))
        + rungs(start, group2, steps2, times, layer % (group2 - after + 1))
        + list(range(start + group2 * steps2, len(kept)))
    )
    return [kept[i] for i in keep]


def branch(length, cache, start, layers, span, overlap) -> str:
    group = 1 + math.ceil((layers - span) / (span - overlap))
    after = min(math.ceil(span / (span - overlap)), group)
    room = cache - start - layers
    if length <= cache:
        return "whole"
    if room < after:
        return "sinks and recent"
    return "one pass" if length - cache <= (room // after) * (group - after) else "startover"


def test_the_device_ladder_keeps_the_reference_positions():
    compared, past_the_end, branches = 0, 0, set()
    for layers, span, overlap in GEOMETRIES:
        for cache in (9, 24, 64):
            for start in (0, 1, 4, 20):
                for length in (*range(0, 140, 7), 400, 1000):
                    for layer in range(min(layers, 4)):
                        args = (length, cache, start, layers, layer, span, overlap)
                        try:
                            ref = reference_ladder(*args)
                        except IndexError:  # the list form reads past its first pass's entries
                            past_the_end += 1
                            continue
                        assert ladder(*args) == sorted(set(ref)), args
                        compared += 1
                        branches.add(branch(length, cache, start, layers, span, overlap))
    assert branches == {"whole", "sinks and recent", "one pass", "startover"}
    assert compared > 10 * past_the_end


def test_each_sample_of_a_batch_gets_its_own_ladder():
    lengths = torch.tensor([[300], [57], [131]])
    starts = torch.tensor([[4], [1], [20]])
    n = 300
    place = torch.arange(n) - (n - lengths)  # left padded
    for layer in range(3):
        got = lacache.ladder_mask(place, lengths, 40, starts, (8, layer, 4, 1))
        for row in range(3):
            want = torch.zeros(n, dtype=torch.bool)
            keep = reference_ladder(int(lengths[row]), 40, int(starts[row]), 8, layer, 4, 1)
            want[n - int(lengths[row]) + torch.tensor(keep, dtype=torch.long)] = True
            assert torch.equal(got[row], want), (layer, row)


def reference_score(obs, cfg) -> torch.Tensor:
    """LaCache's scores [b, 1, P], one sample at a time from the list form of its ladder."""
    n = obs.keys.shape[2]
    pos = obs.positions.float()
    out = []
    for row in range(pos.shape[0]):
        length = int((pos[row] >= 0).sum())
        start = cfg.sink_tokens
        if start is None:
            start = max(1, min(128, length - obs.num_layers - 1, obs.budget - obs.num_layers - 1))
        keep = reference_ladder(
            length, obs.budget, start, obs.num_layers, obs.layer, cfg.span, cfg.overlap
        )
        s = pos[row] / max(n, 1)
        ladder = torch.zeros(n, dtype=torch.bool)
        ladder[n - length + torch.tensor(keep, dtype=torch.long)] = True
        s = torch.where(ladder, 2.0 + s, s)
        s = torch.where((pos[row] >= 0) & (pos[row] < start), torch.full_like(s, 4.0), s)
        out.append(s[: obs.prefix_len])
    return torch.stack(out)[:, None]


def test_scores_equal_the_per_sample_reference():
    n, window = 120, 4
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 2, n, 8, generator=g)
    valid = torch.ones(3, n, dtype=torch.bool)
    valid[1, :33] = False
    valid[2, :95] = False  # shorter than the budget
    for sinks in (None, 4):
        for budget in (12, 24, 40):
            cfg = CompressionConfig(
                method="lacache", span=3, overlap=0, sink_tokens=sinks,
                max_capacity_prompt=budget, window_size=window,
            ).score_knobs()
            for layer in range(8):
                obs = Observation(
                    keys[:, :, -window:], keys, keys, valid, window=window, budget=budget,
                    scaling=1.0, layer=layer, num_layers=8,
                )
                assert torch.equal(lacache.score(obs, cfg), reference_score(obs, cfg))
