import re

import pytest

import restkv
from restkv.config import CompressionConfig


@pytest.mark.parametrize(
    "knobs,field",
    [
        ({"method": "nope"}, "method"),
        ({"pooling": "median"}, "pooling"),
        ({"metric_mode": "during"}, "metric_mode"),
        ({"merge": "average"}, "merge"),
        ({"gqa_agg": "sum"}, "gqa_agg"),
        ({"window_size": 512, "max_capacity_prompt": 512}, "window_size"),
        ({"window_size": 0}, "window_size"),
        ({"use_ema": True, "alpha": 0.0}, "alpha"),
        ({"use_ema": True, "alpha": 1.5}, "alpha"),
        ({"kernel_size": 0}, "kernel_size"),
        ({"kernel_size": 4}, "kernel_size"),
        ({"tau": 0}, "tau"),
        ({"scale": -1}, "scale"),
        ({"use_pyramid": True, "beta": 0.5}, "beta"),
        ({"method": "streamingllm", "sink_tokens": -1}, "sink_tokens"),
        ({"method": "streamingllm", "sink_tokens": 500}, "sink_tokens"),
        ({"max_capacity_prompt": 0}, "max_capacity_prompt must be >= 1"),
        ({"head_budget": "adakv", "floor": 1.5}, "floor"),
        ({"head_budget": "adakv", "merge": "pivot"}, "merge"),
        ({"use_wo": "yes"}, "use_wo"),
        ({"max_capacity_prompt": 12.5}, "max_capacity_prompt"),
        ({"budget": 3}, "budget"),
    ],
)
def test_bad_knob_raises_naming_the_field(knobs, field):
    with pytest.raises(ValueError, match=field) as err:
        CompressionConfig.from_kwargs(**knobs)
    assert "is not a knob of" not in str(err.value) and "only when" not in str(err.value)


@pytest.mark.parametrize(
    "knobs,message",
    [
        ({"method": "snapkv", "alpha": 0.1}, "alpha is not a knob of method snapkv"),
        ({"method": "h2o", "pooling": "avgpool"}, "pooling is not a knob of method h2o"),
        ({"method": "l2norm", "gqa_agg": "max"}, "gqa_agg is not a knob of method l2norm"),
        ({"method": "fullkv", "merge": "pivot"}, "merge is not a knob of method fullkv"),
        ({"method": "restkv", "alpha": 0.1}, "alpha is read by method restkv only when temporal is ema or inv-ema"),
        ({"method": "restkv", "use_norm": True}, "use_norm is read by method restkv only when metric_mode is before"),
        ({"method": "restkv", "pooling": "avgpool", "scale": 50.0}, "scale is read .* only when pooling is adaptive"),
        ({"method": "snapkv", "pooling": "none", "kernel_size": 5}, "kernel_size is read .* only when pooling is"),
        ({"method": "snapkv", "floor": 0.5}, "floor is read .* only when head_budget is adakv"),
        ({"method": "snapkv", "pooling": "adaptive"}, "pooling must be one of avgpool, maxpool, none"),
    ],
)
def test_a_knob_the_config_does_not_read_raises(knobs, message):
    with pytest.raises(ValueError, match=message):
        CompressionConfig(**knobs)


def test_config_holds_exactly_the_knobs_it_reads():
    assert set(CompressionConfig(method="fullkv")) == {"method", "max_capacity_prompt", "max_capacity_prompt_ratio",
                                                       "window_size", "quant_method", "pruning_ratio"}
    snap = CompressionConfig(method="snapkv", pooling="none")
    assert "kernel_size" not in snap and "alpha" not in snap and snap.gqa_agg == "mean"
    with pytest.raises(AttributeError, match="alpha is not read by this config"):
        snap.alpha
    rk = CompressionConfig(method="restkv", use_ema=True)
    assert rk.alpha == 0.3 and "use_norm" not in rk
    assert CompressionConfig(method="snapkv", max_capacity_prompt=64) == CompressionConfig(
        method="snapkv", max_capacity_prompt=64, pooling="avgpool")  # a default given explicitly is the same config
    assert set(rk.score_knobs()) == {"indicator", "pooling", "kernel_size", "scale", "metric_mode", "use_wo",
                                     "temporal", "alpha", "tau", "query_window",
                                     "query_proxy"}  # gqa_agg is read after scoring


def test_a_preset_drops_what_the_method_does_not_read():
    cfg = CompressionConfig(preset="paper", use_ema=False, pooling="avgpool")
    assert "alpha" not in cfg and "scale" not in cfg and cfg.kernel_size == 5


def test_bad_knob_raises_before_any_forward():
    from helpers import tiny_model

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="alpha"):
        restkv.configure(model, method="restkv", alpha=2.0)
    assert not any(hasattr(m, "_restkv") for m in model.modules())


def test_method_defaults():
    assert CompressionConfig(method="restkv").pooling == "adaptive"
    assert CompressionConfig(method="snapkv").pooling == "avgpool"
    assert "pooling" not in CompressionConfig(method="h2o")  # H2O does not pool
    assert CompressionConfig(method="pyramidkv").pyramid
    assert not CompressionConfig(method="fullkv").evicts


