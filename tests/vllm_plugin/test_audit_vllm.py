"""``python -m restkv.vllm.audit`` in the installed vLLM (a supported version): every target and
attribute present (exit status 0), every target's source the one recorded for this version."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from restkv.vllm import audit, hooks  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.quick]

ROOT = Path(__file__).resolve().parents[2]


def test_the_audit_finds_everything_and_the_sources_recorded():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-m", "restkv.vllm.audit"], env=env, capture_output=True, text=True,
                         timeout=600, check=False)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == f"vLLM {vllm.__version__}"
    assert not [line for line in lines if "MISSING" in line]
    version = vllm.__version__.split("+")[0]
    wrapped = [t for t in audit.targets(hooks.TARGETS) if t.module not in hooks.absent()]
    same = {}  # target -> the versions whose recorded source it equals
    for line in lines:
        if line.startswith("  same as "):
            versions, target = line.removeprefix("  same as ").split(": ")
            same[target.split(" ")[0]] = versions.split(", ")
    assert {t.path: version in same.get(t.path, ()) for t in wrapped} == {t.path: True for t in wrapped}
