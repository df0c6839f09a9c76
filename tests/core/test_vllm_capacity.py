"""``restkv.vllm.capacity`` without vLLM: a request's blocks against a step-by-step count with
the scheduler's rules, the pool in both of ``hooks.memory``'s cases, the documented example, bad
input."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
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
    return capacity.Holding(prompt, after, largest or prompt, -(-prompt_len // block_size))


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
    assert capacity.holding(None, 300, 21, 32, True) == capacity.Holding(10, 10, 10, 10)  # 320 entries
    assert capacity.holding(None, 300, 22, 32, True) == capacity.Holding(10, 10, 11, 10)


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
    assert c.plain.holding == capacity.Holding(2048, 2048, 2112, 2048) and c.plain.at_once == 15
    assert c.plugin.holding == capacity.Holding(2048 + 64, 64, 128, 2048) and c.plugin.at_once == 240
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


# hybrid sliding-window models: every KV cache group's blocks, FP8 pools

GEMMA3_270M = dict(  # as its config.json: 18 layers, every 6th full attention, a window of 512
    model_type="gemma3_text", num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
    hidden_size=640, torch_dtype="float32", sliding_window=512, sliding_window_pattern=6,
)


def _folder(tmp_path, name, **config):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def simulated(cfg, window, groups, prompt_len, output_len, block_size, caching, chunk) -> capacity.Holding:
    """One request's steps as vLLM's managers run them, block lists and all: each sliding group's list
    gets its blocks wholly below ``c - window + 1`` replaced by null blocks before a step computing tokens
    from c (``remove_skipped_blocks``), then grows to ``ceil((c + n) / b)`` entries; the full group's
    is ``stepped``'s count. ``groups``: (full, sliding) group counts. Blocks held: the non-null ones."""
    full, sliding = groups
    b, computed, lists, totals = block_size, 0, [[] for _ in range(sliding)], {"prompt": [], "decode": []}
    offset, evicted, after = 0, False, 0
    while computed < prompt_len + output_len - 1:
        n = min(chunk, prompt_len - computed) if computed < prompt_len else 1
        e = cfg and settings.eviction(cfg, computed, n, prompt_len, offset, caching, b, evicted)
        full_blocks = -(-(e.slots if e else computed + n - offset) // b)
        for blocks in lists:
            skipped = max(0, computed - window + 1) // b
            blocks[: min(skipped, len(blocks))] = [None] * min(skipped, len(blocks))
            blocks.extend(object() for _ in range(-(-(computed + n) // b) - len(blocks)))
        held = full * full_blocks + sum(sum(x is not None for x in blocks) for blocks in lists)
        totals["prompt" if computed < prompt_len else "decode"].append(held)
        offset += e.evicted if e else 0
        evicted = evicted or bool(e)
        computed += n
        if computed == prompt_len:  # before its next step frees the window's tail
            skipped = max(0, prompt_len - window + 1) // b
            tails = sum(sum(x is not None for x in blocks[skipped:]) for blocks in lists)
            after = full * -(-(prompt_len - offset) // b) + tails
    prompt = max(totals["prompt"])
    return capacity.Holding(prompt, after, max(totals["decode"], default=prompt))


@pytest.mark.parametrize("cfg", [None, CompressionConfig.from_kwargs(method="snapkv", max_capacity_prompt=64,
                                                                      window_size=16, decode_interval=24)],
                         ids=["plain", "snapkv"])
def test_a_hybrid_requests_blocks_equal_a_simulation_of_vllms_block_lists(cfg, tmp_path):
    """Gemma 3's layers (1 full-attention group, 5 sliding of 3 layers each) and smaller windows: random
    prompts, outputs, block sizes, chunks, prefix caching on and off; the blocks to be free to admit it:
    its prompt's in the full group, in each sliding group up to vLLM's cap
    ``ceil(min(W - 1 + chunk, L) / b) + 1``."""
    rng = random.Random(1)
    for window in (512, 40, 17):
        model = memory.model_of(_folder(tmp_path, f"w{window}", **{**GEMMA3_270M, "sliding_window": window}))
        for _ in range(25):
            prompt_len, output_len = rng.choice((1, 17, 40, 64, 150, 333, 700)), rng.choice((1, 2, 17, 80, 257))
            b, chunk, caching = rng.choice((16, 32)), rng.choice((7, 64, 512)), rng.random() < 0.5
            got = capacity.holding(cfg, prompt_len, output_len, b, caching, model, chunk, 2048)
            want = simulated(cfg, window, (1, 5), prompt_len, output_len, b, caching, chunk)
            whole = -(-prompt_len // b)
            admitted = whole + 5 * min(whole, -(-min(window - 1 + chunk, 2048) // b) + 1)
            case = (window, prompt_len, output_len, b, caching, chunk)
            assert got == capacity.Holding(*dataclasses.astuple(want)[:3], admitted), case


def test_layer_kinds_from_config_json(tmp_path):
    """Gemma 3 (a pattern, and its layer_types), Gemma 2 (every other layer), gpt-oss (layer_types, 12 and
    12: one group each), a Mistral-like config (every layer slides) and Qwen2's use_sliding_window=false."""
    gemma3 = memory.model_of(_folder(tmp_path, "gemma3", **GEMMA3_270M))
    assert (gemma3.layers, gemma3.sliding, gemma3.window, gemma3.evicted) == (18, 15, 512, 3)
    assert (gemma3.group_layers, gemma3.groups()) == (3, (1, 5))
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    listed = memory.model_of(_folder(tmp_path, "listed", **{**GEMMA3_270M, "layer_types": kinds * 3}))
    assert (listed.sliding, listed.group_layers, listed.groups()) == (15, 3, (1, 5))
    one_b = memory.model_of(_folder(tmp_path, "gemma3-1b", **{**GEMMA3_270M, "num_hidden_layers": 26}))
    assert (one_b.sliding, one_b.group_layers, one_b.groups()) == (22, 4, (1, 6))
    gemma2 = {**GEMMA3_270M, "model_type": "gemma2", "num_hidden_layers": 26, "sliding_window": 4096}
    del gemma2["sliding_window_pattern"]
    g2 = memory.model_of(_folder(tmp_path, "gemma2", **gemma2))
    assert (g2.sliding, g2.window, g2.group_layers, g2.groups()) == (13, 4096, 13, (1, 1))
    oss = {**GEMMA3_270M, "num_hidden_layers": 24, "sliding_window": 128,
           "layer_types": ["sliding_attention", "full_attention"] * 12}
    oss = memory.model_of(_folder(tmp_path, "oss", **oss))
    assert (oss.sliding, oss.window, oss.group_layers, oss.groups()) == (12, 128, 12, (1, 1))
    plain = {k: v for k, v in GEMMA3_270M.items() if "sliding" not in k}
    mistral = memory.model_of(_folder(tmp_path, "mistral", **plain, sliding_window=4096))
    assert (mistral.sliding, mistral.evicted, mistral.groups()) == (18, 0, (0, 1))
    qwen = memory.model_of(_folder(tmp_path, "qwen", **plain, sliding_window=4096, use_sliding_window=False))
    assert (qwen.sliding, qwen.window, qwen.groups()) == (0, 0, (1, 0))
    with pytest.raises(ValueError, match="--model: .* 0 full-attention KV cache groups"):
        capacity.capacity(str(tmp_path / "mistral"), 1 << 30, 4096, SNAPKV, 2048, 16)


def test_the_real_gemma3_config(tmp_path):
    """The packaged Gemma 3 270M's config.json, where present, reads as its layers are."""
    folder = os.path.expanduser("~/.cache/restkv/models/gemma3-270m")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        pytest.skip("no Gemma 3 270M folder")
    m = memory.model_of(folder)
    assert (m.layers, m.sliding, m.window, m.group_layers, m.groups()) == (18, 15, 512, 3, (1, 5))


def test_a_hybrid_pools_blocks_and_requests_at_once(tmp_path):
    """Gemma 3 270M in float32, blocks of 16: a block holds 16 tokens of 3 layers (one KV head of 256,
    K and V): 96 KiB; FP8 a quarter. Prompt 2000 + output 100, chunks of 512, SnapKV keeping 256: each
    arm's blocks as the simulation counts them (decoding: the full group's 23 with the plugin, 132
    without, and 33 per sliding group, ceil(512 / 16) + 1); requests at once ``1 + (N - first) // largest``."""
    folder = _folder(tmp_path, "gemma3", **GEMMA3_270M)
    knobs = {"method": "snapkv", "max_capacity_prompt": 256}
    c = capacity.capacity(folder, 256 << 20, 4096, knobs, 2000, 100, block_size=16, max_num_batched_tokens=512)
    assert c.block_bytes == 16 * 3 * 2 * 256 * 4 == 96 << 10
    assert c.plain.blocks == c.plugin.blocks == (256 << 20) // (96 << 10) - 1 == 2729
    cfg = settings.from_env({"restkv": knobs})
    for arm, config in ((c.plain, None), (c.plugin, cfg)):
        want = simulated(config, 512, (1, 5), 2000, 100, 16, True, 512)
        admitted = 125 + 5 * min(125, -(-(511 + 512) // 16) + 1)
        assert arm.holding == capacity.Holding(*dataclasses.astuple(want)[:3], admitted)
        first = max(want.prompt, want.largest, admitted)
        assert arm.at_once == 1 + (2729 - first) // want.largest
        assert arm.per_request == want.largest * (96 << 10)
    assert c.plugin.holding.largest == 23 + 5 * 33 and c.plain.holding.largest == 132 + 5 * 33
    fp8 = capacity.capacity(folder, 256 << 20, 4096, knobs, 2000, 100, block_size=16, max_num_batched_tokens=512,
                            kv_cache_dtype="fp8")
    assert fp8.block_bytes == 24 << 10 and fp8.plugin.blocks == (256 << 20) // (24 << 10) - 1
    bf16 = capacity.capacity("llama-3.1-8b", 64 << 30, 131072, SNAPKV, 32768, 1024, kv_cache_dtype="fp8_e5m2")
    assert bf16.block_bytes == 1 << 20 and bf16.plain.blocks == 65535  # half of bfloat16's 2 MiB


def test_vllms_start_up_check_and_the_plugins_count_every_group(tmp_path):
    """vLLM starts with a pool that holds max_model_len tokens in the full group and each sliding group's
    cap, and the null block; one block fewer is refused, naming the flag. The plugin asks more under prefix
    caching: the fresh blocks of a first eviction's kept entries beside them (B=1024 at most: 64 blocks of
    16), without it no more; a block fewer is refused as the plugin's."""
    folder = _folder(tmp_path, "gemma3", **GEMMA3_270M)
    blocks = -(-4096 // 16) + 5 * (-(-(511 + 512) // 16) + 1) + 1  # 256 + 5 x 65 + 1
    block = 96 << 10
    sizes = dict(block_size=16, max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes: .* vLLM refuses to start"):
        capacity.capacity(folder, blocks * block - 1, 4096, SNAPKV, 2000, 100, **sizes)
    capacity.capacity(folder, blocks * block, 4096, SNAPKV, 2000, 100, prefix_caching=False, **sizes)
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes: .* 320 blocks .* the plugin refuses to start"):
        capacity.capacity(folder, blocks * block, 4096, SNAPKV, 2000, 100, **sizes)
    capacity.capacity(folder, (blocks + 64) * block, 4096, SNAPKV, 2000, 100, **sizes)
    with pytest.raises(ValueError, match="the plugin refuses to start"):
        capacity.capacity(folder, (blocks + 64) * block - 1, 4096, SNAPKV, 2000, 100, **sizes)


def test_bad_kv_cache_dtype_is_one_line_naming_the_flag():
    with pytest.raises(SystemExit) as e:
        capacity.main(GOOD + ["--kv-cache-dtype", "int3"])
    assert "--kv-cache-dtype" in str(e.value.code) and "\n" not in str(e.value.code)
