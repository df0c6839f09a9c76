"""The public calls that attach eviction to a model: ``configure`` (until the next ``configure``/``detach``),
``compressing`` (for a ``with`` block, restoring what was there before), ``kept_positions``, and
``replace_<family>()`` for code written for the original's per-family patches. The mechanism is
``restkv.integration.attachment``.
"""

from __future__ import annotations

import contextlib
import importlib

import torch
from torch import nn

from ..config import CompressionConfig
from ..eviction.plans import attention_modules
from . import ATTACH_CALLS
from .attachment import Attachment, attached, detach, install
from .calibration import layer_plans

__all__ = ["FAMILIES", "Attachment", "attached", "check_family", "check_model"] + list(ATTACH_CALLS)

FAMILIES = {
    "llama": "transformers.models.llama.modeling_llama",
    "mistral": "transformers.models.mistral.modeling_mistral",
    "qwen2": "transformers.models.qwen2.modeling_qwen2",
    "gemma": "transformers.models.gemma.modeling_gemma",
    "gemma2": "transformers.models.gemma2.modeling_gemma2",
    "gemma3": "transformers.models.gemma3.modeling_gemma3",
}


def _replace(family: str):
    def replace():
        install(importlib.import_module(FAMILIES[family]))

    replace.__name__ = f"replace_{family}"
    replace.__doc__ = f"Enable KV eviction for {family} models on every backend (idempotent)."
    return replace


replace_llama = _replace("llama")
replace_mistral = _replace("mistral")
replace_qwen2 = _replace("qwen2")
replace_gemma = _replace("gemma")
replace_gemma2 = _replace("gemma2")
replace_gemma3 = _replace("gemma3")


def check_model(model) -> None:
    """Raise ``TypeError`` unless ``model`` is a torch module: a name or a tokenizer given in its place is named,
    with ``restkv.load``, which loads a model (and its tokenizer) by name."""
    if isinstance(model, nn.Module):
        return
    what = f"the str {model!r}" if isinstance(model, str) else f"a {type(model).__name__}"
    name = repr(model) if isinstance(model, str) else "'smollm2-135m'"
    raise TypeError(
        f"model: restkv takes a loaded model (a torch.nn.Module), got {what}; restkv.load(name) loads one: "
        f"model, tokenizer = restkv.load({name})"
    )


def check_family(model: nn.Module) -> None:
    """Raise ``ValueError`` naming the model's family when it has no attention module restkv can evict in
    (one with ``layer_idx`` and ``o_proj``: the Llama, Mistral, Qwen2 and Gemma families); ``TypeError`` when it
    is no model at all (``check_model``)."""
    check_model(model)
    if attention_modules(model):
        return
    kind = getattr(getattr(model, "config", None), "model_type", None)
    raise ValueError(
        f"{type(model).__name__}{f' ({kind})' if kind else ''} is not a supported family: restkv evicts in "
        "the attention modules of the Llama, Mistral, Qwen2 and Gemma families (modules with layer_idx and "
        "o_proj; this model has none)"
    )


def configure(model: nn.Module, **knobs) -> CompressionConfig:
    """Set the eviction method and knobs of ``model`` (see ``CompressionConfig``) until the next call.

    Every knob is validated before anything changes; the next prefill (a fresh ``generate()``) uses it.
    """
    cfg = CompressionConfig.from_kwargs(**knobs)
    check_family(model)
    plans = layer_plans(model, cfg)
    detach(model)
    Attachment(model, plans).attach()
    return cfg


@contextlib.contextmanager
def compressing(model: nn.Module, **knobs):
    """``with restkv.compressing(model, method=..., ...) as cfg:`` eviction inside the block only.

    On exit the model is as it was: the hooks and attributes are removed (or the configuration from an
    earlier ``configure`` comes back).
    """
    cfg = CompressionConfig.from_kwargs(**knobs)
    check_family(model)
    with attached(model, layer_plans(model, cfg)):
        yield cfg


def kept_positions(model: nn.Module) -> list[torch.Tensor | None]:
    """Per layer, the prompt positions kept by the last prefill: LongTensor [batch, kv_heads, kept].

    Positions count from each sample's first real token; -1 marks kept padding. None for layers
    that are not evicted (sliding-window), before any prefill, or without eviction attached.
    """
    check_model(model)
    attachment = getattr(model, "_restkv", None)
    if attachment is None:
        return [None] * len(attention_modules(model))
    return [state.kept for state in attachment.states]
