"""The GPU check: one command, no download, that prints restkv's table on a Llama-3.1-8B-shaped model.

A randomly initialised Llama of Llama-3.1-8B's shape (32 layers, 32 query / 8 KV heads, head_dim 128,
hidden 4096, intermediate 14336, vocabulary 128256, llama3 RoPE, bf16) is built on ``--device``. For sdpa
and, when a flash kernel is importable (``flash_attn``: flash_attention_2, ``flash_attn_interface``:
flash_attention_3), for flash, one table row per length and method:

- greedy = masked full cache: at the check length (4K), the greedy tokens of the evicted cache against the
  full cache with every evicted prompt entry masked (``masked_reference``: the same prefill, then at each decoded token
  the model's attention with the prompt entries outside ``restkv.kept_positions`` masked, fed the same
  tokens). ``yes`` when every token matches; ``yes, k ties`` when k tokens differ but the reference's
  logit margin between the two is under the dtype's tolerance (bf16 attention over a gathered and over a
  masked cache round differently); ``NO`` otherwise. The ``fullkv`` row is the reference
  (``reference``); the longer lengths are timed only (``-``);
- prefill: seconds of one forward over the prompt (with the eviction step of every layer), its ratio to
  the full-cache prefill and to SnapKV's;
- decode: median ms per greedy token after that prefill, on the full cache and on the evicted ones
  (budget ``--budget`` = 1024 entries per KV head);
- peak: the peak memory allocated on the model's device during prefill and decode
  (``torch.cuda.max_memory_allocated(device)``; resident set on CPU), and that peak minus the memory
  held before (the weights; a resident set that shrank reads 0.00).

Every method is warmed up first at the first row's length (CUDA initialisation, kernel selection, ReST-KV's
W_O factorisation are not timed), and each length's rows follow one untimed full-cache prefill of that length
(the allocator's pools and the kernels for its shapes); clocks are read after
``torch.cuda.synchronize(device)``.

Usage::

    python benchmarks/gpu_check.py                      # cuda, the 8B shape, 4K check, 32K and 128K
    python benchmarks/gpu_check.py --device cpu --tiny  # the same code on a small model (the test suite runs it)

Needs restkv installed first (``pip install -e .`` in the clone: torch, transformers, accelerate and the rest
of requirements.txt; restkv imports accelerate) and nothing else: no flash_attn (used when importable), no
network (the model is random, the prompts random ids). What a run takes on a 141 GiB GPU, measured on an NVIDIA
H200, is in docs/gpu.md ("Measured on an NVIDIA H200"). Exit status 1 when a greedy
row reads ``NO`` (one ``FAIL greedy:`` line each), 2 (one line) when ``--device cuda`` finds no CUDA device,
else 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import sys
import time

import torch
from torch.nn import functional as F
from transformers import LlamaConfig
from transformers.modeling_utils import AttentionInterface

import restkv

from devices import PeakMemory, device_of, random_llama, sync

METHODS = ("snapkv", "restkv", "adakv")
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPES = {
    "llama3.1-8b": dict(
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
    ),
    "tiny": dict(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=256,
    ),
}
RUNS = {  # check length, timed lengths, budget, greedy tokens checked, decode steps timed
    "llama3.1-8b": dict(check=4096, lengths=(32768, 131072), budget=1024, new_tokens=16, steps=32),
    "tiny": dict(check=256, lengths=(512, 1024), budget=64, new_tokens=8, steps=4),
}
LEGEND = (
    "greedy = masked full cache: at L={check}, the evicted run's greedy tokens against the full cache with the "
    "evicted entries masked (yes; yes, k ties: k tokens within the dtype's rounding; NO: a real difference); "
    "reference: the full cache itself; -: a timed-only length. / full, / SnapKV: prefill time ratios; "
    "speed-up vs full: full-cache decode time / this row's. Memory in GiB on the model's device."
)
TIE = {torch.float32: 1e-4, torch.float16: 0.05, torch.bfloat16: 0.25}  # logit margin read as a tie
REFERENCE = "restkv_masked_reference"


def build_model(shape: str, device, dtype: torch.dtype, max_len: int):
    """A randomly initialised Llama of ``shape``, built on ``device`` in ``dtype`` (sdpa)."""
    config = LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=max(max_len, 131072),
        rope_parameters=dict(LLAMA3_ROPE),
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config._attn_implementation = "sdpa"
    return random_llama(config, dtype, device)


def flash_backends() -> list[str]:
    """The flash attention implementations whose kernel is importable here."""
    found = []
    if importlib.util.find_spec("flash_attn") is not None:
        found.append("flash_attention_2")
    if importlib.util.find_spec("flash_attn_interface") is not None:
        found.append("flash_attention_3")
    return found


def set_backend(model, attn: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(attn)
    else:
        model.config._attn_implementation = attn


def cache_keyword(model) -> str:
    """The forward's cache argument: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def prefill(model, ids):
    """One forward over ``ids`` [1, L] -> (cache, last logits [1, V] float32)."""
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return cache_of(out), out.logits[:, -1].float()


