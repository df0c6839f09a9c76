"""The plugin's start-up line (``restkv.vllm.startup``) without vLLM: its text, the runner read
off the model runner's class, one line through vLLM's logger."""

from __future__ import annotations

import logging

from restkv.config import CompressionConfig
from restkv.vllm import startup


def _cfg(**knobs) -> CompressionConfig:
    return CompressionConfig.from_kwargs(**knobs)


def test_the_line_names_method_knobs_backend_and_runner():
    cfg = _cfg(method="snapkv", max_capacity_prompt=64, window_size=8)
    assert startup.line(cfg, ["CPU_ATTN"] * 30, "V1") == (
        "restkv: snapkv max_capacity_prompt=64 window_size=8 decode_interval=0; "
        "backend CPU_ATTN; runner V1"
    )
    two = startup.line(cfg, ["TRITON_ATTN", "FLASH_ATTN", "FLASH_ATTN"], "V2")
    assert two.endswith("; backends FLASH_ATTN, TRITON_ATTN; runner V2")


def test_knobs_other_than_the_methods_defaults_follow():
    assert startup.knobs(_cfg(method="h2o", decode_interval=32, decode_compression_ratio=0.5)) == (
        "h2o max_capacity_prompt=512 window_size=32 decode_interval=32 decode_compression_ratio=0.5"
    )
    paper = startup.knobs(_cfg(preset="paper", max_capacity_prompt=128))
    assert paper.startswith("restkv max_capacity_prompt=128 window_size=32 decode_interval=0")


def test_off():
    assert (
        startup.line(None)
        == startup.OFF
        == "restkv: off (RESTKV_VLLM and additional_config['restkv'] unset)"
    )


def test_the_runner_is_read_off_the_class():
    v2 = type("GPUModelRunner", (), {"__module__": startup.V2})
    v1 = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu_model_runner"})
    assert startup.runner(type("Sub", (v2,), {})) == "V2"
    assert startup.runner(type("CPUModelRunner", (v1,), {})) == "V1"


def test_one_line_under_vllms_logger(caplog):
    with caplog.at_level(logging.INFO, logger="vllm.restkv"):
        startup.log(
            _cfg(method="snapkv", max_capacity_prompt=64, window_size=8), ["CPU_ATTN"], object
        )
        startup.log(None)
    assert [r.name for r in caplog.records] == ["vllm.restkv", "vllm.restkv"]
    assert caplog.messages[1] == startup.OFF and caplog.messages[0].endswith("runner V1")
