"""The vLLM plugin's configuration and eviction rule (no vLLM needed; the plugin itself:
tests/vllm_plugin)."""

import json

import pytest
import torch

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
    "knobs, across, mixes",
    [
        ({"method": "adakv"}, True, None),
        ({"method": "defensivekv"}, True, None),
        ({"method": "defensivekv", "decode_interval": 32}, True, None),
        ({"method": "tova"}, False, None),
        ({**SNAPKV, "layer_budget": "global"}, True, None),
        ({**SNAPKV, "head_budget": "threshold", "threshold": 0.01}, False, None),
        ({"method": "pyramidkv"}, False, None),
        ({**SNAPKV, "head_budget": "lukv", "lukv_curve": "x.npy"}, True, None),
        ({**SNAPKV, "layer_ratios": "0.5,0.2,0.7"}, False, None),
    ],
)
def test_per_head_and_per_layer_budgets_run(knobs, across, mixes):
    """They run. Under tensor parallelism, AdaKV's split (a layer's budget shared by its heads' scores),
    LU-KV's rounding over a layer's heads and a budget shared across layers gather every rank's scores
    (``sized_across_heads``), as DefensiveKV and TOVA gather every head's terms of their scores
    (``Observation.every_head``), also where a request's heads re-evict from their own pages (every rank
    lays them out at the widest head's width over the ranks); a threshold's, PyramidKV's and
    ``layer_ratios``' counts are each head's own."""
    cfg = settings.from_env({"restkv": knobs})
    assert settings.per_head(cfg) or knobs["method"] == "tova"
    assert settings.sized_across_heads(cfg) == across
    why = settings.mixes_heads(cfg)
    assert why is None if mixes is None else mixes in why


