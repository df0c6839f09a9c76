"""How many entries each layer and each KV head keeps.

Layers (``layer_budget``): uniform, the PyramidKV schedule (same total; ``use_pyramid=True`` is its
other name) or global. KV heads of a layer (``head_budget``): uniform, AdaKV (shared by one top-k over
all heads' scores), HeadKV (from a head-importance table), a threshold (DMS's form, as kvpress's
``DMSPress``: a head keeps the entries scoring at least ``threshold``, at most its budget, the best;
a prompt within the budget is thresholded too, so with ``max_capacity_prompt`` at least the prompt's
length a head keeps exactly those) or LU-KV's budget curve (``lukv_sizes``). All combine with any scorer.

``head_budget="lukv"`` is kvpress's ``LUKVPress`` (LU-KV, https://arxiv.org/abs/2602.08585, code
https://github.com/baidu-baige/LU-KV): each KV head of a layer keeps its count from a budget curve, the user's
``lukv_curve`` (.npy [99, layers, Hkv] of per-head prune ratios, made offline by LU-KV's scripts). Per layer and
per sample, the compression ratio is ``r = 1 - B / L`` (B the layer's budget, L the sample's real prompt
length; while decoding, the entries the layer holds) and picks the curve's row ``round(100 r) - 1``; the counts
are rounded as kvpress does (``lukv_sizes``). The first ``lukv_sink`` tokens (kvpress's ``sink=4``) score
above every other entry; kvpress's ``window`` (1 token) is restkv's ``window_size``, always kept and counted
in the head's count (``method="lukv"`` sets 1; with another method the config's, 32 by default). Where restkv
differs: a head whose count is below its window keeps the window (kvpress: its sinks, then the oldest window
tokens), and when its count is below sinks plus window, which sinks it keeps is the top-k's choice (kvpress:
the first); ties between fractional parts go to the lower head (kvpress: ``torch.topk``'s order); the counts
are computed in float64 (kvpress: float32, which can differ by one entry where ``(1 - ratio) L`` is within
float32 rounding of an integer).

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

import json
import math
import os

import numpy as np

from ..knobs import Knob
from ..lazy import torch

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
    """Whether ``length`` entries are all kept under ``budget``: they fit it, and no threshold
    (``head_budget="threshold"``) evicts below the budget."""
    return length <= budget and cfg.get("head_budget") != "threshold"


def keeps_prompt(cfg, length: int) -> bool:
    """Whether a prompt of ``length`` real tokens keeps every entry at prefill under ``cfg``: the
    config evicts nothing, or the prompt fits its sample budget (:func:`sample_budgets`; then no
    layer's budget, pyramid or per head, is below it) and no threshold evicts below it
    (:func:`fits`)."""
    return not cfg.evicts or fits(cfg, length, sample_budgets(cfg, [length])[0])


def pyramid_budgets(
    budget: int, window: int, num_layers: int, beta: float, prompt_len: int
) -> list[int]:
    """Per-layer budgets (window included) that fall linearly from the first layer to the last.

    PyramidKV: the non-window part goes from ``max_num`` down to ``min_num = (budget - window) / beta``
    with ``max_num + min_num = 2 (budget - window)``, so the layers keep ``num_layers * budget`` in all
    (exactly: rounding leftovers go to the layers with the largest fractions). ``max_num`` is capped
    at the prefix length, as in the original.
    """
    if num_layers == 1:
        return [budget]
    base = budget - window
    min_num = base / beta
    max_num = 2 * base - min_num
    if max_num > prompt_len - window:
        max_num = prompt_len - window
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


def largest_remainder(exact, total):
    """Round non-negative reals [..., n] to ints that sum to ``total`` (an int, or [...]) along the last
    dimension: the floors, plus one for the largest fractional parts (ties: the lower index first)."""
    sizes = exact.floor()
    leftover = total - sizes.sum(-1)
    order = (exact - sizes).argsort(dim=-1, descending=True, stable=True)
    return (sizes + (order.argsort(dim=-1) < leftover[..., None])).long()


def adakv_budgets(scores, base: int, floor: float, normalize: bool):
    """AdaKV: share ``base * heads`` entries among the KV heads of a layer by their scores.

    Each head first keeps its top ``floor * base``; the other slots go to the best remaining
    entries over all heads (one top-k). ``scores`` [b, Hkv, P] -> budgets [b, Hkv] (window excluded).
    With ``normalize``, each head's scores are weighted by the share of its mass inside its top-``base``.
    """
    b, hkv, P = scores.shape
    base = min(base, P)
    ranked = scores.sort(-1, descending=True).values
    if normalize:
        mass = ranked.clamp_min(0)
        ranked = ranked * (
            mass[..., :base].sum(-1, keepdim=True) / mass.sum(-1, keepdim=True).clamp_min(1e-30)
        )
    guaranteed = int(base * floor)
    pool = ranked[..., guaranteed:].reshape(b, -1)
    chosen = pool.topk(hkv * (base - guaranteed), dim=-1).indices // (P - guaranteed)
    extra = torch.zeros(b, hkv, dtype=torch.long, device=scores.device).scatter_add_(
        1, chosen, torch.ones_like(chosen)
    )
    return guaranteed + extra


def global_sizes(scores, total: int):
    """Prefix entries each (layer, KV head) keeps under ``layer_budget="global"``.

    ``scores`` one [b, Hkv, P] per evicted layer (-inf on padding), ``total`` the entries shared by them all
    per sample (window excluded). One top-k over the layers x heads x positions of each sample; -inf
    entries are never counted. Returns one [b, Hkv] per layer.
    """
    b, hkv, P = scores[0].shape
    flat = torch.stack(scores, 1).reshape(b, -1)  # [b, layers * Hkv * P], layer-major
    top = flat.topk(min(total, flat.shape[1]), dim=-1)
    counts = torch.zeros(b, len(scores) * hkv, dtype=torch.long, device=flat.device)
    counts.scatter_add_(1, top.indices // P, torch.isfinite(top.values).long())
    return list(counts.view(b, len(scores), hkv).unbind(1))


def head_sizes(cfg, scores, base: int, table=None, key_valid=None, window: int = 0):
    """Entries each KV head keeps [b, Hkv] (window excluded), or None when heads share the budget evenly.

    ``scores`` [b, Hkv, P] of the layer, ``base`` the per-head budget, ``table`` the layer's HeadKV row [Hkv]
    or LU-KV curve [99, Hkv]; LU-KV reads ``key_valid`` [b, L] (each sample's real tokens) and the ``window``.
    """
    if cfg.get("head_budget") == "lukv":
        return lukv_sizes(table, key_valid.sum(-1), base + window, window)
    if cfg.get("head_budget") == "adakv":
        return adakv_budgets(scores, base, cfg.floor, cfg.normalize)
    if cfg.get("head_budget") == "headkv":
        return table.to(scores.device).clamp(max=scores.shape[-1]).expand(*scores.shape[:2])
    if cfg.get("head_budget") == "threshold":
        return (scores >= cfg.threshold).sum(-1).clamp_max(base)
    return None


def headkv_budgets(importance, base: int, beta: float):
    """HeadKV: per-head budgets [layers, Hkv] from importance [layers, Hkv] (window excluded).

    Every head keeps ``base - base // beta``; the pool ``base // beta`` per head, over all layers, is
    shared in proportion to importance. The total is exactly ``layers * Hkv * base``.
    """
    pool = (base // beta) * importance.numel()
    share = importance / importance.sum()
    shared = largest_remainder((share * pool).flatten(), int(pool)).view(share.shape)
    return shared + int(base - base // beta)


def lukv_sizes(curve, lengths, budget: int, window: int):
    """LU-KV: prefix entries each KV head keeps [b, Hkv] (window excluded), as kvpress's ``LUKVPress``.

    ``curve`` [99, Hkv] the layer's prune ratios, ``lengths`` [b] each sample's real tokens L, ``budget`` B
    (window included). A sample's compression ratio is ``r = 1 - B / L``; its row is ``round(100 r) - 1``
    (clamped to [0, 98]). The heads keep ``(1 - ratio) L`` rounded by largest remainder: the total
    ``round(sum)`` (at least Hkv, at most Hkv L), the floors, one more for the largest fractional parts; each
    head then in [1, L]. The window is part of that count and always kept (a head keeps at least it).
    float64, on the lengths' device, no host read.
    """
    n = lengths.to(torch.float64)[:, None]  # [b, 1]
    r = 1.0 - n.new_full(n.shape, budget) / n  # Python's 1 - B / L (a scalar / tensor is B * (1 / L))
    row = ((r * 100).round().long() - 1).clamp(0, 98)[:, 0]
    exact = (1.0 - curve.to(lengths.device)[row]).clamp(0.0, 1.0) * n  # [b, Hkv]
    hkv = exact.shape[1]
    total = torch.minimum(exact.sum(-1).round().clamp_min(hkv), hkv * n[:, 0])
    keep = torch.minimum(largest_remainder(exact, total).clamp_min(1), n.long())
    keep = torch.where(r > 0, keep, n.long())  # kvpress: a ratio <= 0 keeps everything
    return (keep - window).clamp_min(0)


def load_lukv_curve(path: str, num_layers: int, num_kv_heads: int):
    """An LU-KV budget curve (``.npy``, [99, layers, Hkv] prune ratios) as float64; ValueError naming
    ``lukv_curve`` for a missing or unreadable file, another shape or values that are not finite."""
    try:
        curve = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"lukv_curve: cannot read {path} as .npy ({type(e).__name__}: {e})") from None
    shape = (99, num_layers, num_kv_heads)
    if curve.shape != shape or not np.issubdtype(curve.dtype, np.number):
        raise ValueError(
            f"lukv_curve: {path} has shape {curve.shape} ({curve.dtype}), the model needs {shape} numbers"
        )
    curve = torch.from_numpy(curve.astype(np.float64))
    if not torch.isfinite(curve).all():
        raise ValueError(f"lukv_curve: {path} holds values that are not finite")
    return curve


def load_head_importance(path: str, num_layers: int, num_heads: int, num_kv_heads: int):
    """Read a head-importance table and return it per KV head [layers, Hkv] (float64, mean over a GQA group).

    Accepts ``{"layer-head": [scores...] or score}`` (the HeadKV authors' format) or ``[[...], ...]``
    (layers x heads). A missing file or a shape that does not fit the model raises a ValueError.
    """
    if not os.path.isfile(path):
        raise ValueError(f"head_importance file not found: {path}")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if isinstance(data, dict):
        table = torch.full((num_layers, num_heads), float("nan"), dtype=torch.float64)
        for key, value in data.items():
            try:
                layer, head = (int(x) for x in key.split("-"))
                table[layer, head] = (
                    float(sum(value) / len(value)) if isinstance(value, list) else float(value)
                )
            except (ValueError, IndexError, TypeError, ZeroDivisionError):
                raise ValueError(
                    f"{path}: entry {key!r} does not fit a model of {num_layers} layers x {num_heads} heads"
                ) from None
        if torch.isnan(table).any():
            raise ValueError(
                f"{path}: {int(torch.isnan(table).sum())} of {num_layers}x{num_heads} heads have no score"
            )
    else:
        table = torch.tensor(data, dtype=torch.float64)
        if table.shape not in ((num_layers, num_heads), (num_layers, num_kv_heads)):
            raise ValueError(
                f"{path}: table of shape {tuple(table.shape)} does not fit a model of {num_layers} layers x "
                f"{num_heads} heads ({num_kv_heads} KV heads)"
            )
    if (table < 0).any():
        raise ValueError(f"{path}: head scores must be non-negative")
    if table.shape[1] != num_kv_heads:
        table = table.view(num_layers, num_kv_heads, -1).mean(-1)
    return table
