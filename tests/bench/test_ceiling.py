"""benchmarks/ceiling.py and benchmarks/hindsight.py: the layer-output error against a float64 loop on SmolLM2
layers, the hindsight definitions on hand-made tensors, and the run end to end on tiny models."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from helpers import ROOT, prompt, tiny_model

sys.path.insert(0, str(ROOT / "benchmarks"))
import ceiling  # noqa: E402
import hindsight  # noqa: E402
from fidelity import essay_samples, teacher_forced  # noqa: E402

import restkv  # noqa: E402
from restkv.eviction.plans import attention_modules  # noqa: E402
from restkv.config import CompressionConfig  # noqa: E402
from restkv.eviction.select import head_scores  # noqa: E402

FUTURE = CompressionConfig.from_kwargs(method="restkv", pooling="none")


def loop_layer_error(q, k, v, scaling, keep, w_o, observed):
    """float64, one query and head at a time: the layer output (o_proj of the heads' attention outputs) of each
    of the last ``observed`` queries over every key it sees, and over the kept keys only; [observed] ||difference||
    and the full outputs [observed, Hq * d] (o_proj's input)."""
    hq, n = q.shape[1], k.shape[2]
    g, prefix = hq // k.shape[1], keep.shape[-1]
    errors, inputs = [], []
    for t in range(n - observed, n):
        full, kept = [], []
        for h in range(hq):
            keys, vals = k[0, h // g, : t + 1].double(), v[0, h // g, : t + 1].double()
            logits = keys @ q[0, h, t].double() * scaling
            mask = torch.ones(t + 1, dtype=torch.bool)
            mask[:prefix] = keep[0, h // g]
            full.append(logits.softmax(0) @ vals)
            kept.append(logits[mask].softmax(0) @ vals[mask])
        y, y_kept = torch.cat(full), torch.cat(kept)
        errors.append((w_o.double() @ y - w_o.double() @ y_kept).norm())
        inputs.append(y)
    return torch.stack(errors), torch.stack(inputs)


def test_layer_output_error_matches_a_float64_loop_on_smollm2(smollm2):
    model, tokenizer = smollm2
    length, observed, window = 160, 4, 16
    ids = essay_samples(tokenizer, 1, length, observed + 1, seed=3)[0][:-1]
    chosen = {0: None, 14: None, 29: None}
    hooks = [model.model.layers[i].self_attn.o_proj.register_forward_pre_hook(
        lambda mod, args, i=i: chosen.__setitem__(i, args[0][0].detach())) for i in chosen]
    try:
        layers = {i: (module, obs) for i, module, obs in ceiling.capture(model, ids, observed) if i in chosen}
    finally:
        for hook in hooks:
            hook.remove()
    g = torch.Generator().manual_seed(0)
    for i, (module, obs) in layers.items():
        keep = hindsight.top_set(torch.rand(1, 3, length - window, generator=g), 40)
        w_o = module.o_proj.weight
        expected, inputs = loop_layer_error(obs.queries, obs.keys, obs.values, obs.scaling, keep, w_o, observed)
        torch.testing.assert_close(inputs.float(), chosen[i][-observed:], rtol=1e-4, atol=1e-5)  # what o_proj saw
        got = hindsight.layer_output_error(obs.window_attention, obs.values, keep, w_o)[0]
        torch.testing.assert_close(got.double(), expected, rtol=2e-4, atol=1e-6)
        assert float(expected.min()) > 0


def test_future_attention_and_kept_sets_by_definition():
    g = torch.Generator().manual_seed(1)
    attention = torch.rand(1, 4, 3, 7, generator=g).softmax(-1)  # 4 query heads, 2 KV heads
    got = hindsight.future_attention(attention, 2, 5)
    for k in range(2):
        for n in range(5):
            expected = sum(float(attention[0, h, t, n]) for h in (2 * k, 2 * k + 1) for t in range(3)) / 6
            assert got[0, k, n].item() == pytest.approx(expected, rel=1e-6)
    scores = torch.tensor([[[0.1, 0.9, 0.3, 0.7, 0.2], [5.0, 1.0, 2.0, 4.0, 3.0]]])
    assert hindsight.top_set(scores, 2).tolist() == [[[False, True, False, True, False], [True, False, False, True, False]]]
    positions = torch.tensor([[[0, 3, 5, 6], [1, 2, -1, -1]]])
    assert hindsight.positions_mask(positions, 5).tolist() == [[[True, False, False, True, False],
                                                                 [False, True, True, False, False]]]
    keys = torch.arange(2 * 7, dtype=torch.float32).view(1, 2, 7, 1).expand(1, 2, 7, 3)
    layer = hindsight.cache_layer(hindsight.top_set(scores, 2), keys, -keys)
    assert layer.positions.tolist() == [[[1, 3, 5, 6], [0, 3, 5, 6]]] and layer.seen == 7
    assert layer.keys[0, 1, :, 0].tolist() == [7.0, 10.0, 12.0, 13.0] and layer.values[0, 1, 0, 0] == -7.0


def test_future_restkv_is_the_indicator_of_the_continuation_queries():
    model = tiny_model("llama")
    length, observed, window = 40, 5, 4
    [(_, module, obs), *_] = ceiling.capture(model, prompt(length + observed)[0], observed)
    q, k, v = (x[0].double() for x in (obs.queries, obs.keys, obs.values))
    g, n = q.shape[0] // k.shape[0], k.shape[1]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    logits = q[:, length:] @ k.transpose(-1, -2) * obs.scaling
    future = torch.arange(n)[None] > torch.arange(length, n)[:, None]
    a = logits.masked_fill(future, float("-inf")).softmax(-1)[..., :length].mean(1)  # [Hq, L]
    o = (a[..., None] * v[:, :length]).sum(1)  # the aggregated row's output over the prompt
    w_o = module.o_proj.weight.double().view(-1, q.shape[0], q.shape[-1])  # [D, Hq, d]
    dist = torch.einsum("ehd,hnd->hne", w_o, o[:, None] - v[:, :length]).norm(dim=-1)
    expected = (a / (1 - a) * dist).view(k.shape[0] // g, g, -1).mean(1)[:, : length - window]
    got = head_scores(obs, FUTURE)[0, :, : length - window]
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-7)
    by_attention = hindsight.future_attention(obs.window_attention, k.shape[0] // g, length - window)[0]
    torch.testing.assert_close(by_attention.double(), a.view(-1, g, length).mean(1)[:, : length - window],
                               rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_sample_values_end_to_end(family):
    model, ids, length = tiny_model(family), prompt(70)[0], 64
    rows = [(m, 16, dict(method=m, max_capacity_prompt=16, window_size=4)) for m in ("streamingllm", "snapkv")]
    rows.append(("streamingllm", 80, dict(method="streamingllm", max_capacity_prompt=80, window_size=4)))
    out = ceiling.sample_values(model, ids, length, rows, [16, 80], 4, FUTURE, dict(rounds=8, pool=8, batch=4))
    assert set(out["kl"]) == {"streamingllm", "snapkv", *ceiling.HINDSIGHT}
    assert all(x >= 0 for by in out["kl"].values() for x in by.values())
    assert all(out["kl"][name]["80"] == 0 for name in ceiling.HINDSIGHT) and out["kl"]["streamingllm"]["80"] == 0
    assert out["error"]["future_setlevel"]["16"] < out["error"]["future_attention"]["16"]
    assert out["kl"]["future_setlevel"]["16"] != out["kl"]["future_attention"]["16"] and out["swaps"]["16"] > 0
    # a cache built from a real config's kept positions is that config's cache
    pre = restkv.sweep_caches(model, ids[None, :length], None, [{"method": "fullkv"}, rows[1][2]])
    full, layers = pre.caches[0], {}
    for i, module in enumerate(attention_modules(model)):
        if pre.kept[1][i] is not None:
            keep = hindsight.positions_mask(pre.kept[1][i], length - 4)
            prompt_layer = full.layers[module.layer_idx]
            layers[module.layer_idx] = hindsight.cache_layer(keep, prompt_layer.keys, prompt_layer.values)
    assert len(layers) == (1 if family == "gemma3" else 3)
    real, built = teacher_forced(model, ids, length, pre.logits, [pre.caches[1], ceiling.with_layers(full, layers)])
    assert torch.equal(real, built)


class Bytes:
    """A tokenizer of the tiny models' vocabulary: one id per byte."""

    def __call__(self, text, return_tensors=None):
        return types.SimpleNamespace(input_ids=(torch.tensor(list(text[:3000].encode())) % 94 + 3)[None])


SMALL = ["--samples", "2", "--length", "48", "--continuation", "4", "--max_capacity_prompts", "12", "20",
         "--window_size", "4", "--method", "streamingllm", "snapkv", "--rounds", "4", "--pool", "4"]


def test_main_tables_resume_and_bad_flags(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ceiling, "load_from_args", lambda args: (tiny_model("llama"), Bytes(), None))
    out = tmp_path / "ceiling.json"
    ceiling.main(SMALL + ["--output", str(out)])
    text = capsys.readouterr().out
    stored = json.loads(out.read_text())
    assert set(stored["kl"]) == {*ceiling.HINDSIGHT, "streamingllm-window_size=4", "snapkv-window_size=4"}
    assert all(len(v) == 2 for by in stored["kl"].values() for v in by.values())
    assert "| future_setlevel |" in text and "Share of the gap streamingllm-window_size=4" in text and "| B=12 | B=20 |" in text

    out.write_text(json.dumps({k: ({r: {b: v[:1] for b, v in by.items()} for r, by in stored[k].items()}
                                   if k in ("kl", "error") else {b: v[:1] for b, v in stored[k].items()})
                               for k in ("kl", "error", "swaps", "seconds")}))  # as if stopped after one sample
    calls, real = [], ceiling.sample_values
    monkeypatch.setattr(ceiling, "sample_values", lambda *a: calls.append(1) or real(*a))
    ceiling.main(SMALL + ["--output", str(out)])
    again = json.loads(out.read_text())
    assert len(calls) == 1 and again["kl"] == stored["kl"] and again["error"] == stored["error"]

    monkeypatch.setattr(ceiling, "load_from_args", lambda args: pytest.fail("loaded a model before checking flags"))
    for flags, message in [(["--max_capacity_prompts", "4"], "exceed window_size"),
                           (["--future_restkv", "gqa_agg=none"], "future_restkv"),
                           (["--future_restkv", "tau=-1"], "future_restkv: tau"),
                           (["--pool", "0"], "pool"), (["--continuation", "1"], "continuation"),
                           (["--variant", "future_attention", "gqa_agg=rank"], "hindsight rows")]:
        with pytest.raises(ValueError, match=message):
            ceiling.main(SMALL + flags)
