"""restkv's vLLM path (``restkv.vllm``: its rules, paged layouts, query ring and worker) against
``restkv.configure`` on a tiny model, through a paged-attention engine in plain torch
(``tests/vllm_sim.py``; the plugin inside vLLM itself: tests/vllm_plugin)."""

from __future__ import annotations

import pytest
import torch
from helpers import fewest_length, on_ranks, prompt, small, tiny_lukv_curve, tiny_model
from vllm_sim import PagedEngine, scrambled_writer

import restkv
from restkv.config import CompressionConfig
from restkv.methods import METHODS, REGISTRY
from restkv.vllm import paged, settings

BUDGET = dict(max_capacity_prompt=40, window_size=8)


def _runs_in_vllm(name: str) -> bool:
    knobs = small(name)
    try:
        settings.check(CompressionConfig.from_kwargs(**knobs, **BUDGET))
    except ValueError:
        return False
    return True


VLLM_METHODS = [name for name in METHODS if REGISTRY[name].evicts and _runs_in_vllm(name)]


def reference(knobs: dict, ids: list[int], new: int):
    """Tokens and each layer's kept positions [Hkv, B] of restkv's transformers path."""
    model = tiny_model()
    restkv.configure(model, **knobs)
    x = torch.tensor([ids])
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False, pad_token_id=0
    )
    kept = [None if p is None else p[0] for p in restkv.kept_positions(model)]
    return out[0, len(ids) :].tolist(), kept


def engine(knobs: dict, **kw) -> PagedEngine:
    return PagedEngine(tiny_model(attn_implementation="restkv_paged_sim"), knobs, **kw)


def equals_configure(knobs: dict, chunk) -> list:
    """The paged engine on an 80-token prompt (whole, or in chunks of ``chunk``) keeps configure()'s
    positions in every layer and decodes its 6 tokens -> those kept positions."""
    ids = prompt(80)[0].tolist()
    tokens, kept = reference(knobs, ids, 6)
    eng = engine(knobs, chunk=chunk)
    assert eng.generate(ids, 6) == tokens
    for layer, (ours, theirs) in enumerate(zip(kept_of(eng), kept)):
        assert torch.equal(ours, theirs), f"layer {layer}"
    return kept


def decodes_as_configure(knobs: dict, length: int, new: int, **kw) -> None:
    """The paged engine (``kw``: its options) decodes configure()'s ``new`` tokens after a ``length``-token prompt."""
    ids = prompt(length)[0].tolist()
    tokens, _ = reference(knobs, ids, new)
    assert engine(knobs, **kw).generate(ids, new) == tokens


def kept_of(eng: PagedEngine) -> list:
    recorded = eng.recorded.get("r", {})
    return [recorded.get(name) for name in eng.names]


@pytest.mark.parametrize("method", VLLM_METHODS)
@pytest.mark.parametrize("chunk", [None, 13], ids=["whole", "chunks-of-13"])
def test_prefill_eviction_equals_configure(method, chunk):
    """Every method the plugin runs keeps configure()'s positions in every layer, with the prompt in
    one step or in chunks of 13 tokens (the 8-token window split across two), and decodes its
    tokens."""
    knobs = {**small(method), **BUDGET}
    equals_configure(knobs, chunk)


@pytest.mark.parametrize("method", ["snapkv", "restkv", "h2o", "keydiff"])
@pytest.mark.parametrize("length", [30, 80], ids=["prompt-under-budget", "prompt-over-budget"])
def test_eviction_while_decoding_equals_configure(method, length):
    """decode_interval=10: evictions every 10 generated tokens give configure()'s tokens over 60."""
    decodes_as_configure({**small(method), **BUDGET, "decode_interval": 10}, length, 60)


