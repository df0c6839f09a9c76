"""The vLLM benchmarks run end to end on the packaged SmolLM2 (small sizes): the serving table with
its ratios, and the check a GPU user runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from harness import ROOT  # noqa: E402

pytestmark = pytest.mark.vllm


def _run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=1800, check=False,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(__import__("pathlib").Path.home())},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_serving_table(model_dir):
    out = _run(
        "benchmarks/vllm_serving.py", "--workload", "generation", "--prompt_len", "32", "--new_tokens", "160",
        "--pool_requests", "1", "--requests", "4", "--methods", "snapkv", "--max_capacity_prompt", "64",
        "--decode_interval", "32", "--enforce_eager",
    )  # fmt: skip
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert "snapkv / full" in rows[""]
    running = [float(x) for x in rows["peak running"].split("|")[2:4]]
    assert running[1] >= running[0]  # requests held under the budget: at least as many run at once
    evicting = [float(x.split("(")[0]) for x in rows["snapkv"].split("|")[2:6]]
    assert evicting[3] > 0 and abs(sum(evicting[:3]) - evicting[3]) < 0.02


def test_check_prints_both_runs(model_dir):
    out = _run("benchmarks/vllm_check.py", "--prompt_len", "300", "--new_tokens", "8", "--engine", '{"enforce_eager": true}')
    assert "tokens, full cache:" in out and "tokens, plugin:" in out
    assert "kept 128 positions" in out
