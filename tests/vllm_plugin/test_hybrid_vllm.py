"""A hybrid sliding-window model under the plugin: the packaged Gemma 3 270M (18 layers: five of a
512-token sliding window to each full-attention one; vLLM's hybrid allocator makes five sliding-window
KV cache groups and one full-attention group), with prefix caching and chunked prefill on.

Checked on one engine: ReST-KV (the paper's preset, the engine's knobs) on a 700-token prompt, then
SnapKV (a request's own knobs) on the same prompt, a prefix-cache hit: each request's greedy tokens and
its three full-attention layers' kept positions are those of restkv's transformers path with the same
knobs (which evicts Gemma 3's full-attention layers only); plain vLLM answers as plain transformers does;
step by step the sliding-window groups hold the blocks plain vLLM's do (vLLM frees their window, the
plugin never touches them), the full-attention group the kept entries' blocks; every block back in the
pool at the end. vLLM keeps sliding-window checkpoints for prefix hits at a prompt's last token only,
unless ``prefix_cache_retention_interval`` says more; the engine keeps one per block, so that the hit stops
where SnapKV's window begins. On a second engine, PyramidKV's per-layer budgets (the engine's knobs) and then
AdaKV's per-head split (a request's own), the same prompt again: the full-attention layers' heads each
on pages of their own, every head's kept positions and the greedy tokens the transformers path's. Over an FP8
KV cache, ReST-KV keeps nearly the positions it keeps over float32. The hybrid manager turned off is refused in
one line.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from harness import BLOCK, SNAPKV, blocks, engine_run, reference
from test_head_budgets_vllm import heads_kept


MODEL = "gemma3-270m"
LENGTH = 700  # past the 512-token window: the sliding-window groups free blocks of their own
NEW_TOKENS = 12
BUDGET = 128
RESTKV = {"preset": "paper", "max_capacity_prompt": BUDGET}
ADAKV = {"method": "adakv", "max_capacity_prompt": BUDGET, "window_size": 32}
PYRAMIDKV = {"method": "pyramidkv", "max_capacity_prompt": BUDGET, "window_size": 32}
# vLLM keeps a sliding window's prefix-cache checkpoints at a prompt's last token only, unless told an interval:
# every block's here, so that a hit can stop before the window's queries (``test_a_prefix_hit_...``)
ENGINE = {
    "enable_prefix_caching": True, "prefix_cache_retention_interval": BLOCK, "max_num_batched_tokens": 256,
    "max_model_len": 2048,
}  # fmt: skip
FULL_LAYERS = [5, 11, 17]
SHORT = 60  # a prompt near the budgets' smallest


@pytest.fixture(scope="module")
def gemma_prompt(gemma_ids) -> list[int]:
    return gemma_ids[:LENGTH]


@pytest.fixture(scope="module")
def runs(gemma_dir, gemma_prompt) -> tuple:
    """(plain vLLM, the plugin) on the prompt and then the same prompt again, once the first finished."""
    prompts = [gemma_prompt, {"ids": gemma_prompt}]
    plain = engine_run(gemma_dir, prompts, None, NEW_TOKENS, **ENGINE)
    evicted = engine_run(gemma_dir, prompts, RESTKV, NEW_TOKENS, request_knobs=[None, SNAPKV], **ENGINE)
    return plain, evicted


@pytest.fixture(scope="module")
def per_head(gemma_dir, gemma_prompt) -> dict:
    """An engine of per-layer budgets: PyramidKV (its knobs; it holds more blocks than AdaKV), then AdaKV's per-head
    split (a request's own) on the same prompt, then PyramidKV on a prompt of SHORT tokens."""
    prompts = [gemma_prompt, {"ids": gemma_prompt}, {"ids": gemma_prompt[-SHORT:]}]
    return engine_run(gemma_dir, prompts, PYRAMIDKV, NEW_TOKENS, request_knobs=[None, ADAKV], **ENGINE)


def test_plain_vllm_answers_as_plain_transformers(runs, gemma_prompt):
    plain, _ = runs
    assert plain["tokens"][0] == reference(gemma_prompt, {}, NEW_TOKENS, MODEL)["tokens"]


@pytest.mark.parametrize("index, knobs", [(0, RESTKV), (1, SNAPKV)], ids=["restkv-paper", "snapkv-prefix-hit"])
def test_the_full_attention_layers_keep_and_decode_as_restkv(runs, gemma_prompt, index, knobs):
    _, evicted = runs
    ref = reference(gemma_prompt, knobs, NEW_TOKENS, MODEL)
    assert [i for i, k in enumerate(ref["kept"]) if k is not None] == FULL_LAYERS
    (kept,) = evicted["kept"][index]  # one rank, its three evicted layers in order
    assert len(kept) == len(FULL_LAYERS)
    for ours, theirs in zip(kept, [ref["kept"][i] for i in FULL_LAYERS]):
        assert [sorted(h) for h in ours] == [sorted(h) for h in theirs]
    assert evicted["tokens"][index] == ref["tokens"]


@pytest.mark.parametrize("index, knobs", [(0, PYRAMIDKV), (1, ADAKV)], ids=["pyramidkv", "adakv-prefix-hit"])
def test_per_head_and_per_layer_budgets_keep_and_decode_as_restkv(per_head, runs, gemma_prompt, index, knobs):
    """Each full-attention layer's heads keep their own counts (PyramidKV's differ by layer; AdaKV's split over
    Gemma 3's one KV head per layer is the layer's budget) on pages of their own, as the transformers path; the
    sliding-window groups hold the blocks plain vLLM's do, step by step (the first request: plain vLLM's second
    has a longer prefix hit)."""
    if index == 0:
        ours, theirs = per_head["groups"][0], runs[0]["groups"][0]
        assert [row[:6] for row in ours] == [row[:6] for row in theirs]  # the steps, five sliding-window groups
    ref = reference(gemma_prompt, knobs, NEW_TOKENS, MODEL)
    (kept,) = per_head["kept"][index]
    assert len(kept) == len(FULL_LAYERS)
    for layer, ours, theirs in zip(FULL_LAYERS, kept, [ref["kept"][i] for i in FULL_LAYERS]):
        assert heads_kept(ours) == heads_kept(theirs), layer
    assert per_head["tokens"][index] == ref["tokens"]
    assert per_head["cached"][index] == [0, (LENGTH - ADAKV["window_size"]) // BLOCK * BLOCK][index]  # 640 of 700
    assert per_head["steps"][-1][1] == per_head["free_at_start"]


def test_a_short_prompt_under_per_layer_budgets_answers_as_restkv(per_head, gemma_prompt):
    """A short prompt (SHORT tokens) on the engine of per-layer budgets: answered as the transformers path
    answers it with the same knobs; every block back."""
    ref = reference(gemma_prompt[-SHORT:], PYRAMIDKV, NEW_TOKENS, MODEL)
    assert per_head["tokens"][2] == ref["tokens"] and per_head["finish"][2] == "length"
    assert per_head["steps"][-1][1] == per_head["free_at_start"]


# shares of the positions an FP8 run keeps that the float32 cache's run keeps too, measured in layers 5, 11 and 17:
# 0.94, 0.91 and 0.95 (FP8's rounding moves near ties; its greedy tokens differ from float32's here)
FP8_SHARE = 0.85


def test_an_fp8_cache_keeps_as_the_models_dtype_but_for_near_ties(gemma_dir, gemma_prompt, runs):
    """ReST-KV over an FP8 KV cache on the hybrid model: the full-attention layers keep nearly the positions they
    keep over float32, the sliding-window groups hold the blocks they hold there, step by step, and the pool is
    whole at the end."""
    fp8 = engine_run(gemma_dir, [gemma_prompt], RESTKV, NEW_TOKENS, kv_cache_dtype="fp8", **ENGINE)
    _, evicted = runs
    (ours,), (theirs,) = fp8["kept"][0], evicted["kept"][0]
    for layer, a, b in zip(FULL_LAYERS, ours, theirs):
        (a,), (b,) = ({p for p in h if p >= 0} for h in a), ({p for p in h if p >= 0} for h in b)
        assert len(a) == len(b) == BUDGET and len(a & b) / len(b) >= FP8_SHARE, layer
    assert [row[:6] for row in fp8["groups"][0]] == [row[:6] for row in evicted["groups"][0]]
    assert fp8["steps"][-1][1] == fp8["free_at_start"]


def test_a_prefix_hit_stops_before_the_windows_queries(runs):
    _, evicted = runs
    assert evicted["cached"][1] == (LENGTH - SNAPKV["window_size"]) // BLOCK * BLOCK  # 640 of 700


def test_the_sliding_windows_are_vllms_and_the_full_group_holds_the_kept_entries(runs):
    plain, evicted = runs
    ours, theirs = evicted["groups"][0], plain["groups"][0]
    assert [row[0] for row in ours] == [row[0] for row in theirs]  # the same steps
    full = 6  # the full-attention group's column (1 + its index: vLLM puts it last)
    for row, other in zip(ours, theirs):
        assert row[1:full] == other[1:full]  # five sliding-window groups, as plain vLLM's
        end = row[0]
        if end < LENGTH:
            assert row[full] == blocks(end)
        elif end == LENGTH:  # the prompt's blocks and the fresh blocks its kept entries go to
            assert row[full] == blocks(LENGTH) + blocks(BUDGET)
        else:
            assert row[full] == blocks(BUDGET + end - LENGTH)
    assert theirs[-1][1] < blocks(LENGTH)  # vLLM did free the blocks its window left
    assert evicted["steps"][-1][1] == evicted["free_at_start"]
    assert evicted["block_size"] == BLOCK


@pytest.mark.quick
@pytest.mark.parametrize("knobs", [SNAPKV, ADAKV], ids=["uniform", "per-head"])
def test_the_hybrid_manager_turned_off_is_refused_in_one_line(gemma_dir, monkeypatch, knobs):
    from vllm.engine.arg_utils import EngineArgs

    from restkv.vllm.hooks import install

    monkeypatch.setenv("RESTKV_VLLM", json.dumps(knobs))
    install()
    args = EngineArgs(model=gemma_dir, dtype="float32", max_model_len=1024, disable_hybrid_kv_cache_manager=True)
    with pytest.raises(ValueError) as refused:
        args.create_engine_config()
    (line,) = str(refused.value).splitlines()
    assert "--disable-hybrid-kv-cache-manager" in line and "gemma3-270m" in line
