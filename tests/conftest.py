import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# One intra-op thread unless told otherwise: the models here are small, and two threads on a shared
# two-core machine run several times slower.
torch.set_num_threads(int(os.environ.get("RESTKV_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of the packaged ``smollm2-135m``, float32 sdpa on CPU (converted on first use)."""
    from restkv.bench.models import load_model

    return load_model("smollm2-135m")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end runs on the packaged model (the quick subset: -m 'not slow')")
    config.addinivalue_line("markers", "vllm: the vLLM plugin's tests (vLLM's own environment: make vllm-test)")
    config.addinivalue_line("markers", "quick: the vLLM plugin's tests .ci/run runs (make vllm-test-quick)")
    config.addinivalue_line("markers", "both_cores: a vLLM test whose ranks take both cores (run alone by make vllm-test)")
