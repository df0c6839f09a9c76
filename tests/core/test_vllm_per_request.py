"""A request's own knobs in vLLM (``restkv.vllm.per_request``): how they resolve over the engine's
config, what an engine refuses for a request (one line naming the field), and one request's eviction
with its own knobs through the worker against ``restkv.configure`` with those knobs (the paged engine
of ``tests/vllm_sim.py``; mixed batches in vLLM itself: tests/vllm_plugin/test_per_request_vllm.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import prompt
from test_vllm_worker import engine, kept_of, reference

from restkv.config import CompressionConfig
from restkv.vllm import memory, per_request, settings

MODEL = memory.Model(layers=30, heads=9, kv_heads=3, head_dim=64, hidden=576, dtype_bytes=4)
SNAPKV = dict(method="snapkv", max_capacity_prompt=128, window_size=16)


def spec(knobs: dict | None = None, tp: int = 1, **sizes) -> per_request.Engine:
    cfg = None if knobs is None else CompressionConfig.from_kwargs(**knobs)
    sizes = dict(max_num_seqs=8, max_model_len=2048, max_num_batched_tokens=2048, block_size=16, **sizes)
    return per_request.Engine(cfg, MODEL, tensor_parallel=tp, **sizes)


def resolved(knobs, engine_knobs=SNAPKV, **kw) -> dict | None:
    cfg = per_request.resolve(spec(engine_knobs, **kw), knobs)
    return None if cfg is None else cfg.as_dict()


def test_no_knobs_run_the_engines_config():
    assert resolved(None) == CompressionConfig.from_kwargs(**SNAPKV).as_dict()


def test_knobs_without_a_method_change_the_engines():
    assert resolved({"max_capacity_prompt": 64}) == CompressionConfig.from_kwargs(**{**SNAPKV, "max_capacity_prompt": 64}).as_dict()
    assert resolved('{"max_capacity_prompt": 64, "kernel_size": 5}') == CompressionConfig.from_kwargs(
        **{**SNAPKV, "max_capacity_prompt": 64, "kernel_size": 5}
    ).as_dict()


def test_another_method_starts_from_its_defaults_with_the_engines_budget_and_window():
    engine_knobs = {**SNAPKV, "kernel_size": 5, "pooling": "maxpool"}
    ours = resolved({"method": "streamingllm"}, engine_knobs)
    assert ours == CompressionConfig.from_kwargs(method="streamingllm", max_capacity_prompt=128, window_size=16).as_dict()
    restkv_engine = dict(method="restkv", max_capacity_prompt=256, window_size=16)
    ours = resolved({"method": "snapkv", "max_capacity_prompt": 64}, restkv_engine)
    assert ours == CompressionConfig.from_kwargs(method="snapkv", max_capacity_prompt=64, window_size=16).as_dict()


@pytest.mark.parametrize("knobs", ["off", " off", {"method": "fullkv"}, '{"method": "fullkv"}'])
def test_off_keeps_the_whole_cache(knobs):
    assert resolved(knobs) is None
    assert resolved(knobs, None) is None  # also on an engine without the plugin


@pytest.mark.parametrize(
    "knobs, engine_knobs, tp, says",
    [
        ({"bogus": 1}, SNAPKV, 1, "unknown knob bogus"),
        ("{not json", SNAPKV, 1, "must be 'off' or a JSON object"),
        (5, SNAPKV, 1, "got int"),
        ({"max_capacity_prompt": 8}, SNAPKV, 1, "must be smaller than max_capacity_prompt (8)"),
        ({"method": "triattention"}, SNAPKV, 1, "queries and keys before RoPE"),
        ({"max_capacity_prompt": 64}, None, 1, "this engine runs without restkv"),
        ({"method": "random"}, SNAPKV, 2, "drawn for every head at once, and this engine gives each of its 2 ranks"),
        ({"method": "chunkkv"}, SNAPKV, 3, "ChunkKV ranks chunks by the score summed over every head"),
        ({"method": "adakv"}, SNAPKV, 1, "head_budget='adakv' needs an engine started with per-head"),
        ({"max_capacity_prompt": 1024}, SNAPKV, 1, "needs 64 blocks per request past max_model_len's, over the 8"),
        ({"window_size": 32}, SNAPKV, 1, "reads a request's 32 most recent queries; the engine keeps 16"),
        ({"method": "restkv"}, SNAPKV, 1, "W_O factors for restkv"),
        ({"method": "h2o"}, dict(method="restkv", max_capacity_prompt=128), 1, "share per pooled token for h2o"),
    ],
)
def test_a_request_the_engine_cannot_serve_is_refused_in_one_line(knobs, engine_knobs, tp, says):
    with pytest.raises(ValueError) as e:
        resolved(knobs, engine_knobs, tp=tp)
    message = str(e.value)
    assert message.startswith("extra_args['restkv']") and says in message and "\n" not in message


def test_a_lighter_request_on_a_heavier_engine_is_served():
    engine_knobs = dict(method="restkv", max_capacity_prompt=256, window_size=32)
    for knobs in ({"method": "snapkv"}, {"method": "streamingllm", "max_capacity_prompt": 64}, {"window_size": 8}):
        assert resolved(knobs, engine_knobs) is not None


# one request's eviction with its own knobs, through the worker, against configure() with them
ENGINE = dict(method="h2o", max_capacity_prompt=40, window_size=8)
CASES = [
    (ENGINE, {"max_capacity_prompt": 24}, dict(ENGINE, max_capacity_prompt=24)),
    (ENGINE, {"method": "snapkv"}, dict(method="snapkv", max_capacity_prompt=40, window_size=8)),
    (ENGINE, {"method": "snapkv", "window_size": 4, "decode_interval": 3}, dict(method="snapkv", max_capacity_prompt=40, window_size=4, decode_interval=3)),
    (dict(method="restkv", max_capacity_prompt=40, window_size=8), {"method": "keydiff", "max_capacity_prompt": 30}, dict(method="keydiff", max_capacity_prompt=30, window_size=8)),
    (dict(method="adakv", max_capacity_prompt=40, window_size=8), {"max_capacity_prompt": 32}, dict(method="adakv", max_capacity_prompt=32, window_size=8)),
    (ENGINE, "off", dict(method="fullkv")),
]


@pytest.mark.parametrize("chunk", [None, 13], ids=["whole", "chunks-of-13"])
@pytest.mark.parametrize("engine_knobs, knobs, theirs", CASES, ids=lambda x: str(x) if isinstance(x, str) else None)
def test_a_requests_own_knobs_evict_as_configure_with_them(engine_knobs, knobs, theirs, chunk):
    ids = prompt(80)[0].tolist()
    tokens, kept = reference(theirs, ids, 8)
    eng = engine(engine_knobs, chunk=chunk)
    assert eng.generate(ids, 8, knobs=knobs) == tokens
    if theirs["method"] == "fullkv":
        assert kept_of(eng) == [None] * len(eng.names)  # nothing evicted
    else:
        for layer, (ours, ref) in enumerate(zip(kept_of(eng), kept)):
            assert torch.equal(ours, ref), f"layer {layer}"
    assert eng.generate(ids, 8) == reference(engine_knobs, ids, 8)[0]  # the next request runs the engine's


def test_under_tensor_parallelism_a_requests_split_across_heads_is_counted_over_the_ranks():
    """A request running AdaKV on an engine of three ranks (one KV head each, PyramidKV's): its heads' split
    is gathered over the ranks, so one rank's head may keep every head's share: it is counted at three
    times the mean until the worker's count; where the ranks replicate the KV heads it is refused."""
    pyramid = CompressionConfig.from_kwargs(method="pyramidkv", max_capacity_prompt=128)
    sizes = dict(max_num_seqs=8, max_model_len=2048, max_num_batched_tokens=2048, block_size=16)
    engine = per_request.Engine(pyramid, MODEL.per_rank(3), tensor_parallel=3, **sizes)
    cfg = per_request.resolve(engine, {"method": "adakv", "max_capacity_prompt": 64})
    try:
        assert settings.eviction(cfg, 0, 1000, 1000, 0, False, 16).counted == 3 * 64 + 16
    finally:  # the config is a key of settings' tables: the other tests' run on one rank
        settings.bind_model(cfg, 30, 9, 3)
    replicated = per_request.Engine(pyramid, MODEL.per_rank(3), tensor_parallel=3, replicated=True, **sizes)
    with pytest.raises(ValueError, match="ranks do not split evenly"):
        per_request.resolve(replicated, {"method": "adakv", "max_capacity_prompt": 64})
