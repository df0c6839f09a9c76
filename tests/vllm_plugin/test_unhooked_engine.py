"""Inside vLLM: an attention backend whose ``forward`` the plugin did not wrap is refused when the
engine starts, and one unwrapped while the engine runs stops the step that would free its blocks.

Each engine runs in a subprocess (``python THIS_FILE MODE``): the plugin's table is edited before
vLLM loads its plugins (``unhooked``), or the CPU backend's ``forward`` is unwrapped after the engine
has started (``unwrapped``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
KNOBS = {"method": "snapkv", "max_capacity_prompt": 64, "window_size": 16}


def _engine(mode: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from restkv.integration.models import cache_dir
    from restkv.vllm import hooks

    if mode == "unhooked":
        del hooks.TARGETS[CPU_ATTN]
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(cache_dir("smollm2-135m")), dtype="float32", max_model_len=512, block_size=32,
        kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0, additional_config={"restkv": KNOBS},
    )  # fmt: skip
    if mode == "unwrapped":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as impl

        impl.forward = impl.forward.__wrapped__
    out = llm.generate([{"prompt_token_ids": list(range(1000, 1200))}], SamplingParams(max_tokens=4, temperature=0))
    print("RESULT " + json.dumps(list(out[0].outputs[0].token_ids)))


def _run(mode: str) -> subprocess.CompletedProcess:
    pytest.importorskip("vllm")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RESTKV_VLLM": ""}
    return subprocess.run(
        [sys.executable, __file__, mode], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT
    )


def _error_lines(done: subprocess.CompletedProcess, start: str) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.lstrip("[rank0]: ").startswith(start)]


@pytest.mark.vllm
def test_an_unhooked_backend_is_refused_when_the_engine_starts():
    done = _run("unhooked")
    assert done.returncode != 0 and "RESULT" not in done.stdout
    refused = _error_lines(done, "RuntimeError: restkv.vllm: layer ")
    assert refused, done.stderr[-3000:]
    assert "attention backend CPUAttentionBackendImpl is not one the plugin hooks" in refused[-1]
    assert "--attention-backend" in refused[-1]


@pytest.mark.vllm
def test_a_backend_unwrapped_at_run_time_stops_the_step():
    done = _run("unwrapped")
    assert done.returncode != 0 and "RESULT" not in done.stdout
    stopped = _error_lines(done, "RuntimeError: restkv.vllm: layer ")
    assert stopped, done.stderr[-3000:]
    assert "(CPU_ATTN) ran its attention without the plugin in this step" in stopped[-1]


if __name__ == "__main__":
    _engine(sys.argv[1])
