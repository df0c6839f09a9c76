"""Engines one after another in one process (``harness.engine_run``): each line of stdin a JSON
``[spec, knobs]``, run as ``benchmarks/vllm_check.py``'s ``run_spec`` with ``knobs`` in ``RESTKV_VLLM``
(None: plain vLLM), a fresh ``LLM`` each, its engine core in this process; each answered on stdout by a
``RESULT {...}`` line, or ``FAILED`` and the error as JSON text (vLLM's own logs come between). Importing
vLLM once saves each later engine most of its start."""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from vllm_check import run_spec


def main() -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    for line in sys.stdin:
        spec, knobs = json.loads(line)
        os.environ["RESTKV_VLLM"] = json.dumps(knobs) if knobs else ""
        try:
            answer = "RESULT " + json.dumps(run_spec(spec))
        except Exception:  # noqa: BLE001 (sent back whole; the harness starts a fresh process after it)
            answer = "FAILED " + json.dumps(traceback.format_exc()[-4000:])
        gc.collect()
        cleanup_dist_env_and_memory()
        print(answer, flush=True)


if __name__ == "__main__":
    main()
