"""Fixtures of the vLLM plugin's tests (``harness.py`` holds the runs)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import harness
import pytest

# Under pytest-xdist (``make vllm-test`` runs two workers) each worker keeps to a core of its own: its
# process and every process it starts (engines, servers, restkv's reference runs), unless a test binds its
# ranks itself (``harness.TP3_ENV``, ``harness.TWO_ENV``). Such tests are marked ``both_cores`` and run
# alone (``harness.Cores``).
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
XDIST = WORKER.startswith("gw")
if XDIST and hasattr(os, "sched_setaffinity"):
    CORE = int(WORKER[2:]) % os.cpu_count()
    os.sched_setaffinity(0, {CORE})
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(CORE))
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# make vllm-test hands whole files to its two workers in this order (``--no-loadscope-reorder``): first the files
# with tests that take both cores, those tests first in each, so that they run one after another at the start;
# then the others, longest first (``--durations=0``), so that the last file to finish is a short one. Files not
# named follow.
ORDER = [
    "test_head_budgets_vllm.py",
    "test_vllm_plugin.py",
    "test_serve.py",
    "test_pipeline_vllm.py",
    "test_load.py",
    "test_capacity_vllm.py",
    "test_benchmarks.py",
    "test_fp8_vllm.py",
    "test_hybrid_vllm.py",
    "test_memory_vllm.py",
    "test_bench_serve.py",
    "test_prompt_lengths_vllm.py",
    "test_concurrency.py",
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(ORDER)}

    def place(item) -> tuple:
        return rank.get(item.path.name, len(ORDER)), item.get_closest_marker("both_cores") is None

    items.sort(key=place)


def _cores() -> harness.Cores | None:
    """The lock over the cores that xdist's workers share (None: not under xdist)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not (XDIST and run):
        return None
    return harness.Cores(Path(tempfile.gettempdir()) / f"restkv-vllm-test-{run}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test, with its fixtures' set-up and tear-down, under the cores' lock: alone if marked ``both_cores``."""
    cores = _cores()
    if cores is None:
        yield
        return
    held = cores.hold(alone=item.get_closest_marker("both_cores") is not None)
    try:
        yield
    finally:
        cores.release(held)


def pytest_sessionfinish(session):
    """Each worker removes the lock's files as it ends (one still running makes them again: none is held then)."""
    cores = _cores()
    if cores is not None:
        shutil.rmtree(cores.folder, ignore_errors=True)


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
