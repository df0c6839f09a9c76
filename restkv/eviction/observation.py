"""What a layer's scorer sees (``Observation``), built from the layer's tensors, and the layer's W_O."""

from __future__ import annotations

import contextlib
import weakref

import torch
from accelerate.utils import align_module_device

from ..scoring.observe import Observation, wo_factor
from ..scoring.output_error import wo_gram
from ..scoring.rope import Rope


def observation(
    plan,
    module,
    queries,
    keys,
    values,
    key_valid,
    budget: int,
    kwargs,
    memo: dict,
    rope: Rope | None = None,
    head_valid=None,
    hidden=None,
) -> Observation:
    """What the layer's scorer sees: queries [b, Hq, Lq, d] of the last Lq positions, keys/values [b, H, L, d],
    key_valid [b, L] (head_valid [b, H, L] when heads hold different entries), this layer's budget and RoPE,
    hidden [b, L, D] the layer's attention input (a method that reads it, ``Method.reads_hidden``)."""
    return Observation(
        queries=queries,
        keys=keys,
        values=values,
        key_valid=key_valid,
        window=plan.cfg.window_size,
        budget=budget,
        scaling=kwargs.get("scaling") or module.head_dim**-0.5,
        softcap=kwargs.get("softcap"),
        wo_factor=lambda: layer_wo_factor(module, keys.device),
        wo_weight=lambda: layer_wo_weight(module, keys.device),
        wo_gram=lambda heads: layer_wo_gram(module, keys.device, heads),
        rope=rope,
        layer=plan.rank,
        num_layers=plan.num_evicted,
        memo=memo,
        head_valid=head_valid,
        data=plan.data,
        hidden=hidden,
    )


_WO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # o_proj -> {what: (weight tag, value)}


def _weights_on(module, device):
    """A context in which ``module``'s weights are on ``device``: accelerate keeps an offloaded layer's
    weights on the meta device between forwards."""
    if module.weight.device.type != "meta":
        return contextlib.nullcontext()
    return align_module_device(module, execution_device=device)


def _per_weight(module, device, what, compute) -> torch.Tensor:
    """``compute(o_proj.weight)`` of an attention module, once per weight and ``what``, on ``device``."""
    o_proj = module.o_proj
    w = o_proj.weight
    tag = "offloaded" if w.device.type == "meta" else (w.data_ptr(), w._version, w.device, w.dtype)
    store = _WO.setdefault(o_proj, {})
    cached = store.get(what)
    if cached is None or cached[0] != tag:
        with torch.no_grad(), _weights_on(o_proj, device):
            cached = (tag, compute(o_proj.weight))
        store[what] = cached
    return cached[1].to(device)


def layer_wo_factor(module, device) -> torch.Tensor:
    """The W_O factor R [Hq, d, d] of an attention module (computed once per weight), on ``device``."""
    heads = module.config.num_attention_heads
    return _per_weight(module, device, "factor", lambda w: wo_factor(w, heads))


def layer_wo_gram(module, device, heads: int) -> torch.Tensor:
    """``M_ac`` [H, g, g, d, d] of an attention module's o_proj for ``heads`` groups of its query heads
    (``output_error.wo_gram``; computed once per weight), on ``device``."""
    return _per_weight(
        module, device, ("gram", heads), lambda w: wo_gram(w, heads, module.head_dim)
    )


def layer_wo_weight(module, device) -> torch.Tensor:
    """The o_proj weight W_O [hidden, Hq d] of an attention module, on ``device``."""
    with torch.no_grad(), _weights_on(module.o_proj, device):
        return module.o_proj.weight.detach().to(device)
