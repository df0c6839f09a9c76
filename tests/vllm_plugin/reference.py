"""restkv's transformers path on the packaged SmolLM2: greedy tokens and kept positions, as JSON on
stdout.

Run with restkv's own environment: ``python tests/vllm_plugin/reference.py '<knobs json>' <new tokens>
<prompt ids json> [model]`` (knobs ``{}``: no eviction; model: a registry name or a folder, default
the packaged SmolLM2). The vLLM plugin's tests and ``benchmarks/vllm_check.py`` compare against it.
"""

from __future__ import annotations

import json
import sys

import torch


def main(knobs: dict, new_tokens: int, prompt: list[int], name: str = "smollm2-135m") -> dict:
    import restkv
    from restkv.integration.models import load_model

    model, _ = load_model(name)
    if knobs:
        restkv.configure(model, **knobs)
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


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(main(json.loads(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), *sys.argv[4:])))
