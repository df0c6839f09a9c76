"""Each attention backend's ``forward``, followed by ``Worker.layer`` on the layer's paged cache.

vLLM writes a step's keys and values (``do_kv_cache_update``) before the backend's ``forward``, so
after it the cache holds every entry of the step. The layer's cache is read through its layout
(``restkv.vllm.paged``): the GPU backends' declared one (FlashAttention, FlashInfer, Triton: the
page view vLLM builds for the spec the backend's ``customize_spec`` declares, K and V found on its
last or head axis, checked against the layer), the CPU backend's probed from its own writer.
"""

from __future__ import annotations

import copy
import functools

import torch
from vllm.platforms import current_platform
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

from .. import paged
from .runner import CURRENT


def forward(layout):
    """A backend's ``forward`` followed by ``Worker.layer`` on the cache as ``layout(impl, layer,
    kv_cache, block_size)`` reads it (``block_size``: the engine's)."""

    def wrap(orig):
        @functools.wraps(orig)
        def wrapped(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
            out = orig(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
            worker = CURRENT[0]
            if worker is not None and worker.step and attn_metadata is not None and layer.layer_name in worker.layer_index:
                tokens = attn_metadata.num_actual_tokens
                q = query[:tokens].view(tokens, self.num_heads, self.head_size)
                softcap = getattr(self, "logits_soft_cap", None) or None  # 0: none
                paged_cache = _layer_layout(layout, self, layer, kv_cache, worker.block_size)
                worker.layer(layer.layer_name, q, paged_cache, self.scale, softcap, key, value, out)
            return out

        return wrapped

    return wrap


def _layer_layout(layout, impl, layer, kv_cache, block_size: int) -> paged.Paged:
    """``layout(impl, layer, kv_cache, block_size)``, kept on the layer while its cache is the same
    tensor (every step reads it)."""
    key = (kv_cache.data_ptr(), tuple(kv_cache.shape), tuple(kv_cache.stride()), kv_cache.dtype, block_size)
    kept = getattr(layer, "_restkv_layout", None)
    if kept is None or kept[0] != key:
        kept = layer._restkv_layout = (key, layout(impl, layer, kv_cache, block_size))
    return kept[1]


def declared(impl, layer, kv_cache, block_size: int) -> paged.Paged:
    """FlashAttention, FlashInfer, Triton: the cache as the backend declares it, checked against the
    layer's KV heads and head size, the engine's ``block_size`` and the model's dtype."""
    backend = layer.attn_backend
    heads, d = impl.num_kv_heads, impl.head_size
    key = (backend, heads, d, layer.kv_cache_dtype, layer.dtype, block_size)
    if key not in _HEAD_SLOTS:
        quant = get_kv_quant_mode(layer.kv_cache_dtype)
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=heads, head_size=d,
            dtype=layer.kv_cache_torch_dtype, kv_quant_mode=quant,
        )  # fmt: skip
        _HEAD_SLOTS[key] = backend.customize_spec(spec).num_head_slots
    name = backend.get_name()
    return paged.declared(kv_cache, name, heads, d, block_size, layer.dtype, _HEAD_SLOTS[key], fp8(layer, name))


def fp8(layer, backend: str) -> tuple | None:
    """A per-tensor FP8 cache's (float8 type of its bytes, k_scale, v_scale): the layer's scale tensors,
    which vLLM updates in place; None for any other ``kv_cache_dtype``. The type as ``backend`` writes
    it: e4m3 the platform's (``fp8_dtype``: e4m3fnuz on ROCm), e5m2 as such, except vLLM's Triton writer,
    which stores every FP8 cache as the platform's e4m3 (``triton_reshape_and_cache_flash``)."""
    stored = paged.FP8.get(layer.kv_cache_dtype)
    if stored is None:
        return None
    if stored is not torch.float8_e5m2 or backend == "TRITON_ATTN":
        stored = current_platform.fp8_dtype()
    return stored, layer._k_scale, layer._v_scale


# (backend, KV heads, head size, cache dtype, model dtype, block size) -> the head slots of its
# page as the backend's ``customize_spec`` declares them (vLLM's ``AttentionSpec.num_head_slots``)
_HEAD_SLOTS: dict = {}


def cpu(impl, layer, kv_cache, block_size: int) -> paged.Paged:
    """vLLM's CPU backend: [blocks, Hkv, block_size, 2 d], each block packed for its ISA by
    ``cpu_attn_reshape_and_cache`` (probed once per block shape, dtype and ISA)."""
    from vllm import _custom_ops as ops

    quantized = fp8(layer, "CPU_ATTN")

    def writer(cache, keys, values, slots):
        blocks, heads, size, _ = cache.shape
        key_cache, value_cache = cache.view(blocks, heads, 2 * size, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            keys.to(layer.dtype), values.to(layer.dtype), key_cache, value_cache, slots, layer.isa,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto" if quantized is None else layer.kv_cache_dtype,
        )  # fmt: skip

    return paged.probed(kv_cache, block_size, kv_cache.shape[1], impl.head_size, writer, layer.isa, quantized)


# the fields of vLLM's ``CommonAttentionMetadata`` ``single_head`` gives (every field without a default;
# ``hooks.unhooked`` checks them against the running vLLM)
COMMON_FIELDS = (
    "query_start_loc", "query_start_loc_cpu", "seq_lens", "num_reqs", "num_actual_tokens", "max_query_len",
    "max_seq_len", "block_table_tensor", "slot_mapping",
)  # fmt: skip

# the backends per-head budgets run on: their kernel reads the pages through the cache's strides (any
# head-major layout: block b is pages b * Hkv + h of one head, ``restkv.vllm.heads``) and their builder
# sizes nothing the flattened batch (Hkv times the sequences and tokens) can outgrow: the CPU backend's;
# Triton's, whose split-K scratch is sized from ``max_num_seqs`` but read only where it has a row per query
# token (vLLM 0.33.0's ``unified_attention`` runs its 2D kernel otherwise). FlashAttention's builder plans
# FA3's schedule for the model's query heads and FlashInfer's its wrappers for the model's heads: refused.
HEAD_PAGES = ("CPU_ATTN", "TRITON_ATTN")


def single_head(layer, vllm_config, block_size: int, device, builders: dict):
    """Layer ``layer``'s attention over single-head pages through its own backend: a function
    ``attend(query [Hkv T, G, d], batch: heads.FlatBatch, kv_cache, keys, values) -> [Hkv T, G, d]`` that
    writes the step's ``keys``, ``values`` [Hkv T, d] to the batch's slots with the backend's own writer
    (``do_kv_cache_update``: an FP8 cache's quantized as vLLM quantizes it) and runs the backend's metadata
    builder and implementation for G query heads on one KV head, on the layer's cache viewed as
    ``[blocks Hkv, 1, block_size, 2 d]`` (its pages). No attention code of its own. The layers share one
    builder per backend and geometry (``builders``, filled here): its buffers (Triton's split-K scratch)
    are one set for every layer, which run one after another (``restkv.vllm.memory``)."""
    impl = layer.impl
    group = impl.num_heads // impl.num_kv_heads
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=impl.head_size,
        dtype=layer.kv_cache_torch_dtype, kv_quant_mode=get_kv_quant_mode(layer.kv_cache_dtype),
    )  # fmt: skip
    kind = (layer.attn_backend.get_builder_cls(), group, spec)
    if kind not in builders:
        builders[kind] = kind[0](spec, [layer.layer_name], vllm_config, device)
        builders[kind].num_heads = group
    builder = builders[kind]
    flat = copy.copy(impl)
    flat.num_heads, flat.num_kv_heads, flat.num_queries_per_kv = group, 1, group
    forward = type(impl).forward
    forward = getattr(forward, "__wrapped__", forward)  # the backend's own, not the plugin's wrapper
    write = type(impl).do_kv_cache_update

    seen = [None, None]  # the cache last attended and its pages (every step's, a view made once)

    def attend(query, batch, kv_cache, keys, values):
        if seen[0] is not kv_cache:
            allocated = kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache  # FP8: vLLM's uint8
            seen[:] = kv_cache, paged.head_pages(allocated)
        write(flat, layer, keys[:, None], values[:, None], seen[1], batch.slot_mapping)
        rows = query.shape[0]
        values = (
            batch.query_start_loc, batch.query_start_loc_cpu, batch.seq_lens, len(batch.seq_lens), rows,
            batch.max_query_len, batch.max_seq_len, batch.block_table, batch.slot_mapping,
        )  # fmt: skip
        common = CommonAttentionMetadata(**dict(zip(COMMON_FIELDS, values)))
        output = query.new_empty(query.shape)
        forward(flat, layer, query, query[:, :1], query[:, :1], seen[1], builder.build(0, common), output=output)
        return output

    return attend
