"""The GPU backends' paged KV cache built and written by vLLM's own code, read and written by the
plugin (``restkv.vllm.hooks.attention.declared``, then ``restkv.vllm.paged``).

For each backend the plugin reads through ``declared`` (``hooks.BACKENDS``), each ``KVCacheLayout``
it takes and each dtype it supports: its spec from its own ``customize_spec``
(``customize_attention_spec``), three layers' pages allocated as vLLM's model runner allocates them
(``get_kv_cache_config_from_groups`` then ``allocate_kv_cache``: ``create_kv_cache_views``, kernel
blocks from ``select_common_block_size``), and keys and values written by the backend's own
``do_kv_cache_update`` through vLLM's cache writer: the reference of vLLM's kernel test
(tests/kernels/attention/test_cache.py, ``test_reshape_and_cache_flash``) and, where vLLM's Triton
runs on CPU (0.33's CUDA build under ``CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1``), its Triton writer
``triton_reshape_and_cache_flash``. The plugin must read the entries back, and its writes must
leave the whole buffer as the writer leaves it. Runs in .venv-vllm (0.32.0) and .venv-vllm033
(0.33.0); a backend whose module does not import (FlashInfer without its package) is skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import numpy as np
import torch
from vllm.config import CacheConfig, DeviceConfig, VllmConfig
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, get_kv_quant_mode
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import (
    allocate_kv_cache,
    customize_attention_spec,
    select_common_block_size,
)

from harness import assert_each_head_attends_its_entries, fp8_entries, heads_on_pages, step_entries  # noqa: E402
from restkv.vllm import heads, hooks, memory, paged
from restkv.vllm.hooks import attention

GPU = [name for name, (_, _, layout) in hooks.BACKENDS.items() if layout is attention.declared]
LAYERS, BLOCKS = ["l0", "l1", "l2"], 10
# (engine block size, kernel block: None for the backend's own choice, Hkv, d)
CASES = [(16, None, 1, 64), (32, None, 2, 128), (16, None, 8, 64), (64, 16, 2, 64)]


def planner():
    """vLLM's ``get_kv_cache_config_from_groups`` (0.32: kv_cache_utils; 0.33: kv_cache_planning)."""
    for module in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        try:
            return importlib.import_module(module).get_kv_cache_config_from_groups
        except (ImportError, AttributeError):
            continue
    raise AssertionError("vLLM's get_kv_cache_config_from_groups is not found")


def declaration(name: str):
    """(module, backend class, implementation class) of the plugin's backend ``name``: skipped where
    its module does not import; a failure where vLLM's declaration of it is not found."""
    module_name, impl_name, _ = hooks.BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        pytest.skip(f"{module_name} does not import here ({e}): vLLM cannot select it either")
    impl = getattr(module, impl_name)
    backends = [
        c
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, AttentionBackend) and c.__module__ == module_name
        and c.get_name() == name and c.get_impl_cls() is impl
    ]  # fmt: skip
    assert len(backends) == 1, f"{module_name}: no backend {name} declares {impl_name}"
    return module, backends[0], impl


@functools.cache
def vllm_config(block_size: int, layout: str) -> VllmConfig:
    from vllm.platforms import current_platform

    # 0.33's CUDA build without a GPU detects no platform and refuses "auto"; nothing here reads it
    device = "auto" if current_platform.device_type else "cpu"
    config = VllmConfig(
        cache_config=CacheConfig(block_size=block_size), device_config=DeviceConfig(device=device)
    )
    config.cache_config.kv_cache_layout = layout
    return config


def pages(backend, spec, block_size: int, layout: str, kernel: int | None):
    """(the raw buffer, each layer's page) as vLLM's model runner allocates them for ``spec``."""
    config = vllm_config(block_size, layout)
    groups = [KVCacheGroupSpec(list(LAYERS), spec)]
    kv_cache_config = planner()(config, groups, BLOCKS * len(LAYERS) * spec.page_size_bytes)
    kernel = kernel or select_common_block_size(block_size, [backend], [spec])
    try:
        caches = allocate_kv_cache(
            kv_cache_config, torch.device("cpu"), KVCacheLayout[layout], [kernel]
        )
    except ValueError as e:  # a layout vLLM cannot split into kernel blocks
        pytest.skip(f"vLLM: {e}")
    raw = caches[LAYERS[0]]
    return torch.tensor([], dtype=torch.int8).set_(raw.untyped_storage()), caches, kv_cache_config


