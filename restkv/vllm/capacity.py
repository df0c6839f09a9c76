"""How many requests of one shape vLLM runs at once in its KV pool, with the plugin and without,
the plugin's own memory counted (no vLLM import).

``python -m restkv.vllm.capacity --model llama-3.1-8b --kv-cache-memory-bytes 64G
--max-model-len 131072 --knobs '{"method": "snapkv", "max_capacity_prompt": 1024}'
--prompt-len 32768 --output-len 1024``; ``capacity(...)`` is the same as a function.

A request of prompt P and output O, in blocks of b tokens (``holding.Holding``, step by step in
``restkv.vllm.holding``): its last step writes entry P + O - 2 (the O-th token is sampled, never
written), so plain vLLM holds ``ceil((P + O - 1) / b)`` blocks at its largest. With the plugin it
holds its whole prompt (computed chunk by chunk) up to the end-of-prefill eviction, in that step
also, under prefix caching, the ``ceil(B / b)`` fresh blocks its B kept entries go to; then
``ceil(B / b)`` blocks, a token more each step, cut back at each ``decode_interval`` check.

A hybrid sliding-window model (Gemma 2 and 3, gpt-oss): a block holds b tokens of
``Model.group_layers`` layers, and a request holds blocks in every KV cache group at each step: the
full-attention group's as above (the plugin evicts that group only), and each sliding-window group's
as vLLM frees them, the same with the plugin and without (about ``(W + chunk) / b + 1`` while its
prompt is computed ``max_num_batched_tokens`` tokens a step, ``W / b + 1`` while decoding).

At once (``at_once``): vLLM admits a request once its whole prompt's blocks are free
(``scheduler_reserve_full_isl``, its default; a sliding group's up to vLLM's admission cap), and a
waiting request preempts none, so K requests run together, each at its largest, when K - 1 at their
largest after the prompt and one at its prompt's peak fit in the pool's N blocks (vLLM's null block
aside): ``K = 1 + (N - max(prompt, admitted, largest)) // largest``, at most ``max_num_seqs``. An FP8
``kv_cache_dtype`` stores 1 byte an element: a block's bytes are the model dtype's over its bytes per
element (bfloat16: half). The pool: an explicit
``kv_cache_memory_bytes`` is kept whole, the plugin's memory beyond it; the bytes vLLM finds from
``gpu_memory_utilization`` lose the plugin's reserve (``memory.reserved``) first, as
``hooks.memory`` does. The prompts share no prefix.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from ..config import CompressionConfig
from . import memory, settings, startup
from .holding import Holding, admission_cap, at_once, briefly, holding

__all__ = ["Arm", "Capacity", "Holding", "at_once", "briefly", "capacity", "holding", "report"]


@dataclass(frozen=True)
class Arm:
    """One engine, with the plugin or without: its pool's usable ``blocks``, a request's
    ``holding``, the requests it runs ``at_once`` (``briefly``: for moments), a request's KV bytes
    at its largest (``per_request``)."""

    blocks: int
    holding: Holding
    at_once: int
    briefly: int
    per_request: int


@dataclass(frozen=True)
class Capacity:
    """Both arms, the pool's bytes, the plugin's (beyond the pool when ``explicit``, else out of
    it) and the settings in one line."""

    plugin: Arm
    plain: Arm
    block_bytes: int
    pool_bytes: int
    plugin_bytes: int
    explicit: bool
    max_num_seqs: int
    settings: str


def capacity(
    model,
    kv_cache_memory_bytes: int | None,
    max_model_len: int,
    knobs,
    prompt_len: int,
    output_len: int,
    max_num_seqs: int = 256,
    block_size: int = 16,
    *,
    available: int | None = None,
    max_num_batched_tokens: int = 8192,
    tensor_parallel_size: int = 1,
    dtype: str | None = None,
    prefix_caching: bool = True,
    kv_cache_dtype: str = "auto",
) -> Capacity:
    """Both arms for requests of ``prompt_len`` + ``output_len`` tokens. The pool: exactly one of
    ``kv_cache_memory_bytes`` (the operator's, kept whole) and ``available`` (what vLLM finds for
    the KV cache from ``gpu_memory_utilization``). ``model``: a ``memory.MODELS`` name, a folder
    with a config.json, or one rank's ``memory.Model``; ``knobs``: a dict or a CompressionConfig.
    Bad input raises a one-line ValueError naming the flag."""
    _positive(
        max_model_len=max_model_len, prompt_len=prompt_len, output_len=output_len,
        max_num_seqs=max_num_seqs, block_size=block_size, tensor_parallel_size=tensor_parallel_size,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    if (kv_cache_memory_bytes is None) == (available is None):
        raise ValueError("--kv-cache-memory-bytes: give it or --available-kv-cache-memory")
    explicit = kv_cache_memory_bytes is not None
    flag = "--kv-cache-memory-bytes" if explicit else "--available-kv-cache-memory"
    given = kv_cache_memory_bytes if explicit else available
    _positive(**{flag[2:].replace("-", "_"): given})
    if prompt_len + output_len > max_model_len:
        raise ValueError(
            f"--prompt-len + --output-len ({prompt_len + output_len}) exceed --max-model-len "
            f"({max_model_len})"
        )
    cfg = knobs if isinstance(knobs, CompressionConfig) else _config(knobs)
    settings.check(cfg)
    if settings.deferred(cfg):
        raise ValueError(
            f"--knobs: layer_budget={cfg['layer_budget']!r} keeps what its scores decide across layers, so "
            "no count from the knobs bounds a request below its prompt; measure it with benchmarks/vllm_serving.py"
        )
    m = model
    if not isinstance(model, memory.Model):
        m = memory.model_of(model, dtype, kv_cache_dtype).per_rank(tensor_parallel_size)
    full, sliding = m.groups()
    if full != 1:
        raise ValueError(
            f"--model: its {m.evicted} full-attention and {m.sliding} sliding-window layers make {full} "
            "full-attention KV cache groups in vLLM; the plugin evicts one"
        )
    settings.bind_model(cfg, m.layers, m.heads * m.ranks, m.kv_heads * m.ranks, m.ranks)
    block_bytes = m.block_bytes(block_size)
    sizes = (max_num_seqs, max_model_len)
    if explicit:  # as hooks.memory logs it: fixed bytes, and per_token for each token of the pool
        pool = given
        plugin_bytes = sum(memory.fixed_bytes(cfg, m, *sizes, max_num_batched_tokens, block_size).values())
        plugin_bytes += given // m.block_bytes(1) * memory.per_token(cfg, m)
    else:
        plugin_bytes = memory.reserved(cfg, m, *sizes, given, max_num_batched_tokens, block_size)
        pool = given - plugin_bytes
    # vLLM's own check: a request of max_model_len tokens in every group, and the null block
    cap = admission_cap(m.window, block_size, max_model_len, max_num_batched_tokens) if sliding else 0
    need = (full * -(-max_model_len // block_size) + sliding * cap + 1) * block_bytes
    for what, n in (("", given), (f" less the plugin's {plugin_bytes / 2**30:.3f} GiB", pool)):
        if n < need:
            raise ValueError(
                f"{flag}: {max(n, 0) / 2**30:.3f} GiB{what} holds fewer than --max-model-len "
                f"{max_model_len} tokens ({need / 2**30:.3f} GiB): vLLM refuses to start"
            )
    # the plugin's (``hooks.refusals.pool``): that request's most blocks while it evicts, at once
    most = settings.most_blocks(cfg, max_model_len, block_size, prefix_caching)
    evicting = (sliding * cap + most + 1) * block_bytes
    if pool < evicting:
        raise ValueError(
            f"{flag}: {max(pool, 0) / 2**30:.3f} GiB of pool holds fewer than the {most} blocks a request of "
            f"--max-model-len {max_model_len} tokens may hold while it evicts ({evicting / 2**30:.3f} GiB with "
            "the other groups and the null block): the plugin refuses to start"
        )

    def arm(c, pool_bytes: int) -> Arm:
        h = holding(c, prompt_len, output_len, block_size, prefix_caching, m, max_num_batched_tokens, max_model_len)
        n = pool_bytes // block_bytes - 1  # vLLM's null block aside
        k, moments = at_once(h, n, max_num_seqs), briefly(h, n, max_num_seqs)
        return Arm(n, h, k, moments, h.largest * block_bytes)

    name = model if isinstance(model, str) else "model"
    kinds = f", {m.sliding} of them sliding-window ({m.window} tokens)" if sliding else ""
    groups = f", {full + sliding} KV cache groups of {m.group_layers} layers" if sliding else ""
    line = (
        f"{name} per rank ({m.layers} layers{kinds}, {m.kv_heads} KV heads x {m.head_dim}, "
        f"{m.pool_bytes} B per cached element{groups}), block {block_size}; prompt {prompt_len} + output {output_len}, no "
        f"shared prefix; {startup.knobs(cfg)}; max_model_len {max_model_len}, max_num_seqs "
        f"{max_num_seqs}, prefix caching {'on' if prefix_caching else 'off'}"
    )
    plugin, plain = arm(cfg, pool), arm(None, given)
    return Capacity(plugin, plain, block_bytes, pool, plugin_bytes, explicit, max_num_seqs, line)


def _positive(**values) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer; got {v!r}")


def _config(knobs) -> CompressionConfig:
    """``settings.from_env``'s config, its errors naming ``--knobs``."""
    try:
        return settings.from_env({"restkv": knobs})
    except ValueError as e:
        text = str(e).removeprefix(f"{settings.ENV}: ").removeprefix("additional_config['restkv'] ")
        raise ValueError(f"--knobs: {text}") from None


