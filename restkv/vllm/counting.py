"""The rules both of vLLM's sides apply to a request: when it evicts (``eviction``, ``evicts``), how many
entries it is counted at once it did (``room``, ``Eviction``) and the blocks that takes (``extra_blocks``,
``most_blocks``),
and how much of a prefix-cache hit it may take (``hit_limit``). The scheduler, which frees and allocates
blocks, and every worker, which rewrites the cache, both compute them from the same numbers, so they agree
without a message. No vLLM import here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import CompressionConfig
from ..strategies.budgets import fits, layer_budgets
from .heads import equivalent_length
from .plugin_config import UNBOUNDED, deferred, per_head, per_layer, prompt_evicts, query_rows, summed, uncached
from .tables import largest, layers_of, mean_kept, rank_share

def schedule_length(cfg: CompressionConfig, prompt_len: int, seen: int, at_prefill: bool) -> int:
    """The length a per-layer schedule is read at in a check after ``seen`` tokens: the prompt's (the
    budgets of the prompt's end are kept while decoding), or while decoding under
    ``decode_compression_ratio`` the tokens seen (``restkv.strategies.decoding.decoding_budgets``)."""
    if at_prefill or cfg.get("decode_compression_ratio") is None:
        return prompt_len
    return seen


def room(cfg: CompressionConfig, budget: int, block_size: int, prompt_len: int, decoding: bool = False) -> int:
    """Entries a kept set is counted at, from the config alone (0: ``budget``, every head and layer
    keeping as many): where heads or layers keep their own counts (``per_head``), their mean over
    every layer and head and ``block_size`` more (``restkv.vllm.heads.equivalent_length``: any split
    over the layers' and heads' pages fits), the bound of the count the worker sends once the heads
    kept theirs (``heads.exact_length``). ``decoding``: a check after the prompt's end, where LU-KV's
    counts follow each layer's widest head (not known here): ``UNBOUNDED``, all it holds. Under tensor
    parallelism where the heads' split is across ranks (``sized_across_heads``), each rank's heads may
    hold all of it: the mean times the ranks."""
    if not per_head(cfg):
        return 0
    if decoding and cfg.get("head_budget") == "lukv":
        return UNBOUNDED
    layers = layers_of(cfg) if per_layer(cfg) else 1
    return equivalent_length(min(UNBOUNDED, rank_share(cfg) * mean_kept(cfg, budget, prompt_len, layers)), block_size)



@dataclass(frozen=True)
class Eviction:
    """What one request does at the end of one engine step.

    ``held`` entries are in its blocks once the step's tokens are written; it keeps ``budget`` of
    them. ``fresh``: the kept entries go to ``kept_blocks`` new blocks allocated after the held ones
    (its first eviction with prefix caching on: the held blocks may be shared with other requests
    or offered as cache hits, so they are left whole and released); else they are written over its
    first ``kept_blocks`` blocks (its blocks are its own).
    """

    held: int
    """Entries in the request's blocks once the step's tokens are written."""
    budget: int
    """Entries it keeps."""
    fresh: bool
    """The kept entries go to new blocks after the held ones (else over its first blocks)."""
    block_size: int
    """Entries per block."""
    room: int = 0
    """Entries the kept set is counted at (0: ``budget``; ``settings.room``): with per-head budgets the mean
    over every layer and head and ``block_size`` more, whatever the heads' split, until the worker's count
    (``measured``); at most ``held + block_size``."""
    measured: bool = False
    """Its kept count is the worker's (``per_head``: from its heads' lengths, ``heads.exact_length``):
    ``room`` is its bound until ``kept`` gives it."""

    @property
    def counted(self) -> int:
        """Entries the request is counted at once it evicted."""
        return self.room or self.budget

    @property
    def held_blocks(self) -> int:
        """Blocks the held entries fill."""
        return -(-self.held // self.block_size)

    @property
    def kept_blocks(self) -> int:
        """Blocks the kept entries fill."""
        return -(-self.counted // self.block_size)

    @property
    def first_kept_block(self) -> int:
        """Index in the request's blocks of the first block the kept entries go to."""
        return self.held_blocks if self.fresh else 0

    @property
    def slots(self) -> int:
        """Token slots the request needs during the step: its held blocks and, kept in fresh
        blocks, those too; else at least its kept blocks (per-head budgets can count more)."""
        if self.fresh:
            return (self.held_blocks + self.kept_blocks) * self.block_size
        return max(self.held_blocks, self.kept_blocks) * self.block_size

    @property
    def evicted(self) -> int:
        """Entries it removes: its offset (logical positions - entries held) grows by as many (with
        per-head budgets counted at ``room``: negative where that exceeds what it held)."""
        return self.held - self.counted

    def kept(self, counted: int) -> "Eviction":
        """The eviction once the worker measured its kept count (``counted`` entries)."""
        if not 0 < counted <= self.room:
            raise RuntimeError(f"restkv.vllm: a kept count of {counted} entries, outside 1 .. {self.room}")
        return replace(self, room=counted, measured=False)

    def cut(self, blocks: list) -> list:
        """Keep, in place, the ``kept_blocks`` of ``blocks`` (a request's block ids, or a copy of its
        block-table row) from ``first_kept_block``; return the others, which go back to the pool."""
        first, count = self.first_kept_block, self.kept_blocks
        gone = blocks[:first] + blocks[first + count :]
        blocks[:] = blocks[first : first + count]
        return gone


