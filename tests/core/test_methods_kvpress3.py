"""kvpress's CapPress, DuoAttentionPress, MergingPress, LUKVPress and ExpectedAttentionStatsPress
against float64 loops written from their reference code."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from test_methods_2026 import case, rotation, scores_of

STATS = "expected_attention_stats"
DUO = "duo_attention"


def cap_loops(q_pre, k, v, pos, P, n_sink=4, n_future=512, tau=5.0, eps=1e-6):
    """[b, Hkv, P] float64: kvpress CapPress.score, one sample and head at a time."""
    b, hq, n, d = q_pre.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.zeros(b, hkv, P, dtype=torch.float64)
    for i in range(b):
        rows = [t for t in range(n) if pos[i, t] >= n_sink]
        nxt = int(pos[i, -1]) + 1
        R = sum(rotation(p) for p in range(nxt, nxt + n_future)) / n_future
        top = -math.inf
        for h in range(hq):
            mu = R @ q_pre[i, h, rows].mean(0)
            kk, vv = k[i, h // g, rows], v[i, h // g, rows]
            c = torch.stack([mu @ x / (mu.norm() * x.norm()) for x in kk]).clamp(-1, 1)
            w = torch.exp(tau * c - (tau * c).max())
            A = torch.eye(d, dtype=torch.float64)
            for w_j, x in zip(w, vv):
                A += (w_j + eps) * torch.outer(x, x)
            lev = torch.stack([x @ torch.linalg.solve(A, x) for x in vv])
            for s, t in zip(w * lev, rows):
                if t < P:
                    out[i, h // g, t] += s / g
        top = max(top, float(out[i, :, [t for t in rows if t < P]].max()))
        for t in range(P):
            if 0 <= pos[i, t] < n_sink:
                out[i, :, t] = top + 1
    return out


@pytest.mark.parametrize("knobs", [{}, dict(tau=2.0, n_sink=2, n_future_positions=7, epsilon=0.1)])
def test_cap_equals_float64_loops(knobs):
    obs, q_pre, k, v, _, pos = case(n=26, pad=(0, 5), window=4, budget=12, seed=3)
    got = scores_of(obs, method="cap", **knobs)
    cfg = dict(n_sink=4, n_future=512, tau=5.0, eps=1e-6)
    cfg.update({"n_future" if a == "n_future_positions" else "eps" if a == "epsilon" else a: x
                for a, x in knobs.items()})
    ref = cap_loops(q_pre, k, v, pos, obs.prefix_len, **cfg)
    real = (pos[:, None, : obs.prefix_len] >= 0).expand_as(ref)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got.double()[real], ref[real], rtol=2e-4, atol=1e-7)


# --- MergingPress: merge="value" ---


def value_merge_loops(keys, values, kept, threshold=0.0, fraction=1.0):
    """The kept values [B, d] float64 of one head after kvpress MergingPress.merge: keys, values
    [L, d], ``kept`` the kept positions; every other position is evicted."""
    L = keys.shape[0]
    evicted = [j for j in range(L) if j not in kept]

    def unit(x):
        return x / max(float(x.norm()), 1e-6)

    best = []
    for e in evicted:
        sims = [float(unit(keys[e]) @ unit(keys[r])) for r in kept]
        t = max(range(len(kept)), key=lambda i: (sims[i], -i))
        best.append((sims[t], t))
    ok = [s >= threshold for s, _ in best]
    if fraction < 1.0 and any(ok):
        floor = torch.quantile(torch.tensor([s if o else -math.inf for (s, _), o in zip(best, ok)],
                                            dtype=torch.float64), 1.0 - fraction)
        ok = [o and s >= floor for (s, _), o in zip(best, ok)]
    out = values[kept].clone()
    total = torch.zeros(len(kept), dtype=torch.float64)
    incoming = torch.zeros_like(out)
    for e, (s, t), o in zip(evicted, best, ok):
        ne, nt = values[e].norm(), values[kept[t]].norm()
        w = max(s, 0.0) * o * ne / (ne + nt + 1e-6)
        total[t] += w
        incoming[t] += w * values[e]
    for t in range(len(kept)):
        if total[t] > 0:
            out[t] = (out[t] + incoming[t]) / (1 + total[t])
    return out


@pytest.mark.parametrize("gate", [dict(), dict(similarity_threshold=0.2), dict(merge_fraction=0.5),
                                  dict(similarity_threshold=0.1, merge_fraction=0.75)])
def test_value_merge_equals_float64_loops(gate):
    from restkv.eviction.select import select
    from restkv.config import CompressionConfig

    obs, *_ = case(n=30, pad=(0, 0), window=4, budget=12, seed=5)
    base = dict(method="snapkv", max_capacity_prompt=12, window_size=4)
    plain = select(obs, CompressionConfig(**base))
    merged = select(obs, CompressionConfig(**base, merge="value", **gate))
    assert torch.equal(plain.keys, merged.keys) and torch.equal(plain.index, merged.index)
    threshold = gate.get("similarity_threshold", 0.0)
    fraction = gate.get("merge_fraction", 1.0)
    for i in range(2):
        for h in range(2):
            kept = plain.index[i, h].tolist()
            ref = value_merge_loops(obs.keys[i, h].double(), obs.values[i, h].double(), kept,
                                    threshold, fraction)
            torch.testing.assert_close(merged.values[i, h].double(), ref, rtol=1e-5, atol=1e-6)
    assert not torch.equal(plain.values, merged.values)


def test_value_merge_leaves_padding_out_and_refuses_per_head_budgets():
    from restkv.eviction.select import select
    from restkv.config import CompressionConfig

    obs, *_ = case(n=30, pad=(0, 7), window=4, budget=12, seed=6)
    merged = select(obs, CompressionConfig(method="snapkv", max_capacity_prompt=12, window_size=4,
                                           merge="value"))
    kept = [j for j in merged.index[1, 0].tolist() if j >= 7]
    real = obs.keys[1, 0, 7:].double(), obs.values[1, 0, 7:].double()
    ref = value_merge_loops(*real, [j - 7 for j in kept])
    got = merged.values[1, 0][merged.index[1, 0] >= 7].double()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for bad in (dict(head_budget="adakv"), dict(layer_budget="global")):
        with pytest.raises(ValueError, match="merge"):
            CompressionConfig(method="snapkv", merge="value", **bad)


def test_value_merge_runs_while_decoding_and_in_sweep_mode():
    from helpers import generate, prompt, sweep_equals_separate_runs, tiny_model

    import restkv

    model = tiny_model("qwen2", "sdpa")
    ids = prompt(60)
    knobs = dict(method="snapkv", max_capacity_prompt=24, window_size=4, merge="value")
    with restkv.compressing(model, **knobs, decode_interval=3):
        merged, _ = generate(model, ids, n=8)
    with restkv.compressing(model, **{**knobs, "merge": "none"}, decode_interval=3):
        plain, _ = generate(model, ids, n=8)
    assert merged.shape == plain.shape
    sweep_equals_separate_runs(model, ids, [knobs, {**knobs, "merge_fraction": 0.5}], 4)



# --- ExpectedAttentionStatsPress: expected_attention_stats ---


def stats_loops(mean, cov, k, v, pos, P, n_sink=4, n_future=512, covariance=True):
    """[b, Hq, P] float64: kvpress ExpectedAttentionStatsPress.score with the statistics ``mean``
    [Hq, d], ``cov`` [Hq, d, d] before RoPE: softmax over the non-sink keys of s mu'.k + s^2 k^T
    S' k / 2 (mu' = R mu, S' = R S R^T, R the mean RoPE of the next positions), times ||v||; sinks
    max + 1."""
    b, hkv, n, d = k.shape
    hq = mean.shape[0]
    g, s = hq // hkv, d**-0.5
    out = torch.zeros(b, hq, P, dtype=torch.float64)
    for i in range(b):
        nxt = int(pos[i, -1]) + 1
        R = sum(rotation(p) for p in range(nxt, nxt + n_future)) / n_future
        keys = [j for j in range(n) if pos[i, j] >= n_sink]
        for h in range(hq):
            mu, S = R @ mean[h], R @ cov[h] @ R.T
            kk = k[i, h // g]
            z = torch.stack([s * mu @ kk[j] + (s * s / 2 * kk[j] @ S @ kk[j] if covariance else 0)
                             for j in keys])
            for a_j, j in zip(torch.softmax(z, 0), keys):
                if j < P:
                    out[i, h, j] = a_j * v[i, h // g, j].norm()
        non_sink = pos[i, :P] >= n_sink
        out[i][:, (pos[i, :P] >= 0) & ~non_sink] = out[i][:, non_sink].max() + 1
    return out


@pytest.mark.parametrize("covariance", [True, False])
def test_expected_attention_stats_equal_float64_loops(covariance):
    """The statistics given (obs.data), not the prompt's, make the scores."""
    obs, _, k, v, _, pos = case(n=26, pad=(0, 5), window=4, budget=12, seed=7)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 40, 8, generator=g, dtype=torch.float64) * 0.6
    x = x + torch.randn(4, 1, 8, generator=g)
    mean = x.mean(1)
    centred = x - mean[:, None]
    cov = centred.transpose(1, 2) @ centred / 39
    obs.data = (mean.float(), cov.float())
    got = scores_of(obs, method="expected_attention_stats", use_covariance=covariance)
    ref = stats_loops(mean, cov, k, v, pos, obs.prefix_len, covariance=covariance)
    real = (pos[:, None, : obs.prefix_len] >= 0).expand_as(ref)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got.double()[real], ref[real], rtol=2e-5, atol=1e-7)
    prompts = scores_of(obs, method="expected_attention", use_covariance=covariance)
    assert not torch.allclose(got[real], prompts[real], rtol=1e-2)


