"""The vLLM plugin (``restkv.vllm``) on the packaged SmolLM2, against plain vLLM and restkv's
transformers path.

Runs in the vLLM environment (``make vllm-test``); skipped where vLLM is not installed. Each engine
runs in a subprocess (``run_engine.py``); restkv's transformers path runs in restkv's own
environment (``RESTKV_PYTHON``, default ``.venv/bin/python``) through ``reference.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
PROMPT_LEN = 300
NEW_TOKENS = 16
BLOCK = 32
SNAPKV = {"method": "snapkv", "max_capacity_prompt": 128, "window_size": 32}
RESTKV = {"preset": "paper", "max_capacity_prompt": 128}


def _restkv_python() -> str:
    python = os.environ.get("RESTKV_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    if not Path(python).exists():
        pytest.skip(
            f"restkv's own environment is needed for the reference (RESTKV_PYTHON={python})"
        )
    return python


def _run(cmd: list[str], env: dict) -> str:
    done = subprocess.run(
        cmd,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise AssertionError(f"{cmd[1]} failed:\n{done.stderr[-4000:]}")
    return done.stdout


@pytest.fixture(scope="session")
def prompt() -> list[int]:
    """The README's first PROMPT_LEN tokens (and the packaged model converted, by restkv's
    environment)."""
    code = (
        "import json; from restkv.bench.models import load_model; "
        "_, t = load_model('smollm2-135m'); "
        f"print(json.dumps(t(open('README.md').read())['input_ids'][:{PROMPT_LEN}]))"
    )
    ids = json.loads(_run([_restkv_python(), "-c", code], {}).strip().splitlines()[-1])
    assert len(ids) == PROMPT_LEN
    return ids


@pytest.fixture(scope="session")
def model_dir(prompt) -> str:
    from restkv.bench.models import cache_dir

    return str(cache_dir("smollm2-135m"))


_RUNS: dict = {}


def engine_run(model_dir: str, prompt: list[int], knobs: dict | None) -> dict:
    """Greedy tokens, kept positions and block counts of one engine (cached per knobs)."""
    key = json.dumps(knobs, sort_keys=True)
    if key not in _RUNS:
        spec = {
            "model": model_dir,
            "prompts": [prompt],
            "max_tokens": NEW_TOKENS,
            "block_size": BLOCK,
        }
        env = {"RESTKV_VLLM": json.dumps(knobs)} if knobs else {"RESTKV_VLLM": ""}
        out = _run([sys.executable, str(HERE / "run_engine.py"), json.dumps(spec)], env)
        _RUNS[key] = json.loads(
            next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]
        )
    return _RUNS[key]


def reference(prompt: list[int], knobs: dict) -> dict:
    out = _run(
        [
            _restkv_python(),
            str(HERE / "reference.py"),
            json.dumps(knobs),
            str(NEW_TOKENS),
            json.dumps(prompt),
        ],
        {},
    )
    return json.loads(out.strip().splitlines()[-1])


def test_budget_covering_the_prompt_gives_plain_vllm_tokens(model_dir, prompt):
    plain = engine_run(model_dir, prompt, None)
    covered = engine_run(model_dir, prompt, {**SNAPKV, "max_capacity_prompt": PROMPT_LEN})
    assert covered["tokens"] == plain["tokens"]
    assert covered["kept"] == [[]]  # nothing evicted
    assert covered["steps"][:2] == plain["steps"][:2]  # the same blocks held


@pytest.mark.parametrize("knobs", [SNAPKV, RESTKV], ids=["snapkv", "restkv-paper"])
def test_eviction_matches_restkv_transformers_path(model_dir, prompt, knobs):
    ref = reference(prompt, knobs)
    run = engine_run(model_dir, prompt, knobs)
    kept = run["kept"][0]
    assert len(kept) == len(ref["kept"]) == 30
    for layer, (ours, theirs) in enumerate(zip(kept, ref["kept"])):
        assert ours == theirs, f"layer {layer}: kept positions differ"
    assert run["tokens"][0] == ref["tokens"]


def test_evicted_blocks_return_to_the_pool(model_dir, prompt):
    budget = SNAPKV["max_capacity_prompt"]
    run = engine_run(model_dir, prompt, SNAPKV)
    plain = engine_run(model_dir, prompt, None)
    (scheduled, after_prefill), (decode_scheduled, _) = run["steps"][:2]
    full_blocks = -(-PROMPT_LEN // BLOCK)
    kept_blocks = -(-budget // BLOCK)
    assert (
        run["free_at_start"] - scheduled == full_blocks
    )  # the prefill step holds the whole prompt
    assert (
        after_prefill - scheduled == full_blocks - kept_blocks
    )  # then the evicted blocks come back
    assert plain["steps"][0][1] == plain["steps"][0][0]  # plain vLLM keeps them
    assert run["free_at_start"] - decode_scheduled == -(
        -(budget + 1) // BLOCK
    )  # decoding appends after B entries


def test_refusals_at_startup(model_dir, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from restkv.vllm.engine import check_config, install

    monkeypatch.setenv("RESTKV_VLLM", json.dumps(SNAPKV))
    install()
    ok = dict(
        model=model_dir,
        dtype="float32",
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_model_len=1024,
        max_num_batched_tokens=1024,
    )
    for change, words in [
        ({"enable_prefix_caching": True}, "prefix caching"),
        ({"enable_chunked_prefill": True}, "chunked prefill"),
    ]:
        with pytest.raises(ValueError, match=words):
            EngineArgs(**{**ok, **change}).create_engine_config()
    config = EngineArgs(**ok).create_engine_config()  # the supported setting starts
    # vLLM's CPU platform turns asynchronous scheduling off itself; a config that has it is refused
    config.scheduler_config.async_scheduling = True
    with pytest.raises(ValueError, match="asynchronous scheduling"):
        check_config(config)
