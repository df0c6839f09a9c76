"""Fixtures of the vLLM plugin's tests (``harness.py`` holds the runs)."""

from __future__ import annotations

import harness
import pytest


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
