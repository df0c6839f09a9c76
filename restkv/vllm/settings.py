"""The plugin's settings, in three rooms, under one name (``settings.X``): no vLLM import here.

- ``restkv.vllm.plugin_config``: the config read from ``RESTKV_VLLM`` or an engine's
  ``additional_config`` and checked (``from_env``, ``check``), and what it asks (``per_head``,
  ``per_layer``, ``deferred``, ``summed``, ``query_rows``, ...);
- ``restkv.vllm.tables``: the model's budgets per layer and per KV head (``bind_model``, HeadKV's table,
  LU-KV's curve, ``largest``, ``mean_kept``) and the tensor-parallel ranks sharing the heads;
- ``restkv.vllm.counting``: the rules both of vLLM's sides apply (``eviction``, ``Eviction``, ``room``,
  ``hit_limit``, ``extra_blocks``, ``most_blocks``): the scheduler, which frees and allocates blocks, and every worker,
  which rewrites the cache, both compute them from the same numbers, so they agree without a message.
"""

from __future__ import annotations

from .counting import (
    Eviction,
    budget_at,
    eviction,
    evicts,
    extra_blocks,
    hit_limit,
    most_blocks,
    most_budget,
    room,
    schedule_length,
)
from .plugin_config import DEFERRED as DEFERRED  # the constants, documented where they are defined
from .plugin_config import ENV as ENV
from .plugin_config import PER_HEAD as PER_HEAD
from .plugin_config import PER_LAYER as PER_LAYER
from .plugin_config import SHARED as SHARED
from .plugin_config import SUMMED as SUMMED
from .plugin_config import UNBOUNDED as UNBOUNDED
from .plugin_config import (
    budget_knobs,
    check,
    deferred,
    from_env,
    mixes_heads,
    per_head,
    per_head_refusals,
    per_layer,
    prompt_evicts,
    query_rows,
    shares_heads,
    sized_across_heads,
    summed,
    uncached,
)
from .tables import (
    bind_model,
    head_table,
    largest,
    layer_budget,
    layer_table,
    layers_of,
    lukv_kept,
    lukv_largest,
    mean_kept,
    most_kept,
    rank_share,
)

__all__ = [
    "Eviction", "bind_model", "budget_at", "budget_knobs", "check", "deferred", "eviction", "evicts",
    "extra_blocks", "from_env", "head_table", "hit_limit", "largest", "layer_budget", "layer_table",
    "layers_of", "lukv_kept", "lukv_largest", "mean_kept", "mixes_heads", "most_blocks", "most_budget", "most_kept",
    "per_head", "per_head_refusals", "per_layer", "prompt_evicts", "query_rows", "rank_share", "room",
    "schedule_length", "shares_heads", "sized_across_heads", "summed", "uncached",
]
