"""KVzip: keep the entries the model needs to reconstruct its context (query-agnostic importance).

Paper: "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" (Kim et al., 2025),
https://arxiv.org/abs/2505.23416; code: https://github.com/snu-mllab/KVzip (``model/wrapper.py``
``self_task``/``scoring``, ``attention/score.py``); kvpress's ``KVzipPress``.

After the prefill the model reads its prompt again as the answer to a request to repeat it, in
chunks of ``repeat_chunk`` tokens after the first ``sink_tokens`` (the sinks stand for the original's
system prompt: never evicted, in every chunk's softmax). Chunk 0's pass is ``"\\n\\nRepeat the previous
context exactly."`` + the assistant header of the chat template (``"\\n"`` without one) + the chunk;
chunk i > 0's is ``"\\n\\nRepeat the part of the previous context exactly, starting with "`` + the last
8 tokens of chunk i-1 + the header + the chunk; positions continue after the prompt. An entry's score
is the largest attention it receives from a pass's queries (all of them, the instruction's too), the
softmax taken over [sinks | the chunk | the pass's own tokens, causal]; the max over the query heads
of a GQA group is ``gqa_agg="max"`` (the default, as the reference).

Budget: the reference keeps a fraction r of all layers x heads x context entries (the original's
``--ratio``, 0.3; kvpress's ``compression_ratio`` = 1 - r) by one global threshold. Here the model keeps
``num_layers * Hkv * B`` entries in all, B = ``max_capacity_prompt`` per KV head and layer as for every
method (or ``max_capacity_prompt_ratio=r``: B = round(L r), the reference's r): the window and the sinks
always, the other ``num_layers * Hkv * (B - window)`` by one top-k over every layer, head and prefix
entry (``layer_budget="global"``, the reference's non-layerwise default). ``layer_budget="uniform"``
with ``head_budget="adakv", floor=0`` is kvpress's ``layerwise=True``; with ``head_budget="uniform"`` the
original's ``level=pair-uniform``.

Cost: one extra forward per chunk, about 20 instruction tokens + the chunk, each token attending over
the whole prompt: L + ~20 ceil((L - sinks) / repeat_chunk) tokens in all (1.02 L at 2K tokens), plus at
every layer the reconstruction's attention [pass x (sinks + chunk + pass)] in float32, the full cache
held meanwhile. ``benchmarks/deferred_cost.py``, SmolLM2-135M at 1,024 tokens (CPU, float32, one thread):
the passes feed 1.01 L tokens and take 3.2 times the full-cache prefill's time, about half of it in the
scores (the reference warns of 2-3 times on GPU). The passes' tokens never stay in the cache.

Differences: the scores in float32 (the reference's softmax is in the model's dtype); 4 sinks (kvpress's;
the original uses its whole system prompt) and chunks of 2000 (the original's; kvpress's ``chunk_size``, 2048:
``repeat_chunk`` here, ``chunk_size`` being ChunkKV's selection knob); kvpress's
later chunks' instruction has no trailing space, the original's has. The tokenizer is the model's
(``model.config.name_or_path``) unless ``tokenizer`` names one.
"""

from __future__ import annotations

import functools

from ..knobs import GQA_AGG, Knob
from ..lazy import torch
from ..scoring.observe import attention_received
from . import streamingllm

FIRST = "\n\nRepeat the previous context exactly."
NEXT = "\n\nRepeat the part of the previous context exactly, starting with "
PREVIOUS = 8  # tokens of the previous chunk after NEXT
SINK = 2.0  # above any attention probability: the sinks are always kept

KNOBS = (
    streamingllm.KNOBS[0],
    Knob(
        "repeat_chunk",
        2000,
        "context tokens reconstructed per extra forward",
        rule=">= 1",
    ),
    Knob(
        "tokenizer",
        None,
        "tokenizer of the repeat prompt (a path or hub id; none: the model's name_or_path)",
    ),
    GQA_AGG.but(default="max"),
)


def check(cfg):
    streamingllm.check(cfg)
    if cfg.get("decode_interval"):
        raise ValueError(
            "decode_interval is not supported by kvzip (its scores come from passes after the prefill)"
        )


@functools.lru_cache(maxsize=8)
def template(path: str) -> tuple[list[int], list[int], list[int]]:
    """Token ids of (FIRST, NEXT, the assistant header) with the tokenizer at ``path``."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # any failure to find or read one
        raise ValueError(
            f"tokenizer: kvzip's repeat prompt needs a tokenizer; none loads from {path!r} "
            f"({type(e).__name__}); give tokenizer=PATH"
        ) from None
    suffix = "\n"
    if getattr(tok, "chat_template", None):
        context = "dummy context"
        separator = "\n" + "#" * 13
        text = tok.apply_chat_template(
            [{"role": "user", "content": context + separator}],
            add_generation_prompt=True,
            tokenize=False,
            enable_thinking=False,
        )
        suffix = text.split(separator)[1]
    return tuple(tok.encode(t, add_special_tokens=False) for t in (FIRST, NEXT, suffix))


def _tokenizer_path(cfg, model) -> str:
    return cfg.get("tokenizer") or getattr(model.config, "name_or_path", "") or ""


def check_model(cfg, model) -> None:
    """The repeat prompt's tokenizer loads (a ValueError naming ``tokenizer`` otherwise)."""
    template(_tokenizer_path(cfg, model))


def passes(
    context_ids: "torch.Tensor", cfg, model
) -> tuple[int, list[tuple[int, int, "torch.Tensor"]]]:
    """The reconstruction of one sample's prompt ``context_ids`` [L]: (sinks, [(start, stop, pass ids [r])]),
    each pass scoring positions [start, stop)."""
    first, following, header = (
        torch.tensor(t, dtype=torch.long) for t in template(_tokenizer_path(cfg, model))
    )
    n = context_ids.shape[0]
    sinks = min(cfg.sink_tokens, context_ids.shape[0])
    ids = context_ids.cpu()
    out = []
    for start in range(sinks, n, cfg.repeat_chunk):
        stop = min(n, start + cfg.repeat_chunk)
        ask = (
            first
            if start == sinks
            else torch.cat([following, ids[start - min(PREVIOUS, cfg.repeat_chunk) : start]])
        )
        out.append((start, stop, torch.cat([ask, header, ids[start:stop]]).to(context_ids.device)))
    return sinks, out


def score(obs, cfg):
    """Largest attention each prefix entry gets from the window's queries (a pass's tokens), sinks above all
    -> [b, Hq, P]."""
    blocks = obs.recent_attention_blocks(obs.window)  # a pass's queries: in blocks
    s = attention_received(blocks, obs.prefix_len)
    pos = obs.positions[:, None, : obs.prefix_len]
    return torch.where((pos >= 0) & (pos < cfg.sink_tokens), SINK, s)
