"""An FP8 KV cache (``kv_cache_dtype="fp8"``) under the plugin: vLLM's CPU writer's bytes read through
the layer's scales, and the packaged model served over it.

Checked: the entries vLLM's CPU backend writes (its ISA's packing, quantized by its own kernel: keys and
values FP8 holds exactly at the scales, so its rounding toward zero does not enter) read back as written,
and kept entries move byte for byte; with
SnapKV and ReST-KV (``method="restkv"``) on one FP8 engine, a prompt the budget covers answers as plain
vLLM over FP8 does, and prompts over the budget keep the positions the same engine over the model's
dtype keeps, but for the few near ties FP8's rounding moves in each head (``FIRST_LAYER`` and the
shares below it), every block back in the pool at the end.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch
from harness import DECODING, SNAPKV, cpu_isa, engine_run, fp8_entries
from vllm import _custom_ops as ops

from restkv.vllm.hooks import attention

# kv_cache_dtype -> the float8 type vLLM's CPU writer stores
TYPES = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.quick
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_cache_dtype", list(TYPES))
def test_the_cpu_backends_fp8_entries_read_through_the_layers_scales(kv_cache_dtype, dtype):
    isa = cpu_isa(dtype, kv_cache_dtype)
    g = torch.Generator().manual_seed(0)
    blocks, heads, bs, d = 6, 2, 32, 64
    cache = torch.zeros(blocks, heads, bs, 2 * d, dtype=torch.uint8)
    scales = torch.tensor(0.25), torch.tensor(3.0)
    layer = SimpleNamespace(isa=isa, kv_cache_dtype=kv_cache_dtype, dtype=dtype, _k_scale=scales[0], _v_scale=scales[1])
    slots = torch.randperm(blocks * bs, generator=g)[:70]
    keys, values = (fp8_entries((len(slots), heads, d), TYPES[kv_cache_dtype], float(s), dtype, g) for s in scales)
    key_cache, value_cache = cache.view(blocks, heads, 2 * bs, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        keys, values, key_cache, value_cache, slots, isa,
        k_scale=float(scales[0]), v_scale=float(scales[1]), kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    paged = attention.cpu(SimpleNamespace(head_size=d), layer, cache, bs)
    read_keys, read_values = paged.read(slots)
    assert read_keys.dtype == torch.float32
    assert torch.equal(read_keys, keys.float()) and torch.equal(read_values, values.float())

    positions = torch.randint(0, len(slots), (heads, 9), generator=g)
    entries = paged.stored(slots, positions)
    assert all(x.dtype == TYPES[kv_cache_dtype] for x in entries)  # bytes, not values
    paged.write(slots[:9], *entries)
    moved_keys, moved_values = paged.read(slots[:9])
    for h in range(heads):  # head h's kept entries in the first 9 slots, in order
        assert torch.equal(moved_keys[:, h], keys[positions[h], h].float())
        assert torch.equal(moved_values[:, h], values[positions[h], h].float())


RESTKV_KNOBS = {"method": "restkv", "max_capacity_prompt": 128, "window_size": 32}
LENGTHS = (100, 300, 300)  # under the budget (SnapKV's knobs), over it with SnapKV's, over it with ReST-KV's
# shares of the positions an FP8 run keeps that the model's dtype's run keeps too, measured (SnapKV, ReST-KV):
# layer 0, whose queries are alike (only the keys' rounding differs), 0.997 and 0.995; every layer 0.968 and
# 0.967; the least of any head 0.922 and 0.914. Few heads keep the very same set (0.033 and 0.044 of the
# layers x heads): FP8's rounding swaps about 3 of the 96 entries each head selects, past the window.
FIRST_LAYER, EVERY_LAYER, ANY_HEAD = 0.98, 0.93, 0.85


def served(model_dir, text_ids, kv_cache_dtype):
    prompts = [text_ids[:n] for n in LENGTHS]
    return engine_run(model_dir, prompts, RESTKV_KNOBS, request_knobs=[SNAPKV, SNAPKV, None], kv_cache_dtype=kv_cache_dtype)


def pairs(layer: list) -> set:
    """A layer's kept (KV head, position) pairs (-1 pads a head shorter than the layer's widest)."""
    return {(h, p) for h, head in enumerate(layer) for p in head if p >= 0}


def shares(ours: list, theirs: list) -> list:
    """Per layer, per KV head: the share of ``theirs``' kept positions ``ours`` keeps too."""
    return [[len(set(a) & set(b)) / len(b) for a, b in zip(la, lb)] for la, lb in zip(ours, theirs)]


