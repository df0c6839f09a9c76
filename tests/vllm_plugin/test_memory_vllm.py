"""Inside vLLM: with vLLM sizing the KV pool from memory, the plugin's peak (``restkv.vllm.memory``)
comes off what the worker found, and the pool holds that many fewer blocks than plain vLLM's; an
operator's ``kv_cache_memory_bytes`` is kept whole, the plugin's bytes beyond it logged.

Each engine runs in a subprocess (``python THIS_FILE MODE``, the packaged SmolLM2 in float32 on
vLLM's CPU backend, ``gpu_memory_utilization`` of the machine's memory); a recorder under the
plugin's wrapper of ``CPUWorker.determine_available_memory`` reports the bytes vLLM found.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from vllm_check import script_result  # noqa: E402
KNOBS = {"method": "h2o", "max_capacity_prompt": 128, "window_size": 32}
ENGINE = dict(
    max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=2048, block_size=32, gpu_memory_utilization=0.15
)
EXPLICIT = 256 << 20  # an operator's kv_cache_memory_bytes


def _engine(mode: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.v1.worker.cpu_worker import CPUWorker

    from restkv.integration.models import cache_dir

    found = []
    orig = CPUWorker.determine_available_memory

    @functools.wraps(orig)
    def recorded(self, *args, **kwargs):  # under the plugin's wrapper, which installs over it
        found.append(orig(self, *args, **kwargs))
        return found[-1]

    CPUWorker.determine_available_memory = recorded
    from vllm import LLM, SamplingParams

    extra = {"additional_config": {"restkv": KNOBS}} if mode != "plain" else {}
    if mode == "explicit":
        extra["kv_cache_memory_bytes"] = EXPLICIT
    llm = LLM(
        model=str(cache_dir("smollm2-135m")), dtype="float32", enforce_eager=True, seed=0, **ENGINE, **extra
    )
    out = llm.generate([{"prompt_token_ids": list(range(1000, 1300))}], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    config = llm.llm_engine.vllm_config
    print("RESULT " + json.dumps({"found": found[0], "blocks": config.cache_config.num_gpu_blocks}))


def _run(mode: str) -> dict:
    result = script_result([__file__, mode], None, log="restkv: ")
    result["log"] = [x for x in result["log"] if x.startswith(("restkv: reserved", "restkv: the plugin takes"))]
    return result


@pytest.mark.vllm
def test_the_pool_is_smaller_by_the_plugins_peak():
    """The pool with the plugin holds ``(found - reserved) // block bytes`` blocks, ``reserved`` as
    ``restkv.vllm.memory`` computes it from the model's config.json; plain vLLM's holds
    ``found // block bytes`` of what it found (its resident memory differs a little between runs)."""
    pytest.importorskip("vllm")
    from restkv.config import CompressionConfig
    from restkv.integration.models import cache_dir
    from restkv.vllm import memory

    plugin, plain = _run("plugin"), _run("plain")
    model = memory.model_of(str(cache_dir("smollm2-135m")), "float32")
    cfg = CompressionConfig.from_kwargs(**KNOBS)
    sizes = ENGINE["max_num_seqs"], ENGINE["max_model_len"]
    reserve = memory.reserved(cfg, model, *sizes, plugin["found"], ENGINE["max_num_batched_tokens"])
    block = ENGINE["block_size"] * model.layers * model.kv_bytes(1)
    assert len(plugin["log"]) == 1, "one line at start-up"
    assert plugin["blocks"] == (plugin["found"] - reserve) // block
    assert plain["blocks"] == plain["found"] // block
    fewer = plugin["found"] // block - plugin["blocks"]  # than plain vLLM on the same bytes
    assert fewer == reserve // block or fewer == reserve // block + 1
    drift = abs(plain["found"] - plugin["found"]) // block + 2  # the two runs' resident memory, rounding
    assert abs(plain["blocks"] - plugin["blocks"] - reserve // block) <= drift


@pytest.mark.vllm
def test_an_explicit_pool_is_kept_and_the_plugins_bytes_logged():
    """``kv_cache_memory_bytes`` is the pool the operator chose: it is kept whole, and the worker says
    in one line what the plugin takes beyond it."""
    pytest.importorskip("vllm")
    from restkv.integration.models import cache_dir
    from restkv.vllm import memory

    explicit = _run("explicit")
    model = memory.model_of(str(cache_dir("smollm2-135m")), "float32")
    assert explicit["found"] == EXPLICIT
    assert explicit["blocks"] == EXPLICIT // (ENGINE["block_size"] * model.layers * model.kv_bytes(1))
    assert len(explicit["log"]) == 1 and "beyond the KV pool of kv_cache_memory_bytes" in explicit["log"][0]


if __name__ == "__main__":
    _engine(sys.argv[1])
