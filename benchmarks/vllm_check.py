"""Check the vLLM plugin where vLLM runs (any device, any backend vLLM picks): one prompt served with
and without the plugin, greedy; prints both token lists, the blocks the request held at every step
and the pool's free blocks, and the positions the first layer kept; then checks them and exits 1 on
any failure, one ``FAIL <check>: <why>`` line each.

    .venv-vllm/bin/python benchmarks/vllm_check.py                    # the packaged SmolLM2, CPU
    python benchmarks/vllm_check.py --model /models/Llama-3.1-8B-Instruct --prompt_len 4000 \\
        --knobs '{"method": "restkv", "max_capacity_prompt": 1024, "decode_interval": 128}'

The checks (``failures``): the plugin evicted; in each run the pool's free blocks at the end are
those at the start; at every step the request held the blocks ``restkv.vllm.settings`` gives (the
entries it holds, plus the kept ones' fresh blocks in a first eviction under prefix caching; with
per-head or per-layer budgets, after the first eviction, the fewest blocks its heads' kept entries
need, ``heads.exact_length``; the full cache: every token's); with ``--reference PYTHON`` (restkv's
own environment) the plugin's greedy tokens and every layer's and KV head's kept positions are
those of ``restkv.configure`` on the same prompt (a model transformers loads, float32): the tokens
equal up to the first difference, which passes only as a tie (the reference's token within
``gpu_check.TIE`` of vLLM's by vLLM's logprobs), the kept positions equal in float32 and at least ``--kept_share`` of them shared in a
reduced precision (the reference is float32). ``--reference_json FILE`` keeps the reference's
result (computed once, read by later runs with the same model, knobs and lengths).

Exit status: 0 every check passed; 1 a check failed or an engine failed; 3 vLLM itself refused the
configuration where it runs (``not run: <vLLM's reason>``, e.g. an attention backend the GPU or the
installation cannot run).

Each engine runs in a subprocess (``--spec``: one engine from a JSON spec, printing ``RESULT
{...}``, which tests/vllm_plugin runs too). vLLM's own flags pass through ``--engine '{...}'``
(e.g. ``{"tensor_parallel_size": 2}``); on a CUDA machine both arms run with
``async_scheduling=False``, ``cudagraph_mode=PIECEWISE`` and, where vLLM has it (0.34.0),
``enable_extensible_kv_cache=False`` (what the plugin needs there).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE_KEYS = (
    "max_num_seqs",
    "enable_extensible_kv_cache",
    "enable_prefix_caching",
    "prefix_cache_retention_interval",
    "enable_chunked_prefill",
    "max_num_batched_tokens",
    "additional_config",
    "enforce_eager",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "compilation_config",
    "async_scheduling",
    "attention_config",
    "kv_cache_dtype",
)
NOT_RUN = 3  # exit status: vLLM refused the configuration here, nothing was checked
VLLM_REFUSAL = re.compile(r"Selected backend \S+ is not valid for this configuration\..*")


def engine(spec: dict):
    """An ``LLM`` from a spec: ``model``, ``max_model_len``, ``block_size``, ``kv_tokens`` (the KV pool
    in tokens, float32; None: vLLM's own sizing), ``dtype`` and vLLM keywords of ``ENGINE_KEYS``."""
    from vllm import LLM

    own = {k: spec[k] for k in ENGINE_KEYS if k in spec}
    if spec.get("kv_tokens"):
        config = json.loads((Path(spec["model"]) / "config.json").read_text())
        d = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * d * 4
        ranks = spec.get("tensor_parallel_size", 1) * spec.get("pipeline_parallel_size", 1)  # each a share of it
        own["kv_cache_memory_bytes"] = spec["kv_tokens"] * per_token // ranks
    return LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec.get("max_model_len", 1024),
        block_size=spec.get("block_size"),
        seed=0,
        **own,
    )


