"""Each attention backend's ``forward``, followed by ``Worker.layer`` on the layer's paged cache.

vLLM writes a step's keys and values (``do_kv_cache_update``) before the backend's ``forward``, so
after it the cache holds every entry of the step. The layer's cache is read through its layout
(``restkv.vllm.paged``): the GPU backends' declared one (FlashAttention, FlashInfer, Triton: a
logical ``[blocks, KV heads, block_size, 2 d]`` tensor, keys then values), the CPU backend's probed
from its own writer.
"""

from __future__ import annotations

import functools

from .. import paged
from .runner import CURRENT


def forward(layout):
    """A backend's ``forward`` followed by ``Worker.layer`` on the cache as ``layout(impl, layer,
    kv_cache)`` reads it."""

    def wrap(orig):
        @functools.wraps(orig)
        def wrapped(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
            out = orig(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
            worker = CURRENT[0]
            if worker is not None and worker.step and attn_metadata is not None:
                tokens = attn_metadata.num_actual_tokens
                q = query[:tokens].view(tokens, self.num_heads, self.head_size)
                softcap = getattr(self, "logits_soft_cap", None) or None  # 0: none
                worker.layer(layer.layer_name, q, layout(self, layer, kv_cache), self.scale, softcap)
            return out

        return wrapped

    return wrap


def declared(impl, layer, kv_cache) -> paged.Paged:
    """FlashAttention, FlashInfer, Triton: keys ``[..., :d]``, values ``[..., d:]`` of the logical
    ``[blocks, KV heads, block_size, 2 d]`` cache, in any physical order."""
    return paged.declared(kv_cache, impl.head_size)


def cpu(impl, layer, kv_cache) -> paged.Paged:
    """vLLM's CPU backend: [blocks, Hkv, block_size, 2 d], each block packed for its ISA by
    ``cpu_attn_reshape_and_cache`` (probed once per block shape, dtype and ISA)."""
    from vllm import _custom_ops as ops

    def writer(cache, keys, values, slots):
        blocks, heads, size, _ = cache.shape
        key_cache, value_cache = cache.view(blocks, heads, 2 * size, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            keys, values, key_cache, value_cache, slots, layer.isa,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
        )  # fmt: skip

    _, heads, size, _ = kv_cache.shape
    return paged.probed(kv_cache, size, heads, impl.head_size, writer, layer.isa)
