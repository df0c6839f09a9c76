"""transformers' own flash-attention path on CPU: its wrapper (``flash_attention_forward``: unpadding,
``cu_seqlens``, the 2D padding mask, sliding windows, softcap) with the kernel replaced by plain-torch
stand-ins of flash-attn's ``flash_attn_func`` / ``flash_attn_varlen_func`` (same signatures, float32
softmax, the causal mask aligned bottom-right as flash-attn >= 2.1).

``reference_flash(name)`` makes transformers load these for the backend ``name`` (``flash_attention_2``,
``flash_attention_3`` or a hub kernel's name, which it registers as transformers registers a hub kernel:
the flash wrapper and flash's mask), so ``tiny_model(family, name)`` runs the flash path on CPU.
"""

from __future__ import annotations

import contextlib

import torch
import transformers.modeling_flash_attention_utils as fa
from helpers import tiny_model
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import AttentionInterface


CALLS = {"flash_attn_func": 0, "flash_attn_varlen_func": 0}  # how often transformers called each kernel


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q [b, sq, Hq, d], k / v [b, sk, Hkv, d] -> [b, sq, Hq, d] (Hq a multiple of Hkv)."""
    if dropout_p or alibi_slopes is not None:
        raise NotImplementedError("the reference kernel has no dropout nor ALiBi")
    CALLS["flash_attn_func"] += 1
    return _attention(q, k, v, softmax_scale, causal, window_size, softcap)


def _attention(q, k, v, softmax_scale, causal, window_size, softcap):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    qf = q.float().transpose(1, 2)  # [b, Hq, sq, d]
    kf = k.float().transpose(1, 2).repeat_interleave(hq // hkv, 1)
    vf = v.float().transpose(1, 2).repeat_interleave(hq // hkv, 1)
    logits = qf @ kf.transpose(-1, -2) * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)  # each query's position among the keys
    j = torch.arange(sk, device=q.device)[None, :]
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    left, right = window_size
    if causal:
        allowed &= j <= i
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)  # a row sees nothing: 0
    return (probs @ vf).transpose(1, 2).to(q.dtype)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q [Nq, Hq, d], k / v [Nk, Hkv, d] packed sequences (``cu_seqlens`` their offsets) -> [Nq, Hq, d]."""
    if dropout_p or alibi_slopes is not None or block_table is not None:
        raise NotImplementedError("the reference kernel has no dropout, ALiBi nor paged cache")
    CALLS["flash_attn_varlen_func"] += 1
    out = torch.empty_like(q)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(bounds_q) - 1):
        rq = slice(bounds_q[s], bounds_q[s + 1])
        rk = slice(bounds_k[s], bounds_k[s + 1])
        if rq.stop == rq.start:
            continue
        out[rq] = _attention(q[None, rq], k[None, rk], v[None, rk], softmax_scale, causal, window_size, softcap)[0]
    return out


def install(name: str) -> None:
    """Make transformers' flash wrapper use the reference kernels for the backend ``name``."""
    if name not in AttentionInterface._global_mapping:  # a hub kernel's name: registered as transformers does
        AttentionInterface.register(name, flash_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    fa._loaded_implementation = name
    fa._flash_fn, fa._flash_varlen_fn, fa._flash_with_kvcache_fn = flash_attn_func, flash_attn_varlen_func, None
    fa._pad_fn, fa._unpad_fn = fa._pad_input, fa._unpad_input
    fa._process_flash_kwargs_fn = fa._lazy_define_process_function(flash_attn_varlen_func)
    fa._process_with_kvcache_kwargs_fn = dict


@contextlib.contextmanager
def reference_flash(name: str = "flash_attention_2"):
    """``with reference_flash(name):`` the flash backend ``name`` runs the reference kernels in the block."""
    saved = {k: getattr(fa, k, None) for k in ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn",
                                         "_flash_with_kvcache_fn", "_pad_fn", "_unpad_fn", "_process_flash_kwargs_fn",
                                         "_process_with_kvcache_kwargs_fn")}
    install(name)
    try:
        yield
    finally:
        for k, value in saved.items():
            setattr(fa, k, value)


def flash_model(family: str = "llama", name: str = "flash_attention_2", **overrides):
    """``tiny_model(family)`` on the flash backend ``name`` (inside ``reference_flash(name)``: transformers refuses
    to build a model on flash without the package, not to switch one to it)."""
    model = tiny_model(family, "sdpa", **overrides)
    model.config._attn_implementation = name
    return model