@pytest.mark.parametrize(
    "knobs",
    [
        {"method": "adakv"},
        {"method": "defensivekv"},
        {"method": "snapkv", "head_budget": "threshold", "threshold": 0.02},
        {"method": "pyramidkv"},
        {"method": "pyramidkv", "head_budget": "adakv"},
        {"method": "restkv", "head_budget": "adakv"},
        {"method": "snapkv", "head_budget": "threshold", "threshold": 0.2},
        {"method": "snapkv", "head_budget": "lukv", "lukv_curve": tiny_lukv_curve()},
        {"method": "pyramidkv", "head_budget": "lukv", "lukv_curve": tiny_lukv_curve()},
        {"method": "snapkv", "layer_ratios": "0.5,0.2,0.7"},
        {"method": "snapkv", "layer_ratios": "20,40,30", "head_budget": "adakv"},
    ],
    ids=["adakv", "defensivekv", "snapkv-threshold", "pyramidkv", "pyramidkv-adakv", "restkv-adakv",
         "threshold-to-the-window", "lukv", "pyramidkv-lukv", "layer-ratios", "layer-budgets-adakv"],
)
@pytest.mark.parametrize("chunk", [None, 13], ids=["whole", "chunks-of-13"])
def test_per_head_eviction_while_decoding_equals_configure(knobs, chunk):
    """Per-head and per-layer budgets with decode_interval=10: each eviction reads the heads' pages laid
    out as configure() lays out its heads (older entries, a gap, the newest window), and 60 tokens are
    configure()'s."""
    decodes_as_configure({**small(knobs["method"]), **knobs, **BUDGET, "decode_interval": 10}, 80, 60, chunk=chunk)


@pytest.mark.parametrize(
    "knobs",
    [
        {"method": "snapkv", "head_budget": "lukv", "lukv_curve": tiny_lukv_curve()},
        {"method": "snapkv", "layer_ratios": "20,40,30"},
        {"method": "snapkv", "layer_ratios": "0.5,0.2,0.7"},
        {"method": "h2o", "layer_ratios": "20,50,60"},
    ],
    ids=["lukv", "layer-budgets", "layer-ratios", "h2o-layer-budgets"],
)
@pytest.mark.parametrize("chunk", [None, 13], ids=["whole", "chunks-of-13"])
def test_lukv_and_layer_ratios_equal_configure(knobs, chunk):
    """LU-KV's curve (each head's count from its row at the prompt's length) and ``layer_ratios`` (each
    layer's budget, as integers or ratios of the prompt) keep configure()'s positions in every layer and
    head, and its tokens."""
    kept = equals_configure({**small(knobs["method"]), **knobs, **BUDGET}, chunk)
    assert len({int(n) for layer in kept for n in (layer >= 0).sum(-1)}) > 1  # layers or heads kept different counts


@pytest.mark.parametrize(
    "knobs, length",
    [
        ({"method": "snapkv", "head_budget": "threshold", "threshold": 0.2}, 30),
        ({"method": "pyramidkv"}, 30),
        ({"method": "snapkv", "layer_ratios": "20,40,30"}, 30),
        ({"method": "h2o", "layer_ratios": "20,50,60"}, 45),
        ({"method": "adakv"}, 30),
    ],
    ids=["threshold", "pyramidkv", "layer-budgets", "h2o-layer-budgets", "adakv"],
)
def test_a_prompt_within_the_budget_evicts_as_configure(knobs, length):
    """A prompt of at most max_capacity_prompt, evicting every 10 tokens: a threshold selects at the prompt's
    end anyway, a layer whose budget is below B (PyramidKV's schedule for a short prompt, ``layer_ratios``)
    evicts once it holds more than its own budget, as configure() does; 40 tokens are configure()'s."""
    decodes_as_configure({**small(knobs["method"]), **knobs, **BUDGET, "decode_interval": 10}, length, 40)


@pytest.mark.parametrize(
    "knobs",
    [
        {"method": "snapkv"},
        {"method": "adakv"},
        {"method": "pyramidkv"},
        {"method": "pyramidkv", "head_budget": "adakv"},
        {"method": "snapkv", "head_budget": "threshold", "threshold": 0.02},
        {"method": "snapkv", "head_budget": "lukv", "lukv_curve": tiny_lukv_curve()},
    ],
    ids=["snapkv", "adakv", "pyramidkv", "pyramidkv-adakv", "threshold", "lukv"],
)
def test_decode_compression_ratio_equals_configure(knobs):
    """decode_compression_ratio=0.5 every 8 tokens: each check keeps half the tokens seen (PyramidKV's
    schedule read at that count, AdaKV's split of it, LU-KV's curve at the heads' width); 40 tokens are
    configure()'s."""
    ratio = {"decode_interval": 8, "decode_compression_ratio": 0.5}
    decodes_as_configure({**small(knobs["method"]), **knobs, **BUDGET, **ratio}, 60, 40)


