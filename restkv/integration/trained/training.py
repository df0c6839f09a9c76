"""Training: KVzap's linear model (ridge regression) or MLP (AdamW on the log scores), Fast KVzip's gates
(SGD on binary cross-entropy), from their initial weights to the held-out report."""

from __future__ import annotations

import math
import time

from ...lazy import torch
from ...methods import fastkvzip, kvzap
from .extraction import SEED, examples, log_scores, model_shape, split
from .held_out import quality

MLP_EPOCHS = 15  # kvpress's
MLP_LR = 5e-3
MLP_BATCH = 512
GATE_STEPS = 600
GATE_BATCH = 256
GATE_LR = 0.2  # the authors'
GATE_EPOCHS = 20
GATE_DIM = 16  # the published gates' (q{g}_dim16_sink16)
GATE_SINKS = 16


def _linear_init(fan_in: int, *shape, g) -> "torch.Tensor":
    """nn.Linear's initial weights or bias: uniform in +-1/sqrt(fan_in)."""
    bound = 1 / math.sqrt(fan_in)
    return (torch.rand(*shape, generator=g) * 2 - 1) * bound


def train_kvzap(data: dict, kind: str) -> list[tuple]:
    """KVzap's weights per layer from training examples (the package's docstring): [(W, b)] or
    [(W1, b1, W2, b2)]."""
    x = data["hidden"].transpose(0, 1)  # [layers, N, D]
    y = log_scores(data["scores"]).transpose(0, 1)  # [layers, N, Hkv]
    if kind == "linear":
        return [_ridge(x[i].double(), y[i].double()) for i in range(x.shape[0])]
    layers, n, d = x.shape
    g = torch.Generator().manual_seed(SEED)
    params = [list(new_mlp(d, y.shape[-1], g)) for _ in range(layers)]
    flat = [p.requires_grad_() for layer in params for p in layer]
    optimizer = torch.optim.AdamW(flat, lr=MLP_LR)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=MLP_EPOCHS)
    with torch.enable_grad():
        for _ in range(MLP_EPOCHS):
            for batch in torch.randperm(n, generator=g).split(MLP_BATCH):
                pred = torch.stack([kvzap.surrogate(p, x[i, batch]) for i, p in enumerate(params)])
                loss = torch.nn.functional.mse_loss(pred, y[:, batch])
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(flat, 1.0)
                optimizer.step()
            schedule.step()
    return [tuple(p.detach() for p in layer) for layer in params]


def new_linear(d: int, hkv: int, g) -> tuple:
    """KVzap's linear model as nn.Linear initialises it: (W, b)."""
    return _linear_init(d, hkv, d, g=g), _linear_init(d, hkv, g=g)


def new_mlp(d: int, hkv: int, g) -> tuple:
    """KVzap's MLP as nn.Linear initialises it: (W1, b1, W2, b2)."""
    h = kvzap.HIDDEN_UNITS
    return (
        _linear_init(d, h, d, g=g),
        _linear_init(d, h, g=g),
        _linear_init(h, hkv, h, g=g),
        _linear_init(h, hkv, g=g),
    )


def _ridge(x: "torch.Tensor", y: "torch.Tensor", alpha: float = 1.0) -> tuple:
    """Ridge regression with an unpenalised intercept (scikit-learn's ``Ridge``): x [N, D], y [N, H]
    float64 -> (W [H, D], b [H]) float32."""
    x_mean = x.mean(0)
    y_mean = y.mean(0)
    xc = x - x_mean
    yc = y - y_mean
    gram = xc.T @ xc + alpha * torch.eye(x.shape[1], dtype=x.dtype)
    w = torch.linalg.solve(gram, xc.T @ yc).T  # [H, D]
    return w.float(), (y_mean - w @ x_mean).float()


def _gate_schedule(step: int, steps: int) -> float:
    """The authors' ``lr_schedule``."""
    if step < 0.01 * steps:
        return 0.01 * step
    if step >= 0.75 * steps:
        return 0.25
    return 0.5 if step >= 0.5 * steps else 1.0


