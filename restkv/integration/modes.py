"""``generate()``'s decoding modes on an evicted cache: what each needs, and what is refused
before any forward.

- Greedy, sampling (``num_return_sequences`` included) and beam search: the cache layers reorder
  their samples (``reorder_cache``; the packed per-head layout gathers its segments' rows).
- Assisted decoding (``prompt_lookup_num_tokens``, an ``assistant_model``): its first forward holds
  the prompt and the first candidates. The attachment knows the prompt's length from ``generate()``
  (``LayerState.prompt_length``), evicts over the prompt only and attends the candidates as decoded
  tokens, so the tokens are those of greedy decoding; rejected candidates leave by ``crop``. A
  selection deferred after the prefill, eviction while decoding and a quantized cache cannot do
  either: refused.
- Eviction on the assistant model itself (a draft whose cache is evicted too): refused at the
  draft's first ``generate()``, before either model's first forward. transformers crops an
  assistant's cache to one token before the last accepted one and feeds that token again, which
  reaches into the draft's prompt after a round with no accepted candidate: the kept prompt's newest
  entries would have to leave the evicted cache (every layout: dense, per head, packed), which no
  cache layer supports yet.
- Beam search with ThinK's pruned channels on the packed layout: refused.
- A compressed context (``restkv.compress_context``) given an input that does not begin with the context
  it was compressed from: refused (``ContextCache.check_prompt``).
"""

from __future__ import annotations

import torch

ASSISTANTS = ("prompt_lookup_num_tokens", "assistant_early_exit")


def _setting(model, kwargs: dict, name: str):
    if kwargs.get(name) is not None:
        return kwargs[name]
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    return getattr(config, name, None)


def check(attachment, model, kwargs: dict) -> None:
    """Refuse, before any forward, a ``generate(**kwargs)`` mode the config cannot decode."""
    cfg = attachment.cfg
    if not cfg.evicts:
        return
    if _setting(model, kwargs, "is_assistant"):
        raise ValueError(
            f"method={cfg.method!r} on an assistant_model: transformers crops the assistant's "
            "cache into its prompt, which an evicted cache cannot give back; restkv.detach() the "
            "assistant (the main model's cache may be evicted)"
        )
    assistant = kwargs.get("assistant_model") is not None
    assisted = assistant or any(_setting(model, kwargs, k) for k in ASSISTANTS)
    if assisted:
        if cfg.get("decode_interval"):
            knob = "decode_interval"
        elif cfg.quant_method:
            knob = "quant_method"
        elif any(s.plan.deferred for s in attachment.states):
            knob = "layer_budget" if cfg.get("layer_budget") == "global" else "method"
        else:
            knob = None
        if knob is not None:
            raise ValueError(
                f"{knob}={cfg.get(knob)!r} cannot drop an assistant's rejected tokens "
                "(assisted decoding: prompt_lookup_num_tokens or assistant_model); "
                f"generate without an assistant or without {knob}"
            )
    beams = _setting(model, kwargs, "num_beams") or 1
    packed = (
        cfg.get("head_budget") != "uniform"
        or cfg.get("gqa_agg") == "none"
        or cfg.get("max_capacity_prompt_ratio") is not None
    )
    if beams > 1 and cfg.get("pruning_ratio") is not None and packed and cfg.get("varlen", True):
        raise ValueError(
            "num_beams > 1 with pruning_ratio and per-head budgets in the packed "
            "layout is not supported: set varlen=False or pruning_ratio=None"
        )


def generate(attachment, original, *args, **kwargs):
    """``model.generate`` with the checks above, the prompt's length known to the layers."""
    check(attachment, attachment.model, kwargs)
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    length = inputs.shape[-1] if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 else None
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if length is not None and hasattr(cache, "check_prompt"):
        cache.check_prompt(inputs)
    for state in attachment.states:
        state.prompt_length = length
    try:
        return original(*args, **kwargs)
    finally:
        for state in attachment.states:
            state.prompt_length = None
