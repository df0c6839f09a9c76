"""Block-by-block compression of the prompt (``prompt_block``): kvpress's ``BlockPress``.

kvpress's ``BlockPress`` (``kvpress/presses/block_press.py``; the block prompt processing of
KeyDiff, https://arxiv.org/abs/2504.15364) keeps the first B entries, then for each next block of
``block_size`` (128 there) tokens scores the kept entries and the block together and keeps the best
B of them, as a prefill in blocks under a fixed cache would. As there, all the prompt's queries and
keys come from one forward; only the selection goes block by block.

Here each step is a selection of the config's method (every strategy of the config: per-head
budgets, rankings) over the kept entries and the block, observed by the block's last ``window_size``
queries (as eviction while decoding observes, ``restkv.eviction.decode.reselect``): a score that
reads earlier queries reads those. The block's last ``window_size`` entries are always kept at that
step, as the window is at the end. Where restkv differs: blocks start after the first B entries, as
kvpress's do, but a last block shorter than the window joins the one before it (so every step has a
window's queries); ``prompt_block`` must be at least ``window_size``.
"""

from __future__ import annotations

from ..knobs import Knob
from ..methods import REGISTRY

KNOBS = (
    Knob(
        "prompt_block",
        None,
        "kvpress's BlockPress (block_size 128 there): select the budget block by block as the "
        "prompt arrives, each block scored with what is kept so far (None or 0: off)",
        nullable=True,
        of=int,
        check=lambda n: n >= 0,
        rule=">= window_size (or 0: off)",
        stage="select",
    ),
)


def check(values: dict) -> None:
    block = values.get("prompt_block")
    if not block:
        return
    if block < values["window_size"]:
        raise ValueError(
            f"prompt_block must be >= window_size ({values['window_size']}): a block's last "
            f"window_size queries observe it; got {block}"
        )
    if REGISTRY[values["method"]].replays or values.get("layer_budget") == "global":
        raise ValueError(
            "prompt_block needs a budget per layer known at its prefill: no global budget and no "
            "method that replays the prompt"
        )
    if values.get("compose") is not None:
        raise ValueError(
            "prompt_block and compose are two ways to select in steps; give one of them"
        )
    if values.get("merge", "none") != "none" or values.get("gqa_agg") == "none":
        raise ValueError(
            "prompt_block needs merge 'none' and one kept set per KV head (gqa_agg not 'none')"
        )


def applies(cfg) -> bool:
    return bool(cfg.get("prompt_block"))


def steps(n: int, budget: int, block: int, window: int) -> list:
    """The blocks ``(start, stop)`` of a prompt of ``n`` entries after its first ``budget``; a last
    block shorter than ``window`` joins the one before it."""
    out = []
    for start in range(budget, n, block):
        out.append([start, min(start + block, n)])
    if len(out) > 1 and out[-1][1] - out[-1][0] < window:
        last = out.pop()
        out[-1][1] = last[1]
    return [tuple(s) for s in out]
