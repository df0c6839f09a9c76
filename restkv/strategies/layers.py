"""Which attention layers eviction applies to, from a model's config (a transformers ``PretrainedConfig`` or
vLLM's ``hf_text_config``): ``restkv.configure``'s plans and the vLLM plugin read the same rule. No torch here.
"""

from __future__ import annotations


def is_sliding(config, layer_idx: int) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[layer_idx] != "full_attention"
    return getattr(config, "sliding_window", None) is not None and getattr(
        config, "use_sliding_window", True
    )


def evicted_layers(config, layer_indices) -> dict:
    """``{layer index: its sliding window or None}`` of the layers eviction applies to.

    The full-attention layers; in a model whose every layer is sliding-window (Mistral v0.1's config,
    transformers' default ``MistralConfig``) every layer, with its window W: eviction keeps entries among
    those the first decoded token can still attend (the last W - 1, all of them for a shorter prompt), and
    decoding never attends an entry more than W - 1 positions back, as the model's own mask. Models that
    interleave both kinds (Gemma 2/3) keep their sliding-window layers whole.
    """
    full = [i for i in layer_indices if not is_sliding(config, i)]
    if full:
        return dict.fromkeys(full)
    window = getattr(config, "sliding_window", None)
    return dict.fromkeys(layer_indices, window) if window else {}
