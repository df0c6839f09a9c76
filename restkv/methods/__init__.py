"""The method registry: one line per method.

A method is a module of this folder with

- ``KNOBS``: the knobs its score reads (``restkv.knobs.Knob``), with their defaults;
- ``score(obs, cfg)``: ``restkv.scoring.observe.Observation`` -> float32 scores [b, Hq or Hkv, P] (or [b, 1, P],
  shared by every head); ``cfg`` holds only the declared knobs (and the layer's budget is ``obs.budget``);
- optionally ``uses_budget(cfg) -> bool`` (the score reads ``obs.budget``), ``check(values)`` (a
  cross-knob check that raises ``ValueError``), ``check_layers(values, num_layers)`` (a check
  against the model's number of evicted layers, run by ``configure``). Constants computed from the model
  once per ``configure`` and read as ``obs.data`` (Q-Filters' filters) are registered with their
  computation in ``restkv.integration.calibration``.

A registry line may give other defaults, for the method's knobs or for the strategies (budgets,
merging): PyramidKV is SnapKV's score with ``layer_budget="pyramid"``.

A method whose scores come from forward passes of its own after the prefill (KVzip) also has
``passes(context_ids, cfg)`` (see ``restkv.eviction.deferred``) and ``check_model(values, model)``
(run by ``configure`` before any work); to read a long pass in several forwards, ``PASS_CHUNK`` with
``query_statistic``, ``merge`` and ``finish`` (KVCompose; see ``replay_scores``). One that shares
``layer_budget="global"``'s entries among the layers and heads in its own way (KVCompose's composite
tokens) has ``global_sizes(scores, total, cfg, top_k)`` (``top_k``: the plain split, to fall back
on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

from . import (
    cam,
    cap,
    compactor,
    cur,
    defensivekv,
    duo_attention,
    expected_attention,
    expected_attention_stats,
    fastkvzip,
    finch,
    h2o,
    keydiff,
    kvcompose,
    kvgrad,
    kvzap,
    kvzip,
    l2norm,
    lacache,
    lagkv,
    leverage,
    noncausal,
    qfilter,
    random,
    restkv,
    restkv_repeat,
    rkv,
    simlayerkv,
    snapkv,
    streamingllm,
    tova,
    triattention,
)


@dataclass(frozen=True)
class Method:
    """A registered method: its scorer module (``None``: keep everything) and its defaults."""

    name: str
    """Its ``configure(model, method=...)`` name."""
    module: ModuleType | None = None
    """The module of this folder holding its ``KNOBS`` and ``score`` (``None``: keep everything)."""
    defaults: dict = field(default_factory=dict)
    """Defaults of this registration, over its knobs' and the strategies' own."""

    @property
    def evicts(self) -> bool:
        """Whether it evicts (``fullkv`` keeps every entry)."""
        return self.module is not None

    @property
    def knobs(self) -> tuple:
        """The scorer's knobs, with this registration's defaults."""
        own = getattr(self.module, "KNOBS", ())
        return tuple(
            k.but(default=self.defaults[k.name]) if k.name in self.defaults else k for k in own
        )

    @property
    def scorer(self) -> str:
        """Identity of the score function: registrations of one module share scores."""
        return self.module.__name__

    @property
    def doc(self) -> str:
        """The first line of its module's docstring: what it keeps."""
        return (
            (self.module.__doc__ or "").strip().split("\n")[0]
            if self.module
            else "keeps every entry"
        )

    def score(self, obs, cfg):
        """Its module's ``score(obs, cfg)``: float32 scores [b, Hq or Hkv or 1, P], the higher the more
        worth keeping."""
        return self.module.score(obs, cfg)

    def uses_budget(self, cfg) -> bool:
        """Whether its score under ``cfg`` reads the layer's budget (``obs.budget``)."""
        reads = getattr(self.module, "uses_budget", None)
        return bool(reads and reads(cfg))

    def check(self, values: dict) -> None:
        """Its checks across knobs (``ValueError``), if it has any."""
        check = getattr(self.module, "check", None)
        if check is not None:
            check(values)

    def check_layers(self, values, num_layers: int) -> None:
        """Its checks against the model's number of evicted layers (``ValueError``), if any."""
        check = getattr(self.module, "check_layers", None)
        if check is not None:
            check(values, num_layers)

    def check_model(self, values, model) -> None:
        """Its checks against the model, run by ``configure`` before any work (``ValueError``), if any."""
        check = getattr(self.module, "check_model", None)
        if check is not None:
            check(values, model)

    @property
    def reads_hidden(self) -> bool:
        """Its score reads the layer's attention input (``obs.hidden``: KVzap, Fast KVzip)."""
        return bool(getattr(self.module, "READS_HIDDEN", False))

    @property
    def replays(self) -> bool:
        """Its scores come from forward passes of its own after the prefill (``passes``)."""
        return hasattr(self.module, "passes")


# kvpress's SnapKV where it differs from restkv's (its window of 64 aside: window_size is 32 for every method).
_KVPRESS_SNAPKV = {"kernel_size": 5, "window_reduce": "mean"}


