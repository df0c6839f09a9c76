"""The trained weights' held-out agreement with KVzip: loss, Spearman correlation, top-share overlap."""

from __future__ import annotations

from ...lazy import torch
from ...methods import fastkvzip, kvzap
from .extraction import log_scores


def predict(method: str, weights: list, x: "torch.Tensor") -> "torch.Tensor":
    """The method's scores of examples x [N, layers, D] -> [N, layers, Hkv]."""
    with torch.no_grad():
        if method == "kvzap":
            return torch.stack([kvzap.surrogate(w, x[:, i]) for i, w in enumerate(weights)], 1)
        return torch.stack(
            [fastkvzip.gate(w, x[None, :, i])[0].T for i, w in enumerate(weights)], 1
        )


def quality(method: str, weights: list, held: dict, keep: float = 0.3) -> dict:
    """Held-out agreement with KVzip: the training loss, the Spearman correlation of predicted and
    KVzip's scores and the overlap of their top ``keep`` share, per layer and KV head over each
    held-out
    window's drawn positions, averaged."""
    pred = predict(method, weights, held["hidden"])
    target = held["scores"]
    if method == "kvzap":
        loss = torch.nn.functional.mse_loss(pred, log_scores(target))
    else:
        bce = torch.nn.functional.binary_cross_entropy(pred, target, reduction="none")
        loss = bce.mean(0).sum()  # mean over positions, summed over layers and heads
    rho, overlap = [], []
    for w in held["window"].unique():
        at = held["window"] == w
        a, b = pred[at].flatten(1).T, target[at].flatten(1).T  # [layers * Hkv, n]
        rho.append(_pearson(_ranks(a), _ranks(b)))
        k = max(1, round(keep * a.shape[1]))
        top_a = torch.zeros_like(a, dtype=torch.bool).scatter_(1, a.topk(k).indices, True)
        top_b = torch.zeros_like(b, dtype=torch.bool).scatter_(1, b.topk(k).indices, True)
        overlap.append((top_a & top_b).sum(1).float() / k)
    return {
        "loss": float(loss),
        "spearman": float(torch.cat(rho).mean()),
        f"top{round(keep * 100)}_overlap": float(torch.cat(overlap).mean()),
    }


def _ranks(x: "torch.Tensor") -> "torch.Tensor":
    return x.argsort(-1).argsort(-1).double()


def _pearson(a: "torch.Tensor", b: "torch.Tensor") -> "torch.Tensor":
    a = a - a.mean(-1, keepdim=True)
    b = b - b.mean(-1, keepdim=True)
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-12)
