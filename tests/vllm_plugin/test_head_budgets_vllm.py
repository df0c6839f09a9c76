"""Per-head budgets served in vLLM (``restkv.vllm.heads``): AdaKV and a threshold's counts on the
packaged SmolLM2 (9 query heads on 3 KV heads), each KV head of a request on pages of its own,
attended through the CPU backend's own implementation for 3 query heads on one KV head.

Checked against restkv's transformers path with the same knobs: every layer's and head's kept
positions, and the greedy tokens; against the pool: a request holds the blocks the scheduler counts
(``ceil(B / block_size) + 1`` after its eviction, one more every ``block_size`` tokens), and every
block is back at the end.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from harness import BLOCK, PROMPT_LEN, TP3_ENV, blocks, engine_run, one_after_another, reference
from helpers import fewest_length, lukv_curve

from restkv.vllm import settings

pytestmark = pytest.mark.vllm

ADAKV = {"method": "adakv", "max_capacity_prompt": 128, "window_size": 32}
PYRAMIDKV = {"method": "pyramidkv", "max_capacity_prompt": 128, "window_size": 32}
LAYER_DEFENSIVEKV = {"method": "layer_defensivekv", "value_norm": "l2", "max_capacity_prompt": 128, "window_size": 32}
LAYER_RATIOS = {
    "method": "snapkv",
    "max_capacity_prompt": 128,
    "window_size": 32,
    "layer_ratios": ",".join(str(round(0.3 + 0.6 * (i % 5) / 4, 2)) for i in range(30)),  # 0.3 .. 0.9 by layer
}


@pytest.fixture(scope="module")
def lukv(tmp_path_factory) -> dict:
    """SnapKV's scores with LU-KV's counts from a curve for SmolLM2's 30 layers and 3 KV heads (each row's
    ratios +-0.15 around the row's own)."""
    curve = lukv_curve(tmp_path_factory.mktemp("lukv") / "curve.npy", layers=30, hkv=3)
    return {"method": "snapkv", "head_budget": "lukv", "lukv_curve": curve, "max_capacity_prompt": 128, "window_size": 32}


@pytest.fixture(scope="module")
def headkv(tmp_path_factory) -> dict:
    """HeadKV with a skewed head-importance table for SmolLM2's 30 layers x 9 heads."""
    import numpy as np

    table = np.random.default_rng(0).gamma(0.5, size=(30, 9)).round(4).tolist()
    path = tmp_path_factory.mktemp("headkv") / "head_importance.json"
    path.write_text(json.dumps(table))
    return {"method": "headkv", "max_capacity_prompt": 128, "window_size": 32, "head_importance": str(path)}


def tp_knobs(lukv: dict, headkv: dict) -> dict:
    """name -> the knobs of a request that three ranks of one KV head each serve (64 tokens)."""
    return {
        "adakv": {**ADAKV, "decode_interval": 32},
        "headkv": headkv,
        "lukv": {**lukv, "decode_interval": 32},
        "snapkv-global": {"method": "snapkv", "layer_budget": "global", "max_capacity_prompt": 128, "window_size": 32},
        "layer-defensivekv": LAYER_DEFENSIVEKV,
        "defensivekv": {"method": "defensivekv", "max_capacity_prompt": 128, "window_size": 32, "decode_interval": 32},
        "pyramidkv": {**PYRAMIDKV, "decode_interval": 32},
    }


TP_ENGINES = {
    "layer-defensivekv": ["layer-defensivekv", "adakv", "headkv", "snapkv-global", "pyramidkv"],
    "defensivekv": ["defensivekv"],
    "lukv": ["lukv"],
}
"""TP=3 engine (its config the first request's) -> the requests it serves, the others with their own knobs
(``restkv.vllm.per_request``): an engine's config must hold every term of the plugin's memory and every
block its requests need, which Layer-DefensiveKV's does for the first group only."""