def kernel_test_writer(key, value, key_cache, value_cache, slot_mapping, *args):
    """vLLM's reference for its cache writer (tests/kernels/attention/test_cache.py,
    ``test_reshape_and_cache_flash``, NHC): token i's key and value at ``[block, offset]`` of the
    key and value caches the backend hands it."""
    block_size = key_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        key_cache[slot // block_size, slot % block_size] = key[i]
        value_cache[slot // block_size, slot % block_size] = value[i]


def triton_writer(monkeypatch):
    """vLLM's Triton cache writer, run by Triton's interpreter on CPU tensors."""
    from vllm.triton_utils import HAS_TRITON

    if not (HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip(
            "vLLM's Triton runs on CPU with CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 (0.33)"
        )
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

    # the wrapper sizes its tiles by the device's capability (a tuning choice); CPU tensors have none
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    return triton_reshape_and_cache_flash


WRITERS = {"kernel_test": lambda monkeypatch: kernel_test_writer, "triton": triton_writer}


def writes_through(monkeypatch, module, write) -> None:
    """The backend ``module``'s cache writer (each name a backend calls; FlashAttention's is absent where
    vLLM's CUDA ops are) replaced by ``write``."""
    for writer_name in ("reshape_and_cache_flash", "triton_reshape_and_cache_flash"):
        monkeypatch.setattr(module, writer_name, write, raising=False)
    monkeypatch.setattr(torch.ops, "_C_cache_ops", SimpleNamespace(reshape_and_cache_flash=write))


def allocated(backend, impl_cls, spec, layout: str, kernel: int | None):
    """(a function allocating the caches of ``spec`` as the backend customizes it: ``pages``; the backend's
    implementation for its KV heads and twice as many query heads; the customized spec)."""
    spec = customize_attention_spec(backend, spec)
    impl = impl_cls(
        num_heads=2 * spec.num_kv_heads, head_size=spec.head_size, scale=spec.head_size**-0.5,
        num_kv_heads=spec.num_kv_heads, alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto",
    )  # fmt: skip
    return functools.partial(pages, backend, spec, spec.block_size, layout, kernel), impl, spec


def layer_of(backend, spec, model_dtype, kv_cache_dtype="auto"):
    """The attention layer's attributes the plugin and ``do_kv_cache_update`` read."""
    one = torch.tensor(1.0)
    return SimpleNamespace(
        attn_backend=backend, kv_cache_dtype=kv_cache_dtype, kv_cache_torch_dtype=spec.dtype,
        dtype=model_dtype, _k_scale=one, _v_scale=one,
    )  # fmt: skip


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("block_size, kernel, heads, d", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", [layout.name for layout in KVCacheLayout])
@pytest.mark.parametrize("name", GPU)
def test_the_plugin_reads_and_writes_each_entry_where_vllm_writes_it(
    monkeypatch, name, layout, dtype, block_size, kernel, heads, d, writer
):
    module, backend, impl_cls = declaration(name)
    taken = backend.supported_kv_cache_layouts() or tuple(KVCacheLayout)
    if KVCacheLayout[layout] not in taken:
        pytest.skip(f"{name} does not take {layout}")
    if dtype not in backend.supported_dtypes:
        pytest.skip(f"{name} does not run {dtype}")
    writes_through(monkeypatch, module, WRITERS[writer](monkeypatch))

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=d, dtype=dtype)
    with_vllm, impl, spec = allocated(backend, impl_cls, spec, layout, kernel)
    written, caches, kv_cache_config = with_vllm()
    layer = layer_of(backend, spec, dtype)
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(kv_cache_config.num_blocks * block_size, generator=g)[:40]
    keys, values = (torch.randn(len(slots), heads, d, generator=g).to(dtype) for _ in range(2))
    impl.do_kv_cache_update(layer, keys, values, caches["l1"], slots)  # the middle layer of three
    assert written.any()

    read_keys, read_values = attention.declared(impl, layer, caches["l1"], block_size).read(slots)
    assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
    blank, blank_caches, _ = with_vllm()
    attention.declared(impl, layer, blank_caches["l1"], block_size).write(slots, keys, values)
    assert torch.equal(blank, written)  # the writer's elements, and no other (nor another layer's)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("name", GPU)
def test_an_fp8_page_reads_through_the_layers_scales(monkeypatch, name, layout, kv_cache_dtype):
    """An FP8 cache as vLLM allocates it for the backend, written by its ``do_kv_cache_update`` through
    vLLM's Triton writer (which quantizes, at the layer's scales): the plugin reads each entry within one
    float8 step of the key or value written, and its write of the entries as stored leaves the buffer as
    the writer left it."""
    module, backend, impl_cls = declaration(name)
    if kv_cache_dtype not in backend.supported_kv_cache_dtypes or KVCacheLayout[layout] not in (
        backend.supported_kv_cache_layouts() or tuple(KVCacheLayout)
    ):
        pytest.skip(f"{name} does not take {kv_cache_dtype} in {layout}")
    write = triton_writer(monkeypatch)
    # its FP8 needs a device of compute capability 8.9 (fp8e4nv); the interpreter runs it on CPU
    monkeypatch.setattr(importlib.import_module(write.__module__), "_is_supported_kv_cache_dtype", lambda _: True)
    writes_through(monkeypatch, module, write)
    heads, d, block_size = 2, 64, 16
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=d, dtype=torch.uint8,
        kv_quant_mode=get_kv_quant_mode(kv_cache_dtype),
    )  # fmt: skip
    with_vllm, impl, spec = allocated(backend, impl_cls, spec, layout, None)
    written, caches, kv_cache_config = with_vllm()
    impl.kv_cache_dtype = kv_cache_dtype  # FlashAttention's __init__ refuses FP8 without its CUDA kernels
    scales = torch.tensor(0.25), torch.tensor(3.0)
    layer = layer_of(backend, spec, torch.bfloat16, kv_cache_dtype)
    layer._k_scale, layer._v_scale = scales
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(kv_cache_config.num_blocks * block_size, generator=g)[:40]
    ours = attention.declared(impl, layer, caches["l1"], block_size)
    # vLLM's Triton writer stores any FP8 cache as the platform's e4m3 (triton_reshape_and_cache_flash)
    fp8 = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" and name != "TRITON_ATTN" else torch.float8_e4m3fn
    keys, values = (fp8_entries((len(slots), heads, d), fp8, float(s), torch.bfloat16, g) for s in scales)
    impl.do_kv_cache_update(layer, keys, values, caches["l1"], slots)
    assert written.any()

    read_keys, read_values = ours.read(slots)
    assert read_keys.dtype == torch.float32
    assert torch.equal(read_keys, keys.float()) and torch.equal(read_values, values.float())
    blank, blank_caches, _ = with_vllm()
    entries = ours.stored(slots, torch.arange(len(slots)).expand(heads, -1))
    attention.declared(impl, layer, blank_caches["l1"], block_size).write(slots, *entries)
    assert torch.equal(blank, written)  # the writer's bytes, and no other (nor another layer's)


@pytest.mark.parametrize("name", GPU)
def test_a_quantized_page_other_than_fp8_is_refused_naming_the_backend(monkeypatch, name):
    """A cache of a quantized type the plugin does not read (here int8 per token and head, as bytes of
    a plain FP8 spec's page): not the model's dtype."""
    _, backend, _ = declaration(name)
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8,
        kv_quant_mode=get_kv_quant_mode("fp8"),
    )  # fmt: skip
    spec = customize_attention_spec(backend, spec)
    _, caches, _ = pages(backend, spec, 16, "LBHNC", None)
    impl = SimpleNamespace(num_kv_heads=2, head_size=64)
    with pytest.raises(ValueError, match=f"{name}'s KV cache .* not the model's torch.bfloat16"):
        attention.declared(impl, layer_of(backend, spec, torch.bfloat16, "int8_per_token_head"), caches["l1"], 16)


@pytest.mark.parametrize("heads, refused", [(2, "2 head slots for 2 KV heads"), (1, "ambiguous")])
def test_two_packed_planes_are_refused(monkeypatch, heads, refused):
    """vLLM's two-plane page (ROCm's ``customize_spec``: K and V as 2 head slots of Hkv d each,
    packed within) has the last-axis page's shape at Hkv = 2 and the head-axis page's declaration at
    Hkv = 1: the plugin refuses both."""
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionBackend

    spec = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=64, dtype=torch.bfloat16)
    spec = RocmAttentionBackend.customize_spec(spec)
    assert spec.num_head_slots == 2
    _, caches, _ = pages(RocmAttentionBackend, spec, 16, "LHBNC", 16)
    assert caches["l1"].shape[1] == 2 and caches["l1"].shape[3] == heads * 64
    impl = SimpleNamespace(num_kv_heads=heads, head_size=64)
    layer = layer_of(RocmAttentionBackend, spec, torch.bfloat16)
    with pytest.raises(ValueError, match=refused):
        attention.declared(impl, layer, caches["l1"], 16)