def watch_blocks(
    scheduler, steps: list, held: dict, trace: dict | None = None, batch: list | None = None, groups: dict | None = None
) -> None:
    """Record the pool's free blocks around each ``update_from_output`` (after scheduling, after the
    step), the most blocks each request held after scheduling (the evicted KV cache group's: the first
    without the plugin), in ``trace`` each request's ``[tokens computed by the step's end, tokens
    scheduled, blocks held]`` per step, in ``groups`` its blocks per step in every group (a sliding
    window's real blocks, not its null ones) and in ``batch`` each step's count of requests."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    update = scheduler.update_from_output
    managers = manager.coordinator.single_type_managers
    state = getattr(manager, "_restkv", None)
    evicted = managers[0 if state is None else state.group]

    def recorded(*args, **kwargs):
        before = pool.get_num_free_blocks()
        for req_id, scheduled in args[0].num_scheduled_tokens.items():
            blocks = evicted.req_to_blocks.get(req_id, [])
            held[req_id] = max(held.get(req_id, 0), len(blocks))
            end = scheduler.requests[req_id].num_computed_tokens  # advanced when scheduled
            if trace is not None:
                trace.setdefault(req_id, []).append([end, scheduled, len(blocks)])
            if groups is not None:
                real = [sum(not b.is_null for b in m.req_to_blocks.get(req_id, [])) for m in managers]
                groups.setdefault(req_id, []).append([end, *real])
        out = update(*args, **kwargs)
        steps.append([before, pool.get_num_free_blocks()])
        if batch is not None:
            batch.append(len(args[0].num_scheduled_tokens))
        return out

    scheduler.update_from_output = recorded


def record_kept(worker) -> None:
    """From now on, the runner's plugin records each request's first kept positions per layer."""
    state = getattr(worker.model_runner, "_restkv", None)
    if state is not None:
        state.recorded = {}
        state.observer = lambda req, layer, positions: state.recorded.setdefault(req, {}).update({layer: positions})


def kept_on_worker(worker) -> dict:
    """The runner's recorded kept positions: {request id: {layer index: [Hkv][B]}}."""
    state = getattr(worker.model_runner, "_restkv", None)
    if state is None:
        return {}
    return {
        req: {state.layer_index[name]: positions.tolist() for name, positions in layers.items()}
        for req, layers in state.recorded.items()
    }


