"""Check the vLLM plugin where vLLM runs (any device, any backend vLLM picks): one prompt served with
and without the plugin, greedy; prints both token lists, the blocks the request held at every step
and the pool's free blocks, and the positions the first layer kept.

    .venv-vllm/bin/python benchmarks/vllm_check.py                    # the packaged SmolLM2, CPU
    python benchmarks/vllm_check.py --model /models/Llama-3.1-8B-Instruct --prompt_len 4000 \\
        --knobs '{"method": "restkv", "max_capacity_prompt": 1024, "decode_interval": 128}'

Passing means: the plugin's run holds the prompt's blocks during the step that evicts (plus the kept
ones' with prefix caching), then about ``max_capacity_prompt / block_size`` blocks; its free blocks
come back; its tokens are greedy text (they may differ from the full cache's: the cache is evicted).
With ``--reference PYTHON`` (restkv's own environment) the plugin's tokens and the first layer's kept
positions are compared with ``restkv.configure`` on the same prompt (a model transformers loads).

Each engine runs in a subprocess (``--spec``: one engine from a JSON spec, printing ``RESULT
{...}``, which tests/vllm_plugin runs too). vLLM's own flags pass through ``--engine '{...}'``
(e.g. ``{"tensor_parallel_size": 2}``); on a CUDA machine both arms run with
``async_scheduling=False`` and ``cudagraph_mode=PIECEWISE`` (what the plugin needs there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE_KEYS = (
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "max_num_batched_tokens",
    "additional_config",
    "enforce_eager",
    "tensor_parallel_size",
    "compilation_config",
    "async_scheduling",
)


def engine(spec: dict):
    """An ``LLM`` from a spec: ``model``, ``max_model_len``, ``block_size``, ``kv_tokens`` (the KV pool
    in tokens, float32; None: vLLM's own sizing), ``dtype`` and vLLM keywords of ``ENGINE_KEYS``."""
    from vllm import LLM

    own = {k: spec[k] for k in ENGINE_KEYS if k in spec}
    if spec.get("kv_tokens"):
        config = json.loads((Path(spec["model"]) / "config.json").read_text())
        d = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * d * 4
        own["kv_cache_memory_bytes"] = spec["kv_tokens"] * per_token // spec.get("tensor_parallel_size", 1)
    return LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec.get("max_model_len", 1024),
        block_size=spec.get("block_size"),
        seed=0,
        **own,
    )


def watch_blocks(scheduler, steps: list, held: dict) -> None:
    """Record the pool's free blocks around each ``update_from_output`` (after scheduling, after the
    step) and the most blocks each request held after scheduling."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    update = scheduler.update_from_output

    def recorded(*args, **kwargs):
        before = pool.get_num_free_blocks()
        for req_id in args[0].num_scheduled_tokens:
            blocks = manager.coordinator.single_type_managers[0].req_to_blocks.get(req_id, [])
            held[req_id] = max(held.get(req_id, 0), len(blocks))
        out = update(*args, **kwargs)
        steps.append([before, pool.get_num_free_blocks()])
        return out

    scheduler.update_from_output = recorded


def kept_on_worker(worker) -> dict:
    """The runner's recorded kept positions: {request id: {layer rank: [Hkv][B]}}."""
    state = getattr(worker.model_runner, "_restkv", None)
    if state is None:
        return {}
    return {
        req: {state.rank[name]: positions.tolist() for name, positions in layers.items()}
        for req, layers in state.kept.items()
    }