@pytest.mark.parametrize("method", ["snapkv", "restkv", "h2o"])
def test_prefix_cache_hit_keeps_the_shared_blocks_whole(method):
    """A prompt evicted under prefix caching gives its blocks back whole (its kept entries went to
    new blocks); a second prompt hitting them evicts as without the hit."""
    knobs = {**small(method), **BUDGET, "decode_interval": 10}
    first = prompt(80, seed=1)[0].tolist()
    second = first[:64] + prompt(24, seed=2)[0].tolist()
    eng = engine(knobs, caching=True)
    eng.generate(first, 25)
    (gone, contents), *later = eng.released
    assert not later, "one first eviction, one release"
    for cache, saved in zip(eng.caches, contents):
        assert torch.equal(cache[gone], saved), "a released block was rewritten"
    hits = gone[:8]  # the blocks of the first 64 prompt tokens, whole
    tokens, kept = reference(knobs, second, 25)
    again = engine(knobs, caching=True)
    again.caches = eng.caches  # the same pool, the released blocks still holding the first prompt
    again.paged = eng.paged
    again.free = [b for b in eng.free if b not in hits]
    assert again.generate(second, 25, hit_blocks=hits) == tokens
    for ours, theirs in zip(kept_of(again), kept):
        assert torch.equal(ours, theirs)


def test_hit_limit_leaves_the_read_queries_computed():
    cfg = CompressionConfig.from_kwargs(method="snapkv", **BUDGET)
    assert settings.hit_limit(cfg, 100) == 92  # the window's 8 queries are computed
    restkv_cfg = CompressionConfig.from_kwargs(method="restkv", query_window=20, **BUDGET)
    assert settings.hit_limit(restkv_cfg, 100) == 80
    h2o = CompressionConfig.from_kwargs(method="h2o", **BUDGET)
    assert settings.hit_limit(h2o, 100) == 0  # its prefill sums every query
    assert settings.hit_limit(h2o, 30) == 22  # a prompt under the budget: its window only


def test_scrambled_layout_equals_declared():
    """The probed map of a writer whose blocks are not strided (element order scrambled) reads back
    what the writer wrote, and the engine on it keeps what it keeps on the declared layout."""
    cache = torch.zeros(6, 2, 8, 32)
    p = paged.probed(cache, 8, 2, 16, scrambled_writer, "scrambled-test")
    assert p.keys.dim() == 3  # an element map, not a view
    k, v = torch.randn(2, 20, 2, 16).unbind(0)
    slots = torch.randperm(48)[:20]
    scrambled_writer(cache, k, v, slots)
    rk, rv = p.read(slots)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    blank = torch.zeros_like(cache)
    paged.probed(blank, 8, 2, 16, scrambled_writer, "scrambled-test").write(slots, k, v)
    assert torch.equal(blank, cache)
    knobs = {"method": "snapkv", **BUDGET}
    ids = prompt(80)[0].tolist()
    a, b = engine(knobs), engine(knobs, layout="scrambled")
    assert a.generate(ids, 5) == b.generate(ids, 5)
    for x, y in zip(kept_of(a), kept_of(b)):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    "computed, scheduled, offset, due",
    [
        (0, 80, 0, True),  # the whole prompt in one step
        (0, 64, 0, False),  # a chunk before the prompt's end
        (64, 16, 0, True),  # the last chunk
        (80, 1, 40, False),  # decoding, before the interval
        (89, 1, 40, True),  # the 10th token after the prompt
        (99, 1, 50, True),  # the 20th
    ],
)
def test_eviction_checks(computed, scheduled, offset, due):
    cfg = CompressionConfig.from_kwargs(method="snapkv", **BUDGET, decode_interval=10)
    e = settings.eviction(cfg, computed, scheduled, 80, offset, False, 8)
    assert (e is not None) == due
    if due:
        assert e.held == computed + scheduled - offset and e.budget == 40 and not e.fresh