def eviction(
    cfg: CompressionConfig,
    computed: int,
    scheduled: int,
    prompt_len: int,
    offset: int,
    caching: bool,
    block_size: int,
    evicted: bool | None = None,
) -> Eviction | None:
    """The request's eviction at the end of a step that computes its tokens ``computed`` ..
    ``computed + scheduled - 1`` (logical positions), or None.

    Eviction is checked once a step has computed the whole prompt (``prompt_len``) and then every
    ``decode_interval`` tokens after it (logical counts ``prompt_len + m * decode_interval``), as
    restkv's transformers path does; a request evicts at a check when it holds more than its budget:
    ``max_capacity_prompt``, or while decoding under ``decode_compression_ratio`` r
    ``max(window_size + 1, int(n (1 - r)))`` of the n tokens it has seen; a threshold's
    (``head_budget="threshold"``) at every check, as ``restkv.configure`` selects; once a request's heads
    hold their own pages (``per_head``, ``evicted``), at every check too: a layer's widest head may hold
    more than the budget where the request holds fewer, and the worker keeps all of a layer that fits, as
    ``configure()`` decides layer by layer. ``offset``: entries it evicted before (logical - held);
    ``caching``: prefix caching is on; ``evicted``: it evicted before (default: ``offset != 0``).
    """
    end = computed + scheduled
    if not _checks_between(computed, end, prompt_len, cfg.get("decode_interval") or 0):
        return None
    held = end - offset
    at_prefill = computed < prompt_len
    budget = budget_at(cfg, end, at_prefill)
    evicted = offset != 0 if evicted is None else evicted
    length = schedule_length(cfg, prompt_len, end, at_prefill)
    if not evicts(cfg, held, budget, length, at_prefill, evicted):
        return None
    counted = room(cfg, budget, block_size, length, decoding=not at_prefill)
    counted = counted and min(counted, held + block_size)  # no head keeps more than it holds
    fresh = caching and not evicted and not deferred(cfg)  # ``uncached``: its blocks are its own
    return Eviction(held, budget, fresh, block_size, counted, per_head(cfg))


def evicts(cfg: CompressionConfig, held: int, budget: int, length: int, at_prefill: bool, evicted: bool) -> bool:
    """Whether a check that finds ``held`` entries evicts, as ``restkv.configure`` decides: at the prompt's
    end ``prompt_evicts``; while decoding, some layer holds more than its budget (``budget``, or the
    smallest layer's of a ``per_layer`` config, its schedule read at ``length``) or a threshold selects
    (``fits``); and once its heads hold their own pages (``per_head``, ``evicted``) at every check, since
    a layer's widest head is not known here: the worker keeps all of a layer that fits."""
    if at_prefill:
        return prompt_evicts(cfg, held)
    if evicted and per_head(cfg):
        return True
    smallest = min(layer_budgets(cfg, layers_of(cfg), length, budget)) if per_layer(cfg) else budget
    return not fits(cfg, held, smallest)


def _checks_between(computed: int, end: int, prompt_len: int, interval: int) -> bool:
    """Whether a check point (``prompt_len``, then every ``interval`` tokens) is in (computed, end]."""
    if end < prompt_len:
        return False
    if computed < prompt_len:
        return True
    return interval > 0 and (end - prompt_len) // interval > (computed - prompt_len) // interval


def most_budget(cfg: CompressionConfig, seen: int) -> int:
    """The largest budget of any check up to ``seen`` tokens: ``max_capacity_prompt``, or under
    ``decode_compression_ratio`` the decoding budget of ``seen`` tokens where larger."""
    return max(cfg.max_capacity_prompt, budget_at(cfg, seen, at_prefill=False))


def budget_at(cfg: CompressionConfig, seen: int, at_prefill: bool) -> int:
    """Entries kept per KV head and layer at a check after ``seen`` tokens (window included)."""
    ratio = cfg.get("decode_compression_ratio")
    if at_prefill or ratio is None:
        return cfg.max_capacity_prompt
    return max(cfg.window_size + 1, max(1, int(seen * (1 - ratio))))


def hit_limit(cfg: CompressionConfig, num_tokens: int) -> int:
    """The most tokens of a request that a prefix-cache hit may provide: an eviction reads the
    queries of its last ``query_rows`` positions (and a ``SUMMED`` method's prefill every query),
    which only a computed token has; an ``uncached`` request takes none. ``num_tokens``: what the
    request's prefill computes up to."""
    if (summed(cfg) and prompt_evicts(cfg, num_tokens)) or uncached(cfg, num_tokens):
        return 0
    return max(0, num_tokens - query_rows(cfg))


def extra_blocks(cfg: CompressionConfig, max_model_len: int, block_size: int) -> int:
    """Blocks a request can hold beyond ``max_model_len``'s: the kept ones during a first eviction
    with prefix caching on (under tensor parallelism, as many as ``room`` may count: ``rank_share``)."""
    most = (
        max_model_len
        if cfg.get("decode_compression_ratio") is not None
        else cfg.max_capacity_prompt
    )
    largest_kept = min(UNBOUNDED, rank_share(cfg) * largest(cfg, most, max_model_len))
    kept = max(most, equivalent_length(largest_kept, block_size) if per_head(cfg) else 0)
    return -(-min(kept, max_model_len + block_size) // block_size)


def most_blocks(cfg: CompressionConfig, max_model_len: int, block_size: int, caching: bool) -> int:
    """The most blocks one request holds at once in the evicted group (``Eviction.slots``): the
    ``max_model_len`` entries it may hold and, in a first eviction under prefix caching, the fresh blocks
    its kept entries go to (``extra_blocks``); evicting in place, per-head counts may round a block over
    (``room``: at most ``held + block_size``). A pool that cannot hold them would leave a request computed
    again near ``max_model_len`` (preempted late) waiting for blocks that never come."""
    blocks = -(-max_model_len // block_size)
    if caching:
        return blocks + extra_blocks(cfg, max_model_len, block_size)
    return blocks + (1 if per_head(cfg) else 0)
