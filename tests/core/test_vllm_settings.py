"""The vLLM plugin's configuration and eviction rule (no vLLM needed; the plugin itself:
tests/vllm_plugin)."""

import json

import pytest

from restkv.vllm import check_version, settings

SNAPKV = {"method": "snapkv", "max_capacity_prompt": 128, "window_size": 32}


def test_config_from_the_environment(monkeypatch):
    monkeypatch.setenv(settings.ENV, json.dumps(SNAPKV))
    cfg = settings.from_env()
    assert (cfg.method, cfg.max_capacity_prompt, cfg.window_size) == ("snapkv", 128, 32)
    assert (
        settings.from_env({"restkv": {**SNAPKV, "max_capacity_prompt": 64}}).max_capacity_prompt
        == 64
    )
    monkeypatch.setenv(settings.ENV, "")
    assert settings.from_env() is None


@pytest.mark.parametrize(
    "knobs, words",
    [
        ({"method": "layer_defensivekv", "decode_interval": 8}, "needs a budget per layer"),
        ({"method": "headkv"}, "head_budget='headkv' needs head_importance=FILE"),
        ({**SNAPKV, "head_budget": "lukv", "lukv_curve": "x.npy"}, "head_budget='lukv' cannot run"),
        ({"method": "adakv", "decode_interval": 32, "decode_compression_ratio": 0.5}, "keeps its budget while decoding"),
        ({"method": "kvzip"}, "forward passes"),
        ({"method": "fullkv"}, "keeps every entry"),
        ({**SNAPKV, "gqa_agg": "none"}, "gqa_agg"),
        ({"method": "expected_attention"}, "RoPE"),
        ({"method": "kvzap"}, "hidden states"),
        ({"method": "leverage"}, "before RoPE"),
        ({"method": "triattention"}, "before RoPE"),
        ({"method": "qfilter"}, "Q-Filters"),
        ({**SNAPKV, "rerotate_keys": "end"}, "rerotate_keys"),
        ({"method": "snapkv", "bogus": 1}, "bogus"),
    ],
)
def test_refused_configs(knobs, words):
    with pytest.raises(ValueError, match=words):
        settings.from_env({"restkv": knobs})


def test_bad_json_is_one_line(monkeypatch):
    monkeypatch.setenv(settings.ENV, "{method: snapkv}")
    with pytest.raises(ValueError, match="RESTKV_VLLM must be a JSON object"):
        settings.from_env()


def test_another_vllm_version_is_refused():
    check_version("0.32.0")
    check_version("0.32.0+cpu")
    check_version("0.33.0")
    with pytest.raises(RuntimeError, match="0.32.0, 0.33.0"):
        check_version("0.31.1")


def test_additional_config_is_named_in_its_errors():
    with pytest.raises(ValueError, match=r"additional_config\['restkv'\] must be a JSON object"):
        settings.from_env({"restkv": "snapkv"})


