"""One validated config object for every eviction knob.

The knob names follow the original ReST-KV command line so that sweep scripts carry over.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

METHODS = ("fullkv", "restkv", "snapkv", "h2o", "streamingllm", "pyramidkv", "cam", "l2norm", "adakv", "headkv")
HEAD_BUDGETS = ("uniform", "adakv", "headkv")
QUANT_BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
QUANT_PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
POOLINGS = ("avgpool", "maxpool", "adaptive", "none")
METRIC_MODES = ("before", "after")
MERGES = ("none", "pivot")
GQA_AGGS = ("mean", "max", "sum_norm", "rank")

# Named knob sets. "paper": ReST-KV exactly as published (ICLR 2026 paper and its code).
PRESETS = {
    "paper": dict(
        method="restkv", window_size=32, kernel_size=7, pooling="adaptive", use_wo=True, use_norm=False,
        use_ema=True, alpha=0.3, metric_mode="after", tau=1.0, scale=2000.0, gqa_agg="mean",
    ),
}

# pooling used when the caller does not choose one
DEFAULT_POOLING = {"restkv": "adaptive", "snapkv": "avgpool", "pyramidkv": "avgpool", "adakv": "maxpool", "headkv": "maxpool"}


@dataclass(frozen=True)
class CompressionConfig:
    """Every knob of one eviction run.

    Parameters
    ----------
    method : str
        One of ``METHODS``; ``"fullkv"`` keeps the whole cache.
    max_capacity_prompt : int
        Entries kept per KV head per layer after prefill (the budget B), window included.
    window_size : int
        The last ``window_size`` prompt tokens: always kept, and their queries observe the prefix.
    kernel_size : int
        Odd width of the spatial pooling (the minimum width for ``pooling="adaptive"``).
    pooling : str or None
        ``avgpool``, ``maxpool``, ``adaptive`` (ReST-KV's drift-following window) or ``none``;
        ``None`` picks the method's own default.
    use_wo : bool
        ReST-KV: measure the output change after the head's slice of ``o_proj`` (else in value space).
    use_norm : bool
        ReST-KV ``metric_mode="before"``: divide by ``||O_q W_O^h||``.
    use_ema : bool
        ReST-KV: smooth over the window queries with an EMA (the paper's choice, ``preset="paper"``);
        the default, a plain mean, found more needles than the EMA in the study and was never worse
        beyond its noise on fidelity or RULER (docs/results.md).
    alpha : float
        EMA weight of the newest query, in (0, 1].
    metric_mode : str
        ReST-KV: ``after`` aggregates attention over the window first, ``before`` scores each query.
    tau : float
        ReST-KV: exponent of the output-distance term.
    scale : float
        ReST-KV adaptive pooling: positions of drift per pooling step.
    use_pyramid : bool
        Give lower layers larger budgets (PyramidKV schedule, same total).
    beta : float
        PyramidKV: ratio of the largest to the smallest layer budget is about ``2 * beta``.
    merge : str
        ``pivot`` merges each evicted entry into its most similar kept key (keys and values alike).
    sink_tokens : int
        StreamingLLM: first tokens always kept.
    gqa_agg : str
        How per-query-head scores reduce over a GQA group: ``mean`` (the original), ``max``, or the
        scale-free ``sum_norm`` (each head's scores divided by their sum) and ``rank`` (each head's
        ranks), both then averaged.
    head_budget : str or None
        How a layer's budget is shared by its KV heads: ``uniform``, ``adakv`` (by a top-k over all
        heads' scores) or ``headkv`` (by a head-importance table). ``None``: ``adakv`` / ``headkv`` for
        those methods (which score like SnapKV), ``uniform`` otherwise. Per-head budgets are held in a
        variable-length cache.
    floor : float
        AdaKV: each head keeps at least ``floor`` of the per-head budget.
    normalize : bool
        AdaKV: weight each head's scores by the share of its mass inside its top-B.
    head_importance : str or None
        HeadKV: JSON file of per-layer, per-head importance (``{"layer-head": [scores...]}``, as the
        HeadKV authors publish, or a ``[layers][heads]`` list).
    headkv_beta : float
        HeadKV: each head keeps ``B - B // headkv_beta`` entries, the rest is shared by importance.
    varlen : bool
        Per-head budgets: pack each head's entries (memory = sum of head lengths). ``False`` keeps a
        layout padded to the longest head with the rest masked (no memory saved; for comparison).
    quant_method : str or None
        Hold the kept entries in transformers' quantized cache layer: ``quanto`` (2/4 bits) or
        ``hqq`` (1/2/3/4/8 bits). ``None``: full precision.
    nbits : int
        Bits per quantized key/value element.
    residual_length : int
        Decoded entries kept in full precision before they are quantized in one go.
    q_group_size : int
        Quantization group size.
    """

    method: str = "restkv"
    max_capacity_prompt: int = 512
    window_size: int = 32
    kernel_size: int = 7
    pooling: str | None = None
    use_wo: bool = True
    use_norm: bool = False
    use_ema: bool = False
    alpha: float = 0.3
    metric_mode: str = "after"
    tau: float = 1.0
    scale: float = 2000.0
    use_pyramid: bool = False
    beta: float = 20.0
    merge: str = "none"
    sink_tokens: int = 4
    gqa_agg: str = "mean"
    head_budget: str | None = None
    floor: float = 0.2
    normalize: bool = False
    head_importance: str | None = None
    headkv_beta: float = 1.2
    varlen: bool = True
    quant_method: str | None = None
    nbits: int = 4
    residual_length: int = 32
    q_group_size: int = 64

    def __post_init__(self):
        _check_choice("method", self.method, METHODS)
        if self.pooling is None:
            object.__setattr__(self, "pooling", DEFAULT_POOLING.get(self.method, "none"))
        _check_choice("pooling", self.pooling, POOLINGS)
        _check_choice("metric_mode", self.metric_mode, METRIC_MODES)
        _check_choice("merge", "none" if self.merge is None else self.merge, MERGES)
        _check_choice("gqa_agg", self.gqa_agg, GQA_AGGS)
        if self.head_budget is None:
            object.__setattr__(self, "head_budget", self.method if self.method in HEAD_BUDGETS else "uniform")
        _check_choice("head_budget", self.head_budget, HEAD_BUDGETS)
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"floor must be in [0, 1], got {self.floor}")
        if not self.headkv_beta > 1.0:
            raise ValueError(f"headkv_beta must be > 1, got {self.headkv_beta}")
        if self.head_budget == "headkv" and not self.head_importance:
            raise ValueError("head_importance (a JSON file of head scores) is required for head_budget='headkv'")
        if self.quant_method is not None:
            _check_choice("quant_method", self.quant_method, tuple(QUANT_BITS))
            _check_choice("nbits", self.nbits, QUANT_BITS[self.quant_method])
            if self.head_budget != "uniform" and self.varlen:
                raise ValueError("quant_method needs head_budget='uniform' (or varlen=False)")
            module, package = QUANT_PACKAGES[self.quant_method]
            if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
                raise ValueError(f"quant_method={self.quant_method!r} needs the {package} package: pip install {package}")
        if self.merge == "pivot" and self.head_budget != "uniform":
            raise ValueError("merge='pivot' needs head_budget='uniform'")
        for name in ("use_wo", "use_norm", "use_ema", "use_pyramid", "normalize", "varlen"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("max_capacity_prompt", "window_size", "kernel_size", "sink_tokens", "nbits", "residual_length", "q_group_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {self.window_size}")
        if self.window_size >= self.max_capacity_prompt:
            raise ValueError(
                f"window_size ({self.window_size}) must be smaller than max_capacity_prompt "
                f"({self.max_capacity_prompt})"
            )
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd integer >= 1, got {self.kernel_size}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if not self.tau > 0:
            raise ValueError(f"tau must be > 0, got {self.tau}")
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")
        if not self.beta >= 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")
        if not 0 <= self.sink_tokens <= self.max_capacity_prompt - self.window_size:
            raise ValueError(
                f"sink_tokens must be in [0, max_capacity_prompt - window_size], got {self.sink_tokens}"
            )

    @property
    def evicts(self) -> bool:
        return self.method != "fullkv"

    @property
    def pyramid(self) -> bool:
        return self.use_pyramid or self.method == "pyramidkv"

    @classmethod
    def from_kwargs(cls, preset: str | None = None, **kwargs) -> "CompressionConfig":
        """Build from keyword knobs (over a named ``preset``); an unknown knob raises a ValueError naming it."""
        if preset is not None:
            _check_choice("preset", preset, tuple(PRESETS))
            kwargs = {**PRESETS[preset], **kwargs}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown knob(s) {', '.join(unknown)}; known knobs: {', '.join(sorted(known))}")
        return cls(**kwargs)


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")
