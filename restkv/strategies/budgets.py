"""How many entries each layer and each KV head keeps.

Layers (``layer_budget``): uniform, the PyramidKV schedule (same total; ``use_pyramid=True`` is its
other name) or global. KV heads of a layer (``head_budget``): uniform, AdaKV (shared by one top-k over
all heads' scores), HeadKV (from a head-importance table), a threshold (DMS's form, as kvpress's
``DMSPress``: a head keeps the entries scoring at least ``threshold``, at most its budget, the best;
a prompt within the budget is thresholded too, so with ``max_capacity_prompt`` at least the prompt's
length a head keeps exactly those; a prompt within the window keeps all, unscored) or LU-KV's budget
curve (``lukv_sizes``). All combine with any scorer.
Each head's count is computed in ``head_budgets``.

``global`` shares ``num_layers * Hkv * (B - window)`` prefix entries among every evicted layer and KV
head by one top-k over all their scores (``global_sizes``); each (layer, head) keeps its share plus the
window, which is always kept and never competes, so no layer gets fewer than 0: a layer or head whose
scores lose everywhere keeps its window only. Inside a layer the heads split their entries as that top-k
says (AdaKV's split without a floor, ``head_budget`` is not read), in the packed per-head layout. The
selection waits for every layer's prefill (``restkv.eviction.deferred``); the full cache is held until then.
This is Layer-DefensiveKV's allocation and KVzip's non-layerwise one.

``layer_ratios`` (kvpress's ``PerLayerCompressionPress``) gives each evicted layer its own budget,
in place of ``max_capacity_prompt``: comma-separated compression ratios in [0, 1) (a layer of L
prompt tokens keeps ``int(L (1 - r))``, as kvpress, L with padding in a batch; at least
``window_size + 1``, at most L) or budgets (integers above ``window_size``, window included), one
per evicted layer.
"""

from __future__ import annotations

import math

from ..knobs import Knob
from .head_budgets import (  # noqa: F401  (the eviction step reads them from here)
    adakv_budgets,
    global_sizes,
    head_sizes,
    headkv_budgets,
    largest_remainder,
    load_head_importance,
    load_lukv_curve,
    lukv_sizes,
)

HEAD_BUDGETS = ("uniform", "adakv", "headkv", "threshold", "lukv")
PER_HEAD = HEAD_BUDGETS[1:]
LAYER_BUDGETS = ("uniform", "pyramid", "global")
PER_LAYER = LAYER_BUDGETS[:2]  # the layer's budget is known before the other layers' prefill