@pytest.mark.parametrize(
    "knobs, mixes",
    [
        ({"method": "adakv"}, True),
        ({"method": "defensivekv"}, True),
        ({**SNAPKV, "head_budget": "threshold", "threshold": 0.01}, False),
        ({"method": "pyramidkv"}, False),
    ],
)
def test_per_head_and_per_layer_budgets_run(knobs, mixes):
    """They run; AdaKV's split (a layer's budget shared by its heads' scores) is refused under
    tensor parallelism, a threshold's and PyramidKV's counts are each head's own."""
    cfg = settings.from_env({"restkv": knobs})
    assert settings.per_head(cfg)
    assert ("among all its KV heads" in (settings.mixes_heads(cfg) or "")) == mixes


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("held", [129, 150, 159, 160, 161, 300])
def test_a_per_head_eviction_is_counted_at_the_budget_plus_a_block(held, caching):
    """AdaKV at budget 128, blocks of 32: the request counts 160 entries (5 blocks, whatever its
    heads' split) once evicted, its offset (logical - counted) negative where it held fewer; during
    the step it has room for what it held and for the kept blocks."""
    cfg = settings.from_env({"restkv": {"method": "adakv", "max_capacity_prompt": 128}})
    e = settings.eviction(cfg, 0, held, held, 0, caching, 32)
    assert (e.budget, e.counted, e.kept_blocks, e.evicted) == (128, 160, 5, held - 160)
    held_blocks = -(-held // 32)
    slots = (held_blocks + 5) * 32 if caching else max(held_blocks, 5) * 32
    assert e.slots == slots
    uniform = settings.eviction(settings.from_env({"restkv": SNAPKV}), 0, held, held, 0, caching, 32)
    assert (uniform.counted, uniform.kept_blocks, uniform.evicted) == (128, 4, held - 128)
    assert settings.extra_blocks(cfg, 4096, 32) == 5 and settings.extra_blocks(uniform_cfg(), 4096, 32) == 4


def uniform_cfg():
    return settings.from_env({"restkv": SNAPKV})


def test_headkv_is_counted_from_its_table(tmp_path):
    """HeadKV's table, bound to the model: the request is counted at the window plus the table's
    average count over every layer and head, plus a block (its pages are one pool); a table that does
    not fit the model is one line naming it."""
    import numpy as np

    path = tmp_path / "importance.json"
    path.write_text(json.dumps(np.random.default_rng(0).gamma(0.5, size=(4, 6)).tolist()))
    cfg = settings.from_env({"restkv": {"method": "headkv", "max_capacity_prompt": 64, "head_importance": str(path)}})
    with pytest.raises(RuntimeError, match="bind_model"):
        settings.room(cfg, 64, 16, 300)
    settings.bind_model(cfg, 4, 6, 2)
    table = settings.head_table(cfg)
    assert table.shape == (4, 2) and int(table.sum()) == 4 * 2 * (64 - 32)
    most = 32 + -(-int(table.sum(-1).max()) // 2)
    mean = 32 + -(-int(table.sum()) // table.numel())
    assert settings.room(cfg, 64, 16, 300) == mean + 16 == 64 + 16 < most + 16
    e = settings.eviction(cfg, 0, 300, 300, 0, False, 16)
    assert e.counted == mean + 16 and e.kept_blocks == -(-(mean + 16) // 16)
    other = settings.from_env({"restkv": {"method": "headkv", "max_capacity_prompt": 64, "head_importance": str(path), "window_size": 8}})
    with pytest.raises(ValueError, match="importance.json"):
        settings.bind_model(other, 5, 6, 2)


@pytest.mark.parametrize("prompt_len", [300, 140])
def test_pyramidkv_is_counted_at_its_mean_over_the_layers(prompt_len):
    """PyramidKV's layers keep from about 2 B down to B / beta; the request is counted at the mean of
    its schedule over the model's layers (B, or more where a short prompt clips the last layers),
    plus a block, not at its first layer's budget: every layer's pages are one pool."""
    from restkv.strategies.budgets import layer_budgets

    unbound = settings.from_env({"restkv": {"method": "pyramidkv", "max_capacity_prompt": 63, "window_size": 7}})
    with pytest.raises(RuntimeError, match="bind_model"):
        settings.room(unbound, 63, 16, prompt_len)
    cfg = settings.from_env({"restkv": {"method": "pyramidkv", "max_capacity_prompt": 64, "window_size": 8}})
    settings.bind_model(cfg, 12, 6, 2)
    budgets = layer_budgets(cfg, 12, prompt_len, 64)
    assert max(budgets) > 100 and -(-sum(budgets) // 12) >= 64
    assert settings.room(cfg, 64, 16, prompt_len) == -(-sum(budgets) // 12) + 16
    assert settings.eviction(cfg, 0, prompt_len, prompt_len, 0, False, 16).counted == -(-sum(budgets) // 12) + 16


@pytest.mark.parametrize("caching", [False, True])
def test_a_global_budget_is_counted_at_its_bound_until_the_worker_measures_it(caching):
    """layer_budget='global': the scores decide each layer's count, so the step that evicts is given
    the bound (every layer keeping all it holds, and a block: ``held + block_size``), over its own
    blocks, prefix caching or not (a request over the budget takes and gives no hits); the worker's
    measured count then sets what the request keeps, within 1 .. that bound; it shares the budget
    among every head, so tensor parallelism is refused."""
    cfg = settings.from_env({"restkv": {"method": "layer_defensivekv", "value_norm": "l2", "max_capacity_prompt": 64}})
    assert settings.per_head(cfg) and settings.deferred(cfg) and "every layer" in settings.mixes_heads(cfg)
    e = settings.eviction(cfg, 0, 300, 300, 0, caching, 16)
    assert e.measured and e.counted == 316 and not e.fresh
    assert e.slots == 20 * 16  # the bound's blocks, one more than the held ones
    assert settings.uncached(cfg, 300) and settings.hit_limit(cfg, 300) == 0
    assert not settings.uncached(cfg, 64) and settings.hit_limit(cfg, 64) == 32
    kept = e.kept(100)
    assert not kept.measured and kept.counted == 100 and kept.evicted == 200 and kept.kept_blocks == 7
    for bad in (0, 317):
        with pytest.raises(RuntimeError, match="kept count"):
            e.kept(bad)
    assert not settings.eviction(uniform_cfg(), 0, 300, 300, 0, caching, 16).measured
