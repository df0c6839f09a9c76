"""ThinK's key-channel pruning (``pruning_ratio``) with every token eviction and with fullkv.

The channels each head keeps equal a float64 loop over the definition; decoding equals the full cache
with the evicted entries masked and the dropped channels of the older kept keys zeroed; the cache holds
the smaller keys (``memory_report``); a ratio it cannot apply raises before any work.
"""

from __future__ import annotations

import pytest
import torch

import restkv
from restkv.config import CompressionConfig
from restkv.strategies.think import kept_channels, query_energy
from helpers import capture, generate, masked_reference_logits, prompt, small, tiny_model


def _loop_channels(q, keys, valid, key_valid, window, ratio):
    """Per (sample, head): channel c scores mean_t q_c^2 (last window real queries, mean over the group)
    times mean_j k_c^2 (valid kept entries); the int(d ratio) lowest are dropped."""
    b, hq, n, d = q.shape
    heads = keys.shape[1]
    g = hq // heads
    out = []
    for s in range(b):
        rows = []
        for h in range(heads):
            score = []
            for c in range(d):
                qn = [sum(float(q[s, h * g + i, t, c]) ** 2 for t in range(n - window, n) if key_valid[s, t])
                      / sum(1 for t in range(n - window, n) if key_valid[s, t]) for i in range(g)]
                entries = [j for j in range(keys.shape[2]) if valid[s, h, j]]
                kn = sum(float(keys[s, h, j, c]) ** 2 for j in entries) / len(entries)
                score.append(sum(qn) / g * kn)
            order = sorted(range(d), key=lambda c: score[c])
            rows.append(sorted(order[int(d * ratio):]))
        out.append(rows)
    return torch.tensor(out)


@pytest.mark.parametrize("heads", [2, 6], ids=["per-kv-head", "per-query-head"])
def test_kept_channels_equal_a_float64_loop(heads):
    g = torch.Generator().manual_seed(heads)
    q = torch.randn(2, 6, 12, 10, generator=g) * torch.linspace(0.2, 3, 10)
    keys = torch.randn(2, heads, 9, 10, generator=g) * torch.linspace(3, 0.2, 10)
    valid = torch.rand(2, heads, 9, generator=g) > 0.3
    key_valid = torch.ones(2, 12, dtype=torch.bool)
    key_valid[1, :8] = False  # sample 1 is left padded: 2 of its 6 window queries are padding
    energy = query_energy(q, key_valid, 6)
    for ratio in (0.3, 0.55):
        ours = kept_channels(keys, valid, energy, ratio)
        assert torch.equal(ours, _loop_channels(q, keys, valid, key_valid, 6, ratio))


CASES = [
    dict(method="fullkv"),
    dict(method="snapkv"),
    dict(method="adakv"),  # per-head budgets, packed
    dict(method="adakv", varlen=False),  # per-head budgets, padded and masked
    dict(method="restkv", gqa_agg="none"),  # one set per query head: each chooses its own channels
    dict(method="kvzip"),  # deferred: a global budget after the passes
]


def _channels(layer, b):
    c = getattr(layer, "channels", None)
    return None if c is None else c.reshape(b, -1, c.shape[-1])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("knobs", CASES, ids=lambda k: "-".join(map(str, k.values())))
