"""KVzap and Fast KVzip: their scores against a float64 loop of kvpress's models on the same weights, their
weights' files, the hidden states they read, and training that brings them closer to KVzip's scores."""

from __future__ import annotations

import math

import pytest
import torch

import restkv
from helpers import prompt, random_weights, tiny_model, tiny_tokenizer
from restkv.config import CompressionConfig
from restkv.integration import trained
from restkv.integration.models import essays_text
from restkv.methods import fastkvzip, kvzap
from restkv.scoring.observe import Observation

N, D, HKV, G = 40, 16, 2, 3


def _observation(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, N, 8, generator=g) for h in (HKV * G, HKV, HKV))
    obs = Observation(q, k, v, torch.ones(1, N, dtype=torch.bool), window=4, budget=12, scaling=8**-0.5)
    obs.hidden = torch.randn(1, N, D, generator=g) * 3
    obs.data = random_weights(cfg, D, HKV, G, seed=seed)
    return obs


def _gelu(x: float) -> float:
    return 0.5 * x * (1 + math.erf(x / math.sqrt(2)))


def kvzap_reference(weights, h):
    """kvpress's KVzapModel layer, a float64 loop: h [n, D] -> [Hkv, n]."""
    w = [t.double() for t in weights]
    out = torch.zeros(w[-1].shape[0], h.shape[0], dtype=torch.float64)
    for n in range(h.shape[0]):
        x = h[n].double()
        if len(w) == 4:
            x = torch.tensor([_gelu(float(w[0][j] @ x + w[1][j])) for j in range(w[0].shape[0])],
                             dtype=torch.float64)
        for head in range(out.shape[0]):
            out[head, n] = w[-2][head] @ x + w[-1][head]
    return out


def gate_reference(weights, h):
    """kvpress's FastKVzipGate, a float64 loop: h [n, D] -> [Hkv, n]."""
    w = {k: t.double() for k, t in weights.items()}
    hkv, _, sinks, o = w["k_base"].shape
    groups = w["b"].shape[-1]

    def norm(x, scale):
        return x / math.sqrt(float((x * x).mean()) + 1e-6) * scale

    out = torch.zeros(hkv, h.shape[0], dtype=torch.float64)
    for n in range(h.shape[0]):
        x = h[n].double()
        q = (w["q_proj.weight"] @ x + w["q_proj.bias"]).view(hkv, groups, o)
        k = (w["k_proj.weight"] @ x).view(hkv, o)
        for head in range(hkv):
            key = norm(k[head], w["k_norm.weight"])
            total = 0.0
            for j in range(groups):
                query = norm(q[head, j], w["q_norm.weight"])
                logit = float(key @ query) / math.sqrt(o) + float(w["b"][head, 0, j])
                others = sum(math.exp(float(w["k_base"][head, 0, i] @ query) / math.sqrt(o) - logit)
                             for i in range(sinks))
                total += 1 / (1 + others)
            out[head, n] = total / groups
    return out


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_kvzap_scores_are_kvpress_model_on_the_hidden_states(kind):
    cfg = CompressionConfig(method="kvzap", kvzap_type=kind, kvzap_file="unused.pt")
    obs = _observation(cfg)
    got = kvzap.score(obs, cfg.score_knobs())
    ref = kvzap_reference(obs.data, obs.hidden[0, : obs.prefix_len])
    assert got.dtype == torch.float32 and got.shape == (1, HKV, N - 4)
    torch.testing.assert_close(got[0].double(), ref, rtol=1e-5, atol=1e-5)


def test_fastkvzip_scores_are_kvpress_gate_with_the_sinks_kept():
    cfg = CompressionConfig(method="fastkvzip", fastkvzip_file="unused.pt")
    obs = _observation(cfg, seed=1)
    got = fastkvzip.score(obs, cfg.score_knobs())
    ref = gate_reference(obs.data, obs.hidden[0, : obs.prefix_len])
    ref[:, : cfg.sink_tokens] = fastkvzip.SINK
    assert got.dtype == torch.float32
    torch.testing.assert_close(got[0].double(), ref, rtol=1e-5, atol=1e-6)
    assert 0 < got[0, :, cfg.sink_tokens :].min() and got[0, :, cfg.sink_tokens :].max() < 1