def tp_run(model_dir: str, text_ids: list, knobs: dict, name: str) -> tuple:
    """Request ``name``'s prompt and its ``kept`` and ``tokens``: its engine of ``TP_ENGINES`` (TP=3) serving
    its requests one after another, each on a 300-token prompt of its own (no prefix shared)."""
    names = next(names for names in TP_ENGINES.values() if name in names)
    prompts = [text_ids[50 * i : 50 * i + PROMPT_LEN] for i in range(len(names))]
    own = [None, *(knobs[n] for n in names[1:])]
    runs = one_after_another(model_dir, knobs[names[0]], list(zip(prompts, own)), 64, TP3_ENV, tensor_parallel_size=3)
    return prompts[names.index(name)], runs[names.index(name)]


def heads_kept(layer: list) -> list:
    """[Hkv][B] kept positions -> each head's, sorted, padding (-1) dropped."""
    return [sorted(p for p in head if p >= 0) for head in layer]


def keeps_and_decodes_as_restkv(model_dir, prompt, knobs: dict, **vllm) -> None:
    """The engine's kept positions per layer and head (its heads keeping different counts) and greedy
    tokens are restkv's transformers path's with the same knobs."""
    ref = reference(prompt, knobs)
    run = engine_run(model_dir, [prompt], knobs, **vllm)
    (kept,) = run["kept"][0]
    assert len({len(h) for layer in kept for h in heads_kept(layer)}) > 1, "every head kept the same count"
    assert_kept_as_reference(kept, ref["kept"])
    assert run["tokens"][0] == ref["tokens"]


def assert_kept_as_reference(kept: list, ref: list) -> None:
    assert len(kept) == len(ref) == 30
    for layer, (ours, theirs) in enumerate(zip(kept, ref)):
        assert heads_kept(ours) == heads_kept(theirs), f"layer {layer}: kept positions differ"


@pytest.mark.parametrize(
    "vllm",
    [pytest.param({}, marks=pytest.mark.quick), {"max_num_batched_tokens": 2048}],
    ids=["chunked-prefill", "whole-prefill"],
)
def test_adakv_keeps_and_decodes_as_restkv(model_dir, prompt, vllm):
    keeps_and_decodes_as_restkv(model_dir, prompt, ADAKV, **vllm)


@pytest.mark.parametrize(
    "knobs",
    [
        {"method": "defensivekv", "max_capacity_prompt": 128, "window_size": 32},
        {"method": "snapkv", "head_budget": "threshold", "threshold": 0.004, "max_capacity_prompt": 128},
        PYRAMIDKV,
        {**PYRAMIDKV, "head_budget": "adakv"},
    ],
    ids=["defensivekv", "snapkv-threshold", "pyramidkv", "pyramidkv-adakv"],
)
def test_other_per_head_budgets_keep_and_decode_as_restkv(model_dir, prompt, knobs):
    keeps_and_decodes_as_restkv(model_dir, prompt, knobs)


@pytest.mark.parametrize(
    "vllm",
    [pytest.param({}, marks=pytest.mark.quick), {"max_num_batched_tokens": 2048}],
    ids=["chunked-prefill", "whole-prefill"],
)
def test_lukv_keeps_and_decodes_as_restkv(model_dir, prompt, lukv, vllm):
    """LU-KV: each head's count from its curve's row at the prompt's length, rounded over the layer's heads,
    read by the scheduler and the worker as configure() reads it."""
    keeps_and_decodes_as_restkv(model_dir, prompt, lukv, **vllm)


def test_layer_ratios_keep_and_decode_as_restkv(model_dir, prompt):
    """``layer_ratios``: each layer's budget a share of the prompt (kvpress's per-layer compression), its
    layers' pages one pool."""
    keeps_and_decodes_as_restkv(model_dir, prompt, LAYER_RATIOS)