def test_the_core_tests_copy_of_the_layouts_is_vllms():
    """tests/core/test_vllm_layouts.py runs without vLLM on a copy of ``KVCacheLayout``."""
    path = Path(__file__).parents[1] / "core" / "test_vllm_layouts.py"
    spec = importlib.util.spec_from_file_location("core_layouts", path)
    core = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(core)
    assert core.LAYOUTS == {layout.name: layout.value for layout in KVCacheLayout}


@pytest.mark.parametrize("layout", [layout.name for layout in KVCacheLayout])
def test_a_page_of_2_hkv_head_slots_is_read_on_its_head_axis(monkeypatch, layout):
    """FlashInfer's NVFP4 declaration (``customize_spec``: 2 Hkv head slots of one head's content)
    at the model's dtype: vLLM allocates [B, 2 Hkv, N, d]; FlashInfer's ``do_kv_cache_update``
    splits it into keys and values as quoted below (its module needs the flashinfer package)."""
    heads, d, block_size = 2, 64, 16
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=d, dtype=torch.bfloat16
    )
    spec = dataclasses.replace(spec, num_head_slots=2 * heads, state_content_bytes=d * 2)
    written, caches, kv_cache_config = pages(None, spec, block_size, layout, block_size)
    assert tuple(caches["l1"].shape[1:]) == (2 * heads, block_size, d)
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(kv_cache_config.num_blocks * block_size, generator=g)[:40]
    keys, values = (torch.randn(len(slots), heads, d, generator=g).bfloat16() for _ in range(2))
    # flashinfer.py, FlashInferImpl.do_kv_cache_update, is_kvcache_nvfp4: "K heads first, then V"
    k_cache, v_cache = caches["l1"].transpose(1, 2).split(heads, dim=-2)
    kernel_test_writer(keys, values, k_cache, v_cache, slots)

    def page(c):
        return paged.declared(c, "FLASHINFER", heads, d, block_size, torch.bfloat16, 2 * heads)

    read_keys, read_values = page(caches["l1"]).read(slots)
    assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
    blank, blank_caches, _ = pages(None, spec, block_size, layout, block_size)
    page(blank_caches["l1"]).write(slots, keys, values)
    assert torch.equal(blank, written)