def run_spec(spec: dict) -> dict:
    """One engine (engine core in this process). ``prompts``: lists of token ids, or ``{"ids": [...]}``
    to submit once the ones before have finished. Returns per prompt its ``tokens``, ``finish`` (vLLM's
    finish reason), ``kept`` (per
    tensor-parallel rank, per layer, per KV head: the positions its first eviction kept; empty
    without eviction), ``held`` (the most blocks it held at once, of the evicted group), ``groups`` (per step it ran in: [tokens
    computed by the step's end, real blocks held in each KV cache group]), ``cached`` (prompt tokens a
    prefix-cache hit gave it), ``trace`` (per step it ran in: [tokens computed by the step's end,
    tokens scheduled, blocks held]), ``batch`` (requests per step) and with ``spec["logprobs"]`` = k its ``logprobs`` (per token,
    {token id: logprob} of vLLM's top k and its own); ``steps`` (free blocks [after scheduling,
    after the step] per step), ``free_at_start``, ``block_size`` and ``caching`` (prefix caching
    on). ``spec["request_knobs"]``: per prompt its own restkv knobs (``SamplingParams.extra_args``;
    None: the engine's); ``spec["refused_knobs"]``: knobs submitted first, whose refusal comes back
    as ``refused`` (vLLM's message)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    llm = engine(spec)
    llm.collective_rpc(record_kept)
    core = llm.llm_engine.engine_core.engine_core
    steps: list = []
    held: dict = {}
    trace: dict = {}
    batch: list = []
    groups: dict = {}
    watch_blocks(core.scheduler, steps, held, trace, batch, groups)
    free_at_start = core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    own_knobs = spec.get("request_knobs") or []

    def params(i: int | None):
        knobs = own_knobs[i] if i is not None and i < len(own_knobs) else None
        return SamplingParams(
            max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True, logprobs=spec.get("logprobs"),
            extra_args=None if knobs is None else {"restkv": knobs},
        )  # fmt: skip

    refused = None
    if "refused_knobs" in spec:
        own_knobs = [spec["refused_knobs"]]
        try:
            llm.generate([{"prompt_token_ids": spec["prompts"][0]}], [params(0)], use_tqdm=False)
        except Exception as e:  # noqa: BLE001 (vLLM's validation error, reported)
            refused = f"{type(e).__name__}: {e}"
        own_knobs = spec.get("request_knobs") or []
    waves: list = [[]]
    for i, p in enumerate(spec["prompts"]):
        if isinstance(p, dict):
            waves.append([(i, p["ids"])])
        else:
            waves[0].append((i, p))
    outs = []
    for wave in waves:
        prompts = [{"prompt_token_ids": p} for _, p in wave]
        outs += llm.generate(prompts, [params(i) for i, _ in wave], use_tqdm=False)
    ranks = llm.collective_rpc(kept_on_worker)

    def own(table: dict, request_id: str, default):
        return next((v for k, v in table.items() if k.rsplit("-", 1)[0] == request_id), default)

    kept = []
    for o in outs:
        per_rank = [own(r, o.request_id, {}) for r in ranks]
        kept.append([[r[i] for i in sorted(r)] for r in per_rank] if per_rank[0] else [])
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "finish": [o.outputs[0].finish_reason for o in outs],
        "kept": kept,
        "steps": steps,
        "free_at_start": free_at_start,
        "held": [own(held, o.request_id, 0) for o in outs],
        "cached": [o.num_cached_tokens or 0 for o in outs],
        "trace": [own(trace, o.request_id, []) for o in outs],
        "groups": [own(groups, o.request_id, []) for o in outs],
        "block_size": core.scheduler.cache_config.block_size,
        "caching": bool(core.scheduler.kv_cache_manager.enable_caching),
        "refused": refused,
        "batch": batch,
    }
    if spec.get("logprobs"):
        result["logprobs"] = [
            [{int(t): float(lp.logprob) for t, lp in step.items()} for step in o.outputs[0].logprobs]
            for o in outs
        ]
    return result


def run_in_subprocess(spec: dict, knobs: dict | None, env: dict | None = None) -> dict:
    """``run_spec`` in a fresh process (the plugin's config is process-wide): ``knobs`` through
    ``RESTKV_VLLM`` (None: plain vLLM)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:  # a spec of many prompts outgrows argv
        json.dump(spec, f)
        f.flush()
        return script_result([__file__, "--spec", "@" + f.name], knobs, env)


def script_result(argv: list[str], knobs: dict | None, env: dict | None = None, log: str | None = None) -> dict:
    """The ``RESULT {...}`` line of ``python ARGV`` run in a fresh process from the repository root,
    ``knobs`` through ``RESTKV_VLLM`` (None: plain vLLM); its stderr's tail if it fails. ``log``: the
    lines of its output holding that text, from it on, under ``"log"``."""
    variables = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RESTKV_VLLM": json.dumps(knobs) if knobs else "",
        **(env or {}),
    }
    done = subprocess.run(
        [sys.executable, *argv], env=variables, capture_output=True, text=True, timeout=3600, cwd=ROOT,
        check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the engine failed:\n{done.stderr[-4000:]}")
    result = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[7:])
    if log is not None:
        lines = (done.stdout + done.stderr).splitlines()
        result["log"] = [x[x.index(log) :] for x in lines if log in x]
    return result


