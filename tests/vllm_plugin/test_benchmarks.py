"""The vLLM benchmarks run end to end on the packaged SmolLM2 (small sizes): the serving table with
its ratios, and the check a GPU user runs (its checks on the harness's runs, its exit status on a
reference that differs), and the GPU verification's arms as vLLM's own config classes read them."""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from harness import PROMPT_LEN, ROOT, SNAPKV, engine_run, reference  # noqa: E402
from vllm_gpu_verify import arms  # noqa: E402

pytestmark = pytest.mark.vllm


def plan() -> list:
    """vllm_gpu_verify.py's arms for a model M."""
    return arms(argparse.Namespace(
        model="M", reference=None, out=ROOT / "r.md", knobs="{}", head_knobs="{}", prompt_len=4000, new_tokens=160,
        gpu_check="",
    ))  # fmt: skip


def _run(*args: str, status: int = 0) -> str:
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=1800, check=False,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )  # fmt: skip
    assert done.returncode == status, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_serving_table(model_dir):
    out = _run(
        "benchmarks/vllm_serving.py", "--workload", "generation", "--prompt_len", "32", "--new_tokens", "160",
        "--pool_requests", "2", "--requests", "4", "--methods", "snapkv", "--max_capacity_prompt", "64",
        "--decode_interval", "32", "--enforce_eager",
    )  # fmt: skip
    text, _, last = out.partition("| attention on the CPU backend")
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    attention = {line.split("|")[1].strip(): line for line in last.splitlines() if line.startswith("| ")}
    assert "snapkv / full" in rows[""]
    own = [float(attention[arm].split("|")[2].split("(")[0]) for arm in ("full", "snapkv")]
    assert min(own) > 0  # vLLM's own attention kernel timed in every arm
    running = [float(x) for x in rows["peak running"].split("|")[2:4]]
    assert running[1] >= running[0]  # requests held under the budget: at least as many run at once
    evicting = [float(x.split("(")[0]) for x in rows["snapkv"].split("|")[2:6]]
    assert evicting[3] > 0 and abs(sum(evicting[:3]) - evicting[3]) < 0.02


def test_each_arm_reads_as_vllm_reads_it():
    """The backend names, the runner's variable and the graph mode are vLLM's own."""
    from vllm import envs
    from vllm.config import AttentionConfig, CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    from vllm_gpu_verify import runners

    from restkv.vllm import hooks

    assert ("V1 runner" in runners()) == hooks.v1_runner()
    assert ("VLLM_USE_V2_MODEL_RUNNER" in envs.environment_variables) == hooks.v1_runner()
    for _, cmd, env in plan()[:-1]:
        assert set(env) <= set(envs.environment_variables)
        engine = json.loads(cmd[cmd.index("--engine") + 1])
        backend = AttentionConfig(**engine["attention_config"]).backend
        assert backend.name == engine["attention_config"]["backend"]
        if "compilation_config" in engine:
            mode = CompilationConfig(**engine["compilation_config"]).cudagraph_mode
            assert mode == CUDAGraphMode.PIECEWISE