def model_config(tmp_path, heads: int, kv_heads: int, d: int):
    """vLLM's ``ModelConfig`` of a Llama with these heads (a config file only: nothing loads weights)."""
    from transformers import LlamaConfig
    from vllm.config import ModelConfig

    LlamaConfig(
        hidden_size=heads * d, num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=3,
        intermediate_size=4 * heads * d, vocab_size=256,
    ).save_pretrained(tmp_path)  # fmt: skip
    return ModelConfig(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True)


def interpreted_triton(monkeypatch):
    """vLLM's Triton attention module, its kernels run by Triton's interpreter on CPU tensors, and a
    record of whether each ``unified_attention`` call ran the split-K (3D) kernel: its scratch
    is filled with NaN before the call, and the 3D kernel alone writes it."""
    triton_writer(monkeypatch)  # skips where vLLM's Triton does not run on CPU
    module, backend, impl_cls = declaration("TRITON_ATTN")
    used_3d = []
    original = module.unified_attention

    def spy(**kwargs):
        kwargs["softmax_segm_max"].fill_(float("nan"))
        original(**kwargs)
        used_3d.append(bool(kwargs["softmax_segm_max"].isfinite().any()))

    monkeypatch.setattr(module, "unified_attention", spy)
    return backend, impl_cls, used_3d