KNOBS = (
    Knob(
        "layer_budget",
        "uniform",
        "how the budget is shared by the layers: uniform, pyramid (PyramidKV: lower "
        "layers get more, same total) or global (one top-k over every layer's and head's scores)",
        choices=LAYER_BUDGETS,
    ),
    Knob(
        "beta",
        20.0,
        "PyramidKV: the largest layer budget is about 2 * beta times the smallest",
        check=lambda b: b >= 1,
        rule=">= 1",
        when={"layer_budget": ("pyramid",)},
    ),
    Knob(
        "head_budget",
        "uniform",
        "how a layer's budget is shared by its KV heads: uniform, adakv (one top-k "
        "over all heads' scores), headkv (a head-importance table), threshold (each head keeps the entries "
        "scoring at least threshold, at most its budget) or lukv (LU-KV: a budget curve file, lukv_curve)",
        choices=HEAD_BUDGETS,
        when={"layer_budget": PER_LAYER},
    ),
    Knob(
        "threshold",
        None,
        "head_budget threshold: entries scoring below it are evicted (DMS's form)",
        of=float,
        when={"head_budget": ("threshold",)},
    ),
    Knob(
        "floor",
        0.2,
        "AdaKV: each head keeps at least this share of the per-head budget",
        check=lambda f: 0.0 <= f <= 1.0,
        rule="in [0, 1]",
        when={"head_budget": ("adakv",)},
    ),
    Knob(
        "normalize",
        False,
        "AdaKV: weight each head's scores by the share of its mass inside its top-B",
        when={"head_budget": ("adakv",)},
    ),
    Knob(
        "head_importance",
        None,
        "HeadKV: JSON file of per-layer, per-head importance scores (default: HeadKV's "
        "retrieval-reasoning scores of the model, computed once on needle prompts and cached)",
        when={"head_budget": ("headkv",)},
    ),
    Knob(
        "headkv_beta",
        1.2,
        "HeadKV: each head keeps B - B // headkv_beta, the rest is shared by importance",
        check=lambda b: b > 1.0,
        rule="> 1",
        when={"head_budget": ("headkv",)},
    ),
    Knob(
        "lukv_curve",
        None,
        "LU-KV: .npy budget curve [99, layers, KV heads] of per-head prune ratios (row "
        "round(100 r) - 1 for compression ratio r = 1 - B / L), made by LU-KV's scripts",
        when={"head_budget": ("lukv",)},
    ),
    Knob(
        "lukv_sink",
        4,
        "LU-KV: the first tokens of the prompt, kept above every score",
        check=lambda n: n >= 0,
        rule=">= 0",
        when={"head_budget": ("lukv",)},
    ),
    Knob(
        "layer_ratios",
        None,
        "a budget per evicted layer instead of max_capacity_prompt: "
        "comma-separated compression ratios in [0, 1) (a layer keeps int(L (1 - r)) of L tokens) "
        "or budgets (integers), one per layer (kvpress's PerLayerCompressionPress)",
        check=lambda t: _parsed(t) is not None,
        rule="comma-separated numbers, all ratios in [0, 1) or all integers >= 1",
        when={"layer_budget": ("uniform",)},
    ),
    Knob(
        "varlen",
        True,
        "per-head budgets: pack each head's entries (memory = the sum of head lengths); false: "
        "pad to the longest head and mask",
        when={"head_budget": PER_HEAD},
    ),
)
def shared_sizes(cfg, scores: list, budget: int):
    """``layer_budget="global"``: prefix entries each (layer, KV head) keeps, one [b, Hkv] per layer.

    ``scores`` one [b, Hkv, P] per evicted layer (-inf on padding), ``budget`` B (window included): the
    layers share ``layers * Hkv * (B - window)`` entries by one top-k (``global_sizes``), or by the
    method's own ``global_sizes(scores, total, knobs, global_sizes)`` (KVCompose)."""
    total = len(scores) * scores[0].shape[1] * (budget - cfg.window_size)
    own = getattr(cfg.scorer.module, "global_sizes", None)
    return global_sizes(scores, total) if own is None else own(scores, total, cfg.score_knobs(), global_sizes)


ALIASES = {
    "use_pyramid": ("layer_budget", {True: "pyramid", False: "uniform"})
}  # the original's flag


def check(values: dict) -> None:
    if values.get("layer_budget") == "global":
        for knob, bad, need in (
            ("gqa_agg", "none", "per-KV-head sets: gqa_agg other than 'none'"),
            ("merge", "pivot", "merge other than 'pivot' or 'value'"),
            ("merge", "value", "merge other than 'pivot' or 'value'"),
        ):
            if values.get(knob) == bad:
                raise ValueError(f"layer_budget='global' needs {need}")
    if values.get("head_budget") == "threshold" and values.get("threshold") is None:
        raise ValueError(
            "head_budget='threshold' needs threshold=VALUE (entries scoring below it are evicted)"
        )
    if values.get("head_budget") == "lukv" and values.get("lukv_curve") is None:
        raise ValueError(
            "head_budget='lukv' needs lukv_curve=PATH (a .npy budget curve [99, layers, KV heads])"
        )
    if (
        values.get("head_budget") == "headkv"
        and values.get("max_capacity_prompt_ratio") is not None
    ):
        raise ValueError(
            "head_budget='headkv' needs max_capacity_prompt (its table is sized by it), not a ratio"
        )
    given = values.get("layer_ratios")
    if given is not None:
        _check_layer_ratios(values, _parsed(given))
    if values.get("gqa_agg") == "none" and (
        values.get("head_budget") in ("headkv", "lukv") or values.get("varlen") is False
    ):
        raise ValueError(
            "gqa_agg='none' (one set per query head) works with head_budget uniform or adakv, varlen=True"
        )


