"""The vLLM plugin's GPU verification in one command: ``vllm_check.py`` in every combination of the
attention backends (FlashAttention, FlashInfer, Triton), vLLM's model runners (V1 and V2 where vLLM has
both, V2 alone on 0.34.0) and graph modes (piecewise CUDA graphs, eager); per-head budgets (``--head_knobs``:
AdaKV) on the backend that runs them on a GPU, Triton with head-major pages (``VLLM_KV_CACHE_LAYOUT=HND``),
with each runner, in both graph modes; then ``gpu_check.py`` (restkv's transformers path on the GPU); one report, a table of each arm:
pass, FAIL and why, or not run and why.

    python benchmarks/vllm_gpu_verify.py --model /path/to/Llama-3.1-8B-Instruct \\
        --reference .venv/bin/python --out report.md
    python benchmarks/vllm_gpu_verify.py --plan     # the arms and their commands; nothing runs

Run it with the vLLM environment's Python (``vllm==0.34.0`` or ``0.33.0``, restkv and the plugin installed);
``--reference``: restkv's own Python (``pip install -e .``), which computes ``configure()``'s tokens
and kept positions once for every arm of the same knobs (kept next to ``--out``: ``*.reference.json``,
``*.heads.reference.json``) and runs ``gpu_check.py``. The
backend goes to vLLM as ``attention_config={"backend": ...}`` (``--attention-backend`` of ``vllm
serve``), the runner as ``VLLM_USE_V2_MODEL_RUNNER`` (0 or 1, where vLLM has both), the graph mode as
``compilation_config={"cudagraph_mode": "PIECEWISE"}`` or ``enforce_eager=True``. An arm vLLM itself
refuses on the machine (a backend its GPU or installation cannot run: ``vllm_check``'s exit status
3) is "not run", with vLLM's reason.

Exit status: 0 every arm passed; 1 an arm failed; 2 no CUDA device (said in one line, before any
work); 3 none failed but some were not run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from vllm_check import NOT_RUN as REFUSED  # vllm_check's exit status when vLLM refused the engine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BACKENDS = {"FlashAttention": "FLASH_ATTN", "FlashInfer": "FLASHINFER", "Triton": "TRITON_ATTN"}  # vLLM's AttentionBackendEnum
BOTH_RUNNERS = {"V1 runner": {"VLLM_USE_V2_MODEL_RUNNER": "0"}, "V2 runner": {"VLLM_USE_V2_MODEL_RUNNER": "1"}}
GRAPHS = {
    "piecewise CUDA graphs": {"compilation_config": {"cudagraph_mode": "PIECEWISE"}},
    "eager": {"enforce_eager": True},
}
KNOBS = '{"method": "restkv", "max_capacity_prompt": 1024, "decode_interval": 128}'
HEAD_KNOBS = '{"method": "adakv", "max_capacity_prompt": 1024}'
# where per-head budgets run on a GPU (``restkv.vllm.hooks.attention.HEAD_PAGES``): backend, environment
HEADS = ("TRITON_ATTN", {"VLLM_KV_CACHE_LAYOUT": "HND"})


def runners() -> dict:
    """vLLM's model runners here, name -> the environment picking it: V1 and V2 where vLLM has both (0.32.0,
    0.33.0: ``VLLM_USE_V2_MODEL_RUNNER``), V2 alone where the V1 runner is gone (0.34.0)."""
    import importlib.util

    try:
        v1 = importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None
    except ModuleNotFoundError:  # no vLLM here (--plan): the runners of a release with both
        v1 = True
    return BOTH_RUNNERS if v1 else {"V2 runner": {}}
PASSED, FAILED, NOT_RUN = "pass", "FAIL", "not run"


def arms(args) -> list[tuple[str, list[str], dict]]:
    """(name, command, environment variables) of every arm, in order."""

    def check(knobs: str, backend: str, engine: dict, saved: str) -> list[str]:
        cmd = [
            sys.executable, str(HERE / "vllm_check.py"), "--model", args.model or "MODEL", "--knobs", knobs,
            "--prompt_len", str(args.prompt_len), "--new_tokens", str(args.new_tokens),
            "--engine", json.dumps({"attention_config": {"backend": backend}, **engine}),
            "--reference_json", str(args.out.with_suffix(saved)),
        ]  # fmt: skip
        return cmd + ["--reference", args.reference] if args.reference else cmd

    out = []
    for (backend, enum), (runner, chosen), (graphs, engine) in itertools.product(
        BACKENDS.items(), runners().items(), GRAPHS.items()
    ):
        cmd = check(args.knobs, enum, engine, ".reference.json")
        out.append((f"vllm_check: {backend}, {runner}, {graphs}", cmd, dict(chosen)))
    enum, env = HEADS
    backend = next(name for name, e in BACKENDS.items() if e == enum)
    for (runner, chosen), (graphs, engine) in itertools.product(runners().items(), GRAPHS.items()):
        cmd = check(args.head_knobs, enum, engine, ".heads.reference.json")
        name = f"vllm_check: per-head budgets, {backend}, {runner}, HND pages, {graphs}"
        out.append((name, cmd, {**chosen, **env}))
    gpu = [args.reference or sys.executable, str(HERE / "gpu_check.py"), *shlex.split(args.gpu_check)]
    out.append(("gpu_check: transformers path", gpu, {}))
    return out


def outcome(status: int, stdout: str, stderr: str) -> tuple[str, str]:
    """(pass / FAIL / not run, why) from an arm's exit status and output."""
    lines = stdout.splitlines()
    if status == 0:
        return PASSED, ""
    not_run = [x for x in lines if x.startswith("not run: ")]
    if status == REFUSED and not_run:
        return NOT_RUN, not_run[0][len("not run: ") :]
    fails = [x[len("FAIL ") :] for x in lines if x.startswith("FAIL ")]
    last = [x for x in stderr.splitlines() if x.strip()]
    return FAILED, "; ".join(fails) or f"exit status {status}: {last[-1] if last else 'no output'}"