def _size(n: float) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def report(c: Capacity) -> str:
    """The settings line, the table, the pool and the plugin's memory, the transient peak."""
    p, q = c.plugin, c.plain
    head = "blocks per request: prompt / largest after | requests at once | KV memory per request"
    lines = [c.settings, f"| | {head} |", "|---|---|---|---|"]
    for name, a in (("without plugin", q), ("with plugin", p)):
        k = f"{a.at_once}{' (max_num_seqs)' if a.at_once == c.max_num_seqs else ''}"
        h = a.holding
        lines.append(f"| {name} | {h.prompt} / {h.largest} | {k} | {_size(a.per_request)} |")
    if c.explicit:
        lines.append(
            f"pool: {_size(c.pool_bytes)} (kv_cache_memory_bytes, kept whole) = {p.blocks} blocks "
            f"and vLLM's null block; the plugin takes up to {_size(c.plugin_bytes)} beyond it: "
            "leave that free"
        )
    else:
        lines.append(
            f"pool: {_size(c.pool_bytes + c.plugin_bytes)} found from gpu_memory_utilization; the "
            f"plugin reserves {_size(c.plugin_bytes)} of it: {p.blocks} blocks with it, {q.blocks} "
            "without (and vLLM's null block)"
        )
    lines.append(
        f"transient: in its prompt's last step a request holds {p.holding.prompt} blocks with the "
        "plugin (its whole prompt and, under prefix caching, its kept entries' fresh blocks), then "
        f"{p.holding.after}; the counts leave room for one such prompt. vLLM admits a request once "
        f"its prompt's blocks are free: while the others are young up to {p.briefly} (with) / "
        f"{q.briefly} (without) may run for moments, the newest then preempted and computed again"
    )
    return "\n".join(lines)


