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
    lines = (line.removeprefix("[rank0]: ") for line in done.stderr.splitlines())
    return [line for line in lines if line.startswith(start)]


@pytest.mark.vllm
@pytest.mark.parametrize(
    "mode, says",
    [
        ("unhooked", "attention backend CPUAttentionBackendImpl is not one the plugin hooks"),
        ("unwrapped", "(CPU_ATTN) ran its attention without the plugin in this step"),
    ],
    ids=["refused-when-the-engine-starts", "the-step-stops-at-run-time"],
)
def test_an_attention_backend_without_the_plugins_hook(mode, says):
    """``unhooked``: refused at start-up, the line naming the flag; ``unwrapped``: the first step
    raises, naming the layer and its backend."""
    done = _run(mode)
    assert done.returncode != 0 and "RESULT" not in done.stdout
    lines = _error_lines(done, "RuntimeError: restkv.vllm: layer ")
    assert lines, done.stderr[-3000:]
    assert says in lines[-1]
    assert mode == "unwrapped" or "--attention-backend" in lines[-1]


if __name__ == "__main__":
    _engine(sys.argv[1])