# DMS in kvpress's threshold form (``DMSPress``): a threshold on a scorer's scores, here KVzip's (kvpress pairs
# it with KVzap, a model trained to predict KVzip+'s scores), with DMSPress's sliding window of 128 tokens.
# kvpress has no default threshold; 0.02 (on KVzip's attention probabilities) is restkv's, to tune per model:
# on SmolLM2-135M, one 1,024-token essay window, it keeps 31% of the entries (the window included; 0.005: 50%).
# Any other scorer takes the rule as head_budget="threshold", threshold=...
_DMS = {
    "layer_budget": "uniform",
    "head_budget": "threshold",
    "threshold": 0.02,
    "window_size": 128,
}


# LU-KV as kvpress's LUKVPress default: Expected Attention (epsilon 0.02) under the per-head budgets of a
# budget curve (``head_budget="lukv"``, ``lukv_curve``: the user's .npy, made by LU-KV's scripts), its 4 sinks
# (``lukv_sink``) and its window of 1 token (``window_size=1``). Any other scorer takes head_budget="lukv".
_LUKV = {"head_budget": "lukv", "epsilon": 0.02, "window_size": 1}


# R-KV as its code runs (``R1KV``, ``run_math.py``): a budget of 128 entries, 8 observed (and always kept)
# queries, compressed again every 128 generated tokens.
_RKV = {"max_capacity_prompt": 128, "window_size": 8, "decode_interval": 128}


# TriAttention as the authors' runs: a budget of 2048, pruned every 128 generated tokens, no recent window
# (1 here), each query head's z-scores reduced over its group by the maximum.
_TRIATTENTION = {"max_capacity_prompt": 2048, "window_size": 1, "decode_interval": 128, "gqa_agg": "max"}


def _register(*methods: Method) -> dict:
    return {m.name: m for m in methods}


REGISTRY = _register(
    Method("fullkv"),
    Method("restkv", restkv),
    Method("snapkv", snapkv),
    Method("pyramidkv", snapkv, {"layer_budget": "pyramid"}),
    Method("h2o", h2o),
    Method("streamingllm", streamingllm),
    Method("cam", cam, {"merge": "cam"}),
    Method("l2norm", l2norm),
    Method("adakv", snapkv, {"head_budget": "adakv", "pooling": "maxpool"}),
    Method("headkv", snapkv, {"head_budget": "headkv", "pooling": "maxpool"}),
    Method("random", random),
    Method("tova", tova),
    Method("lacache", lacache),
    Method("expected_attention", expected_attention),
    Method("keydiff", keydiff),
    Method("criticalkv", snapkv, _KVPRESS_SNAPKV | {"critical": True}),
    Method("critical_adakv", snapkv, _KVPRESS_SNAPKV | {"critical": True, "head_budget": "adakv"}),
    Method("chunkkv", snapkv, _KVPRESS_SNAPKV | {"chunk_size": 20}),
    Method(
        "entropy_gated_chunkkv",
        snapkv,
        _KVPRESS_SNAPKV | {"chunk_size": 10, "low_entropy_chunk_length": 4},
    ),
    Method("defensivekv", defensivekv, {"head_budget": "adakv", "floor": 0.0}),
    Method("layer_defensivekv", defensivekv, {"layer_budget": "global"}),
    Method("kvzip", kvzip, {"layer_budget": "global"}),
    Method(
        "restkv_repeat",
        restkv_repeat,
        {"metric_mode": "before", "temporal": "max", "pooling": "none"},
    ),
    Method("cur", cur),
    Method("leverage", leverage),
    Method("lagkv", lagkv),
    Method("noncausal", noncausal),
    Method("compactor", compactor),
    Method("simlayerkv", simlayerkv, {"head_budget": "threshold", "threshold": 0.5}),
    Method("dms", kvzip, _DMS),
    Method("qfilter", qfilter),
    Method("finch", finch),
    Method("kvcompose", kvcompose, {"layer_budget": "global"}),
    Method("kvgrad", kvgrad, {"layer_budget": "global"}),
    Method("cap", cap),
    Method("expected_attention_stats", expected_attention_stats),
    Method("duo_attention", duo_attention, {"head_budget": "threshold", "threshold": 0.5}),
    Method("kvzap", kvzap),
    Method("fastkvzip", fastkvzip, {"layer_budget": "global"}),
    Method("lukv", expected_attention, _LUKV),
    Method("rkv", rkv, _RKV),
    Method("triattention", triattention, _TRIATTENTION),
)
"""Every registered method by name, in registration order."""

METHODS = tuple(REGISTRY)
"""The registered methods' names, in registration order."""

ALIASES = {"full": "fullkv"}
"""The original ReST-KV code's other method names (``--method full``)."""


def method_key(name) -> str:
    """The registered name that ``name`` stands for, as the runners and ``configure`` read it: any case (the
    original's ``SnapKV``, ``H2O``, ``FullKV``) and ``ALIASES``; a name of no method comes back lower-cased
    (``unknown_method`` says what it might have meant)."""
    key = str(name).strip().lower()
    return ALIASES.get(key, key)


def unknown_method(name) -> str:
    """``unknown method 'snap_kv'; did you mean snapkv?``: the nearest registered names, separators aside
    (``rest-kv``), else every name."""
    import difflib

    plain = {m.replace("_", ""): m for m in METHODS}
    key = method_key(name).replace("-", "").replace("_", "")
    close = [plain[k] for k in difflib.get_close_matches(key, plain, n=3, cutoff=0.75)]
    hint = f"did you mean {' or '.join(close)}?" if close else f"one of {', '.join(METHODS)}"
    return f"unknown method {name!r}; {hint}"