def test_a_threshold_selects_a_prompt_within_the_budget_as_restkv(model_dir, text_ids):
    """A threshold selects at the prompt's end whatever its length, as configure() does: a 100-token prompt
    (under B = 128) keeps the transformers path's positions in every layer and head, and its tokens."""
    knobs = {"method": "snapkv", "head_budget": "threshold", "threshold": 0.004, "max_capacity_prompt": 128}
    keeps_and_decodes_as_restkv(model_dir, text_ids[400:500], knobs)


@pytest.mark.both_cores
def test_per_layer_budgets_under_tensor_parallelism(model_dir, text_ids, lukv, headkv):
    """PyramidKV's layers keep their own counts; its heads do not share them, so three ranks of one
    KV head each keep the transformers path's positions and give its tokens, evicting again every 32
    tokens."""
    knobs = tp_knobs(lukv, headkv)
    prompt, run = tp_run(model_dir, text_ids, knobs, "pyramidkv")
    ref = reference(prompt, knobs["pyramidkv"], 64)
    ranks = run["kept"]
    assert len(ranks) == 3
    joined = [[h for rank in ranks for h in rank[layer]] for layer in range(30)]  # each rank's head
    assert_kept_as_reference(joined, ref["kept"])
    assert run["tokens"] == ref["tokens"]


def test_a_batch_and_a_prefix_hit(model_dir, text_ids, prompt):
    """Three requests in one batch (two over the budget, one under it, which keeps vLLM's own layout),
    then a fourth sharing the first's first 256 tokens: each gives its own transformers-path tokens
    and kept positions; the fourth reads its first 256 tokens from the prefix cache (the first's
    prompt blocks, left whole by its eviction)."""
    batch = [prompt, text_ids[350:550], text_ids[600:700]]
    later = text_ids[:256] + text_ids[700:760]
    run = engine_run(model_dir, [*batch, {"ids": later, "after": 0}], ADAKV)
    for i, p in enumerate([*batch, later]):
        ref = reference(p, ADAKV)
        assert run["tokens"][i] == ref["tokens"], f"request {i}"
        if len(p) > ADAKV["max_capacity_prompt"]:
            (kept,) = run["kept"][i]
            assert_kept_as_reference(kept, ref["kept"])
    assert run["cached"][3] == 256


@pytest.mark.parametrize("knobs", [ADAKV, PYRAMIDKV], ids=["adakv", "pyramidkv"])
def test_the_pool_holds_the_fewest_blocks_the_pages_need(model_dir, prompt, knobs):
    """With prefix caching the step that evicts holds the prompt's blocks and the 5 fresh ones its
    heads' pages may need (``ceil(128 / 32) + 1``, whatever the heads' split); after it, the fewest
    blocks that hold its heads' pages while they decode (the worker's count, a brute-force search over
    the kept lengths here), then as many as that count and one token need; every block is back in the
    pool at the end. PyramidKV's first layers keep up to 219 entries per head, its last 37: the layers'
    pages are one pool."""
    ref = reference(prompt, knobs)
    counted = fewest_length([[len(h) for h in heads_kept(layer)] for layer in ref["kept"]], BLOCK)
    run = engine_run(model_dir, [prompt], knobs)
    start = run["free_at_start"]
    last_chunk = next(i for i, (s, a) in enumerate(run["steps"]) if a != s)
    scheduled, after = run["steps"][last_chunk]
    bound = blocks(ADAKV["max_capacity_prompt"]) + 1
    assert start - scheduled == blocks(PROMPT_LEN) + bound
    assert start - after == blocks(counted) <= bound
    assert start - run["steps"][last_chunk + 1][0] == blocks(counted + 1)
    assert run["held"][0] == blocks(PROMPT_LEN) + bound
    assert run["steps"][-1][1] == start