@pytest.mark.vllm
def test_an_fp8_cache_evicts_as_the_models_dtype_does(model_dir, text_ids):
    fp8 = served(model_dir, text_ids, "fp8")
    plain = engine_run(model_dir, [text_ids[: LENGTHS[0]]], None, kv_cache_dtype="fp8")
    assert fp8["tokens"][0] == plain["tokens"][0]  # the budget covers it: nothing evicted
    assert fp8["kept"][0] == []
    auto = served(model_dir, text_ids, "auto")
    for i, method in ((1, "SnapKV"), (2, "ReST-KV")):
        (ours,), (theirs,) = fp8["kept"][i], auto["kept"][i]
        assert len(ours) == 30 and all(len(h) == 128 for layer in ours for h in layer)
        share = shares(ours, theirs)
        heads = [s for layer in share for s in layer]
        first, every = sum(share[0]) / len(share[0]), sum(heads) / len(heads)
        print(f"{method}: layer 0 {first:.3f}, every layer {every:.3f}, least head {min(heads):.3f} kept alike")
        assert first >= FIRST_LAYER and every >= EVERY_LAYER and min(heads) >= ANY_HEAD
    assert fp8["finish"] == ["length"] * 3
    assert fp8["steps"][-1][1] == fp8["free_at_start"]  # every block back in the pool


# per-layer budgets each equal to the uniform one: the heads' own pages (written by the backend's writer,
# kept entries moved as stored, read back through the layer's scales, settled), selecting what SnapKV selects
PER_LAYER = {**DECODING, "layer_ratios": ",".join(["128"] * 30)}
ADAKV = {"method": "adakv", "max_capacity_prompt": 128, "window_size": 32, "decode_interval": 32}


@pytest.mark.vllm
def test_per_head_pages_over_fp8_answer_as_the_uniform_budget_they_equal(model_dir, text_ids):
    """Over an FP8 cache, per-layer budgets that each equal SnapKV's uniform one (``layer_ratios`` of 128)
    keep every head's entries on pages of its own and evict every 32 generated tokens from them; they
    keep the very positions uniform SnapKV keeps over FP8 and answer the very tokens, so no byte was
    quantized again on the way. AdaKV's own split over FP8 keeps nearly the positions it keeps over the
    model's dtype; every block is back at the end."""
    prompt = text_ids[:300]
    uniform = engine_run(model_dir, [prompt], DECODING, new_tokens=80, kv_cache_dtype="fp8")
    pages = engine_run(model_dir, [prompt], PER_LAYER, new_tokens=80, kv_cache_dtype="fp8")
    assert pages["kept"][0] == uniform["kept"][0] and len(pages["kept"][0][0]) == 30
    assert pages["tokens"][0] == uniform["tokens"][0]
    adakv = engine_run(model_dir, [prompt], ADAKV, new_tokens=80, kv_cache_dtype="fp8")
    for run in (pages, adakv):
        assert run["finish"] == ["length"] and run["steps"][-1][1] == run["free_at_start"]
    auto = engine_run(model_dir, [prompt], ADAKV, new_tokens=80)
    (ours,), (theirs,) = adakv["kept"][0], auto["kept"][0]
    # per layer its (head, position) pairs: AdaKV's heads share the layer's budget (-1 pads a shorter head)
    ours, theirs = ([pairs(layer) for layer in run] for run in (ours, theirs))
    counts = [[sum(1 for h, _ in layer if h == head) for head in range(3)] for layer in theirs]
    assert any(len(set(c)) > 1 for c in counts)  # the heads keep counts of their own
    share = [len(a & b) / len(b) for a, b in zip(ours, theirs)]
    every = sum(len(a & b) for a, b in zip(ours, theirs)) / sum(map(len, theirs))
    print(f"AdaKV over FP8: layer 0 {share[0]:.3f}, every layer {every:.3f}, least layer {min(share):.3f} kept alike")
    assert share[0] >= FIRST_LAYER and every >= EVERY_LAYER and min(share) >= ANY_HEAD


@pytest.mark.quick
def test_fp8_runs_and_other_quantized_caches_are_refused_at_startup(model_dir, monkeypatch):
    """Per-tensor FP8 passes the start-up checks, with uniform and per-head budgets; scales per token and
    head are refused in one line naming the flag."""
    import json

    from vllm.engine.arg_utils import EngineArgs

    from restkv.vllm import settings
    from restkv.vllm.hooks import install
    from restkv.vllm.hooks.refusals import refusals

    monkeypatch.setenv("RESTKV_VLLM", json.dumps({"method": "snapkv", "max_capacity_prompt": 128}))
    install()
    config = EngineArgs(model=model_dir, dtype="float32", max_model_len=1024).create_engine_config()
    uniform = settings.from_env()
    per_head = settings.from_env({"restkv": {"method": "snapkv", "max_capacity_prompt": 128, "head_budget": "adakv"}})
    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        config.cache_config.cache_dtype = dtype
        assert refusals(config, uniform) == [] and refusals(config, per_head) == []
    for dtype in ("fp8_per_token_head", "int8_per_token_head", "nvfp4"):
        config.cache_config.cache_dtype = dtype
        (line,) = refusals(config, uniform)
        assert dtype in line and "--kv-cache-dtype auto, or fp8" in line and line.startswith("RESTKV_VLLM: ")
