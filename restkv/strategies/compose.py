"""Two methods in sequence (``compose``): kvpress's ``ComposedPress`` for two scorers.

kvpress's ``ComposedPress`` (``kvpress/presses/composed_press.py``) runs presses one after the
other, each on what the one before kept, each with its own compression ratio. Here ``compose`` names
the method that prunes first: its scores (its registered defaults, this config's window, a uniform
top-k per KV head) keep ``max(B, int(L (1 - compose_ratio)))`` entries per head of the L prompt
entries (window included; B the config's budget); then the config's own method scores what is left,
observed by the window's queries, and keeps its budget with every strategy of the config (per-head
budgets, rankings, merging, re-rotation). The selection of the second stage is eviction while
decoding's (``restkv.eviction.decode.reselect``): the scorer sees the kept entries in position
order, the window last, and only the window's queries (a score that reads earlier queries, as H2O's,
reads the window's).

Refused, as kvpress refuses ``AdaKVPress`` and ``KVzipPress`` inside ``ComposedPress``: selections
that wait for every layer (``layer_budget="global"``, methods that replay the prompt, as KVzip, in
either stage), and one kept set per query head (``gqa_agg="none"``); Q-Filters (constants computed
from the model for the config's own method) cannot prune first.
"""

from __future__ import annotations

from ..knobs import Knob
from ..methods import METHODS, REGISTRY

# methods that read constants computed from the model for the config's own method (``obs.data``)
# cannot prune first
MODEL_DATA = ("qfilter",)
FIRST = tuple(
    m for m in METHODS if REGISTRY[m].evicts and not REGISTRY[m].replays and m not in MODEL_DATA
)
KNOBS = (
    Knob(
        "compose",
        None,
        "a method that prunes first (kvpress's ComposedPress): its scores keep "
        "int(L (1 - compose_ratio)) entries per head (at least the budget), then this config's "
        "method selects its budget among them; None: off",
        choices=FIRST,
        nullable=True,
        stage="select",
    ),
    Knob(
        "compose_ratio",
        0.5,
        "the compression ratio of compose's stage: it keeps int(L (1 - r)) of the L prompt entries",
        rule="in [0, 1)",
        when={"compose": FIRST},
        stage="select",
    ),
)


def check(values: dict) -> None:
    if values.get("compose") is None:
        return
    if REGISTRY[values["method"]].replays:
        raise ValueError(
            f"compose: method {values['method']} replays the prompt; it cannot be composed"
        )
    if values.get("layer_budget") == "global":
        raise ValueError("compose needs a budget per layer: layer_budget 'uniform' or 'pyramid'")
    if values.get("gqa_agg") == "none":
        raise ValueError("compose needs one kept set per KV head: gqa_agg other than 'none'")


def applies(cfg) -> bool:
    return cfg.get("compose") is not None