@pytest.mark.quick
@pytest.mark.parametrize(
    "knobs, ranks, why",
    [
        (ADAKV, 3, None),
        (LAYER_DEFENSIVEKV, 3, None),
        ({"method": "defensivekv", "decode_interval": 32}, 3, None),
        (ADAKV, 2, "does not divide the model's 3 KV heads"),
    ],
    ids=["adakv", "layer-defensivekv", "defensivekv-decoding", "adakv-replicated"],
)
def test_tensor_parallelism_refused_where_a_heads_scores_read_the_others(model_dir, monkeypatch, knobs, ranks, why):
    """AdaKV shares a layer's budget among all its KV heads and (Layer-)DefensiveKV's scores read every head's
    value norms: every rank gathers them (``ranks``), re-evicting while decoding too. Ranks that do not divide
    the KV heads replicate them, so the gathered heads are not the model's: refused."""
    from vllm.engine.arg_utils import EngineArgs

    from restkv.vllm.hooks import install
    from restkv.vllm.hooks.refusals import refusals

    monkeypatch.setenv("RESTKV_VLLM", json.dumps(knobs))
    install()
    config = EngineArgs(model=model_dir, dtype="float32", max_model_len=1024).create_engine_config()
    assert refusals(config, settings.from_env()) == []
    config.parallel_config.tensor_parallel_size = ranks
    lines = refusals(config, settings.from_env())
    if why is None:
        assert lines == []
    else:
        (line,) = lines
        assert why in line and "--tensor-parallel-size" in line


@pytest.mark.both_cores
@pytest.mark.parametrize("name", ["adakv", "headkv", "lukv", "snapkv-global", "layer-defensivekv", "defensivekv"])
def test_a_split_across_heads_under_tensor_parallelism(model_dir, text_ids, lukv, headkv, name):
    """AdaKV's, HeadKV's, LU-KV's and a cross-layer budget's counts depend on every head's (Layer-DefensiveKV's
    scores on every head's value norms too): three ranks of one KV head each gather them
    (``restkv.vllm.ranks``, ``Observation.every_head``) and keep, head by head, the transformers path's
    positions, and give its tokens; AdaKV, LU-KV and DefensiveKV evict again every 32 tokens (the ranks' widest
    heads differ then: every rank lays its heads out at the widest over the ranks, as one device does; a
    cross-layer budget evicts at the prompt's end only, as ``configure()``)."""
    knobs = tp_knobs(lukv, headkv)
    prompt, run = tp_run(model_dir, text_ids, knobs, name)
    ref = reference(prompt, knobs[name], 64)
    ranks = run["kept"]
    assert len(ranks) == 3
    joined = [[h for rank in ranks for h in rank[layer]] for layer in range(30)]  # each rank's head
    assert len({len(heads_kept([h])[0]) for layer in joined for h in layer}) > 1, "every head kept the same count"
    assert_kept_as_reference(joined, ref["kept"])
    assert run["tokens"] == ref["tokens"]


def test_headkv_keeps_and_decodes_as_restkv(model_dir, prompt, headkv):
    """HeadKV's counts from a head-importance table (a skewed one, SmolLM2's 30 layers x 9 heads),
    read by the scheduler and the worker as configure() reads it."""
    keeps_and_decodes_as_restkv(model_dir, prompt, headkv)