@pytest.mark.parametrize("ranks", [1, 3])
def test_under_tensor_parallelism_a_split_across_heads_is_counted_at_the_ranks_mean(ranks):
    """AdaKV at budget 128, blocks of 32, over ``ranks`` ranks: one rank's heads may take every head's share,
    so until the worker's count the request is counted at ``ranks`` times the mean (at most all it holds);
    PyramidKV's heads keep their layer's budget on every rank."""
    cfg = settings.from_env({"restkv": {"method": "adakv", "max_capacity_prompt": 128}})
    pyramid = settings.from_env({"restkv": {"method": "pyramidkv", "max_capacity_prompt": 128}})
    try:
        settings.bind_model(cfg, 30, 9, 3, ranks)
        e = settings.eviction(cfg, 0, 1000, 1000, 0, False, 32)
        assert e.counted == ranks * 128 + 32
        assert settings.eviction(cfg, 0, 200, 200, 0, False, 32).counted == (160 if ranks == 1 else 232)
        # a first eviction's fresh blocks (prefix caching) fit the block-table row's extra blocks
        fresh = settings.eviction(cfg, 0, 2000, 2000, 0, True, 32)
        assert fresh.kept_blocks == settings.extra_blocks(cfg, 2048, 32) == -(-(ranks * 128 + 32) // 32)
        settings.bind_model(pyramid, 30, 9, 3, ranks)
        assert settings.eviction(pyramid, 0, 1000, 1000, 0, False, 32).counted == 128 + 32
    finally:  # the configs are keys of the module's tables: the other tests' are one rank's
        settings.bind_model(cfg, 30, 9, 3)
        settings.bind_model(pyramid, 30, 9, 3)


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
    its schedule over the model's layers (B; every layer's for a prompt within the budget),
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
    among every head (``sized_across_heads``: gathered over the ranks under tensor parallelism)."""
    cfg = settings.from_env({"restkv": {"method": "layer_defensivekv", "value_norm": "l2", "max_capacity_prompt": 64}})
    assert settings.per_head(cfg) and settings.deferred(cfg) and settings.sized_across_heads(cfg)
    assert settings.mixes_heads(cfg) is None
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


def test_lukv_is_counted_from_its_curve_and_bounded_over_every_prompt(tmp_path):
    """LU-KV: the curve is read with the model (its shape checked in one line); a request is counted at the
    mean of what its layers' heads keep at its prompt's length, plus a block; the largest layer's mean over
    every prompt up to a length (each curve row's last length) equals a search over every length."""
    from helpers import lukv_curve

    from restkv.strategies.head_budgets import lukv_sizes

    path = lukv_curve(tmp_path / "curve.npy", layers=4, hkv=2, spread=0.3)
    cfg = settings.from_env({"restkv": {**SNAPKV, "head_budget": "lukv", "lukv_curve": path, "decode_interval": 10}})
    with pytest.raises(ValueError, match=r"lukv_curve: .* has shape \(99, 4, 2\)"):
        settings.bind_model(cfg, 5, 6, 2)
    settings.bind_model(cfg, 4, 6, 2)
    curve = settings.head_table(cfg)

    def kept(layer, length):  # [Hkv] entries each head keeps, window included
        return lukv_sizes(curve[:, layer], torch.tensor([length]), 128, 32)[0] + 32

    for prompt_len in (129, 300, 1000):
        total = sum(int(kept(layer, prompt_len).sum()) for layer in range(4))
        assert settings.room(cfg, 128, 16, prompt_len) == -(-total // 8) + 16
        e = settings.eviction(cfg, 0, prompt_len, prompt_len, 0, False, 16)
        assert e.measured and e.counted == min(-(-total // 8) + 16, prompt_len + 16)
    decoding = settings.eviction(cfg, 300, 10, 300, 100, False, 16, True)  # its widest head unknown
    assert decoding.counted == 210 + 16
    for held in (100, 128, 129, 700, 2000):
        searched = max(
            [min(held, 128)]
            + [-(-int(kept(layer, n).sum()) // 2) for layer in range(4) for n in range(129, held + 1)]
        )
        assert settings.largest(cfg, 128, held) == searched, held


def test_layer_ratios_are_each_layers_budget(tmp_path):
    """``layer_ratios``: a prompt evicts when longer than its smallest layer's budget (configure()'s rule,
    not ``max_capacity_prompt``'s); the request is counted at its layers' mean, plus a block; a count of
    ratios other than the model's layers is one line."""
    cfg = settings.from_env({"restkv": {**SNAPKV, "layer_ratios": "0.5,0.2,0.7"}})
    with pytest.raises(ValueError, match="layer_ratios must give one value per evicted layer"):
        settings.bind_model(cfg, 4, 6, 2)
    settings.bind_model(cfg, 3, 6, 2)
    assert settings.eviction(cfg, 0, 100, 100, 0, False, 16).counted == -(-(50 + 80 + 33) // 3) + 16  # 33: w + 1
    ints = settings.from_env({"restkv": {**SNAPKV, "layer_ratios": "40,200,60"}})
    settings.bind_model(ints, 3, 6, 2)
    assert settings.eviction(ints, 0, 50, 50, 0, False, 16) is not None  # 50 > 40, under 128
    assert settings.eviction(ints, 0, 40, 40, 0, False, 16) is None
    assert settings.largest(ints, 128, 4096) == 200 and settings.largest(cfg, 128, 1000) == 800


def test_checks_evict_as_configure_decides():
    """A threshold selects at every check, whatever the request holds; a request whose heads hold their own
    pages evicts at every check (its widest head is not known to the scheduler); one that never evicted,
    when it holds more than its smallest layer's budget (PyramidKV's: B in every layer for a prompt within B)."""
    threshold = settings.from_env({"restkv": {**SNAPKV, "head_budget": "threshold", "threshold": 0.2}})
    assert settings.eviction(threshold, 0, 40, 40, 0, False, 16) is not None
    adakv = settings.from_env({"restkv": {"method": "adakv", "max_capacity_prompt": 128, "decode_interval": 8}})
    assert settings.eviction(adakv, 107, 1, 100, 0, False, 16, False) is None
    assert settings.eviction(adakv, 107, 1, 100, -60, False, 16, True) is not None
    pyramid = settings.from_env({"restkv": {"method": "pyramidkv", "max_capacity_prompt": 128, "decode_interval": 8}})
    settings.bind_model(pyramid, 4, 6, 2)
    assert settings.eviction(pyramid, 0, 100, 100, 0, False, 16) is None  # the prompt fits B
    assert settings.eviction(pyramid, 107, 1, 100, 0, False, 16, False) is None  # 108 held, every layer's B 128
    assert settings.eviction(pyramid, 131, 1, 100, 0, False, 16, False) is not None  # 132 held
    assert settings.eviction(uniform_cfg(), 107, 1, 100, 0, False, 16, False) is None
