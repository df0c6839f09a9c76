"""Strategies: how the kept entries are chosen from any method's scores.

A strategy is one module of this package with

- ``KNOBS``: the knobs it reads (``restkv.knobs.Knob``), declared once; ``check(values)`` for checks across
  knobs (optional);
- the hook that the eviction step calls, by the stage it acts on:

  ======================  =========================================================  ======================
  stage                   hook                                                       modules
  ======================  =========================================================  ======================
  layers evicted          ``evicted_layers(config, indices)`` (no knob: the model's)  ``layers``
  budget                  ``sample_budgets``, ``layer_budgets``, ``head_sizes``,      ``budgets``,
                          ``global_sizes`` (per sample, layer, head, across layers)  ``head_budgets``
  ranking                 ``applies(cfg)`` and ``rank(obs, cfg, scores, key, keep)``  ``RANKINGS``, in order
  kept entries            ``merge(cfg, obs, scores, idx, keys, values)``              ``merge``
  kept keys' positions    ``packed_positions``, ``rerotated``                         ``rerotate``
  steps                   ``restkv.eviction.compose``, ``restkv.eviction.blocks``     ``compose``,
                                                                                      ``blocks``
  key channels            ``query_energy``, ``kept_channels``                         ``think``
  while decoding          ``restkv.eviction.decode`` reads ``decode_interval``        ``decoding``
  ======================  =========================================================  ======================

``STRATEGIES`` lists the modules whose knobs every evicting method reads (``restkv.config``); a new
strategy is one module and one line here (CONTRIBUTING.md, "Adding a strategy").
"""

from . import (
    blocks,
    budgets,
    chunks,
    compose,
    critical,
    decoding,
    merge,
    prompt_chunks,
    refine,
    rerotate,
    think,
)

# Knobs read by every evicting method, and their checks, in this order.
STRATEGIES = (
    budgets,
    merge,
    critical,
    chunks,
    prompt_chunks,
    refine,
    decoding,
    rerotate,
    compose,
    blocks,
)
# Ranking strategies: each turns the ranking key of the one before (first: the scores) into its own.
RANKINGS = (critical, chunks, prompt_chunks, refine)

__all__ = [
    "RANKINGS",
    "STRATEGIES",
    "blocks",
    "budgets",
    "chunks",
    "compose",
    "critical",
    "decoding",
    "merge",
    "prompt_chunks",
    "refine",
    "rerotate",
    "think",
]