@pytest.mark.parametrize(
    "vllm",
    [pytest.param({}, marks=pytest.mark.quick), {"max_num_batched_tokens": 2048}],
    ids=["chunked-prefill", "whole-prefill"],
)
def test_a_budget_shared_across_layers_keeps_decodes_and_frees_as_measured(model_dir, prompt, vllm):
    """Layer-DefensiveKV (``layer_budget="global"``, l2 value norms): one top-k over every layer's and
    head's scores once the step's layers have run, so its layers keep different counts. Its kept
    positions per layer and head and its tokens are the transformers path's; the step that evicts
    holds the bound's blocks (every layer keeping all it held, and a block), its own (never cached,
    prefix caching on); after it, the request holds the count the worker measured and sent with the step's output
    (the fewest blocks its heads' pages need while they decode), and every block is back at the end."""
    keeps_and_decodes_as_restkv(model_dir, prompt, LAYER_DEFENSIVEKV, **vllm)
    ref = reference(prompt, LAYER_DEFENSIVEKV)
    per_layer = [sum(len(h) for h in heads_kept(layer)) for layer in ref["kept"]]
    assert len(set(per_layer)) > 1, "every layer kept the same count"
    measured = fewest_length([[len(h) for h in heads_kept(layer)] for layer in ref["kept"]], BLOCK)
    assert max(-(-n // 3) for n in per_layer) + BLOCK > measured  # its largest layer would hold more
    run = engine_run(model_dir, [prompt], LAYER_DEFENSIVEKV, **vllm)
    start = run["free_at_start"]
    evicting = next(i for i, (s, a) in enumerate(run["steps"]) if a != s)
    scheduled, after = run["steps"][evicting]
    assert start - scheduled == blocks(PROMPT_LEN + BLOCK)
    assert start - after == blocks(measured) < blocks(PROMPT_LEN)
    assert run["steps"][-1][1] == start


@pytest.mark.parametrize(
    "knobs",
    [pytest.param(ADAKV, marks=pytest.mark.quick), PYRAMIDKV, {**PYRAMIDKV, "head_budget": "adakv"}],
    ids=["adakv", "pyramidkv", "pyramidkv-adakv"],
)
def test_per_head_budgets_evict_while_decoding_as_restkv(model_dir, prompt, knobs):
    evicts_while_decoding_as_restkv(model_dir, prompt, knobs)


def test_lukv_evicts_while_decoding_as_restkv(model_dir, prompt, lukv):
    """LU-KV while decoding: each check's counts follow the curve's row at the heads' laid-out width, so the
    scheduler gives the evicting step all the request holds and a block, then the worker's count."""
    evicts_while_decoding_as_restkv(model_dir, prompt, lukv)


def evicts_while_decoding_as_restkv(model_dir, prompt, knobs):
    """decode_interval=32 over 200 tokens: every check reads the heads' pages laid out as configure()
    lays out its heads (older entries, a gap, the newest window), selects again and places the heads on
    the blocks the scheduler keeps; the tokens are the transformers path's, the request never holds
    more than its counted entries plus the interval (plus the prompt's blocks during its first
    eviction), and every block is back at the end."""
    knobs = {**knobs, "decode_interval": 32}
    ref = reference(prompt, knobs, 200)
    run = engine_run(model_dir, [prompt], knobs, new_tokens=200)
    assert run["tokens"][0] == ref["tokens"]
    cfg = settings.from_env({"restkv": knobs})
    settings.bind_model(cfg, 30, 9, 3)
    bound = settings.room(cfg, knobs["max_capacity_prompt"], BLOCK, PROMPT_LEN)
    assert run["held"][0] <= blocks(PROMPT_LEN) + blocks(bound)
    evicting = next(i for i, (s, a) in enumerate(run["steps"]) if a != s)
    held_after = [run["free_at_start"] - after for _, after in run["steps"][evicting:-1]]
    first = fewest_length([[len(h) for h in heads_kept(layer)] for layer in ref["kept"]], BLOCK)
    assert held_after[0] == blocks(first) and max(held_after) <= blocks(bound + 32)
    assert run["steps"][-1][1] == run["free_at_start"]


@pytest.mark.parametrize("knobs", [ADAKV, PYRAMIDKV], ids=["adakv", "pyramidkv"])
def test_a_decoding_ratio_with_per_head_budgets_as_restkv(model_dir, prompt, knobs):
    """decode_compression_ratio=0.5 every 32 tokens over 200: each check keeps half the tokens seen, AdaKV's
    split of it, PyramidKV's schedule read at that count; the tokens are the transformers path's and every
    block is back at the end."""
    knobs = {**knobs, "decode_interval": 32, "decode_compression_ratio": 0.5}
    ref = reference(prompt, knobs, 200)
    run = engine_run(model_dir, [prompt], knobs, new_tokens=200)
    assert run["tokens"][0] == ref["tokens"]
    assert run["steps"][-1][1] == run["free_at_start"]
