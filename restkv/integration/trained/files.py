"""The weights' files, in kvpress's formats: written, read and checked against the model's shape."""

from __future__ import annotations

import os

from ...lazy import torch
from ..computed import atomic_save


def to_file(method: str, weights: list) -> dict:
    """kvpress's format: KVzapModel's state dict, or the Fast KVzip authors' {"module": [...]}."""
    if method == "fastkvzip":
        return {"module": [dict(w) for w in weights]}
    names = (
        ("weight", "bias") if len(weights[0]) == 2 else ("0.weight", "0.bias", "2.weight", "2.bias")
    )
    return {f"layers.{i}.{n}": t for i, w in enumerate(weights) for n, t in zip(names, w)}


def _read(path: str, knob: str):
    if not os.path.isfile(path):
        raise ValueError(f"{knob} not found: {path}")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any failure to read one
        raise ValueError(f"{knob} {path}: not a weights file ({type(e).__name__})") from None


def from_file(
    method: str, state, knob: str, path: str, shape: dict, kind: str | None = None
) -> list:
    """Weights per layer from a file's contents, checked against the model's ``shape`` (layers, D,
    Hkv, groups); a ValueError naming ``knob`` otherwise."""
    if method == "kvzap":
        return _kvzap_from_file(state, knob, path, shape, kind)
    return _gates_from_file(state, knob, path, shape)


def _kvzap_from_file(state, knob: str, path: str, shape: dict, kind: str) -> list:
    """KVzap's [(W, b)] or [(W1, b1, W2, b2)] from KVzapModel's state dict."""
    layers = shape["layers"]
    d = shape["hidden"]
    hkv = shape["kv_heads"]
    mlp = isinstance(state, dict) and "layers.0.0.weight" in state
    if kind == "linear" and mlp or kind == "mlp" and not mlp:
        held = "an mlp" if mlp else "no mlp"
        raise ValueError(f"{knob} {path}: holds {held} model but kvzap_type is {kind}")
    names = ("0.weight", "0.bias", "2.weight", "2.bias") if mlp else ("weight", "bias")
    try:
        weights = [tuple(state[f"layers.{i}.{n}"].float() for n in names) for i in range(layers)]
    except (KeyError, TypeError, AttributeError):
        raise ValueError(
            f"{knob} {path}: expected KVzapModel's state dict of {layers} layers"
        ) from None
    first = weights[0][0].shape
    last = weights[0][-1].shape
    if first[-1] != d or last[0] != hkv or f"layers.{layers}.{names[0]}" in state:
        raise ValueError(
            f"{knob} {path}: expected {layers} layers from {d} hidden to {hkv} KV heads, got "
            f"input {first[-1]}, output {last[0]}"
        )
    return weights


def _gates_from_file(state, knob: str, path: str, shape: dict) -> list:
    """Fast KVzip's gates from the authors' ``{"module": [per-layer state dict]}``."""
    layers = shape["layers"]
    d = shape["hidden"]
    hkv = shape["kv_heads"]
    gates = state.get("module") if isinstance(state, dict) else None
    want = {
        "q_proj.weight",
        "q_proj.bias",
        "k_proj.weight",
        "q_norm.weight",
        "k_norm.weight",
        "k_base",
        "b",
    }
    if not isinstance(gates, list) or len(gates) != layers or any(set(w) != want for w in gates):
        raise ValueError(
            f"{knob} {path}: expected {{'module': [{layers} FastKVzipGate state dicts]}}"
        )
    for w in gates:
        o = w["q_norm.weight"].shape[0]
        if (
            w["q_proj.weight"].shape != (hkv * shape["groups"] * o, d)
            or w["k_base"].shape[0] != hkv
        ):
            raise ValueError(
                f"{knob} {path}: expected gates from {d} hidden for {hkv} KV heads of "
                f"{shape['groups']} queries, got q_proj {tuple(w['q_proj.weight'].shape)}"
            )
    return [{k: v.float() for k, v in w.items()} for w in gates]


def save(state: dict, path) -> None:
    """``torch.save`` through a temporary file beside ``path``."""
    atomic_save(state, path)
