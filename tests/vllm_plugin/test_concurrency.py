"""Requests that share cached prefix blocks, running in the same engine steps while one of them
evicts (``concurrent_run.py``: one engine stepped by hand, each step's scheduled requests, evicting
requests and the blocks they share recorded).

Four prompts share the first 256 tokens of ``prompt_text.md`` (8 blocks of 32): T (286 tokens, under
the budget of 320 for its 24 tokens), S (306: under it at its prompt, over it at its first decoding
check, 16 tokens later), M (356) and L (506), both over it at their prompt and 16 tokens later. In
a pool of 4096 tokens nothing is preempted, so each request's greedy tokens must equal, all of
them, those it gets served alone on an empty prefix cache: by plain vLLM for T (it never evicts),
by the plugin alone for the others; the pool's free blocks come back to their start value and no
request is left in the scheduler.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from concurrent_run import in_subprocess
from harness import BLOCK, CHUNK

pytestmark = pytest.mark.vllm

KNOBS = {"method": "snapkv", "max_capacity_prompt": 320, "window_size": 32, "decode_interval": 16}
NEW = 24  # tokens per request: S and L reach a decoding check (16), T none (its first is at 334)
TOGETHER, STAGGERED = (0, 0, 0), (0, 4, 5)  # engine steps the requests are added at


@pytest.fixture(scope="module")
def prompts(text_ids) -> dict:
    shared = text_ids[:256]
    tails = {"T": (300, 330), "S": (340, 390), "M": (400, 500), "L": (520, 770)}
    return {name: shared + text_ids[a:b] for name, (a, b) in tails.items()}


SCENARIOS = {
    "two together": (("L", "T"), TOGETHER),
    "three together": (("L", "S", "M"), TOGETHER),
    "three staggered": (("L", "T", "S"), STAGGERED),
}


@pytest.fixture(scope="module")
def runs(model_dir, prompts) -> dict:
    """The scenarios, then each prompt alone, in an engine with the plugin; T alone in plain vLLM."""

    def spec(scenarios):
        return {
            "model": model_dir,
            "block_size": BLOCK,
            "kv_tokens": 4096,
            "enforce_eager": True,
            "max_num_batched_tokens": CHUNK,  # a 506-token prompt in 4 steps
            "scenarios": scenarios,
        }

    def requests(names, at):
        return [{"ids": prompts[n], "max_tokens": NEW, "at": a} for n, a in zip(names, at)]

    plugin = [requests(names, at) for names, at in SCENARIOS.values()]
    plugin += [requests([name], [0]) for name in "SML"]
    results = in_subprocess(spec(plugin), KNOBS)
    (plain,) = in_subprocess(spec([requests("T", [0])]), None)
    alone = dict(zip("SML", (r["tokens"][0] for r in results[len(SCENARIOS) :])))
    alone["T"] = plain["tokens"][0]
    evicted = {name: any(s["evicting"] for s in r["steps"]) for name, r in zip("SML", results[3:])}
    assert evicted == {"S": True, "M": True, "L": True}
    assert not any(s["evicting"] for s in plain["steps"])
    return {"alone": alone, **dict(zip(SCENARIOS, results))}


def evictions(run: dict, names) -> list:
    """(step, evicting request, its blocks another request also held, the step's requests)."""
    return [
        (i, names[int(r)], shared, sorted(names[int(x)] for x in step["scheduled"]))
        for i, step in enumerate(run["steps"])
        for r, shared in step["evicting"].items()
    ]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_each_request_gets_its_tokens_served_alone(runs, scenario):
    names, _ = SCENARIOS[scenario]
    run = runs[scenario]
    for name, tokens in zip(names, run["tokens"]):
        assert tokens == runs["alone"][name], f"{scenario}: request {name}"
    assert run["free_at_end"] == run["free_at_start"]
    assert run["left"] == 0


def test_two_together_the_long_one_evicts_while_the_short_one_reads_its_blocks(runs):
    """L's prompt takes the first steps; T starts in the step of L's last chunk with 7 of L's
    blocks from the prefix cache (its hit stops before its last 32 tokens), and L evicts at the
    end of that step, releasing the 7 T holds."""
    run = runs["two together"]
    hit = run["cached"][1]
    assert hit == 224
    found = evictions(run, ("L", "T"))
    assert found[0][1:] == ("L", hit // BLOCK, ["L", "T"])
    assert [name for _, name, _, _ in found] == ["L", "L"]  # at its prompt and 16 tokens later


def test_three_together_each_eviction_releases_blocks_the_others_hold(runs):
    """L evicts in the step S and M start, each with the 8 shared blocks from L's cache entries
    (held by L and both); M evicts in the next step, releasing the 8 that S holds too."""
    run = runs["three together"]
    found = evictions(run, ("L", "S", "M"))
    assert run["cached"][1:] == [256, 256]
    assert found[0][1:] == ("L", 8, ["L", "M", "S"])
    assert found[1] == (found[0][0] + 1, "M", 8, ["L", "M", "S"])
    # L and M at their prompt and 16 tokens later, S at its first decoding check
    assert sorted(name for _, name, _, _ in found) == ["L", "L", "M", "M", "S"]


def test_three_staggered_a_decoding_eviction_releases_shared_blocks(runs):
    """L evicts alone; T and S start later from L's released (cached) blocks; S's first eviction,
    at a decoding check, releases the 7 blocks T still holds while T and L decode beside it."""
    run = runs["three staggered"]
    found = evictions(run, ("L", "T", "S"))
    assert run["cached"][1:] == [224, 256]
    decoding = [x for x in found if x[1] == "S"]
    assert len(decoding) == 1 and decoding[0][2:] == (7, ["L", "S", "T"])
    assert not any(name == "T" for _, name, _, _ in found)
