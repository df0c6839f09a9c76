"""Fixtures of the vLLM plugin's tests (``harness.py`` holds the runs)."""

from __future__ import annotations

import os

import harness
import pytest

# Under pytest-xdist (``make vllm-test`` runs two workers), each worker's engines keep to a core of their own
# unless a test binds its ranks itself (``harness.TP3_ENV``, ``harness.TWO_ENV``).
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(int(os.environ["PYTEST_XDIST_WORKER"][2:]) % os.cpu_count()))


@pytest.fixture(scope="session")
def text_ids() -> list[int]:
    return harness.text_ids()


@pytest.fixture(scope="session")
def prompt(text_ids) -> list[int]:
    return text_ids[: harness.PROMPT_LEN]


@pytest.fixture(scope="session")
def model_dir(prompt) -> str:
    from restkv.integration.models import cache_dir

    return str(cache_dir("smollm2-135m"))


@pytest.fixture(scope="session")
def gemma_dir() -> str:
    """The packaged Gemma 3 270M (a hybrid sliding-window model) converted once, by restkv's environment."""
    code = "from restkv.integration.models import resolve; print(resolve('gemma3-270m'))"
    return harness._run([harness._restkv_python(), "-c", code], {}).strip().splitlines()[-1]


@pytest.fixture(scope="session")
def gemma_ids(gemma_dir) -> list[int]:
    """``harness.text_ids`` by Gemma 3's tokenizer."""
    return harness.text_ids("gemma3-270m")