def test_check_passes_the_plugin_and_names_each_failure(model_dir, prompt):
    """``vllm_check.failures`` on the harness's runs and configure()'s reference: none; each part
    spoiled in turn (a token, a kept position, a block held, a block not given back, no eviction)
    gives its own line."""
    from vllm_check import failures

    from restkv.vllm import settings

    cfg = settings.from_env({"restkv": SNAPKV})
    plain, evicted = engine_run(model_dir, [prompt], None), engine_run(model_dir, [prompt], SNAPKV)
    ref = reference(prompt, SNAPKV)
    assert failures(plain, evicted, cfg, PROMPT_LEN, ref) == []

    def spoiled(run: dict, change) -> dict:
        run = copy.deepcopy(run)
        change(run)
        return run

    def first_word(fails: list[str]) -> list[str]:
        return [f.split(":")[0] for f in fails]

    token = spoiled(ref, lambda r: r["tokens"].__setitem__(3, r["tokens"][3] + 1))
    assert first_word(failures(plain, evicted, cfg, PROMPT_LEN, token)) == ["tokens differ from configure()'s"]
    dropped = next(i for i in range(PROMPT_LEN) if i not in ref["kept"][5][1])
    moved = spoiled(ref, lambda r: r["kept"][5][1].__setitem__(0, dropped))  # one position not kept
    assert first_word(failures(plain, evicted, cfg, PROMPT_LEN, moved)) == ["kept positions differ from configure()'s"]
    assert failures(plain, evicted, cfg, PROMPT_LEN, moved, share=0.99) == []  # 127 of 128 shared
    grown = spoiled(evicted, lambda r: r["trace"][0][-1].__setitem__(2, r["trace"][0][-1][2] + 1))
    assert first_word(failures(plain, grown, cfg, PROMPT_LEN)) == ["blocks held"]
    kept = spoiled(evicted, lambda r: r["steps"][-1].__setitem__(1, r["steps"][-1][1] - 1))
    assert first_word(failures(plain, kept, cfg, PROMPT_LEN)) == ["blocks given back"]
    assert first_word(failures(plain, plain, cfg, PROMPT_LEN)) == ["blocks held", "eviction"]


def test_check_counts_a_per_head_request_at_its_heads_pages(model_dir, prompt):
    """AdaKV (per-head budgets): after its eviction the request holds the fewest blocks its heads' kept
    entries need (``heads.exact_length``, which the worker sends), not the bound from its config; the
    check expects that at every step and names a block more."""
    from vllm_check import expected_blocks, failures

    from restkv.vllm import heads, settings

    knobs = {"method": "adakv", "max_capacity_prompt": 64}
    cfg = settings.from_env({"restkv": knobs})
    plain, evicted = engine_run(model_dir, [prompt], None), engine_run(model_dir, [prompt], knobs)
    assert failures(plain, evicted, cfg, PROMPT_LEN, reference(prompt, knobs)) == []
    trace, size = evicted["trace"][0], evicted["block_size"]
    want = expected_blocks(cfg, trace, PROMPT_LEN, size, evicted["caching"], evicted["kept"][0])
    assert len(want) == len(trace)  # every step checked
    lengths = [sum(p >= 0 for p in h) for layer in evicted["kept"][0][0] for h in layer]  # -1: padding
    count = heads.exact_length(lengths, size)
    after = [(held, end - PROMPT_LEN) for end, _, held in trace if end > PROMPT_LEN]  # decoded since the eviction
    assert after and all(held == -(-(count + t) // size) for held, t in after)
    assert any(held < -(-(64 + size + t) // size) for held, t in after)  # below the config's bound
    grown = copy.deepcopy(evicted)
    grown["trace"][0][-1][2] += 1
    assert [f.split(":")[0] for f in failures(plain, grown, cfg, PROMPT_LEN)] == ["blocks held"]


def test_check_exits_1_on_a_reference_that_differs(model_dir, tmp_path):
    """The command a GPU user runs: both runs printed, the blocks and the eviction pass, the tokens
    and kept positions of a reference that differs fail, one line each, exit status 1."""
    from vllm_check import _prompt

    knobs = {"method": "snapkv", "max_capacity_prompt": 128}
    saved = tmp_path / "reference.json"
    key = {"model": model_dir, "knobs": knobs, "prompt": _prompt(model_dir, 300), "new_tokens": 8}
    saved.write_text(json.dumps({**key, "tokens": [0] * 8, "kept": [[list(range(128))] * 3] * 30}))
    out = _run(
        "benchmarks/vllm_check.py", "--model", model_dir, "--prompt_len", "300", "--new_tokens", "8",
        "--knobs", json.dumps(knobs), "--engine", '{"enforce_eager": true}', "--reference_json", str(saved),
        status=1,
    )  # fmt: skip
    assert "tokens, full cache:" in out and "tokens, plugin:" in out
    assert "kept 128 positions" in out
    fails = [line.split(":")[0] for line in out.splitlines() if line.startswith("FAIL ")]
    assert fails == ["FAIL tokens differ from configure()'s", "FAIL kept positions differ from configure()'s"]