def test_fresh_blocks_only_for_a_first_eviction_under_prefix_caching():
    cfg = CompressionConfig.from_kwargs(method="snapkv", **BUDGET, decode_interval=10)
    first = settings.eviction(cfg, 0, 80, 80, 0, True, 8)
    assert first.fresh and first.first_kept_block == 10 and first.slots == 80 + 40
    later = settings.eviction(cfg, 89, 1, 80, 40, True, 8)
    assert not later.fresh and later.first_kept_block == 0 and later.slots == 56
    assert settings.eviction(cfg, 0, 40, 40, 0, True, 8) is None  # fits the budget


@pytest.mark.parametrize("method", VLLM_METHODS)
def test_heads_split_over_ranks_keep_what_all_heads_keep(method):
    """Tensor parallelism gives each rank some KV heads (their query heads, their o_proj columns): a
    config ``settings.mixes_heads`` lets through keeps, from one KV head's share, what it keeps for
    that head from all (a split of the budget across heads, ``sized_across_heads``, from every rank's
    gathered scores: ``ranks``); one it refuses does not (so it refuses what it must)."""
    from restkv.strategies.budgets import shared_sizes
    from restkv.vllm import ranks as tp
    from restkv.vllm.scoring import entry_scores, kept_entries, observation

    g = torch.Generator().manual_seed(3)
    hq, hkv, d, n, hidden = 6, 2, 16, 90, 48
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
    weight = torch.randn(hidden, hq * d, generator=g)
    # DefensiveKV's first stage would fill each head's share alike on flat random attention
    first = {"first_stage_mass": 0.05} if method in ("defensivekv", "layer_defensivekv") else {}
    cfg = CompressionConfig.from_kwargs(**small(method), **BUDGET, **first)
    rows = settings.query_rows(cfg)

    def observe(heads: slice, kv: slice, ranks=None):
        w = weight.view(hidden, hq, d)[:, heads].reshape(hidden, -1)
        gather = None if ranks is None else ranks.gather
        return observation(
            cfg, q[-rows:, heads], k[:, kv], v[:, kv], 40, d**-0.5, None, 1, 3, lambda: w, gather_heads=gather
        )

    def kept(obs, ranks=None) -> list:
        fit = None
        if settings.deferred(cfg):  # one layer's heads sharing the budget as every layer's do
            scores = entry_scores(obs, cfg)
            if ranks is None:
                (sizes,) = shared_sizes(cfg, [scores], 40)
            else:
                (fit,), (sizes,) = tp.layers_sizes(ranks, cfg, [scores], 40)
            positions = kept_entries(obs, cfg, sizes=sizes, scores=scores, fit=fit).positions[0]
        elif ranks is not None and settings.sized_across_heads(cfg):
            scores = entry_scores(obs, cfg)
            fit, sizes = tp.layer_sizes(ranks, obs, cfg, scores)
            positions = kept_entries(obs, cfg, sizes=sizes, scores=scores, fit=fit).positions[0]
        else:
            positions = kept_entries(obs, cfg).positions[0]
        return [sorted(p for p in head.tolist() if p >= 0) for head in positions]

    whole = kept(observe(slice(None), slice(None)))

    def rank(ranks):  # its query heads, KV head and o_proj columns, and the ranks' collectives
        r = ranks.rank
        return kept(observe(slice(3 * r, 3 * r + 3), slice(r, r + 1), ranks), ranks)

    split = [head for heads in on_ranks(hkv, rank) for head in heads]
    if settings.mixes_heads(cfg):
        assert whole != split
    else:
        assert whole == split


@pytest.mark.parametrize("method", ["snapkv", "restkv", "h2o"])
def test_no_host_read_in_the_workers_steps(method):
    """The worker converts no tensor to the host in a step, decoding or evicting (its host facts are
    the runner's numpy arrays; its one copy per step goes host to device): on a GPU no step waits."""
    from test_host_syncs import counting_syncs

    knobs = {**small(method), **BUDGET, "decode_interval": 10}
    eng = engine(knobs, chunk=13)
    counts = []

    def counted(name):
        orig = getattr(eng.worker, name)

        def run(*a, **k):
            with counting_syncs() as n:
                out = orig(*a, **k)
            counts.append(n[0])
            return out

        setattr(eng.worker, name, run)

    for name in ("begin", "layer", "end"):
        counted(name)
    eng.generate(prompt(80)[0].tolist(), 30)
    assert len(counts) > 100 and sum(counts) == 0


