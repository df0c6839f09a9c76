"""KVgrad: KVzip's reconstruction attention x the value's output norm x the downstream gradient.

Paper: "KVgrad" (https://openreview.net/forum?id=cg1wTCJjjk); code: kvpress ``KVgradPress``
(https://github.com/NVIDIA/kvpress, ``kvpress/presses/kvgrad_press.py``, built on ``KVzipPress``).

The passes are KVzip's (``restkv.methods.kvzip``: the model repeats its prompt after the prefill, in
chunks of ``repeat_chunk`` tokens, the first ``sink_tokens`` always kept), each run with autograd:
the objective is ``Phi = sum_p ||h_p||^2`` over the pass tokens p, h the last decoder layer's output
(before the final norm), and ``g_p = ||dPhi / da_p||`` is the gradient's norm at each layer's
attention output a_p. An entry c's score at query head h is ``max_p A_pc ||W_O^h v_c||_2 g_p`` (A:
the reconstruction attention, softmax over [sinks | the chunk | the pass's own tokens] as KVzip's);
the max over a GQA group is ``gqa_agg="max"`` (the reference's). Budget: one top-k over every layer,
head and entry (``layer_budget="global"``, the reference's non-layerwise default), as KVzip.

Cost (the reference warns of 3-4 times the prefill): per chunk, one forward and one backward of its
~``repeat_chunk`` + 20 tokens, each attending over the whole prompt; the parameters get no gradient
(only the activations: ``torch.autograd.grad`` to the attention outputs). Memory: the full cache
while scoring (as KVzip) plus one pass's autograd graph: every layer's activations of the pass
tokens, and the attention's saved tensors, which the flash and memory-efficient kernels keep linear
in the prompt (the math kernel, sdpa's on CPU, saves the r x (L + r) probabilities of every head and
layer: ``repeat_chunk`` bounds r). The scores' reconstruction attention is formed per layer after
the backward, from the pass's queries and keys kept meanwhile (r x d per head).

Differences: float32 scores and gradients (the reference: the model dtype for both); 4 sinks above
every other entry (the reference: the largest score + 1); the chunk of 512 is ``repeat_chunk`` (the
reference's ``chunk_size``); padding is supported (each sample's passes alone, as KVzip here). It
runs under ``torch.inference_mode`` too (the passes leave it).
"""

from __future__ import annotations

from ..compat import cache_argument
from ..knobs import GQA_AGG, Knob
from ..lazy import torch
from . import kvzip

SINK = 1e30  # above any score: the sinks are always kept

KNOBS = (
    kvzip.KNOBS[0],
    Knob(
        "repeat_chunk",
        512,
        "context tokens reconstructed per extra forward and backward",
        rule=">= 1",
    ),
    kvzip.KNOBS[2],
    GQA_AGG.but(default="max"),
)

passes = kvzip.passes
check_model = kvzip.check_model


def check(cfg):
    kvzip.streamingllm.check(cfg)
    if cfg.get("decode_interval"):
        raise ValueError(
            "decode_interval is not supported by kvgrad (its scores come from "
            "passes after the prefill)"
        )


def run_pass(decoder, ids, position_ids, cache, modules) -> dict:
    """One pass ``ids`` [1, r] with autograd -> ``{module: ||dPhi / da_p|| [1, r] float32}`` for the
    attention ``modules``, ``Phi = sum_p ||h_p||^2`` of the last decoder layer's output."""
    outputs = {}
    last = {}

    def keep_output(module, args, output):
        outputs[module] = output[0]

    def keep_last(module, args, output):
        last["h"] = output[0] if isinstance(output, tuple) else output

    hooks = [m.register_forward_hook(keep_output) for m in modules]
    hooks.append(decoder.layers[-1].register_forward_hook(keep_last))
    try:
        with torch.inference_mode(False), torch.enable_grad():
            ids = ids.clone()  # not inference tensors: autograd saves them
            position_ids = position_ids.clone()
            embeds = decoder.get_input_embeddings()(ids).detach().requires_grad_(True)
            decoder(
                inputs_embeds=embeds,
                position_ids=position_ids,
                use_cache=True,
                **{cache_argument(decoder): cache},
            )
            phi = last["h"].float().square().sum()
            grads = torch.autograd.grad(phi, [outputs[m] for m in modules], allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    norms = {}
    for m, g in zip(modules, grads):
        if g is None:  # an output the objective does not read
            norms[m] = torch.zeros(ids.shape, device=ids.device)
        else:
            norms[m] = torch.linalg.vector_norm(g, dim=-1, dtype=torch.float32)
    return norms


def score(obs, cfg):
    """``max_p A_pc g_p ||W_O^h v_c||`` of each scored entry c per query head, sinks above all
    -> [b, Hq, P]."""
    P = obs.prefix_len
    a = obs.window_attention[..., :P]  # [b, Hq, r, P]
    if obs.query_weights is not None:  # None (not its passes' observation): every query weighs 1
        a = a * obs.query_weights[:, None, :, None]
    s = a.amax(-2) * obs.projected_value_norms("l2")
    pos = obs.positions[:, None, :P]
    return torch.where((pos >= 0) & (pos < cfg.sink_tokens), SINK, s)
