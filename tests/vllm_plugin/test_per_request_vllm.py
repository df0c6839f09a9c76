"""A request's own knobs in vLLM (``restkv.vllm.per_request``): one engine, one batch of requests that
each run their own configuration (the engine's, a smaller budget, another method, none), each checked
against restkv's transformers path with that request's knobs (greedy tokens; kept positions in every
layer); a bad request is refused with vLLM's validation error naming the field before the engine sees
it, and the engine serves the batch after it."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from harness import H2O, PROMPT_LEN, engine_run, reference

pytestmark = pytest.mark.vllm

# the engine's config is H2O's (its memory covers the lighter methods the requests ask for)
OWN = [
    (None, H2O),
    ({"max_capacity_prompt": 64}, {**H2O, "max_capacity_prompt": 64}),
    ({"method": "snapkv"}, {"method": "snapkv", "max_capacity_prompt": 128, "window_size": 32}),
    ("off", {}),
]


def test_a_batch_of_requests_with_their_own_knobs_evicts_as_configure_with_each(model_dir, text_ids):
    prompts = [text_ids[i * 100 : i * 100 + PROMPT_LEN] for i in range(len(OWN))]
    run = engine_run(
        model_dir, prompts, H2O, request_knobs=[k for k, _ in OWN], refused_knobs={"bogus": 1}
    )
    assert run["refused"].startswith("VLLMValidationError: extra_args['restkv']: unknown knob bogus"), run["refused"]
    for i, (prompt, (knobs, theirs)) in enumerate(zip(prompts, OWN)):
        ref = reference(prompt, theirs)
        assert run["tokens"][i] == ref["tokens"], f"request {i} ({knobs}): tokens"
        if not theirs:
            assert run["kept"][i] == [], f"request {i} evicted"
            continue
        (kept,) = run["kept"][i]  # one rank
        assert kept == ref["kept"], f"request {i} ({knobs}): kept positions"
    assert max(run["batch"]) == len(OWN), "the requests never shared a step"
    assert run["steps"][-1][1] == run["free_at_start"], "every block back in the pool"
