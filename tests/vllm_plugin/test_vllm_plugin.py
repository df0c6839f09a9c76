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


def engine_run(model_dir: str, prompt: list[int], knobs: dict | None, more=()) -> dict:
    """Greedy tokens, kept positions and block counts of one engine on ``prompt`` and ``more``
    prompts submitted with it (cached per knobs and prompts)."""
    key = json.dumps([knobs, len(more)], sort_keys=True)
    if key not in _RUNS:
        spec = {
            "model": model_dir,
            "prompts": [prompt, *more],
            "max_tokens": NEW_TOKENS,
            "block_size": BLOCK,
        }
        env = {"RESTKV_VLLM": json.dumps(knobs)} if knobs else {"RESTKV_VLLM": ""}
        out = _run([sys.executable, str(HERE / "run_engine.py"), json.dumps(spec)], env)
        _RUNS[key] = json.loads(
            next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]
        )
    return _RUNS[key]


_REFS: dict = {}


def reference(prompt: list[int], knobs: dict) -> dict:
    """restkv's transformers path on ``prompt`` (cached per knobs and prompt)."""
    key = json.dumps([knobs, prompt], sort_keys=True)
    if key not in _REFS:
        _REFS[key] = _reference(prompt, knobs)
    return _REFS[key]


def _reference(prompt: list[int], knobs: dict) -> dict:
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


def test_a_batch_evicts_each_request_on_its_own(model_dir, prompt):
    """Three requests in one step: two longer than the budget (300 and 200 tokens), one shorter."""
    more = [prompt[50:250], prompt[100:200]]
    run = engine_run(model_dir, prompt, SNAPKV, more)
    for i, p in enumerate([prompt, *more]):
        ref = reference(p, SNAPKV)
        assert run["tokens"][i] == ref["tokens"], f"request {i}"
        if len(p) > SNAPKV["max_capacity_prompt"]:
            assert run["kept"][i] == ref["kept"], f"request {i}"
    scheduled, after_prefill = run["steps"][0]
    blocks = [-(-len(p) // BLOCK) for p in [prompt, *more]]
    kept = [min(b, -(-SNAPKV["max_capacity_prompt"] // BLOCK)) for b in blocks]
    assert run["free_at_start"] - scheduled == sum(blocks)
    assert after_prefill - scheduled == sum(blocks) - sum(kept)


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
