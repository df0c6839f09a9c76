"""Query-agnostic ReST-KV: ReST-KV's output-change indicator over the queries of KVzip's context-repeat passes.

ReST-KV (``restkv.methods.restkv``) scores an entry by the change of the layer's attention output its removal
causes, for the prompt's last queries; those read the question when it is in the prompt, and nothing of it
when the context is compressed before the question comes. Here the observed queries are those of KVzip's
passes (``restkv.methods.kvzip.passes``: after the prefill the model reads its prompt again as the answer
to a request to repeat it, chunk by chunk), which do not depend on any question: each pass's tokens are the
window, [sinks | the chunk] the prefix it scores, and ReST-KV's score runs on that observation unchanged.
The sinks are always kept (above any score). The cost is KVzip's (one extra forward per chunk, the full
cache held meanwhile) with ReST-KV's score in place of the largest attention.

Registered as ``restkv_repeat`` with ``metric_mode="before", temporal="max"`` (each repeat query's own
indicator, the worst case over them: KVzip takes the largest attention over the passes' queries, and the
mean of a pass's rows spreads each entry's one strong attention over the whole chunk), ``pooling="none"``
(KVzip does not pool; the adaptive window's drift would read the pass's length as the budget) and
``gqa_agg="max"`` (KVzip's); every ReST-KV knob can be set as for ``restkv``.
"""

from __future__ import annotations

from ..lazy import torch
from . import kvzip
from . import restkv as rest

KNOBS = (
    *(k for k in rest.KNOBS if k.name != "gqa_agg"),
    *(k for k in kvzip.KNOBS if k.name in ("sink_tokens", "repeat_chunk", "tokenizer", "gqa_agg")),
)
ALIASES = rest.ALIASES
passes = kvzip.passes
check_model = kvzip.check_model


def check(values: dict) -> None:
    rest.check(values)
    kvzip.check(values)
    if values.get("pooling") == "adaptive":
        raise ValueError(
            "pooling='adaptive' is not supported by restkv_repeat (its drift reads the layer's budget, "
            "which a repeat pass does not have): use avgpool, maxpool or none"
        )


def score(obs, cfg):
    """ReST-KV's score of the pass's prefix [sinks | chunk] from the pass's queries, sinks above all
    -> [b, Hq, P]."""
    s = rest.score(obs, cfg)
    pos = obs.positions[:, None, : obs.prefix_len]
    top = torch.finfo(torch.float32).max
    return torch.where((pos >= 0) & (pos < cfg.sink_tokens), top, s)