@pytest.mark.parametrize(
    "counts, max_num_seqs, split_k",
    [([1, 1], 2, False), ([1, 1], 256, True), ([5, 1], 256, None)],
    ids=["decode, 2D kernel", "decode, 3D kernel", "a chunk and a token"],
)
def test_triton_attends_each_heads_own_pages(monkeypatch, tmp_path, counts, max_num_seqs, split_k):
    """Per-head budgets through vLLM's own Triton backend (``attention.single_head``: its metadata
    builder and ``forward`` for G query heads on one KV head), on three layers' caches as vLLM
    allocates them in its head-major layer-compact layout (``VLLM_KV_CACHE_LAYOUT=HND``, LBHNC),
    their pages one pool (``paged.whole``): two requests whose heads hold different numbers of
    entries, written through the backend's declared page, attend to each head's own entries,
    against a float64 softmax over them. The builder sizes its split-K scratch from ``max_num_seqs``,
    which the flattened batch (Hkv times the sequences) outgrows at 2: vLLM then runs the 2D kernel,
    and at 256 the 3D one (both checked). In float32 only: Triton's interpreter computes vLLM's kernel wrong
    in bfloat16 on vLLM's own layout too (tried)."""
    backend, impl_cls, used_3d = interpreted_triton(monkeypatch)
    bs, kv_heads, group, d, dtype = 16, 3, 3, 64, torch.float32
    spec = customize_attention_spec(
        backend, FullAttentionSpec(block_size=bs, num_kv_heads=kv_heads, head_size=d, dtype=dtype)
    )
    _, caches, _ = pages(backend, spec, bs, "LBHNC", None)
    whole, first = paged.whole(caches)
    impl = impl_cls(
        num_heads=kv_heads * group, head_size=d, scale=d**-0.5, num_kv_heads=kv_heads, alibi_slopes=None,
        sliding_window=None, kv_cache_dtype="auto",
    )  # fmt: skip
    layer = layer_of(backend, spec, dtype)
    layer.impl, layer.layer_name, layer._q_scale = impl, "l1", torch.tensor(1.0)
    config = VllmConfig(
        model_config=model_config(tmp_path, kv_heads * group, kv_heads, d),
        cache_config=CacheConfig(block_size=bs), device_config=DeviceConfig(device="cpu"),
    )  # fmt: skip
    config.scheduler_config.max_num_seqs = max_num_seqs
    builders: dict = {}
    attend = attention.single_head(layer, config, bs, torch.device("cpu"), builders)
    page = attention.declared(impl, layer, caches["l1"], bs)
    # every layer shares one builder: one split-K scratch, as restkv.vllm.memory counts it
    other = layer_of(backend, spec, dtype)
    other.impl, other.layer_name, other._q_scale = impl, "l2", torch.tensor(1.0)
    attention.single_head(other, config, bs, torch.device("cpu"), builders)
    (builder,) = builders.values()
    declared = sum(t.nbytes for t in vars(builder).values() if isinstance(t, torch.Tensor))
    estimate = memory.builder_bytes(memory.Model(3, kv_heads * group, kv_heads, d, 4 * d, 4))
    assert declared <= estimate, (declared, estimate)
    if max_num_seqs >= memory.TRITON_ROWS:  # 0.33.0 and 0.34.0 size it by max_num_seqs where fewer
        assert estimate <= kv_heads * 2 * declared, (declared, estimate)  # 0.32.0, 0.33.0: 128 // Hkv rows

    rng, g = np.random.default_rng(0), torch.Generator().manual_seed(0)
    free = [int(b) for b in rng.permutation(caches["l1"].shape[0])]
    # a head over two pages, one under one
    batch, entries = heads_on_pages(
        page.write_pages, counts, [20, 30], [0.6, 0.3, 0.1], bs, free, rng, g, d, dtype, step=False
    )  # the step's entries written by the backend's own writer, in ``attend``
    query = torch.randn(sum(counts), kv_heads * group, d, generator=g)
    rows = tuple(torch.from_numpy(a) for a in heads.flat_rows(np.arange(len(query)), kv_heads))
    keys, values = (heads.flatten(x, rows, kv_heads)[:, 0] for x in step_entries(entries, counts))
    out = torch.zeros_like(query)
    heads.unflatten(out, rows, kv_heads, attend(heads.flatten(query, rows, kv_heads), batch, caches["l1"], keys, values))
    assert_each_head_attends_its_entries(out, query, entries, counts, d**-0.5, 1e-5)
    assert whole.shape[0] == sum(c.shape[0] for c in caches.values()) and first["l1"] == caches["l0"].shape[0]
    if split_k is not None:
        assert used_3d == [split_k]