def new_gate(d: int, hkv: int, groups: int, g) -> dict:
    """A FastKVzipGate's initial state dict (nn.Linear's initialisation, unit norms, zero sinks,
    zero b)."""
    o = GATE_DIM
    return {
        "q_proj.weight": _linear_init(d, hkv * groups * o, d, g=g),
        "q_proj.bias": _linear_init(d, hkv * groups * o, g=g),
        "k_proj.weight": _linear_init(d, hkv * o, d, g=g),
        "q_norm.weight": torch.ones(o),
        "k_norm.weight": torch.ones(o),
        "k_base": torch.zeros(hkv, 1, GATE_SINKS, o),
        "b": torch.zeros(hkv, 1, groups),
    }


def gate_loss(gates: list, x: "torch.Tensor", y: "torch.Tensor") -> "torch.Tensor":
    """The authors' loss: binary cross-entropy per layer, mean over positions, summed over heads and
    layers; x [layers, N, D], y [layers, N, Hkv]."""
    total = 0.0
    for i, gate in enumerate(gates):
        pred = fastkvzip.gate(gate, x[i][None])[0]  # [Hkv, N]
        bce = torch.nn.functional.binary_cross_entropy(pred, y[i].T, reduction="none")
        total = total + bce.mean(-1).sum()
    return total


def train_gates(data: dict, groups: int) -> list[dict]:
    """Fast KVzip's gates per layer from training examples (the package's docstring)."""
    x = data["hidden"].transpose(0, 1)
    y = data["scores"].transpose(0, 1)
    layers, n, d = x.shape
    g = torch.Generator().manual_seed(SEED)
    gates = [new_gate(d, y.shape[-1], groups, g) for _ in range(layers)]
    flat = [p.requires_grad_() for gate in gates for p in gate.values()]
    optimizer = torch.optim.SGD(flat, lr=GATE_LR, momentum=0.9)
    order = torch.randperm(n, generator=g)
    steps = min(GATE_STEPS, math.ceil(GATE_EPOCHS * n / GATE_BATCH))
    with torch.enable_grad():
        for step in range(steps):
            start = step * GATE_BATCH % max(1, n - GATE_BATCH + 1)
            if start < GATE_BATCH and step:
                order = torch.randperm(n, generator=g)
            batch = order[start : start + GATE_BATCH]
            for group in optimizer.param_groups:
                group["lr"] = GATE_LR * _gate_schedule(step, steps)
            optimizer.zero_grad()
            gate_loss(gates, x[:, batch], y[:, batch]).backward()
            optimizer.step()
    return [{k: v.detach() for k, v in gate.items()} for gate in gates]


def train(model, method: str, kind: str, tokenizer_path, windows: int, length: int, data=None):
    """(weights per layer, held-out quality before and after training, seconds) of ``method``
    (``kvzap`` of ``kind``, or ``fastkvzip``) on ``model``; ``data``: the examples if already
    drawn."""
    start = time.perf_counter()
    data = examples(model, tokenizer_path, windows, length) if data is None else data
    fit, held = split(data)
    config = model.config.get_text_config()
    groups = config.num_attention_heads // config.num_key_value_heads
    if method == "kvzap":
        weights = train_kvzap(fit, kind)
        hkv = fit["scores"].shape[-1]
        g = torch.Generator().manual_seed(SEED)
        d = fit["hidden"].shape[-1]
        untrained = [(new_mlp if kind == "mlp" else new_linear)(d, hkv, g)] * len(weights)
    else:
        weights = train_gates(fit, groups)
        g = torch.Generator().manual_seed(SEED)
        untrained = [new_gate(fit["hidden"].shape[-1], fit["scores"].shape[-1], groups, g)] * len(
            weights
        )
    report = {"before": quality(method, untrained, held), "after": quality(method, weights, held)}
    return (
        every_layer(weights, data["layers"], model_shape(model)["layers"]),
        report,
        time.perf_counter() - start,
    )


def every_layer(weights: list, layers: list, count: int) -> list:
    """The weights of every attention layer: zeros (a constant score) where none was trained (the
    layers that keep their whole cache, Gemma's sliding-window ones)."""
    out = [None] * count
    for i, w in zip(layers, weights):
        out[i] = w
    zero = weights[0]
    zero = (
        {k: v * 0 for k, v in zero.items()}
        if isinstance(zero, dict)
        else tuple(v * 0 for v in zero)
    )
    return [zero if w is None else w for w in out]
