"""restkv's transformers path on the packaged SmolLM2: greedy tokens and kept positions, as JSON on
stdout.

Run with restkv's own environment: ``python tests/vllm_plugin/reference.py '<knobs json>' <new tokens>
<prompt ids json> [model]`` (knobs ``{}``: no eviction; model: a registry name or a folder, default
the packaged SmolLM2). The vLLM plugin's tests and ``benchmarks/vllm_check.py`` compare against it.

``python tests/vllm_plugin/reference.py --loop`` answers one run per line of stdin (JSON ``[knobs, new
tokens, prompt, model]``) with a ``RESULT {...}`` line (or ``FAILED`` and the error as JSON text), each model
loaded once: the tests' harness keeps one such process.
"""

from __future__ import annotations

import json
import sys

import torch


def main(knobs: dict, new_tokens: int, prompt: list[int], name: str = "smollm2-135m") -> dict:
    from restkv.integration.models import load_model

    return run(load_model(name)[0], knobs, new_tokens, prompt)


def run(model, knobs: dict, new_tokens: int, prompt: list[int]) -> dict:
    """``model`` configured with ``knobs`` (none: detached, no eviction), greedy on ``prompt``."""
    import restkv

    if knobs:
        restkv.configure(model, **knobs)
    else:
        restkv.detach(model)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
        )
    kept = (
        [None if p is None else p[0].tolist() for p in restkv.kept_positions(model)]
        if knobs
        else []
    )
    return {"tokens": out[0, len(prompt) :].tolist(), "kept": kept}


def loop() -> None:
    import traceback

    from restkv.integration.models import load_model

    models: dict = {}
    for line in sys.stdin:
        knobs, new_tokens, prompt, name = json.loads(line)
        try:
            if name not in models:
                models[name] = load_model(name)[0]
            answer = "RESULT " + json.dumps(run(models[name], knobs, new_tokens, prompt))
        except Exception:  # noqa: BLE001 (sent back whole; the harness starts a fresh process after it)
            answer = "FAILED " + json.dumps(traceback.format_exc()[-4000:])
        print(answer, flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1:] == ["--loop"]:
        loop()
    else:
        print(json.dumps(main(json.loads(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), *sys.argv[4:])))