def test_per_head_pages_need_a_head_major_layout():
    """The same caches in vLLM's default layout (NHD, LBNHC) interleave each block's heads: the
    worker refuses per-head budgets at start-up (``paged.head_pages``, as ``hooks.covered`` calls it)."""
    _, backend, _ = declaration("TRITON_ATTN")
    spec = customize_attention_spec(
        backend, FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32)
    )
    _, caches, _ = pages(backend, spec, 16, "LBNHC", None)
    with pytest.raises(ValueError, match="not head-major"):
        paged.head_pages(caches["l1"])
    _, caches, _ = pages(backend, spec, 16, "LBHNC", None)
    assert paged.head_pages(caches["l1"]).shape == (caches["l1"].shape[0] * 3, 1, 16, 128)


@pytest.mark.parametrize(
    "name, layout, refused",
    [
        ("TRITON_ATTN", "LBHNC", None),
        ("TRITON_ATTN", "LBNHC", "not head-major .*needs VLLM_KV_CACHE_LAYOUT=HND$"),
        ("FLASH_ATTN", "LBHNC", "runs FLASH_ATTN .*--attention-backend TRITON_ATTN"),
    ],
)
def test_a_worker_takes_per_head_budgets_on_triton_in_a_head_major_layout_only(
    monkeypatch, tmp_path, name, layout, refused
):
    """``hooks.covered``, as the worker calls it once the KV cache exists: AdaKV on Triton's caches in
    vLLM's head-major layer-compact layout gets each layer's single-head attention and one pool of
    pages; in vLLM's default layout (NHD) it is refused in one line naming the variable to set, and on
    FlashAttention (whose builder plans for the model's heads) naming the backend that runs it."""
    from restkv.vllm import settings
    from restkv.vllm.worker import Worker

    _, backend, impl_cls = declaration(name)
    wrapped = attention.forward(attention.declared)(impl_cls.forward)
    wrapped._restkv = True  # as ``hooks.install`` marks it
    monkeypatch.setattr(impl_cls, "forward", wrapped)
    kv_heads, group, d, bs = 3, 3, 64, 16
    spec = customize_attention_spec(
        backend, FullAttentionSpec(block_size=bs, num_kv_heads=kv_heads, head_size=d, dtype=torch.float32)
    )
    _, caches, _ = pages(backend, spec, bs, layout, None)
    config = VllmConfig(
        model_config=model_config(tmp_path, kv_heads * group, kv_heads, d),
        cache_config=CacheConfig(block_size=bs), device_config=DeviceConfig(device="cpu"),
    )  # fmt: skip
    for name, cache in caches.items():
        impl = impl_cls(
            num_heads=kv_heads * group, head_size=d, scale=d**-0.5, num_kv_heads=kv_heads, alibi_slopes=None,
            sliding_window=None, kv_cache_dtype="auto",
        )  # fmt: skip
        layer = layer_of(backend, spec, torch.float32)
        layer.impl, layer.layer_name, layer.kv_cache = impl, name, cache
        config.compilation_config.static_forward_context[name] = layer
    cfg = settings.from_env({"restkv": {"method": "adakv", "max_capacity_prompt": 64}})
    worker = Worker(cfg, slots=4, caching=False, block_size=bs)
    worker.index_layers(dict.fromkeys(caches))
    groups = KVCacheConfig(BLOCKS, [], [KVCacheGroupSpec(list(caches), spec)])
    runner = SimpleNamespace(
        _restkv=worker, vllm_config=config, device=torch.device("cpu"), model_state=None, kv_cache_config=groups
    )
    if refused:
        with pytest.raises(RuntimeError, match=refused):
            hooks.covered(runner)
        return
    hooks.covered(runner)
    assert set(worker.attends) == set(LAYERS) and worker.backends == dict.fromkeys(LAYERS, "TRITON_ATTN")
    assert worker.space.first == {"l0": 0, "l1": BLOCKS, "l2": 2 * BLOCKS} and worker.space.heads == kv_heads