def test_query_statistics_of_a_model_are_those_of_its_queries_on_the_essays():
    """The mean and unbiased covariance of every query before RoPE (captured from q_proj) after the
    first n_sink positions of each piece of the essays, prefilled one piece at a time."""
    from helpers import tiny_model, tiny_tokenizer
    from transformers import AutoTokenizer

    from restkv.config import CompressionConfig
    from restkv.integration.query_stats import model_stats, text_samples

    model = tiny_model("llama", "sdpa")
    cfg = CompressionConfig(method="expected_attention_stats", tokenizer=tiny_tokenizer(),
                            stats_samples=3, stats_length=150)
    got = model_stats(model, cfg)
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer())
    layers = model.model.layers
    heads, d = model.config.num_attention_heads, model.config.head_dim
    queries = [[] for _ in layers]
    hooks = [layer.self_attn.q_proj.register_forward_hook(
        lambda mod, args, out, i=i: queries[i].append(out.view(-1, heads, d)[4:].double()))
        for i, layer in enumerate(layers)]
    with torch.no_grad():
        for text in text_samples(3, 150):
            model(input_ids=tokenizer(text, return_tensors="pt").input_ids)
    for h in hooks:
        h.remove()
    for i in range(len(layers)):
        q = torch.cat(queries[i]).transpose(0, 1)  # [Hq, N, d]
        mean = q.mean(1)
        cov = torch.stack([torch.cov(q[h].T) for h in range(heads)])  # unbiased
        torch.testing.assert_close(got["query_mean"][i].double(), mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["query_cov"][i].double(), cov, rtol=1e-4, atol=1e-5)
    assert model_stats(model, cfg) is got  # computed once per model