def test_scores_are_float32_from_low_precision_hidden_states():
    cfg = CompressionConfig(method="fastkvzip", fastkvzip_file="unused.pt")
    obs = _observation(cfg)
    obs.hidden = obs.hidden.to(torch.bfloat16)
    got = fastkvzip.score(obs, cfg.score_knobs())
    assert got.dtype == torch.float32 and torch.isfinite(got).all()


def _files(tmp_path, model, seed=0):
    """A kvzap (mlp) and a fastkvzip file of random weights for ``model``, in kvpress's formats."""
    shape = trained.model_shape(model)
    paths = {}
    for method, knobs in (("kvzap", {"kvzap_type": "mlp"}), ("fastkvzip", {})):
        cfg = CompressionConfig(method=method, **knobs)
        weights = [random_weights(cfg, shape["hidden"], shape["kv_heads"], shape["groups"], seed + i)
                   for i in range(shape["layers"])]
        paths[method] = tmp_path / f"{method}.pt"
        torch.save(trained.to_file(method, weights), paths[method])
    return paths


@pytest.mark.parametrize("method", ["kvzap", "fastkvzip"])
def test_the_scorer_reads_the_layer_attention_input_and_the_file_weights(method, tmp_path, monkeypatch):
    model = tiny_model("llama")
    path = _files(tmp_path, model)[method]
    inputs, seen = {}, []

    def keep(mod, args, kwargs):
        inputs.setdefault(mod.layer_idx, kwargs["hidden_states"])

    hooks = [m.self_attn.register_forward_pre_hook(keep, with_kwargs=True) for m in model.model.layers]
    module = kvzap if method == "kvzap" else fastkvzip
    honest = module.score
    monkeypatch.setattr(module, "score", lambda obs, cfg: seen.append(obs) or honest(obs, cfg))
    restkv.configure(model, method=method, max_capacity_prompt=20, window_size=4, **{f"{method}_file": str(path)})
    with torch.no_grad():
        model(prompt(60), use_cache=True)
    for h in hooks:
        h.remove()
    state = torch.load(path)
    assert len(seen) == 3
    for i, obs in enumerate(seen):
        assert torch.equal(obs.hidden, inputs[i])
        if method == "kvzap":
            assert torch.equal(obs.data[0], state[f"layers.{i}.0.weight"])
        else:
            assert torch.equal(obs.data["k_base"], state["module"][i]["k_base"])


@pytest.mark.parametrize("method,bad,match", [
    ("kvzap", "missing.pt", "kvzap_file not found"),
    ("kvzap", "shape", "kvzap_file .*expected 3 layers from 48 hidden"),
    ("kvzap", "kind", "kvzap_file .*holds an mlp model but kvzap_type is linear"),
    ("fastkvzip", "shape", "fastkvzip_file .*expected gates from 48 hidden"),
    ("fastkvzip", "garbage", "fastkvzip_file .*not a weights file"),
])
def test_a_wrong_weights_file_is_refused_naming_its_knob(method, bad, match, tmp_path):
    model = tiny_model("llama")
    knobs = dict(method=method, max_capacity_prompt=20, window_size=4)
    path = tmp_path / "w.pt"
    if bad == "shape":
        torch.save(trained.to_file(method, [random_weights(CompressionConfig(method=method), 8, 2, 3)] * 3), path)
    elif bad == "kind":
        path = _files(tmp_path, model)["kvzap"]
        knobs["kvzap_type"] = "linear"
    elif bad == "garbage":
        path.write_text("not torch")
    else:
        path = tmp_path / bad
    with pytest.raises(ValueError, match=match):
        restkv.configure(model, **knobs, **{f"{method}_file": str(path)})
    assert not any(hasattr(m, "_restkv") for m in model.modules())


def test_decoding_time_eviction_is_refused():
    for method in ("kvzap", "fastkvzip"):
        with pytest.raises(ValueError, match="decode_interval"):
            CompressionConfig(method=method, decode_interval=4)