def test_a_layer_that_runs_without_the_plugin_stops_the_step():
    """A layer whose attention does not call ``Worker.layer`` (a backend the wrappers miss): the
    step's ``end`` raises, naming the layer and its backend, before any eviction is recorded (its
    blocks are not cut)."""
    knobs = {"method": "snapkv", **BUDGET}
    eng = engine(knobs)
    skipped = eng.names[1]
    eng.worker.backends = {skipped: "SOME_BACKEND"}
    layer = eng.worker.layer

    def layer_but_one(name, *args):
        if name != skipped:
            layer(name, *args)

    eng.worker.layer = layer_but_one
    with pytest.raises(RuntimeError, match=f"layer {skipped} \\(SOME_BACKEND\\) ran its attention without"):
        eng.generate(prompt(80)[0].tolist(), 2)
    assert eng.worker.pending == {}


def test_every_layer_through_the_plugin_passes_the_check():
    """The same engine with every layer calling ``Worker.layer``: steps end without an error and the
    check is reset each step (a second request runs too)."""
    eng = engine({"method": "snapkv", **BUDGET})
    ids = prompt(80)[0].tolist()
    assert eng.generate(ids, 2) == eng.generate(ids, 2)
    assert eng.worker.done == set()


def test_a_step_the_batch_hook_did_not_see_stops():
    """A runner step of scheduled tokens without ``begin`` (a runner whose batch hook did not run)
    raises at ``end``; an empty step (nothing scheduled) does not."""
    eng = engine({"method": "snapkv", **BUDGET})
    eng.worker.end(0)
    with pytest.raises(RuntimeError, match="ran a step of 7 tokens without the plugin's batch hook"):
        eng.worker.end(7)


@pytest.mark.parametrize("chunk", [None, 13], ids=["whole", "chunks-of-13"])
def test_headkv_from_its_table_equals_configure(chunk, tmp_path):
    """HeadKV with a head-importance file (skewed, for the tiny model's layers and heads): the
    worker's counts come from the table the scheduler counts with, as configure()'s do."""
    import json

    import numpy as np

    c = tiny_model().config
    table = np.random.default_rng(1).gamma(0.5, size=(c.num_hidden_layers, c.num_attention_heads))
    path = tmp_path / "importance.json"
    path.write_text(json.dumps(table.tolist()))
    knobs = {"method": "headkv", **BUDGET, "head_importance": str(path)}
    kept = equals_configure(knobs, chunk)
    assert len({int(n) for layer in kept for n in (layer >= 0).sum(-1)}) > 1  # heads kept different counts