def run_spec(spec: dict) -> dict:
    """One engine (engine core in this process). ``prompts``: lists of token ids, or ``{"ids": [...]}``
    to submit once the ones before have finished. Returns per prompt its ``tokens``, ``kept`` (per
    tensor-parallel rank, per layer, per KV head: the positions its first eviction kept; empty
    without eviction), ``held`` (the most blocks it held at once) and ``cached`` (prompt tokens a
    prefix-cache hit gave it); ``steps`` (free blocks [after scheduling, after the step] per step)
    and ``free_at_start``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    llm = engine(spec)
    core = llm.llm_engine.engine_core.engine_core
    steps: list = []
    held: dict = {}
    watch_blocks(core.scheduler, steps, held)
    free_at_start = core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    waves: list = [[]]
    for p in spec["prompts"]:
        if isinstance(p, dict):
            waves.append([p["ids"]])
        else:
            waves[0].append(p)
    outs = []
    for wave in waves:
        outs += llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)
    ranks = llm.collective_rpc(kept_on_worker)

    def own(table: dict, request_id: str, default):
        return next((v for k, v in table.items() if k.rsplit("-", 1)[0] == request_id), default)

    kept = []
    for o in outs:
        per_rank = [own(r, o.request_id, {}) for r in ranks]
        kept.append([[r[i] for i in sorted(r)] for r in per_rank] if per_rank[0] else [])
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "kept": kept,
        "steps": steps,
        "free_at_start": free_at_start,
        "held": [own(held, o.request_id, 0) for o in outs],
        "cached": [o.num_cached_tokens or 0 for o in outs],
    }


def run_in_subprocess(spec: dict, knobs: dict | None, env: dict | None = None) -> dict:
    """``run_spec`` in a fresh process (the plugin's config is process-wide): ``knobs`` through
    ``RESTKV_VLLM`` (None: plain vLLM)."""
    variables = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RESTKV_VLLM": json.dumps(knobs) if knobs else "",
        **(env or {}),
    }
    done = subprocess.run(
        [sys.executable, __file__, "--spec", json.dumps(spec)],
        env=variables,
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=ROOT,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the engine failed:\n{done.stderr[-4000:]}")
    return json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[7:])


def _prompt(model: str, length: int) -> list[int]:
    """The first ``length`` tokens of this README (repeated as needed), by the model's tokenizer."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model)((ROOT / "README.md").read_text())["input_ids"]
    return (ids * (length // len(ids) + 1))[:length]


def _reference(python: str, model: str, knobs: dict, prompt: list[int], new_tokens: int) -> dict:
    script = ROOT / "tests" / "vllm_plugin" / "reference.py"
    cmd = [python, str(script), json.dumps(knobs), str(new_tokens), json.dumps(prompt), model]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a HF-format model folder (default: the packaged SmolLM2)")
    p.add_argument("--knobs", default='{"method": "snapkv", "max_capacity_prompt": 128}', help="restkv's knobs")
    p.add_argument("--prompt_len", type=int, default=300)
    p.add_argument("--new_tokens", type=int, default=16)
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 otherwise")
    p.add_argument("--engine", default="{}", help="more vLLM keywords, JSON")
    p.add_argument("--reference", default=None, help="restkv's own Python, to compare with configure()")
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.spec:
        print("RESULT " + json.dumps(run_spec(json.loads(args.spec))))
        return 0
    import torch

    model = args.model or str(Path.home() / ".cache" / "restkv" / "models" / "smollm2-135m")
    knobs = json.loads(args.knobs)
    dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    prompt = _prompt(model, args.prompt_len)
    gpu = {"async_scheduling": False, "compilation_config": {"cudagraph_mode": "PIECEWISE"}}
    spec = {
        "model": model,
        "prompts": [prompt],
        "max_tokens": args.new_tokens,
        "dtype": dtype,
        "max_model_len": args.prompt_len + args.new_tokens + 64,
        # on CPU a pool of 8 requests: vLLM's own sizing there reserves 92% of the machine's memory
        **(gpu if torch.cuda.is_available() else {"kv_tokens": 8 * (args.prompt_len + args.new_tokens + 64)}),
        **json.loads(args.engine),
    }
    plain = run_in_subprocess(spec, None)
    evicted = run_in_subprocess(spec, knobs)
    print(f"model {model}, {args.prompt_len}-token prompt, {args.new_tokens} new tokens, {dtype}, knobs {knobs}")
    print(f"tokens, full cache: {plain['tokens'][0]}")
    print(f"tokens, plugin:     {evicted['tokens'][0]}")
    print(f"most blocks held by the request: full cache {plain['held'][0]}, plugin {evicted['held'][0]}")
    print("free blocks [after scheduling, after the step], first steps:")
    print(f"  full cache: {plain['steps'][:6]}")
    print(f"  plugin:     {evicted['steps'][:6]}")
    print(f"free blocks at the start {evicted['free_at_start']}, at the end {evicted['steps'][-1][1]}")
    kept = evicted["kept"][0]
    if not kept:
        print("the plugin evicted nothing (the prompt fits the budget?)")
        return 1
    print(f"layer 0, KV head 0 of rank 0 kept {len(kept[0][0][0])} positions: {kept[0][0][0][:12]} ...")
    if args.reference:
        ref = _reference(args.reference, model, knobs, prompt, args.new_tokens)
        same_kept = [layer[0] for layer in kept[0]] == [layer[0] for layer in ref["kept"]]
        print(f"configure(): the same tokens: {ref['tokens'] == evicted['tokens'][0]}, "
              f"the same kept positions in every layer's first head: {same_kept}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
