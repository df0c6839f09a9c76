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
        ({"method": "pyramidkv"}, "layer_budget"),
        ({"method": "adakv"}, "head_budget"),
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