def test_decoding_equals_the_full_cache_with_pruned_channels_zeroed(family, knobs):
    model = tiny_model(family, "eager")
    ids, window = prompt(64), 6
    knobs = dict(knobs)
    method = knobs.pop("method")
    budget = {} if method == "fullkv" else dict(max_capacity_prompt=24)
    restkv.configure(model, **small(method, **knobs, **budget, window_size=window, pruning_ratio=0.4))
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
    logits, cache = torch.stack(out.logits, 1), out.past_key_values
    kept = restkv.kept_positions(model)
    channels = [_channels(layer, 1) for layer in cache.layers]
    assert all(c is not None and c.shape[-1] == 16 - 6 for c in channels)  # int(16 * 0.4) = 6 dropped
    for layer, (q, k, _) in capture(model, ids).items():  # the choice, from the definition
        heads = kept[layer].shape[1]
        k = k.repeat_interleave(heads // k.shape[1], 1)
        rows = kept[layer].clamp_min(0)[..., None].expand(-1, -1, -1, 16)
        valid = kept[layer] >= 0
        loop = _loop_channels(q, k.gather(2, rows), valid, torch.ones(1, 64, dtype=torch.bool), window, 0.4)
        assert torch.equal(channels[layer], loop), layer
    ref = masked_reference_logits(model, ids, kept, 5, channels=channels, recent=window)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_the_cache_holds_the_fewer_channels():
    model = tiny_model("llama", "sdpa")
    ids = prompt(64)
    rows = {}
    for ratio in (None, 0.5):
        restkv.configure(model, method="snapkv", max_capacity_prompt=24, window_size=6, pruning_ratio=ratio)
        rows[ratio] = restkv.memory_report(model(ids, use_cache=True).past_key_values)
    for plain, pruned in zip(rows[None], rows[0.5]):
        assert plain["full_bytes"] == pruned["full_bytes"] == 64 * 2 * 16 * 2 * 4
        assert plain["held_bytes"] == 24 * 2 * 16 * 2 * 4
        keys = (18 * 8 + 6 * 16) * 2 * 4  # older entries: 8 of 16 channels; the window: all
        assert pruned["held_bytes"] == keys + 24 * 2 * 16 * 4 + 2 * 8 * 8  # + values + the channel indices


def test_the_packed_layout_holds_the_fewer_channels():
    model = tiny_model("llama", "sdpa")
    ids, window, d, c = prompt(64), 6, 16, 8
    held = {}
    for ratio in (None, 0.5):
        restkv.configure(model, method="adakv", max_capacity_prompt=24, window_size=window, pruning_ratio=ratio)
        held[ratio] = restkv.memory_report(model(ids, use_cache=True).past_key_values)
        lengths = [(k >= 0).sum(-1).flatten() for k in restkv.kept_positions(model)]  # per head
    for plain, pruned, n in zip(held[None], held[0.5], lengths):
        assert plain["held_bytes"] == int(n.sum()) * d * 2 * 4
        old = int((n - window).clamp_min(0).sum())  # entries before each head's window: c of d channels
        keys = (old * c + (int(n.sum()) - old) * d) * 4
        assert pruned["held_bytes"] == keys + int(n.sum()) * d * 4 + n.numel() * c * 8


def test_sweep_with_pruned_channels_equals_configure_and_generate():
    model = tiny_model("llama", "sdpa")
    ids = prompt(64)
    configs = [dict(method="snapkv", max_capacity_prompt=24, window_size=6, pruning_ratio=0.4),
               dict(method="fullkv", window_size=6, pruning_ratio=0.25), dict(method="snapkv", max_capacity_prompt=24,
                                                                              window_size=6)]
    for cfg, (tokens, kept) in zip(configs, restkv.sweep(model, ids, None, configs, 4, pad_token_id=0)):
        restkv.configure(model, **cfg)
        ref, _ = generate(model, ids, n=4)
        assert torch.equal(tokens, ref) and all(torch.equal(a, b) for a, b in zip(kept, restkv.kept_positions(model)))


def test_a_ratio_it_cannot_apply_raises_naming_the_knob_before_any_work():
    for ratio in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"pruning_ratio must be in \[0, 1\)"):
            CompressionConfig(method="snapkv", pruning_ratio=ratio)
    model = tiny_model("llama")
    for ratio in (0.0, 0.05):  # int(16 * ratio) = 0: nothing to drop
        with pytest.raises(ValueError, match="pruning_ratio=.* drops 0 of the 16 key channels"):
            restkv.configure(model, method="snapkv", pruning_ratio=ratio)
    with pytest.raises(ValueError, match="pruning_ratio"):
        CompressionConfig(method="snapkv", pruning_ratio=0.4, quant_method="quanto")
    assert not any(hasattr(m, "_restkv") for m in model.modules())