@torch.no_grad()
def step(model, cache, token, position: int):
    """One decoded token [1, 1] at ``position`` -> logits [1, V] float32."""
    pos = torch.full((1, 1), position, dtype=torch.long, device=token.device)
    kw = {cache_keyword(model): cache}
    out = model(input_ids=token, position_ids=pos, use_cache=True, logits_to_keep=1, **kw)
    return out.logits[:, -1].float()


def greedy(model, ids, n: int):
    """Greedy decoding of ``n`` tokens -> (tokens [1, n], logits [1, n, V])."""
    cache, logits = prefill(model, ids)
    tokens = [logits.argmax(-1, keepdim=True)]
    seen = [logits]
    for i in range(n - 1):
        seen.append(step(model, cache, tokens[-1], ids.shape[1] + i))
        tokens.append(seen[-1].argmax(-1, keepdim=True))
    return torch.cat(tokens, 1), torch.stack(seen, 1)


def held_mask(kept, prompt_len: int, length: int, heads: int):
    """kept [b, H, K] prompt positions (-1: nothing) -> [b, heads, 1, length] bool: the entries a decoded query
    sees (the kept prompt entries and every entry after the prompt)."""
    b, h, _ = kept.shape
    idx = kept.masked_fill(kept < 0, prompt_len)
    prompt = torch.zeros(b, h, prompt_len + 1, dtype=torch.bool, device=kept.device)
    prompt = prompt.scatter_(2, idx, True)[..., :prompt_len]
    after = torch.ones(b, h, length - prompt_len, dtype=torch.bool, device=kept.device)
    return torch.cat([prompt, after], -1).repeat_interleave(heads // h, 1)[:, :, None]


@torch.no_grad()
def masked_reference(model, ids, kept, tokens, attn: str):
    """Logits [1, n, V] of the full cache fed ``ids`` then ``tokens[:, :-1]``, each decoded query seeing only the
    kept prompt entries of its layer and head (``kept`` per layer [b, H, K], None: the whole prompt) and the
    decoded ones. The prefill runs the backend ``attn`` unchanged; restkv must be detached."""
    backend = AttentionInterface._global_mapping[attn]
    prompt_len = ids.shape[1]

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        held = kept[module.layer_idx]
        if query.shape[2] > 1 or held is None:
            return backend(
                module,
                query,
                key,
                value,
                attention_mask,
                scaling=scaling,
                dropout=dropout,
                **kwargs,
            )
        g = query.shape[1] // key.shape[1]
        allowed = held_mask(held, prompt_len, key.shape[2], query.shape[1])
        out = F.scaled_dot_product_attention(
            query,
            key.repeat_interleave(g, 1),
            value.repeat_interleave(g, 1),
            attn_mask=allowed,
            scale=scaling,
        )
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(REFERENCE, attend)
    previous = model.config._attn_implementation
    model.config._attn_implementation = REFERENCE
    try:
        cache, logits = prefill(model, ids)
        seen = [logits]
        for i in range(tokens.shape[1] - 1):
            seen.append(step(model, cache, tokens[:, i : i + 1], prompt_len + i))
    finally:
        model.config._attn_implementation = previous
    return torch.stack(seen, 1)


def agreement(tokens, reference, tie: float) -> str:
    """``yes`` / ``yes, k ties`` / ``NO (step t)``: the evicted run's tokens [1, n] against the reference's
    logits [1, n, V] (a differing token whose reference margin is under ``tie`` is a tie)."""
    best = reference.argmax(-1)
    ties = 0
    for t in range(tokens.shape[1]):
        if best[0, t] == tokens[0, t]:
            continue
        margin = float(reference[0, t, best[0, t]] - reference[0, t, tokens[0, t]])
        if margin > tie:
            return f"NO (token {t}, margin {margin:.3g})"
        ties += 1
    return "yes" if not ties else f"yes, {ties} ties"


def check(model, ids, method: str, budget: int, new_tokens: int, attn: str, dtype) -> str:
    """Greedy tokens of ``method`` against the masked full cache, on ``ids``."""
    restkv.configure(model, method=method, max_capacity_prompt=budget)
    tokens, _ = greedy(model, ids, new_tokens)
    kept = restkv.kept_positions(model)
    restkv.detach(model)
    reference = masked_reference(model, ids, kept, tokens, attn)
    return agreement(tokens, reference, TIE[dtype])


@torch.no_grad()
def timed(model, ids, method: str, budget: int, steps: int) -> dict:
    """Prefill seconds, median decode ms per token and peak memory of ``method`` on ``ids``."""
    device = device_of(model)
    restkv.configure(model, method=method, max_capacity_prompt=budget)
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        cache, logits = prefill(model, ids)
        sync(device)
        seconds = time.perf_counter() - t0
        token = logits.argmax(-1, keepdim=True)
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            token = step(model, cache, token, ids.shape[1] + i).argmax(-1, keepdim=True)
            sync(device)
            times.append(time.perf_counter() - t0)
        del cache
    restkv.detach(model)
    return {
        "prefill": seconds,
        "decode": 1e3 * statistics.median(times),
        "peak": mem.peak,
        "extra": mem.extra,
    }


def warm_up(model, length: int, budget: int, vocab: int) -> None:
    """Every method once on a prompt of ``length`` (CUDA initialisation, kernel choice, ReST-KV's W_O
    factors)."""
    ids = torch.randint(0, vocab, (1, length), device=device_of(model))
    for method in ("fullkv", *METHODS):
        restkv.configure(model, method=method, max_capacity_prompt=min(budget, length // 2))
        greedy(model, ids, 3)
        restkv.detach(model)
    sync(device_of(model))


def settle(model, ids) -> None:
    """One untimed full-cache prefill of ``ids`` (the allocator's pools and the kernels for this length)."""
    cache, _ = prefill(model, ids)
    del cache
    sync(device_of(model))


def table(model, attn: str, run: dict, dtype, seed: int = 0):
    """Rows ``(attn, L, method, equal, prefill s, x full, x snapkv, decode ms, x full, peak, extra)``."""
    set_backend(model, attn)
    vocab = model.config.vocab_size
    device = device_of(model)
    gen = torch.Generator().manual_seed(seed)
    warm_up(model, run["check"], run["budget"], vocab)
    rows = []
    for length in (run["check"], *run["lengths"]):
        ids = torch.randint(0, vocab, (1, length), generator=gen).to(device)
        settle(model, ids)
        results = {
            m: timed(model, ids, m, run["budget"], run["steps"]) for m in ("fullkv", *METHODS)
        }
        for method, r in results.items():
            equal = "-"
            if length == run["check"]:
                equal = (
                    "reference"
                    if method == "fullkv"
                    else check(model, ids, method, run["budget"], run["new_tokens"], attn, dtype)
                )
            rows.append(
                (
                    attn,
                    length,
                    method,
                    equal,
                    r["prefill"],
                    r["prefill"] / results["fullkv"]["prefill"],
                    r["prefill"] / results["snapkv"]["prefill"],
                    r["decode"],
                    results["fullkv"]["decode"] / r["decode"],
                    r["peak"],
                    r["extra"],
                )
            )
            print(f"done: {attn} L={length} {method} greedy={equal} prefill={r['prefill']:.3f}s "
                  f"decode={r['decode']:.2f}ms peak={gib(r['peak'])}GiB", file=sys.stderr, flush=True)
    return rows


def gib(nbytes: float) -> str:
    """Bytes in GiB to 2 decimals; a negative amount (a resident set that shrank) reads 0.00, never -0.00."""
    return f"{max(nbytes, 0) / 2**30:.2f}"


def print_table(rows, check: int) -> None:
    print(
        "| backend | L | method | greedy = masked full cache | prefill (s) | / full | / SnapKV | "
        "decode (ms/token) | speed-up vs full | peak memory (GiB) | peak over weights (GiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for attn, length, method, equal, s, x_full, x_snap, ms, speed, peak, extra in rows:
        print(
            f"| {attn} | {length} | {method} | {equal} | {s:.3f} | {x_full:.3f} | {x_snap:.3f} | {ms:.2f} | "
            f"{speed:.2f} | {gib(peak)} | {gib(extra)} |",
            flush=True,
        )
    print("\n" + LEGEND.format(check=check))


def versions(device) -> str:
    import transformers

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return f"{gpu}, torch {torch.__version__}, transformers {transformers.__version__}, restkv {restkv.__version__}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--tiny", action="store_true", help="a 4-layer model and short prompts (runs on CPU)"
    )
    p.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --tiny)")
    p.add_argument(
        "--budget",
        type=int,
        default=None,
        help="entries kept per KV head (default 1024; 64 with --tiny)",
    )
    p.add_argument(
        "--lengths",
        type=int,
        nargs="*",
        default=None,
        help="timed prompt lengths (default 32768 131072)",
    )
    p.add_argument(
        "--attn",
        nargs="+",
        default=None,
        help="backends (default: sdpa and every importable flash)",
    )
    args = p.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: gpu_check.py checks restkv on a GPU (--device cpu --tiny runs the same code on CPU)")
        raise SystemExit(2)
    shape = "tiny" if args.tiny else "llama3.1-8b"
    run = dict(RUNS[shape])
    if args.budget is not None:
        run["budget"] = args.budget
    if args.lengths is not None:
        run["lengths"] = tuple(args.lengths)
    dtype = getattr(torch, args.dtype or ("float32" if args.tiny else "bfloat16"))
    if dtype not in TIE:
        raise ValueError(
            f"--dtype: one of {', '.join(str(t).split('.')[1] for t in TIE)}, not {args.dtype}"
        )
    attns = args.attn or ["sdpa", *flash_backends()]
    torch.manual_seed(0)
    model = build_model(
        shape, args.device, dtype, max(run["check"], *run["lengths"]) + run["steps"] + 8
    )
    device = device_of(model)
    print(
        f"random Llama ({shape}): {model.config.num_hidden_layers} layers, {model.config.num_attention_heads}/"
        f"{model.config.num_key_value_heads} heads, head_dim {model.config.head_dim}, {str(dtype)[6:]}, "
        f"budget {run['budget']}; {versions(device)}; flash kernels: {', '.join(flash_backends()) or 'none'}\n"
    )
    rows = []
    for attn in attns:
        rows += table(model, attn, run, dtype)
    print_table(rows, run["check"])
    return rows


if __name__ == "__main__":
    wrong = [row for row in main() if row[3].startswith("NO")]
    for attn, length, method, equal, *_ in wrong:
        print(f"FAIL greedy: {attn}, {method} at {length}: {equal}")
    sys.exit(1 if wrong else 0)