def test_triton_attends_each_heads_own_fp8_pages(monkeypatch, tmp_path):
    """Per-head budgets over an FP8 cache through vLLM's own Triton backend: the heads' held entries on their
    pages as stored (float8 bytes at the layer's scales), the step's written by the backend's own
    ``do_kv_cache_update`` on the pages (vLLM's Triton writer, interpreted), each head attending to its own
    entries against a float64 softmax over their values read through the scales."""
    backend, impl_cls, _ = interpreted_triton(monkeypatch)
    write = triton_writer(monkeypatch)
    # its FP8 needs a device of compute capability 8.9 (fp8e4nv); the interpreter runs it on CPU
    monkeypatch.setattr(importlib.import_module(write.__module__), "_is_supported_kv_cache_dtype", lambda _: True)
    bs, kv_heads, group, d, f8 = 16, 3, 3, 64, torch.float8_e4m3fn
    spec = customize_attention_spec(backend, FullAttentionSpec(
        block_size=bs, num_kv_heads=kv_heads, head_size=d, dtype=torch.uint8, kv_quant_mode=get_kv_quant_mode("fp8"),
    ))  # fmt: skip
    _, caches, _ = pages(backend, spec, bs, "LBHNC", None)
    impl = impl_cls(
        num_heads=kv_heads * group, head_size=d, scale=d**-0.5, num_kv_heads=kv_heads, alibi_slopes=None,
        sliding_window=None, kv_cache_dtype="fp8",
    )  # fmt: skip
    layer = layer_of(backend, spec, torch.float32, "fp8")
    layer.impl, layer.layer_name, layer._q_scale = impl, "l1", torch.tensor(1.0)
    layer._k_scale, layer._v_scale = torch.tensor(0.25), torch.tensor(3.0)
    config = VllmConfig(
        model_config=model_config(tmp_path, kv_heads * group, kv_heads, d),
        cache_config=CacheConfig(block_size=bs), device_config=DeviceConfig(device="cpu"),
    )  # fmt: skip
    attend = attention.single_head(layer, config, bs, torch.device("cpu"), {})
    page = attention.declared(impl, layer, caches["l1"], bs)
    scales = float(layer._k_scale), float(layer._v_scale)

    def exact(x, s):  # the value FP8 holds at scale s
        return (x / s).to(f8).float() * s

    def write_stored(slots, k, v):
        page.write_pages(slots, *((x / s).to(f8) for x, s in zip((k, v), scales)))

    rng, g, counts = np.random.default_rng(0), torch.Generator().manual_seed(0), [5, 1]
    free = [int(b) for b in rng.permutation(caches["l1"].shape[0])]
    shares = [0.6, 0.3, 0.1]
    batch, entries = heads_on_pages(write_stored, counts, [20, 30], shares, bs, free, rng, g, d, torch.float32, step=False)
    entries = [[(exact(k, scales[0]), exact(v, scales[1])) for k, v in kv] for kv in entries]
    query = torch.randn(sum(counts), kv_heads * group, d, generator=g)
    rows = tuple(torch.from_numpy(a) for a in heads.flat_rows(np.arange(len(query)), kv_heads))
    keys, values = (heads.flatten(x, rows, kv_heads)[:, 0] for x in step_entries(entries, counts))
    out = torch.zeros_like(query)
    heads.unflatten(out, rows, kv_heads, attend(heads.flatten(query, rows, kv_heads), batch, page.cache, keys, values))
    assert_each_head_attends_its_entries(out, query, entries, counts, d**-0.5, 1e-4)