def _bytes(text: str) -> int:
    """An int, or as vLLM reads it: ``64G`` GiB, ``64g`` 10^9 bytes; also ``64GiB``."""
    match = re.fullmatch(r"(\d+)\s*([kKmMgGtT])(iB)?", text.strip())
    if match:
        number, unit, binary = match.groups()
        if binary or unit.isupper():
            return int(number) << (10 + 10 * "KMGT".index(unit.upper()))
        return int(number) * 10 ** (3 + 3 * "kmgt".index(unit))
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 64G, 64GiB)") from None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help=f"{', '.join(memory.MODELS)} or a model folder")
    pool = p.add_mutually_exclusive_group(required=True)
    pool.add_argument("--kv-cache-memory-bytes", type=_bytes, help="vLLM's pool, kept whole")
    pool.add_argument(
        "--available-kv-cache-memory", type=_bytes,
        help="instead: the bytes vLLM finds for the KV cache from --gpu-memory-utilization (its "
        "log's 'Available KV cache memory'), which the plugin's reserve comes out of",
    )
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--knobs", required=True, help="the plugin's knobs (JSON), as in RESTKV_VLLM")
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--output-len", type=int, required=True)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the plugin's staging")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dtype", default=None, help="the model's dtype (default: its config's)")
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM's (auto: the model's dtype; fp8: 1 byte)")
    p.add_argument("--no-enable-prefix-caching", action="store_true", help="as vLLM's flag")
    a = p.parse_args(argv)
    knobs = memory.knobs_flag(a.knobs)
    try:
        c = capacity(
            a.model, a.kv_cache_memory_bytes, a.max_model_len, knobs, a.prompt_len, a.output_len,
            a.max_num_seqs, a.block_size, available=a.available_kv_cache_memory, dtype=a.dtype,
            max_num_batched_tokens=a.max_num_batched_tokens,
            tensor_parallel_size=a.tensor_parallel_size,
            prefix_caching=not a.no_enable_prefix_caching, kv_cache_dtype=a.kv_cache_dtype,
        )
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(report(c))


if __name__ == "__main__":
    main()
