"""R-KV and TriAttention against float64 loops written from their reference code, TriAttention's
statistics of a model, the authors' statistics files, and the refusal of a model without RoPE."""

from __future__ import annotations

import cmath
import math

import pytest
import torch
from helpers import tiny_model, tiny_tokenizer
from test_methods_2026 import D, case, rotation, scores_of

import restkv
from restkv.config import CompressionConfig

# --- R-KV ---


def rkv_loops(q, k, valid, window, lam, threshold, kernel, scaling):
    """[b, Hkv, P] float64: R-KV's ``R1KV.update_kv`` score on each sample's real entries (as if it
    were unpadded): softmax over the prefix of the window queries' logits (group maximum), averaged
    over the window, max-pooled; minus the softmax of the keys' mean cosine similarity, each row's
    diagonal and most recent near-duplicate (else its first key) zeroed."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    P = n - window
    out = torch.zeros(b, hkv, P, dtype=torch.float64)
    for i in range(b):
        real = [t for t in range(n) if valid[i, t]]
        m, p = len(real), len(real) - window
        for h in range(hkv):
            kk = [k[i, h, t].double() for t in real]
            rows = [[max(float(q[i, h * g + r, real[m - window + w]].double() @ kk[j]) * scaling for r in range(g))
                     for j in range(p)] for w in range(window)]
            attn = [sum(torch.softmax(torch.tensor(row, dtype=torch.float64), 0)[j] for row in rows) / window
                    for j in range(p)]
            pooled = [max(attn[max(0, j - kernel // 2): j + kernel // 2 + 1]) for j in range(p)]
            sim = [[float(kk[a] @ kk[c] / ((kk[a].norm() + 1e-8) * (kk[c].norm() + 1e-8))) if a != c else 0.0
                    for c in range(m)] for a in range(m)]
            for a in range(m):
                similar = [c for c in range(m) if sim[a][c] > threshold]
                sim[a][max(similar) if similar else 0] = 0.0
            means = torch.tensor([sum(sim[a][c] for a in range(m)) / m for c in range(m)], dtype=torch.float64)
            redundancy = torch.softmax(means, 0)
            for j in range(p):
                out[i, h, real[j]] = lam * pooled[j] - (1 - lam) * redundancy[j]
    return out


@pytest.mark.parametrize("knobs", [{}, dict(mix_lambda=0.6, redundancy_threshold=0.2, kernel_size=3)])
def test_rkv_equals_float64_loops(knobs):
    obs, _, k, _, _, pos = case(n=26, pad=(0, 5), window=4, budget=12, seed=3)
    k[1, 0, 9] = k[1, 0, 20] * 2  # near-duplicates: the newer one is spared
    k[0, 1, 3] = k[0, 1, 14] + 0.01
    obs.keys = k.float()
    cfg = CompressionConfig(method="rkv", max_capacity_prompt=12, window_size=4, **knobs)
    got = scores_of(obs, method="rkv", **knobs)
    ref = rkv_loops(obs.queries, k, pos >= 0, 4, cfg.mix_lambda, cfg.redundancy_threshold, cfg.kernel_size,
                    obs.scaling)
    real = (pos[:, None, : obs.prefix_len] >= 0).expand_as(ref)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got.double()[real], ref[real], rtol=1e-5, atol=1e-7)


def test_rkv_redundancy_is_computed_in_blocks_of_rows(monkeypatch):
    from restkv.methods import rkv

    obs, *_ = case(n=26, window=4, budget=12, seed=4)
    whole = scores_of(obs, method="rkv")
    monkeypatch.setattr(rkv, "SIMILARITY_BLOCK", 2 * 2 * 26 * 3)  # 3 rows at a time
    obs.memo.clear()
    torch.testing.assert_close(scores_of(obs, method="rkv"), whole, rtol=1e-6, atol=1e-8)


def test_rkv_defaults_are_the_reference_runs():
    cfg = CompressionConfig(method="rkv")
    assert (cfg.max_capacity_prompt, cfg.window_size, cfg.decode_interval) == (128, 8, 128)
    assert (cfg.mix_lambda, cfg.pooling, cfg.kernel_size) == (0.1, "maxpool", 7)


# --- TriAttention ---

OFFSETS = [1, 2, 4, 8, 16]


def tri_loops(mean, modulus, k, pos, P, hq, offsets=OFFSETS, normalize=True, base=10000.0):
    """[b, Hq, P] float64: TriAttention's ``score_keys_for_round`` (mean over the offsets) of each key
    before RoPE (its RoPE at its position undone), per query head; z-scored per head over the real
    entries when ``normalize``."""
    b, hkv, n, d = k.shape
    g, half = hq // hkv, d // 2
    omega = [base ** (-2 * f / d) for f in range(half)]
    out = torch.zeros(b, hq, P, dtype=torch.float64)
    for i in range(b):
        nxt = int(pos[i, -1]) + 1
        real = [j for j in range(P) if pos[i, j] >= 0]
        for h in range(hq):
            m = [complex(mean[h, f], mean[h, f + half]) for f in range(half)]
            for j in real:
                pre = rotation(int(pos[i, j]), d, base).T @ k[i, h // g, j].double()
                kc = [complex(pre[f], pre[f + half]) for f in range(half)]
                series = sum(abs(m[f]) * abs(kc[f]) * math.cos((nxt + o - int(pos[i, j])) * omega[f]
                                                               + cmath.phase(m[f] * kc[f].conjugate()))
                             for o in offsets for f in range(half)) / len(offsets)
                extra = sum((float(modulus[h, f]) - abs(m[f])) * abs(kc[f]) for f in range(half))
                out[i, h, j] = series + extra
            if normalize:
                x = out[i, h, real]
                out[i, h, real] = (x - x.mean()) / x.std(unbiased=False).clamp_min(1e-6)
    return out


def _statistics(hq, d, seed=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(hq, 50, d, generator=g, dtype=torch.float64) * 0.5 + torch.randn(hq, 1, d, generator=g)
    half = d // 2
    return x.mean(1), torch.hypot(x[..., :half], x[..., half:]).mean(1)


@pytest.mark.parametrize("normalize", [True, False])
def test_triattention_equals_float64_loops(normalize):
    obs, _, k, _, _, pos = case(n=26, pad=(0, 5), window=4, budget=12, seed=5)
    mean, modulus = _statistics(4, D)
    obs.data = (mean.float(), modulus.float())
    got = scores_of(obs, method="triattention", offset_max_length=16, normalize_scores=normalize)
    ref = tri_loops(mean, modulus, k, pos, obs.prefix_len, 4, normalize=normalize)
    real = (pos[:, None, : obs.prefix_len] >= 0).expand_as(ref)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got.double()[real], ref[real], rtol=1e-4, atol=1e-5)


def test_triattention_without_statistics_takes_its_own_queries():
    obs, q_pre, k, _, _, pos = case(n=26, pad=(0, 5), window=4, budget=12, seed=6)
    rows = q_pre.transpose(0, 1)[:, pos >= 0]  # [Hq, N, d] the real queries before RoPE
    half = D // 2
    mean, modulus = rows.mean(1), torch.hypot(rows[..., :half], rows[..., half:]).mean(1)
    got = scores_of(obs, method="triattention", offset_max_length=16)
    ref = tri_loops(mean, modulus, k, pos, obs.prefix_len, 4)
    real = (pos[:, None, : obs.prefix_len] >= 0).expand_as(ref)
    torch.testing.assert_close(got.double()[real], ref[real], rtol=1e-4, atol=1e-5)


def test_triattention_statistics_of_a_model_are_those_of_its_queries_on_the_essays():
    """The mean and mean pair modulus of every query before RoPE (captured from q_proj) over the essay
    windows prefilled one at a time."""
    from transformers import AutoTokenizer

    from restkv.integration.qfilters import calibration_ids
    from restkv.integration.triattention_stats import model_stats

    model = tiny_model("llama", "sdpa")
    cfg = CompressionConfig(method="triattention", tokenizer=tiny_tokenizer(), triattention_length=600)
    got = model_stats(model, cfg)
    layers = model.model.layers
    heads, d = model.config.num_attention_heads, model.config.head_dim
    queries = [[] for _ in layers]
    hooks = [layer.self_attn.q_proj.register_forward_hook(
        lambda mod, args, out, i=i: queries[i].append(out.view(-1, heads, d).double()))
        for i, layer in enumerate(layers)]
    with torch.no_grad():
        for row in calibration_ids(AutoTokenizer.from_pretrained(tiny_tokenizer()), 1024, 1, 600):
            model(input_ids=row[None])
    for h in hooks:
        h.remove()
    for i in range(len(layers)):
        q = torch.cat(queries[i]).transpose(0, 1)  # [Hq, N, d]
        assert q.shape[1] == 600
        modulus = torch.hypot(q[..., : d // 2], q[..., d // 2:]).mean(1)
        torch.testing.assert_close(got["query_mean"][i].double(), q.mean(1), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["query_abs_mean"][i].double(), modulus, rtol=1e-4, atol=1e-5)
    assert model_stats(model, cfg) is got  # computed once per model


def _authors_file(path, layers, hq, d, seed=0):
    """A statistics file in the authors' format (``calibrate.py``'s payload) and its tensors."""
    g = torch.Generator().manual_seed(seed)
    mean, modulus = torch.randn(layers, hq, d, generator=g), torch.rand(layers, hq, d // 2, generator=g)
    stats = {f"layer{i:02d}_head{h:02d}": {"q_mean_real": mean[i, h, : d // 2], "q_mean_imag": mean[i, h, d // 2:],
                                           "q_abs_mean": modulus[i, h]} for i in range(layers) for h in range(hq)}
    torch.save({"metadata": {"head_dim": d, "sampled_heads": [[i, h] for i in range(layers) for h in range(hq)]},
                "stats": stats}, path)
    return mean, modulus


def test_an_authors_statistics_file_is_read_and_checked(tmp_path):
    model = tiny_model("llama", "sdpa")
    hq, d = model.config.num_attention_heads, model.config.head_dim
    mean, modulus = _authors_file(tmp_path / "stats.pt", 3, hq, d)
    restkv.configure(model, method="triattention", triattention_stats_file=str(tmp_path / "stats.pt"))
    held = [s.plan.data for s in model._restkv.states]
    assert torch.equal(torch.stack([m for m, _ in held]), mean)
    assert torch.equal(torch.stack([a for _, a in held]), modulus)
    restkv.detach(model)
    _authors_file(tmp_path / "wide.pt", 3, hq, 2 * d)
    with pytest.raises(ValueError, match="triattention_stats_file .*does not fit the model"):
        restkv.configure(model, method="triattention", triattention_stats_file=str(tmp_path / "wide.pt"))
    torch.save({"query_mean": mean}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="triattention_stats_file .*not a TriAttention statistics file"):
        restkv.configure(model, method="triattention", triattention_stats_file=str(tmp_path / "other.pt"))
    with pytest.raises(ValueError, match="triattention_stats_file not found"):
        restkv.configure(model, method="triattention", triattention_stats_file=str(tmp_path / "no.pt"))


def test_triattention_refuses_a_model_without_rope_before_any_work(monkeypatch):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    from restkv.integration import triattention_stats

    monkeypatch.setattr(triattention_stats, "compute", lambda *a: pytest.fail("computed for a model refused"))
    torch.manual_seed(0)
    config = SmolLM3Config(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2)  # its layer 3 has no RoPE
    model = SmolLM3ForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"^method triattention .*not a RoPE model\)$"):
        restkv.configure(model, method="triattention", tokenizer=tiny_tokenizer())
    llama = tiny_model("llama", "sdpa")
    del llama.model.rotary_emb
    with pytest.raises(ValueError, match="not a RoPE model"):
        restkv.configure(llama, method="triattention", tokenizer=tiny_tokenizer())


def test_triattention_defaults_are_the_reference_runs():
    cfg = CompressionConfig(method="triattention")
    assert (cfg.max_capacity_prompt, cfg.decode_interval, cfg.window_size) == (2048, 128, 1)
    assert (cfg.offset_max_length, cfg.normalize_scores, cfg.gqa_agg) == (65536, True, "max")
