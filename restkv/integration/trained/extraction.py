"""The training examples: KVzip's scores of drawn positions of the essays, with each layer's attention
input; the held-out split and the targets."""

from __future__ import annotations

import sys

from ...config import CompressionConfig
from ...eviction.deferred import replay_scores
from ...eviction.plans import attention_modules, plan_layers
from ...eviction.step import LayerPrefill
from ...lazy import torch
from ..attachment import attached
from ..computed import model_tokenizer
from ..qfilters import calibration_ids

POSITIONS = 256  # positions drawn per window
HELD_OUT = 8  # every 8th window is held out
SEED = 0


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


def model_shape(model) -> dict:
    config = model.config.get_text_config()
    return {
        "layers": len(attention_modules(model)),
        "hidden": config.hidden_size,
        "kv_heads": config.num_key_value_heads,
        "groups": config.num_attention_heads // config.num_key_value_heads,
    }