def _parsed(text: str) -> list | None:
    """``layer_ratios`` as numbers: ints (budgets) or floats in [0, 1) (ratios); None if neither."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        return None
    if all("." not in part and "e" not in part.lower() for part in text.split(",")):
        return [int(v) for v in values] if all(v >= 1 for v in values) else None
    return values if all(0 <= v < 1 for v in values) else None


def _check_layer_ratios(values: dict, given: list) -> None:
    if values.get("max_capacity_prompt_ratio") is not None:
        raise ValueError(
            "layer_ratios sets every layer's budget: max_capacity_prompt_ratio must be None with it"
        )
    if values.get("head_budget") == "headkv":
        raise ValueError(
            "head_budget='headkv' needs max_capacity_prompt (its table is sized "
            "by it), not layer_ratios"
        )
    window = values["window_size"]
    if isinstance(given[0], int) and min(given) <= window:
        raise ValueError(
            f"layer_ratios: each layer's budget must be larger than window_size "
            f"({window}), got {min(given)}"
        )


def check_layers(values: dict, num_layers: int) -> None:
    """``layer_ratios`` names one value per evicted layer (run by ``configure`` on the model)."""
    given = values.get("layer_ratios")
    if given is not None and len(_parsed(given)) != num_layers:
        raise ValueError(
            f"layer_ratios must give one value per evicted layer ({num_layers}), "
            f"got {len(_parsed(given))}"
        )


def ratio_budgets(cfg, prompt_len: int) -> list[int]:
    """``layer_ratios``' budget of each evicted layer for ``prompt_len`` tokens (window in it)."""
    values = _parsed(cfg.layer_ratios)
    if isinstance(values[0], float):
        values = [int(prompt_len * (1 - r)) for r in values]
    return [min(prompt_len, max(cfg.window_size + 1, v)) for v in values]


def fits(cfg, length: int, budget: int) -> bool:
    """Whether ``length`` entries (the observation window's included) are all kept under ``budget``:
    they all lie in the window (nothing to evict: a prompt of at most ``window_size`` tokens), or
    they fit the budget and no threshold (``head_budget="threshold"``) evicts below it."""
    return length <= cfg.window_size or (length <= budget and cfg.get("head_budget") != "threshold")


def keeps_prompt(cfg, length: int) -> bool:
    """Whether a prompt of ``length`` real tokens keeps every entry at prefill under ``cfg``: the
    config evicts nothing, the prompt lies in the observation window, or it fits its sample
    budget (:func:`sample_budgets`; then no layer's budget, pyramid or per head, is below it) and
    no threshold evicts below it (:func:`fits`)."""
    return not cfg.evicts or fits(cfg, length, sample_budgets(cfg, [length])[0])


def pyramid_budgets(
    budget: int, window: int, num_layers: int, beta: float, prompt_len: int
) -> list[int]:
    """Per-layer budgets (window included) that fall linearly from the first layer to the last.

    PyramidKV: the non-window part goes from ``max_num`` down to ``min_num = (budget - window) / beta``
    with ``max_num + min_num = 2 (budget - window)``, so the layers keep ``num_layers * budget`` in all
    (exactly: rounding leftovers go to the layers with the largest fractions). ``max_num`` is capped
    at the prefix length, as in the original, but not below ``budget - window``: a prompt within the
    budget (which the original never evicts; decoding-time eviction does) gets ``budget`` in every
    layer, not a pyramid upside down.
    """
    if num_layers == 1:
        return [budget]
    base = budget - window
    min_num = base / beta
    max_num = 2 * base - min_num
    if max_num > prompt_len - window:
        max_num = max(prompt_len - window, base)
        min_num = 2 * base - max_num
    step = (max_num - min_num) / (num_layers - 1)
    exact = [max_num - i * step for i in range(num_layers)]
    sizes = [math.floor(x) for x in exact]
    leftover = num_layers * base - sum(sizes)
    by_fraction = sorted(range(num_layers), key=lambda i: exact[i] - sizes[i], reverse=True)
    for i in by_fraction[: max(0, leftover)]:
        sizes[i] += 1
    return [max(0, s) + window for s in sizes]


def layer_budgets(cfg, num_layers: int, prompt_len: int, budget: int | None = None) -> list[int]:
    """Budget of each evicted layer for a prompt of ``prompt_len`` tokens (``budget``: the config's by default)."""
    budget = cfg.max_capacity_prompt if budget is None else budget
    if cfg.get("layer_ratios") is not None:
        return ratio_budgets(cfg, prompt_len)
    if cfg.get("layer_budget") == "pyramid":
        return pyramid_budgets(budget, cfg.window_size, num_layers, cfg.beta, prompt_len)
    return [budget] * num_layers


def sample_budgets(cfg, real_lengths) -> list[int]:
    """The budget of each sample: the config's, or ``round(L * max_capacity_prompt_ratio)`` of its real
    length L (Python's rounding, as the original; at least ``window_size + 1``)."""
    ratio = cfg.get("max_capacity_prompt_ratio")
    if cfg.get("layer_ratios") is not None:  # the smallest layer's: all are kept when it holds them
        return [min(ratio_budgets(cfg, int(n))) for n in real_lengths]
    if ratio is None:
        return [cfg.max_capacity_prompt] * len(real_lengths)
    return [max(cfg.window_size + 1, round(int(n) * ratio)) for n in real_lengths]