@pytest.mark.parametrize("caching", [False, True], ids=["own-blocks", "prefix-caching"])
@pytest.mark.parametrize("method", ["layer_defensivekv", "snapkv", "h2o"])
def test_global_budget_equals_configure_and_holds_its_measured_count(method, caching):
    """layer_budget='global': the worker selects once every layer has run, from all their scores, and
    keeps configure()'s positions in every layer and head (keeping different counts) and
    its tokens; the request then holds the count it measured (its largest layer's mean over the heads,
    one block more), not the bound its eviction step was given."""
    knobs = {**small(method), **BUDGET, "layer_budget": "global"}
    ids = prompt(80)[0].tolist()
    tokens, kept = reference(knobs, ids, 6)
    eng = engine(knobs, chunk=13, caching=caching)
    assert eng.generate(ids, 6) == tokens
    for layer, (ours, theirs) in enumerate(zip(kept_of(eng), kept)):
        assert torch.equal(ours, theirs), f"layer {layer}"
    per_head = [int(n) for p in kept for n in (p >= 0).sum(-1)]
    # H2O's sums rank the earliest entries first everywhere: every head keeps as many on this prompt
    assert len(set(per_head)) > 1 or method == "h2o", "every layer and head kept the same count"
    counted = fewest_length(per_head, eng.bs)
    assert counted < len(ids)
    assert len(eng.blocks) == -(-(counted + 5) // eng.bs)  # 5 tokens written after the eviction
    assert_pages_counted(eng)


def assert_pages_counted(eng: PagedEngine) -> None:
    """Every step: the request holds the blocks the scheduler counts; at an eviction the count is the fewest
    its heads' pages need (the pages inside its blocks: ``vllm_sim``)."""
    assert eng.pages_trace, "no step with single-head pages"
    for step, (blocks, counted, lengths, evicted) in enumerate(eng.pages_trace):
        assert blocks == -(-counted // eng.bs), f"step {step}: {blocks} blocks for {counted} entries"
        if evicted:
            assert counted == fewest_length(lengths, eng.bs), f"step {step}"


def test_ranks_count_a_request_at_the_bound():
    """Under tensor parallelism each rank holds some heads, whose pages can need other counts, and one rank's
    count reaches the scheduler: every rank counts the config's bound (the mean and a block)."""
    knobs = {**small("pyramidkv"), **BUDGET}
    eng = engine(knobs)
    eng.worker.tensor_parallel = 2
    ids = prompt(80)[0].tolist()
    eng.generate(ids, 3)
    counted = [c for _, c, _, evicted in eng.pages_trace if evicted]
    assert counted == [settings.room(eng.cfg, 40, eng.bs, 80)]
    assert counted[0] > fewest_length(eng.pages_trace[0][2], eng.bs)


@pytest.mark.parametrize(
    "knobs",
    [
        {"method": "adakv"},
        {"method": "pyramidkv"},
        {"method": "pyramidkv", "head_budget": "adakv"},
        {"method": "snapkv", "head_budget": "lukv", "lukv_curve": tiny_lukv_curve()},
    ],
    ids=["adakv", "pyramidkv", "pyramidkv-adakv", "lukv"],
)
@pytest.mark.parametrize("caching", [False, True], ids=["own-blocks", "prefix-caching"])
def test_per_head_request_holds_the_fewest_blocks_its_pages_need(knobs, caching):
    """Per-head and per-layer budgets, evicting every 10 tokens: after each eviction the request is counted
    at the fewest entries whose blocks hold its heads' pages while they decode (a brute-force search over
    the next tokens), below the bound of the mean plus a block; the pages stay inside its blocks."""
    knobs = {**small(knobs["method"]), **knobs, **BUDGET, "decode_interval": 10}
    ids = prompt(80)[0].tolist()
    tokens, _ = reference(knobs, ids, 30)
    eng = engine(knobs, chunk=13, caching=caching)
    assert eng.generate(ids, 30) == tokens
    assert_pages_counted(eng)
    evictions = [(counted, lengths) for _, counted, lengths, evicted in eng.pages_trace if evicted]
    assert len(evictions) >= 3
    assert any(counted < -(-int(lengths.sum()) // lengths.size) + eng.bs for counted, lengths in evictions)


def test_a_hybrid_models_full_attention_layers_keep_the_models_indices_and_must_be_the_evicted_group():
    """Gemma 3's full-attention layers 5, 11 and 17 of 18 (the sliding-window ones never indexed): each is
    numbered by its rank among the evicted layers, as ``configure()``'s plans number them (per-layer budgets,
    a method's layer seed); the KV cache group they must
    make up is the one evicted, and a group with another layer (one with a sliding window) or without one
    of them is refused, naming that layer."""
    from restkv.vllm.worker import Worker

    cfg = CompressionConfig.from_kwargs(method="snapkv", max_capacity_prompt=64)
    names = [f"model.layers.{i}.self_attn.attn" for i in (5, 11, 17)]
    worker = Worker(cfg, slots=2, caching=False, block_size=16)
    from transformers import Gemma3TextConfig

    from restkv.strategies.layers import evicted_layers

    config = Gemma3TextConfig(num_hidden_layers=18)  # transformers' own pattern: every sixth layer full attention
    worker.index_layers(dict.fromkeys(names), evicted=list(evicted_layers(config, range(18))))
    assert worker.layer_index == dict(zip(names, (0, 1, 2))) and worker.layers == 3
    worker.leave(5, list(reversed(names)))
    assert worker.group == 5
    with pytest.raises(RuntimeError, match=r"layer model\.layers\.4\.self_attn\.attn has a sliding window but is in"):
        worker.leave(5, [*names, "model.layers.4.self_attn.attn"])
    with pytest.raises(RuntimeError, match=r"layer model\.layers\.17\.self_attn\.attn has no sliding window but is not"):
        worker.leave(5, names[:2])