def test_paper_preset_reproduces_the_published_knobs():
    """The values of the authors' README and of every script of the released code (an-yongqi/rest-kv)."""
    cfg = CompressionConfig.from_kwargs(preset="paper", max_capacity_prompt=128)
    published = dict(method="restkv", indicator="reconstruction", window_size=32, kernel_size=5, pooling="adaptive",
                     scale=2000.0, temporal="ema", alpha=0.3, metric_mode="after", use_wo=True, tau=1.0)
    assert {k: cfg[k] for k in published} == published
    assert cfg.gqa_agg == "mean"  # one kept set per KV head; gqa_agg="none" keeps one per query head as the original
    assert CompressionConfig.from_kwargs(preset="paper", alpha=0.5).alpha == 0.5  # knobs override the preset
    assert CompressionConfig(preset="paper", use_ema=False).temporal == "mean"  # the original's flag is an alias
    with pytest.raises(ValueError, match="preset"):
        CompressionConfig.from_kwargs(preset="fastest")


def test_aliases_of_the_original_flags():
    assert CompressionConfig(ts="none").temporal == "last" and CompressionConfig(ts="inv-ema").temporal == "inv-ema"
    assert CompressionConfig(ss="maxpool").pooling == "maxpool"
    with pytest.raises(ValueError, match="use_ema and temporal are one knob"):
        CompressionConfig(use_ema=True, temporal="mean")
    with pytest.raises(ValueError, match=r"use_ema \(temporal\) is not a knob of method snapkv"):
        CompressionConfig(method="snapkv", use_ema=True)


@pytest.mark.parametrize("knobs,read", [
    (dict(metric_mode="after", use_wo=True), True),
    (dict(metric_mode="after", use_wo=False), False),  # the original applies tau only after W_O, in after mode
    (dict(metric_mode="before"), False),
    (dict(indicator="attn"), False),
])
def test_tau_is_read_only_where_the_original_applies_it(knobs, read):
    assert ("tau" in CompressionConfig(**knobs)) == read
    if not read:
        with pytest.raises(ValueError, match="tau is read by method restkv only when"):
            CompressionConfig(tau=2.0, **knobs)


def test_the_knob_pages_rows_are_short_and_name_exactly_their_readers():
    """Each row's "read by" (``all``, ``all but ...`` or names) read back is every method declaring that knob with
    that default; no row is over 500 characters (the knobs' descriptions make up most of it)."""
    from helpers import ROOT
    from restkv.config.declarations import declared

    rows = [line for line in (ROOT / "docs" / "knobs.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("| `")]
    assert rows and max(map(len, rows)) <= 500
    found = {}
    for row in rows:
        name, default, _, who = [cell.strip() for cell in re.split(r"(?<!\\)\|", row, maxsplit=5)[1:5]]
        who = who.split(" (when ")[0]
        if who == "all":
            methods = set(restkv.METHODS)
        elif who.startswith("all but "):
            methods = set(restkv.METHODS) - set(who[len("all but "):].split(", "))
        else:
            methods = set(who.split(", "))
        found.setdefault((name.strip("`"), default.strip("`")), set()).update(methods)
    for (name, default), methods in found.items():
        assert methods == {m for m in restkv.METHODS if name in declared(m) and str(declared(m)[name].default)
                           == default}, (name, default)


def test_the_knob_page_is_the_knob_table():
    """docs/knobs.md is ``restkv.knob_table()`` after its header: regenerate it when a declaration changes."""
    from helpers import ROOT

    page = (ROOT / "docs" / "knobs.md").read_text(encoding="utf-8")
    assert page.rstrip("\n").endswith(restkv.knob_table().rstrip("\n"))
    assert page.count("| knob |") == 1


BOUNDS = [  # a rule in words, and the same bound as Python comparisons
    (">= 0", lambda x: x >= 0),
    ("> 1", lambda x: x > 1),
    (">= 16", lambda x: x >= 16),
    ("<= 8", lambda x: x <= 8),
    ("in [0, 1]", lambda x: 0 <= x <= 1),
    ("in (0, 1]", lambda x: 0 < x <= 1),
    ("in [0, 1)", lambda x: 0 <= x < 1),
    ("in (0, 1)", lambda x: 0 < x < 1),
    ("in [-1, 1]", lambda x: -1 <= x <= 1),
    ("in [0.5, 2.5)", lambda x: 0.5 <= x < 2.5),
    (">= 1 (or 0: off)", lambda x: x == 0 or x >= 1),
    ("in (0.5, 1] (or 0: off)", lambda x: x == 0 or 0.5 < x <= 1),
]


@pytest.mark.parametrize("rule,inside", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_a_bound_rule_is_the_knobs_check(rule, inside):
    from restkv.knobs import Knob

    knob = Knob("share", 0.5, "a share", rule=rule)
    for x in (-2.0, -1.0, -0.5, 0.0, 1e-9, 0.5, 0.999, 1.0, 1.5, 2.5, 8.0, 15.0, 16.0, 17.0):
        if inside(x):
            assert knob.validate(x) == x
        else:
            with pytest.raises(ValueError, match=re.escape(f"share must be {rule}, got {x!r}")):
                knob.validate(x)


def test_a_rule_that_is_no_bound_needs_its_check():
    from restkv.knobs import Knob

    with pytest.raises(ValueError, match="^odd: rule 'an odd integer' is not a bound"):
        Knob("odd", 1, "an odd number", rule="an odd integer")
    with pytest.raises(ValueError, match=re.escape("block: rule '>= window_size (or 0: off)' is not a")):
        Knob("block", 0, "a block size", rule=">= window_size (or 0: off)")
    odd = Knob("odd", 1, "an odd number", check=lambda n: n % 2 == 1, rule="an odd integer")
    with pytest.raises(ValueError, match="odd must be an odd integer, got 2"):
        odd.validate(2)