def _prompt(model: str, length: int) -> list[int]:
    """The first ``length`` tokens of README.md followed by docs/usage.md (repeated as needed), by the model's
    tokenizer."""
    from transformers import AutoTokenizer

    text = "\n".join((ROOT / name).read_text() for name in ("README.md", "docs/usage.md"))
    ids = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    return (ids * (length // len(ids) + 1))[:length]


def reference(python: str | None, saved: str | None, model: str, knobs: dict, prompt: list[int], new_tokens: int):
    """``restkv.configure``'s tokens and kept positions (``tests/vllm_plugin/reference.py`` in
    ``python``), read from ``saved`` when it holds this model's, knobs', prompt's and length's, else
    computed (and written to ``saved``); None without either."""
    key = {"model": model, "knobs": knobs, "prompt": prompt, "new_tokens": new_tokens}
    if saved and Path(saved).exists():
        data = json.loads(Path(saved).read_text())
        if {k: data.get(k) for k in key} == key:
            return data
        if not python:
            raise ValueError(f"--reference_json {saved} holds another model, knobs, prompt or length")
    if not python:
        return None
    script = ROOT / "tests" / "vllm_plugin" / "reference.py"
    cmd = [python, str(script), json.dumps(knobs), str(new_tokens), json.dumps(prompt), model]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    data = {**key, **json.loads(out.strip().splitlines()[-1])}
    if saved:
        Path(saved).write_text(json.dumps(data))
    return data


def expected_blocks(
    cfg, trace: list, prompt_len: int, block_size: int, caching: bool, kept: list | None = None
) -> list[int]:
    """Blocks the request holds after scheduling at each step of ``trace`` ([end, scheduled, _]) by
    ``restkv.vllm.settings``: the entries it holds (logical tokens minus those evicted before), or
    during an eviction's step the held ones plus, in a first eviction under prefix caching, the
    kept ones' fresh blocks. ``cfg`` None: the full cache, every token's. Where the worker counts the
    kept entries (per-head and per-layer budgets: ``Eviction.measured``), its count after the first
    eviction is the fewest entries whose blocks hold every layer's and head's pages
    (``heads.exact_length`` of the positions ``kept`` holds, -1 padding a head to its layer's widest:
    per rank, per layer, per KV head, the largest over the ranks); the steps after a later such
    eviction, whose kept sets are not recorded, are left out."""
    from restkv.vllm import heads, settings

    offset, evicted, out = 0, False, []
    for end, scheduled, _ in trace:
        e = None if cfg is None else settings.eviction(
            cfg, end - scheduled, scheduled, prompt_len, offset, caching, block_size, evicted
        )  # fmt: skip
        out.append(-(-(end - offset) // block_size) if e is None else e.slots // block_size)
        if e is not None and e.measured:
            if evicted or not kept:
                return out
            lengths = [[sum(p >= 0 for p in h) for layer in rank for h in layer] for rank in kept]  # -1: padding
            e = e.kept(max(heads.exact_length(n, block_size) for n in lengths))
        if e is not None:
            offset += e.evicted
            evicted = True
    return out


def _blocks(name: str, run: dict, cfg, prompt_len: int) -> list[str]:
    """The pool's blocks all back at the end; the request's blocks at every step as the rules give."""
    fails = []
    start, end = run["free_at_start"], run["steps"][-1][1]
    if end != start:
        fails.append(f"blocks given back: {name}: {end} free blocks at the end, {start} at the start")
    trace = run["trace"][0]
    kept = run["kept"][0] if run["kept"] else None
    want = expected_blocks(cfg, trace, prompt_len, run["block_size"], run["caching"], kept)
    for step, ((tokens, scheduled, got), expected) in enumerate(zip(trace, want)):
        if got != expected:
            fails.append(
                f"blocks held: {name}: step {step} ({scheduled} tokens scheduled, {tokens} computed): the "
                f"request held {got} blocks, restkv.vllm.settings gives {expected}"
            )
            break
    return fails


def _tokens(got: list[int], ref: list[int], logprobs: list[dict] | None, tie: float) -> str | None:
    """Why vLLM's tokens are not the reference's, or None: equal up to the first difference, which
    is a tie when the reference's token is within ``tie`` of vLLM's in vLLM's logprobs (none: no
    tie)."""
    t = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    if t is None:
        return None if len(got) == len(ref) else f"{len(got)} tokens, the reference {len(ref)}"
    if logprobs is None:
        return f"token {t}: vLLM {got[t]}, the reference {ref[t]} (no logprobs to read a tie)"
    top = {int(k): v for k, v in logprobs[t].items()}  # JSON's keys are strings
    margin = top[got[t]] - top.get(ref[t], float("-inf"))
    if margin <= tie:
        return None
    return f"token {t}: vLLM {got[t]}, the reference {ref[t]} (margin {margin:.3g} > the tie {tie})"


def kept_share(kept: list, ref: list) -> tuple[float, str | None]:
    """The least share, over layers and KV heads, of the reference's kept positions the plugin kept
    (``kept``: per rank, per layer, [Hkv][B]; ``ref``: per layer [Hkv][B]), and a mismatch of
    layers, heads or counts (None when the shapes agree)."""
    layers = [[h for rank in kept for h in rank[i]] for i in range(len(kept[0]))]  # ranks' heads joined
    ref = [layer for layer in ref if layer is not None]
    if [len(x) for x in layers] != [len(x) for x in ref]:
        return 0.0, f"{[len(x) for x in layers]} heads per layer, the reference {[len(x) for x in ref]}"
    pairs = [(set(a), set(b), len(a), len(b)) for la, lb in zip(layers, ref) for a, b in zip(la, lb)]
    if any(na != nb for _, _, na, nb in pairs):
        return 0.0, "a head kept another number of positions than the reference's"
    return min(len(a & b) / len(b) for a, b, _, _ in pairs), None


def failures(plain: dict, evicted: dict, cfg, prompt_len: int, ref=None, tie=0.0, share=1.0) -> list[str]:
    """Every check that fails, one line each (empty: all pass); see the module's docstring."""
    fails = _blocks("full cache", plain, None, prompt_len) + _blocks("plugin", evicted, cfg, prompt_len)
    if not evicted["kept"][0]:
        fails.append("eviction: the plugin evicted nothing (the prompt fits the budget?)")
    if ref is None:
        return fails
    why = _tokens(evicted["tokens"][0], ref["tokens"], evicted.get("logprobs", [None])[0], tie)
    if why:
        fails.append(f"tokens differ from configure()'s: {why}")
    if evicted["kept"][0]:
        least, shape = kept_share(evicted["kept"][0], ref["kept"])
        if shape or least < share:
            fails.append(
                f"kept positions differ from configure()'s: {shape or f'{least:.1%} shared in the worst layer and head'}"
                f" (needed: {share:.0%})"
            )
    return fails


def _engine_error(error: RuntimeError) -> tuple[bool, str]:
    """(whether vLLM refused the configuration here, its one line) from a failed engine's stderr."""
    text = str(error)
    refused = VLLM_REFUSAL.search(text)
    if refused:
        return True, refused.group(0)
    lines = [x for x in text.splitlines() if x.strip()]
    return False, lines[-1] if lines else "no error output"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a HF-format model folder (default: the packaged SmolLM2)")
    p.add_argument("--knobs", default='{"method": "snapkv", "max_capacity_prompt": 128}', help="restkv's knobs")
    p.add_argument("--prompt_len", type=int, default=300)
    p.add_argument("--new_tokens", type=int, default=16)
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 otherwise")
    p.add_argument("--engine", default="{}", help="more vLLM keywords, JSON")
    p.add_argument("--reference", default=None, help="restkv's own Python, to compare with configure()")
    p.add_argument("--reference_json", default=None, help="the reference's result, kept in this file")
    p.add_argument(
        "--kept_share", type=float, default=None,
        help="least share of configure()'s kept positions kept, per layer and head (default 1 in float32, 0.9 otherwise)",
    )  # fmt: skip
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.spec:
        text = Path(args.spec[1:]).read_text() if args.spec.startswith("@") else args.spec
        print("RESULT " + json.dumps(run_spec(json.loads(text))))
        return 0
    import torch

    sys.path.insert(0, str(ROOT))
    from gpu_check import TIE
    from vllm.engine.arg_utils import EngineArgs

    from restkv.vllm import settings

    model = args.model or str(Path.home() / ".cache" / "restkv" / "models" / "smollm2-135m")
    knobs = json.loads(args.knobs)
    cfg = settings.from_env({"restkv": knobs})  # a bad knob: one line, before any engine
    dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    if getattr(torch, dtype, None) not in TIE:
        p.error(f"--dtype: one of float32, float16, bfloat16; got {dtype}")
    share = args.kept_share if args.kept_share is not None else (1.0 if dtype == "float32" else 0.9)
    prompt = _prompt(model, args.prompt_len)
    gpu = {"async_scheduling": False, "compilation_config": {"cudagraph_mode": "PIECEWISE"}}
    if "enable_extensible_kv_cache" in inspect.signature(EngineArgs).parameters:  # 0.34.0 on CUDA: on by default
        gpu["enable_extensible_kv_cache"] = False
    spec = {
        "model": model,
        "prompts": [prompt],
        "max_tokens": args.new_tokens,
        "dtype": dtype,
        "logprobs": 5,
        "max_model_len": args.prompt_len + args.new_tokens + 64,
        # on CPU a pool of 8 requests: vLLM's own sizing there reserves 92% of the machine's memory
        **(gpu if torch.cuda.is_available() else {"kv_tokens": 8 * (args.prompt_len + args.new_tokens + 64)}),
        **json.loads(args.engine),
    }
    runs = {}
    for name, arm in (("full cache", None), ("plugin", knobs)):
        try:
            runs[name] = run_in_subprocess(spec, arm)
        except RuntimeError as e:
            refused, line = _engine_error(e)
            if refused and arm is None:
                print(f"not run: {line}")
                return NOT_RUN
            print(f"FAIL engine: {name}: {line}")
            return 1
    plain, evicted = runs["full cache"], runs["plugin"]
    print(f"model {model}, {args.prompt_len}-token prompt, {args.new_tokens} new tokens, {dtype}, knobs {knobs}")
    print(f"tokens, full cache: {plain['tokens'][0]}")
    print(f"tokens, plugin:     {evicted['tokens'][0]}")
    print(f"most blocks held by the request: full cache {plain['held'][0]}, plugin {evicted['held'][0]}")
    print("free blocks [after scheduling, after the step], first steps:")
    print(f"  full cache: {plain['steps'][:6]}")
    print(f"  plugin:     {evicted['steps'][:6]}")
    print(f"free blocks at the start {evicted['free_at_start']}, at the end {evicted['steps'][-1][1]}")
    kept = evicted["kept"][0]
    if kept:
        print(f"layer 0, KV head 0 of rank 0 kept {len(kept[0][0][0])} positions: {kept[0][0][0][:12]} ...")
    ref = reference(args.reference, args.reference_json, model, knobs, prompt, args.new_tokens)
    if ref is not None:
        print(f"configure()'s tokens: {ref['tokens']}")
        if kept:
            print(f"kept positions shared with configure()'s, worst layer and head: {kept_share(kept, ref['kept'])[0]:.1%}")
    fails = failures(plain, evicted, cfg, args.prompt_len, ref, TIE[getattr(torch, dtype)], share)
    for line in fails:
        print(f"FAIL {line}")
    checked = "blocks, eviction" + (", tokens and kept positions against configure()" if ref else "")
    print(f"{'all checks passed' if not fails else f'{len(fails)} checks failed'} ({checked})")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