def test_a_stats_file_is_read_and_checked(tmp_path):
    from helpers import tiny_model

    import restkv

    model = tiny_model("llama", "sdpa")
    d = model.config.head_dim
    hq = model.config.num_attention_heads
    cov = torch.eye(d).expand(3, hq, d, d).clone()
    stats = {"query_mean": torch.randn(3, hq, d), "query_cov": cov}
    torch.save(stats, tmp_path / "s.pt")
    restkv.configure(model, method=STATS, stats_file=str(tmp_path / "s.pt"))
    held = [s.plan.data for s in model._restkv.states]
    assert torch.equal(torch.stack([m for m, _ in held]), stats["query_mean"])
    restkv.detach(model)
    from safetensors.torch import save_file

    (tmp_path / "folder").mkdir()
    save_file(stats, str(tmp_path / "folder" / "model.safetensors"))  # kvpress's stats folder
    restkv.configure(model, method=STATS, stats_file=str(tmp_path / "folder"))
    assert torch.equal(model._restkv.states[1].plan.data[1], stats["query_cov"][1])
    restkv.detach(model)
    torch.save({"query_mean": stats["query_mean"][:2]}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="stats_file .*query_mean of shape"):
        restkv.configure(model, method=STATS, stats_file=str(tmp_path / "bad.pt"))
    with pytest.raises(ValueError, match="stats_file not found"):
        restkv.configure(model, method=STATS, stats_file=str(tmp_path / "no.pt"))
    with pytest.raises(ValueError, match="tokenizer"):  # no checkpoint to read a tokenizer from
        restkv.configure(model, method=STATS)


