"""``restkv.vllm.capacity`` without vLLM: a request's blocks against a step-by-step count with
the scheduler's rules, the pool in both of ``hooks.memory``'s cases, the documented example, bad
input."""

from __future__ import annotations

import itertools
import random

import pytest

from restkv.config import CompressionConfig
from restkv.vllm import capacity, memory, settings, startup

LLAMA = ("llama-3.1-8b", 64 << 30, 131072)
SNAPKV = {"method": "snapkv", "max_capacity_prompt": 1024}


def stepped(cfg, prompt_len, output_len, block_size, caching, chunk) -> capacity.Holding:
    """Every step of one request as the scheduler runs it: its prompt ``chunk`` tokens a step, then
    a token a step up to P + O - 1 entries, each step's blocks from ``settings.eviction``."""
    computed, offset, evicted, prompt, after, largest = 0, 0, False, 0, 0, 0
    while computed < prompt_len + output_len - 1:
        n = min(chunk, prompt_len - computed) if computed < prompt_len else 1
        e = cfg and settings.eviction(cfg, computed, n, prompt_len, offset, caching, block_size, evicted)
        blocks = -(-(e.slots if e else computed + n - offset) // block_size)
        if computed < prompt_len:
            prompt = max(prompt, blocks)
        else:
            largest = max(largest, blocks)
        offset += e.evicted if e else 0
        evicted = evicted or bool(e)
        computed += n
        if computed == prompt_len:
            after = -(-(prompt_len - offset) // block_size)
    return capacity.Holding(prompt, after, largest or prompt)


def configs():
    yield None
    grid = itertools.product((40, 64, 100), (8, 32), (0, 1, 7, 16, 50), (None, 0.5))
    for budget, window, interval, ratio in grid:
        if ratio is not None and not interval:
            continue
        knobs = {"max_capacity_prompt": budget, "window_size": window, "decode_interval": interval}
        if ratio is not None:
            knobs["decode_compression_ratio"] = ratio
        yield CompressionConfig.from_kwargs(method="snapkv", **knobs)
    yield CompressionConfig.from_kwargs(method="h2o", max_capacity_prompt=64, decode_interval=20)


@pytest.mark.parametrize("cfg", list(configs()), ids=lambda c: c and startup.knobs(c) or "plain")
def test_holding_equals_a_step_by_step_count(cfg):
    """Random prompts, outputs, block sizes, chunks, prefix caching on and off."""
    rng = random.Random(0)
    for _ in range(40):
        prompt_len = rng.choice((1, 17, 40, 64, 65, 150, 333))
        output_len = rng.choice((1, 2, 16, 17, 80, 257))
        case = (prompt_len, output_len, rng.choice((16, 32)), rng.random() < 0.5)
        assert capacity.holding(cfg, *case) == stepped(cfg, *case, rng.choice((7, 64, 512))), case


def test_plain_vllm_holds_prompt_and_output_less_the_last_token():
    assert capacity.holding(None, 300, 21, 32, True) == capacity.Holding(10, 10, 10)  # 320 entries
    assert capacity.holding(None, 300, 22, 32, True) == capacity.Holding(10, 10, 11)


def test_at_once_leaves_room_for_one_prompt_at_its_peak():
    h = capacity.Holding(prompt=13, after=4, largest=5)
    counts = [capacity.at_once(h, n, 256) for n in (12, 13, 17, 18, 23, 27, 28)]
    assert counts == [0, 1, 1, 2, 3, 3, 4]
    assert capacity.at_once(h, 10**6, 256) == 256
    plain = capacity.Holding(9, 9, 10)
    assert [capacity.at_once(plain, n, 256) for n in (9, 10, 29, 30)] == [0, 1, 2, 3]


def test_the_documented_example():
    c = capacity.capacity(*LLAMA, SNAPKV, 32768, 1024)
    assert c.block_bytes == 2 << 20 and c.plain.blocks == c.plugin.blocks == 32767
    assert c.plain.holding == capacity.Holding(2048, 2048, 2112) and c.plain.at_once == 15
    assert c.plugin.holding == capacity.Holding(2048 + 64, 64, 128) and c.plugin.at_once == 240
    assert (c.plain.per_request, c.plugin.per_request) == (2112 << 21, 128 << 21)
    assert c.plugin.briefly == 256  # 64 blocks each for moments, capped by max_num_seqs
    uncached = capacity.capacity(*LLAMA, SNAPKV, 32768, 1024, prefix_caching=False).plugin
    assert uncached.holding.prompt == 2048 and uncached.at_once == 1 + (32767 - 2048) // 128


def test_an_explicit_pool_is_kept_and_the_plugins_bytes_are_beyond_it():
    """As ``hooks.memory`` logs them: the fixed bytes and ``per_token`` for each pooled token."""
    c = capacity.capacity(*LLAMA, SNAPKV, 32768, 1024, max_num_batched_tokens=2048)
    cfg, model = settings.from_env({"restkv": SNAPKV}), memory.model_of("llama-3.1-8b")
    fixed = sum(memory.fixed_bytes(cfg, model, 256, 131072, 2048).values())
    tokens = (64 << 30) // (32 * model.kv_bytes(1))
    assert c.pool_bytes == 64 << 30 and c.explicit
    assert c.plugin_bytes == fixed + tokens * memory.per_token(cfg, model)


def test_memory_found_from_utilization_loses_the_plugins_reserve():
    c = capacity.capacity("llama-3.1-8b", None, 131072, SNAPKV, 32768, 1024, available=64 << 30)
    cfg, model = settings.from_env({"restkv": SNAPKV}), memory.model_of("llama-3.1-8b")
    reserve = memory.reserved(cfg, model, 256, 131072, 64 << 30, 8192)
    assert c.plugin_bytes == reserve and not c.explicit
    assert c.plugin.blocks == ((64 << 30) - reserve) // (2 << 20) - 1 and c.plain.blocks == 32767
    assert c.plugin.at_once == 1 + (c.plugin.blocks - 2112) // 128


GOOD = (
    "--model llama-3.1-8b --kv-cache-memory-bytes 64G --max-model-len 131072 --prompt-len 32768 "
    "--output-len 1024"
).split() + ["--knobs", '{"method": "snapkv", "max_capacity_prompt": 1024}']


def test_the_command_prints_the_table(capsys):
    capacity.main(GOOD)
    out = capsys.readouterr().out
    assert "| without plugin | 2048 / 2112 | 15 | 4.125 GiB |" in out
    assert "| with plugin | 2112 / 128 | 240 | 256.0 MiB |" in out
    assert "snapkv max_capacity_prompt=1024 window_size=32 decode_interval=0" in out


@pytest.mark.parametrize(
    "flag, value, named",
    [
        ("--prompt-len", "0", "--prompt-len"),
        ("--output-len", "200000", "--max-model-len"),
        ("--knobs", "[1]", "--knobs"),
        ("--knobs", "{not json", "--knobs"),
        ("--knobs", '{"method": "fullkv"}', "--knobs"),
        ("--knobs", '{"method": "snapkv", "nope": 1}', "--knobs"),
        ("--model", "no-such-model", "--model"),
        ("--kv-cache-memory-bytes", "1G", "--kv-cache-memory-bytes"),
        ("--block-size", "-16", "--block-size"),
        ("--max-num-seqs", "0", "--max-num-seqs"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(flag, value, named):
    argv = list(GOOD)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    with pytest.raises(SystemExit) as e:
        capacity.main(argv)
    message = str(e.value.code)
    assert named in message and "\n" not in message, message


def test_the_pool_is_given_once():
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes: give it or --available"):
        capacity.capacity(*LLAMA, SNAPKV, 1024, 64, available=64 << 30)


def test_byte_counts_read_as_vllm_reads_them():
    texts = ("1024", "64G", "64GiB", "64g", "2M", "3k")
    assert [capacity._bytes(x) for x in texts] == [1024, 64 << 30, 64 << 30, 64e9, 2 << 20, 3000]
