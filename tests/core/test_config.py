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
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": 1.5}, "alpha"),
        ({"kernel_size": 0}, "kernel_size"),
        ({"kernel_size": 4}, "kernel_size"),
        ({"tau": 0}, "tau"),
        ({"scale": -1}, "scale"),
        ({"beta": 0.5}, "beta"),
        ({"sink_tokens": -1}, "sink_tokens"),
        ({"use_wo": "yes"}, "use_wo"),
        ({"max_capacity_prompt": 12.5}, "max_capacity_prompt"),
        ({"budget": 3}, "budget"),
    ],
)
def test_bad_knob_raises_naming_the_field(knobs, field):
    with pytest.raises(ValueError, match=field):
        CompressionConfig.from_kwargs(**knobs)


def test_bad_knob_raises_before_any_forward():
    from helpers import tiny_model

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="alpha"):
        restkv.configure(model, method="restkv", alpha=2.0)
    assert not any(hasattr(m, "_restkv") for m in model.modules())


def test_method_defaults():
    assert CompressionConfig(method="restkv").pooling == "adaptive"
    assert CompressionConfig(method="snapkv").pooling == "avgpool"
    assert CompressionConfig(method="h2o").pooling == "none"
    assert CompressionConfig(method="pyramidkv").pyramid
    assert not CompressionConfig(method="fullkv").evicts


def test_paper_preset_reproduces_the_published_knobs():
    cfg = CompressionConfig.from_kwargs(preset="paper", max_capacity_prompt=128)
    published = dict(method="restkv", window_size=32, kernel_size=7, pooling="adaptive", use_wo=True,
                     use_ema=True, alpha=0.3, metric_mode="after", tau=1.0, scale=2000.0, gqa_agg="mean")
    assert {k: getattr(cfg, k) for k in published} == published
    assert CompressionConfig.from_kwargs(preset="paper", alpha=0.5).alpha == 0.5  # knobs override the preset
    with pytest.raises(ValueError, match="preset"):
        CompressionConfig.from_kwargs(preset="fastest")