def test_training_brings_the_scores_closer_to_kvzip_on_held_out_windows(monkeypatch):
    """On a tiny random model (KVzip's scores of 8 essay windows, one held out), each training lowers its
    held-out loss, and KVzap's raises the rank correlation with KVzip's scores (a random model's KVzip
    scores are nearly flat: the gate learns their level first; its ranks are checked on SmolLM2 below)."""
    monkeypatch.setattr(trained.training, "MLP_EPOCHS", 60)
    monkeypatch.setattr(trained.training, "GATE_STEPS", 150)
    monkeypatch.setattr(trained.training, "GATE_EPOCHS", 100)
    model = tiny_model("llama")
    data = trained.examples(model, tiny_tokenizer(), 8, 256)
    drawn = 8 * (256 - 4)  # every position after the 4 sinks (fewer than POSITIONS)
    assert data["hidden"].shape == (drawn, 3, 48) and data["scores"].shape == (drawn, 3, 2)
    for method, kind in (("kvzap", "linear"), ("kvzap", "mlp"), ("fastkvzip", None)):
        weights, report, _ = trained.train(model, method, kind, tiny_tokenizer(), 8, 256, data)
        before, after = report["before"], report["after"]
        assert after["loss"] < before["loss"], (method, kind, report)
        if method == "kvzap":
            assert after["spearman"] > before["spearman"] + 0.1, (method, kind, report)
        assert len(weights) == 3


# held-out Spearman correlation with KVzip's scores of the weights trained on SmolLM2 with the default recipe,
# measured with ``python -m restkv.train kvzap fastkvzip --model smollm2-135m``: 0.70 and 0.46 (before
# training: 0.02 and 0.01); the bounds leave a margin for other thread counts
SPEARMAN = {"kvzap": 0.6, "fastkvzip": 0.35}


@pytest.mark.slow
def test_weights_trained_on_smollm2_agree_with_kvzip_on_held_out_windows(smollm2):
    """The packaged SmolLM2, trained as ``python -m restkv.train`` does (16 essay windows of 1,024 tokens,
    2 held out; minutes on CPU): every model's held-out loss falls and its ranking of the entries
    agrees with KVzip's (Spearman correlation over each layer's and head's drawn positions)."""
    model, _ = smollm2
    data = trained.examples(model, None, 16, 1024)
    for method, kind in (("kvzap", "mlp"), ("fastkvzip", None)):
        _, report, _ = trained.train(model, method, kind, None, 16, 1024, data)
        before, after = report["before"], report["after"]
        assert after["loss"] < before["loss"], (method, kind, report)
        assert after["spearman"] > SPEARMAN[method], (method, kind, report)


@pytest.mark.slow
def test_kvzap_keeps_what_kvzip_keeps_more_than_chance_on_smollm2(smollm2):
    """End to end with the weights ``configure`` finds (trained on first use): the kept sets of the
    trained methods overlap KVzip's on an essay window beyond what a random choice would."""
    model, tokenizer = smollm2
    ids = tokenizer(essays_text()[-20000:], return_tensors="pt").input_ids
    ids = ids[:, -768:]
    kept = {}
    for method in ("kvzip", "kvzap", "fastkvzip", "random"):
        restkv.configure(model, method=method, max_capacity_prompt=192, window_size=16)
        with torch.no_grad():
            model(ids, use_cache=True)
        kept[method] = restkv.kept_positions(model)
        restkv.detach(model)

    def overlap(a, b):
        shares = []
        for x, y in zip(kept[a], kept[b]):
            if x is None or y is None:
                continue
            for hx, hy in zip(x[0], y[0]):
                sx, sy = set(hx[hx >= 0].tolist()), set(hy[hy >= 0].tolist())
                shares.append(len(sx & sy) / max(1, len(sx | sy)))
        return sum(shares) / len(shares)

    chance = overlap("kvzip", "random")
    for method in ("kvzap", "fastkvzip"):
        assert overlap("kvzip", method) > chance + 0.05, (method, overlap("kvzip", method), chance)
