"""Every method the plugin serves, on prompts of every length, in vLLM's engine: 1 token, shorter
than the window, between the window and the budget, just over the budget and far over it, with the
method's default knobs and with a small budget and window (evicting again every 4 generated tokens),
bfloat16.
Each request must finish as asked (its 10 tokens, vLLM's ``length``), none failed, and the pool must be
whole at the end. The requests run their own knobs (``restkv.vllm.per_request``) on as few engines as
cover them: an engine's config must hold every term of the plugin's memory a request needs, so the
methods heavier than the first engine's in one term get engines of their own (``ENGINES``)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from harness import BLOCK, engine_run

from restkv.config import CompressionConfig
from restkv.methods import METHODS, REGISTRY
from restkv.vllm import memory, per_request, settings

pytestmark = pytest.mark.vllm

SMALL = {"max_capacity_prompt": 64, "window_size": 16, "decode_interval": 4}
LENGTHS = {"default": (1, 20, 100, 600), "small": (1, 7, 40, 65, 300)}  # budgets 512 / 32 and 64 / 16
SIZES = dict(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=512)
FIRST = "layer_defensivekv"  # per-head and shared across layers: the engine serving the most of them


def knobs(method: str, which: str) -> dict:
    """The request's knobs: the method's defaults, or the small budget and window (without evicting
    while decoding where the method cannot: a budget shared across layers)."""
    if which == "default":
        return {"method": method}
    small = {"method": method, **SMALL}
    try:
        CompressionConfig.from_kwargs(**small)
    except ValueError:
        small.pop("decode_interval")
    return small


def served() -> list[str]:
    """The methods the plugin serves with their own knobs."""
    found = []
    for name in METHODS:
        try:
            settings.check(CompressionConfig.from_kwargs(method=name))
        except ValueError:
            continue
        found.append(name)
    return [n for n in found if REGISTRY[n].evicts]


def engine_knobs(method: str) -> dict:
    """An engine's knobs: the method's defaults, its query ring as wide as any request's window."""
    return {"method": method, "window_size": max(32, CompressionConfig.from_kwargs(method=method).window_size)}


def engine_of(method: str, model: memory.Model) -> per_request.Engine:
    cfg = CompressionConfig.from_kwargs(**engine_knobs(method))
    sizes = SIZES
    settings.bind_model(cfg, model.layers, model.heads, model.kv_heads)
    return per_request.Engine(cfg, model, sizes["max_num_seqs"], sizes["max_model_len"], sizes["max_num_batched_tokens"], BLOCK)


def engines(model_dir: str) -> dict:
    """Engine method -> the requests' (method, knob set) it serves: ``FIRST``'s, then each method it
    refuses on an engine of its own."""
    model = memory.model_of(model_dir, "float32")
    first = engine_of(FIRST, model)
    plan: dict = {FIRST: []}
    for method in served():
        for which in LENGTHS:
            try:
                per_request.resolve(first, knobs(method, which))
                plan[FIRST].append((method, which))
            except ValueError:
                plan.setdefault(method, []).append((method, which))
    return plan


@pytest.fixture(scope="module")
def plan(model_dir) -> dict:
    return engines(model_dir)


def test_the_engines_cover_every_method_served(plan):
    assert {m for requests in plan.values() for m, _ in requests} == set(served())
    assert len(plan) <= 5, plan.keys()


@pytest.mark.parametrize("engine_method", [FIRST, "restkv", "h2o", "rkv"])
def test_every_method_answers_prompts_of_every_length(engine_method, plan, model_dir, text_ids):
    requests = plan.get(engine_method)
    if requests is None:
        pytest.skip(f"{engine_method}'s requests run on {FIRST}'s engine")
    prompts, own = [], []
    for method, which in requests:
        for length in LENGTHS[which]:
            prompts.append(text_ids[:length])
            own.append(knobs(method, which))
    run = engine_run(
        model_dir, prompts, engine_knobs(engine_method), new_tokens=10, request_knobs=own, kv_tokens=16384,
        dtype="bfloat16", **SIZES,
    )  # fmt: skip
    wrong = [
        f"{json.dumps(k)} at {len(p)} tokens: {f} {t}"
        for p, k, f, t in zip(prompts, own, run["finish"], run["tokens"])
        if f != "length" or len(t) != 10
    ]
    assert wrong == []
    assert run["steps"][-1][1] == run["free_at_start"], "every block back in the pool"
