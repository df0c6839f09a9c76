"""Tiny random models of every supported family, built from configs (no download)."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

COMMON = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "gemma": (GemmaConfig, GemmaForCausalLM, {}),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    ),
}


def tiny_model(family: str = "llama", attn_implementation: str = "sdpa", seed: int = 0, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **extra, **overrides})
    config._attn_implementation = attn_implementation
    return model_cls(config).eval()