# --- DuoAttentionPress: duo_attention ---


def duo_head_loops(q_mean, k_mean, q_len=500):
    """[Hkv] float64: kvpress duo_attention_on_the_fly's score of one layer: the mean query and key
    repeated over q_len positions and rotated there, the last query's softmax attention (scaled by
    1/sqrt(d)) over the keys, the mean of its cumulated sum, averaged over each GQA group."""
    hq, d = q_mean.shape
    hkv = k_mean.shape[0]
    g = hq // hkv
    out = torch.zeros(hkv, dtype=torch.float64)
    rotations = [rotation(p, d) for p in range(q_len)]
    for h in range(hq):
        q = rotations[-1] @ q_mean[h].double()
        logits = torch.stack([q @ (R @ k_mean[h // g].double()) / math.sqrt(d) for R in rotations])
        a = torch.softmax(logits, 0)
        out[h // g] += sum(a[: p + 1].sum() for p in range(q_len)) / q_len / g
    return out


def test_duo_attention_head_scores_equal_float64_loops():
    from helpers import rope_embed

    from restkv.methods.duo_attention import head_scores

    g = torch.Generator().manual_seed(9)
    q_mean = torch.randn(4, 8, generator=g) * 2
    k_mean = torch.randn(2, 8, generator=g) * 2
    got = head_scores(q_mean, k_mean, rope_embed(8), 8**-0.5)
    torch.testing.assert_close(got.double(), duo_head_loops(q_mean, k_mean), rtol=1e-5, atol=1e-6)


def test_duo_attention_streaming_heads_keep_sinks_and_recent_tokens():
    """Streaming heads (obs.data) keep the first sink_size and last recent_size real tokens, the
    others every token, as kvpress's masked_key_indices; a capped budget keeps the sinks, then the
    latest."""
    from restkv.config import CompressionConfig
    from restkv.eviction.select import select

    obs, _, _, _, _, pos = case(n=30, pad=(0, 6), window=1, budget=30, seed=10)
    obs.data = torch.tensor([True, False])
    knobs = dict(method=DUO, window_size=1, sink_size=3, recent_size=5)
    kept = select(obs, CompressionConfig(max_capacity_prompt=30, **knobs))
    for i, length in enumerate((30, 24)):
        for h, streaming in enumerate((True, False)):
            want = {p for p in range(length) if not streaming or p < 3 or p >= length - 5}
            got = {int(p) for p in kept.positions[i, h] if p >= 0}
            assert got == want, (i, h)
    obs.budget = 10  # the layer's budget
    capped = select(obs, CompressionConfig(max_capacity_prompt=10, **knobs))
    got = {int(p) for p in capped.positions[0, 1] if p >= 0}
    assert got == {0, 1, 2} | set(range(30 - 7, 30))
    assert pos[1, 6] == 0
    obs.budget = 3  # fewer than the sinks: the earliest of them, then the window
    capped = select(obs, CompressionConfig(max_capacity_prompt=3, **knobs))
    got = {int(p) for p in capped.positions[0, 1] if p >= 0}
    assert got == {0, 1, 29}


def test_duo_attention_without_patterns_ranks_the_layers_own_heads():
    """A hand-made observation: its own mean query and key before RoPE make the head scores."""
    from restkv.methods.duo_attention import own_streaming_heads

    obs, q_pre, k, _, _, pos = case(b=1, pad=(0,), n=26, window=1, budget=26, seed=11)
    k_pre = torch.stack([k[0, :, t] @ rotation(int(pos[0, t])) for t in range(26)], 1)  # R^T k
    ref = duo_head_loops(q_pre[0].mean(1), k_pre.mean(1))
    got = own_streaming_heads(obs, SimpleNamespace(head_compression_ratio=0.5))
    assert got.tolist() == [bool(ref[0] < ref[1]), bool(ref[1] <= ref[0])]


def test_duo_attention_head_scores_of_a_model_are_those_of_its_means_on_the_essays():
    """The scores average, over the essay windows, each layer's loop score of the window's mean
    q_proj and k_proj outputs (before RoPE); the streaming heads are the lowest over the model."""
    from helpers import tiny_model, tiny_tokenizer
    from transformers import AutoTokenizer

    import restkv
    from restkv.config import CompressionConfig
    from restkv.integration.duo_heads import model_head_scores
    from restkv.integration.qfilters import calibration_ids

    model = tiny_model("llama", "sdpa")
    knobs = dict(method="duo_attention", tokenizer=tiny_tokenizer(), duo_samples=2, duo_length=96,
                 head_compression_ratio=0.5)
    got = model_head_scores(model, CompressionConfig(**knobs))
    ids = calibration_ids(AutoTokenizer.from_pretrained(tiny_tokenizer()), 1024, 2, 96)
    layers = model.model.layers
    heads, kv, d = 6, 2, model.config.head_dim
    means = [[] for _ in layers]
    def mean_q_k(module, args, kwargs, out):
        h = kwargs["hidden_states"]
        q = module.q_proj(h).view(-1, heads, d).mean(0).double()
        k = module.k_proj(h).view(-1, kv, d).mean(0).double()
        means[module.layer_idx].append((q, k))

    hooks = [layer.self_attn.register_forward_hook(mean_q_k, with_kwargs=True) for layer in layers]
    with torch.no_grad():
        for row in ids:
            model(input_ids=row[None])
    for h in hooks:
        h.remove()
    ref = torch.stack([sum(duo_head_loops(q, k, 500) for q, k in m) / len(m) for m in means])
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)
    restkv.configure(model, **knobs)
    streaming = torch.stack([s.plan.data for s in model._restkv.states])
    lowest = ref.flatten().argsort()[:3]
    picked = streaming.flatten().nonzero().flatten()
    assert picked.sort().values.tolist() == lowest.sort().values.tolist()
    restkv.detach(model)


def test_duo_attention_streaming_heads_are_chosen_among_the_evicted_layers(tmp_path):
    """Gemma 3 keeps its sliding-window layers whole: their heads are never streaming heads, and the
    ratio counts the evicted layers' heads only (here layer 1's two)."""
    from helpers import tiny_model

    import restkv

    model = tiny_model("gemma3", "sdpa")
    (tmp_path / "heads.tsv").write_text("0.1\t0.2\n0.9\t0.5\n0.3\t0.4\n")
    restkv.configure(model, method=DUO, head_compression_ratio=0.5,
                     duo_attention_file=str(tmp_path / "heads.tsv"))
    states = model._restkv.states
    assert [s.plan.rank for s in states] == [-1, 0, -1]
    assert [s.plan.data.tolist() for s in states] == [[False, False], [False, True], [False, False]]


def test_a_duo_attention_file_is_read_and_checked(tmp_path):
    from helpers import tiny_model

    import restkv

    model = tiny_model("llama", "sdpa")
    (tmp_path / "heads.tsv").write_text("0.9\t0.1\n0.5\t1.7\n-0.2\t0.3\n")
    restkv.configure(model, method="duo_attention", head_compression_ratio=0.5,
                     duo_attention_file=str(tmp_path / "heads.tsv"))
    streaming = torch.stack([s.plan.data for s in model._restkv.states])
    assert streaming.tolist() == [[False, True], [False, False], [True, True]]  # clipped: -0.2 -> 0
    restkv.detach(model)
    (tmp_path / "bad.tsv").write_text("0.9\t0.1\n")
    with pytest.raises(ValueError, match="duo_attention_file .*shape"):
        restkv.configure(model, method=DUO, duo_attention_file=str(tmp_path / "bad.tsv"))
    (tmp_path / "text.tsv").write_text("a\tb\n")
    with pytest.raises(ValueError, match="duo_attention_file .*not a tab-separated"):
        restkv.configure(model, method=DUO, duo_attention_file=str(tmp_path / "text.tsv"))
    with pytest.raises(ValueError, match="duo_attention_file not found"):
        restkv.configure(model, method=DUO, duo_attention_file=str(tmp_path / "no.tsv"))
    with pytest.raises(ValueError, match="tokenizer"):
        restkv.configure(model, method="duo_attention", head_compression_ratio=0.5)