def versions() -> str:
    import torch

    try:
        import vllm

        version = vllm.__version__
    except ImportError:
        version = "not installed"
    return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, vLLM {version}"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a HF-format model folder (vLLM's and transformers')")
    p.add_argument("--reference", default=None, help="restkv's own Python: configure()'s reference, gpu_check.py")
    p.add_argument("--out", type=Path, default=Path("vllm_gpu_verify.md"), help="the report (markdown)")
    p.add_argument("--knobs", default=KNOBS, help="restkv's knobs, JSON")
    p.add_argument("--head_knobs", default=HEAD_KNOBS, help="the per-head budgets' arms' knobs, JSON")
    p.add_argument("--prompt_len", type=int, default=4000)
    p.add_argument("--new_tokens", type=int, default=160, help="default: past one decode_interval's eviction")
    p.add_argument("--gpu_check", default="", help="gpu_check.py's flags, e.g. '--lengths 32768' (under 48 GiB)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per arm")
    p.add_argument("--plan", action="store_true", help="print the arms and their commands; run nothing")
    args = p.parse_args(argv)
    for name in ("prompt_len", "new_tokens", "timeout"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    sys.path.insert(0, str(ROOT))
    from restkv.vllm import settings

    configs = {}
    for flag in ("knobs", "head_knobs"):
        try:
            configs[flag] = settings.from_env({"restkv": json.loads(getattr(args, flag))})
        except ValueError as e:  # JSONDecodeError included
            p.error(f"--{flag}: {e}")
    if not settings.per_head(configs["head_knobs"]):
        p.error(f"--head_knobs: {args.head_knobs} gives every head of a layer the same budget (no per-head budgets)")
    args.out = args.out.resolve()  # the arms run in the repository's root
    if args.reference and Path(args.reference).exists():
        args.reference = os.path.abspath(args.reference)  # a venv's python: its link kept
    plan = arms(args)
    if args.plan:
        for name, cmd, env in plan:
            variables = "".join(f"{k}={v} " for k, v in env.items())
            print(f"{name}\n    {variables}{shlex.join(cmd)}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: vllm_gpu_verify.py checks the plugin on a GPU (vllm_check.py runs on CPU)")
        return 2
    if not args.model or not (Path(args.model) / "config.json").exists():
        p.error(f"--model: a HF-format model folder (with config.json) is needed; got {args.model}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows, logs = [], []
    for name, cmd, env in plan:
        print(f"{name} ...", flush=True)
        try:
            done = subprocess.run(
                cmd, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, capture_output=True, text=True,
                cwd=ROOT, timeout=args.timeout, check=False,
            )  # fmt: skip
            result, why = outcome(done.returncode, done.stdout, done.stderr)
            output = done.stdout + (f"\n(stderr, last lines)\n{done.stderr[-3000:]}" if result == FAILED else "")
        except subprocess.TimeoutExpired:
            result, why, output = FAILED, f"no result in {args.timeout} s", ""
        print(f"    {result}{': ' + why if why else ''}", flush=True)
        rows.append((name, result, why))
        logs.append(f"### {name}\n\n```\n{' '.join(f'{k}={v}' for k, v in env.items())} {shlex.join(cmd)}\n\n{output}\n```\n")
    table = ["| arm | result | why |", "|---|---|---|"] + [f"| {n} | {r} | {cell(w)} |" for n, r, w in rows]
    head = f"# vLLM plugin on a GPU\n\n{versions()}; model {args.model}; knobs {args.knobs}\n"
    args.out.write_text("\n".join([head, *table, "", *logs]))
    print("\n".join(table) + f"\n\nreport: {args.out}")
    results = [r for _, r, _ in rows]
    return 1 if FAILED in results else 3 if NOT_RUN in results else 0


if __name__ == "__main__":
    sys.exit(main())
