"""The kvpress side of ``kvpress_compare.py``: what runs in kvpress's own venv, and press specs as data.

Run by ``kvpress_compare.py`` as ``<kvpress python> -I kvpress_side.py KIND`` (``KIND`` one of ``CHILDREN``)
with the job as JSON on stdin; it prints its result as JSON. It imports only the standard library, torch,
transformers and kvpress (and ``compress_step.py``'s timing loop), never restkv.

A press is written as data (``press("AdaKVPress", press=press("SnapKVPress", ...))``) so that the pair table
of ``kvpress_compare.py`` needs no kvpress; ``RATIO`` in a spec is the matched ``compression_ratio``
(``RATIO_AFTER_HALF``: the one that keeps as many after a press that kept half).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RATIO = "<compression_ratio>"
# the ratio of a press that follows one keeping half of the L entries (ComposedPress): 2 r - 1 keeps the same
# B of the int(L / 2) left (even L)
RATIO_AFTER_HALF = "<compression_ratio after a press keeping half>"
# presses that draw from torch's global random state at every call (a Gaussian sketch): each runs on its own
# prefill, after torch.manual_seed(0), since a shared prefill interleaves the draws of several presses
UNSEEDED = {"LeverageScorePress", "CompactorPress"}  # CompactorPress holds a LeverageScorePress


def press(name: str, attributes: dict | None = None, **args) -> dict:
    """A kvpress press as data: its class name and constructor arguments (presses nest); ``attributes``:
    fields set after construction (those a press fills itself from the input, e.g. FinchPress's window)."""
    spec = {"press": name, "args": args}
    if attributes:
        spec["attributes"] = attributes
    return spec


def press_classes(spec) -> set:
    """Names of the kvpress classes a spec uses."""
    if isinstance(spec, list):
        return set().union(*map(press_classes, spec)) if spec else set()
    if not isinstance(spec, dict):
        return set()
    return {spec["press"]}.union(*map(press_classes, spec["args"].values()))


def build_press(spec, classes: dict, ratio: float):
    """A press from its spec: ``classes`` maps names to kvpress classes; ``RATIO`` becomes ``ratio``."""
    if isinstance(spec, list):
        return [build_press(s, classes, ratio) for s in spec]
    if isinstance(spec, dict):
        built = classes[spec["press"]](**{k: build_press(v, classes, ratio) for k, v in spec["args"].items()})
        for name, value in spec.get("attributes", {}).items():
            setattr(built, name, value)
        return built
    if spec == RATIO_AFTER_HALF:
        return 2 * ratio - 1
    return ratio if spec == RATIO else spec


def describe_press(spec) -> str:
    """``AdaKVPress(SnapKVPress(window_size=64, kernel_size=5))`` (the ratio left out)."""
    if isinstance(spec, list):
        return "[" + ", ".join(map(describe_press, spec)) + "]"
    if not isinstance(spec, dict):
        return repr(spec)
    args = [describe_press(v) if k in ("press", "presses") else f"{k}={describe_press(v)}"
            for k, v in spec["args"].items() if v != RATIO]
    args += [f"{k}={v!r} (set)" for k, v in spec.get("attributes", {}).items()]
    return f"{spec['press']}({', '.join(args)})"


def kept_from_mask(pruned, heads: int, length: int):
    """The complement of kvpress's ``masked_key_indices`` (batch, head, position) of batch 1 -> positions
    [heads, K] in order, -1 after a head's last one."""
    import torch

    keep = torch.ones(heads, length, dtype=torch.bool)
    keep[pruned[1], pruned[2]] = False
    pos = torch.where(keep, torch.arange(length), length).sort(-1).values[:, : int(keep.sum(-1).max())]
    return pos.masked_fill(pos == length, -1)


def gathered_positions(full, kept):
    """Where each kept row comes from: ``kept`` [b, H, K, d] holds rows of ``full`` [b, H, L, d] -> [b, H, K].

    Rows are matched by their exact bits (a fingerprint, then checked); None when some kept row is no row
    of ``full`` (a press that changes the keys).
    """
    import torch

    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[full.element_size()]
    weights = torch.randint(1, 2**20, (full.shape[-1],), generator=torch.Generator().manual_seed(0))

    def fingerprint(x):  # < 2^20 * 2^31 * d: no int64 overflow
        return (x.contiguous().view(ints).long() * weights).sum(-1)

    order = fingerprint(full).sort(-1)
    at = torch.searchsorted(order.values, fingerprint(kept)).clamp_max(full.shape[2] - 1)
    idx = order.indices.gather(-1, at)
    return idx if torch.equal(full.gather(2, idx[..., None].expand_as(kept)), kept) else None


def _kvpress_classes():
    import kvpress

    return {n: getattr(kvpress, n) for n in dir(kvpress) if n.endswith("Press")}


def _capture_kept(built, gathered: dict):
    """Wrap ``built.compress`` so that each layer's kept positions land in ``gathered[layer]`` ([b, H, K])."""
    compress = built.compress

    def capture(module, hidden_states, keys, values, attentions, kwargs):
        _ROTATED.clear()
        k, v = compress(module, hidden_states, keys, values, attentions, kwargs)
        found = None if k.shape == keys.shape else gathered_positions(keys, k)
        if found is None and k.shape != keys.shape:  # keys moved: the indices they were re-rotated from
            found = _ROTATED.get("indices")
        gathered[module.layer_idx] = found
        return k, v

    _record_rerotations()
    built.compress = capture


_ROTATED: dict = {}  # the indices of the last KeyRerotationPress.rerotate_keys call


def _record_rerotations():
    """Make ``KeyRerotationPress.rerotate_keys`` (also FinchPress's) leave its kept indices in ``_ROTATED``."""
    from kvpress.presses.key_rerotation_press import KeyRerotationPress

    original = KeyRerotationPress.rerotate_keys
    if getattr(original, "records", False):
        return

    def recorded(module, indices, keys):
        _ROTATED["indices"] = indices
        return original(module, indices, keys)

    recorded.records = True
    KeyRerotationPress.rerotate_keys = staticmethod(recorded)


def _kept(masked, gathered, layer, length: int, full=None):
    """A layer's kept positions [H, K]: the complement of the masked ones, the gathered ones, all of them, the
    rows of the prefill's keys ``full`` it holds (a press that shrinks the cache in its own hooks, as KVCompose),
    or None (a press that changed the keys: no kept set to read)."""
    import torch

    heads = layer.keys.shape[1]
    if masked is not None:
        return kept_from_mask(masked, heads, length)
    if gathered is not None:
        return gathered[0]
    if layer.keys.shape[2] == length:
        return torch.arange(length).expand(heads, -1)
    found = None if full is None else gathered_positions(full, layer.keys)
    return None if found is None else found[0]


def _prefill_keys(model, length: int, into: dict) -> list:
    """Hooks that keep each layer's cache keys once they hold the ``length`` prompt entries (before any press's
    own hooks, registered after these, change them) in ``into[layer]``."""
    def keep(module, args, kwargs, output):
        keys = kwargs["past_key_values"].layers[module.layer_idx].keys
        if module.layer_idx not in into and keys.shape[2] == length:
            into[module.layer_idx] = keys.clone()

    return [layer.self_attn.register_forward_hook(keep, with_kwargs=True) for layer in model.model.layers]


def _continue(model, cache, ids, length: int, masked: list, last):
    """Teacher-force ``ids[length:]`` on ``cache`` with each layer's ``masked_key_indices`` -> log-probs [T, vocab]."""
    import torch

    for module, m in zip((layer.self_attn for layer in model.model.layers), masked):
        module.masked_key_indices = m
    positions = torch.arange(length, ids.shape[1] - 1)[None]  # as kvpress's pipeline: the original positions
    if len({layer.keys.shape[-2] for layer in cache.layers}) == 1:
        rest = model(input_ids=ids[:, length:-1], past_key_values=cache, position_ids=positions).logits[0]
    else:  # layers of different lengths (SimLayerKV, KVCompose): one token at a time, which needs no mask
        rest = torch.cat([model(input_ids=ids[:, t : t + 1], past_key_values=cache,
                                position_ids=positions[:, t - length : t - length + 1]).logits[0]
                          for t in range(length, ids.shape[1] - 1)])
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None
    return torch.cat([last, rest]).float().log_softmax(-1)


def run_each(model, ids, length: int, built):
    """kvpress as documented: ``with press(model): model(prompt)``, then the continuation -> (kept, log-probs)."""
    import torch
    from transformers import DynamicCache

    gathered, cache, full = {}, DynamicCache(), {}
    _capture_kept(built, gathered)
    hooks = _prefill_keys(model, length, full)
    try:
        with torch.no_grad():
            with built(model):
                last = model(input_ids=ids[:, :length], past_key_values=cache, logits_to_keep=1).logits[0, -1:]
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        masked = [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]
        kept = [_kept(m, gathered.get(i), cache.layers[i], length, full.get(i)) for i, m in enumerate(masked)]
        return kept, _continue(model, cache, ids, length, masked, last)


def run_shared(model, ids, length: int, presses: dict):
    """One prefill for every press: after each layer's attention, each press's own forward hook runs on its own
    copy of the layer's cache (the prefill's outputs do not depend on the compression, so each press sees what
    its own prefill would show it). -> ``{"full": log-probs, key: (kept, log-probs)}``."""
    import torch
    from transformers import DynamicCache

    layers = model.model.layers
    caches = {key: DynamicCache() for key in presses}
    masked = {key: [None] * len(layers) for key in presses}
    gathered = {key: {} for key in presses}
    for key, built in presses.items():
        built.post_init_from_model(model)
        _capture_kept(built, gathered[key])

    def hook(module, args, kwargs, output):
        i, full = module.layer_idx, kwargs["past_key_values"].layers[module.layer_idx]
        for key, built in presses.items():
            caches[key].update(full.keys.clone(), full.values.clone(), i)  # its own copy: presses write into it
            module.masked_key_indices = None
            built.forward_hook(module, args, {**kwargs, "past_key_values": caches[key]}, output)
            masked[key][i] = getattr(module, "masked_key_indices", None)
        module.masked_key_indices = None
        return output

    for layer in layers:
        layer.self_attn.rotary_emb = model.model.rotary_emb  # as a press's __call__ sets it
    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers]
    full_cache = DynamicCache()
    try:
        with torch.no_grad():
            last = model(input_ids=ids[:, :length], past_key_values=full_cache, logits_to_keep=1).logits[0, -1:]
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        out = {"full": _continue(model, full_cache, ids, length, [None] * len(layers), last)}
        for key in presses:
            kept = [_kept(m, gathered[key].get(i), caches[key].layers[i], length,
                          full_cache.layers[i].keys[:, :, :length])
                    for i, m in enumerate(masked[key])]
            out[key] = (kept, _continue(model, caches[key], ids, length, masked[key], last))
    return out


def given_filters(built, path: str) -> None:
    """A ``QFilterPress`` with the filters of ``path`` ([layers, Hkv, d], the authors' orientation) instead of
    the published ones it downloads (none exist for the models compared here, and nothing is downloaded)."""
    import torch

    built.q_filters = torch.load(path)
    built.post_init_from_model = lambda model: None


def given_head_scores(path: str) -> None:
    """kvpress's on-the-fly DuoAttention head scores (computed on BookSum, a download) replaced by
    those of ``path`` ([layers, Hkv], restkv's on the essays); ``DuoAttentionPress`` makes its
    streaming heads from them with its own code."""
    import torch
    from kvpress.presses import duo_attention_press

    scores = torch.load(path).numpy()
    duo_attention_press.duo_attention_on_the_fly = lambda model, *args, **kwargs: scores


def given_stats(built, path: str) -> None:
    """An ``ExpectedAttentionStatsPress`` reading the statistics folder ``path`` (kvpress's
    ``stats_folder``) instead of the hub's (published for other models; nothing is downloaded)."""
    built.stats_folder = path
def given_kvzap(built, path: str) -> None:
    """A ``KVzapPress`` with the weights of ``path`` (``KVzapModel``'s state dict, trained here by
    ``restkv.integration.trained``) instead of NVIDIA's published ones it downloads (none exist for the
    models compared here)."""
    import torch
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

    state = torch.load(path)
    mlp = "layers.0.0.weight" in state
    first, last = (state["layers.0.0.weight"], state["layers.0.2.weight"]) if mlp else (state["layers.0.weight"],) * 2
    layers = 1 + max(int(name.split(".")[1]) for name in state)
    config = KVzapConfig(input_dim=first.shape[1], output_dim=last.shape[0], n_modules=layers,
                         hidden_dim=first.shape[0] if mlp else None)
    model = KVzapModel(config)
    model.load_state_dict(state)
    built.kvzap_model = model.eval()
    built.post_init_from_model = lambda model: None


def given_curve(built, path: str) -> None:
    """An ``LUKVPress`` with the budget curve of ``path`` (.npy [99, layers, KV heads]) instead of the one it
    downloads (published for Llama-3.1-8B only): its ``post_init_from_model`` loads none when one is set."""
    import numpy as np

    built._budget_curves = np.load(path, allow_pickle=False)


def given_gates(built, path: str) -> None:
    """A ``FastKVzipPress`` with the gates of ``path`` (the authors' format, trained here) instead of the
    published ones it downloads (none exist for the models compared here)."""
    import torch
    from kvpress.presses.fastkvzip_press import FastKVzipGate

    gates = []
    for i, w in enumerate(torch.load(path)["module"]):
        hkv, _, sinks, o = w["k_base"].shape
        gate = FastKVzipGate(i, w["q_proj.weight"].shape[1], hkv, w["b"].shape[-1], torch.float32, o, sinks)
        gate.load_state_dict(w)
        gates.append(gate.eval())
    built.gates = gates


def load_model(path: str):
    """The checkpoint in float32 with sdpa, as restkv loads it.

    restkv writes it with transformers 5, whose config holds RoPE's base in ``rope_parameters``; transformers
    4 reads only ``rope_theta`` and ``rope_scaling`` and would silently use its default base (10000, where
    SmolLM2's is 100000), so they are set from ``rope_parameters`` there.
    """
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    rope = getattr(config, "rope_parameters", None)
    if int(transformers.__version__.split(".")[0]) < 5 and isinstance(rope, dict):
        config.rope_theta = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            config.rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def kvpress_model_child(job: dict) -> dict:
    """Every sample with the full cache and under each press; one file per (press, sample) in ``job["out"]``.

    Presses with hooks of their own (a custom ``__call__``, as KVzip) or random draws (``UNSEEDED``) get one
    prefill each, the others share one (``run_shared``). That sharing is checked first: on the first sample's
    first ``check`` tokens, every shared press must give what its own prefill gives, bit for bit. Returns the
    check's result.
    """
    import torch

    torch.set_num_threads(job["threads"])
    model = load_model(job["model"])
    classes, out, length = _kvpress_classes(), Path(job["out"]), job["length"]
    own = {key for key, spec in job["presses"].items()
           if type(build_press(spec, classes, job["ratio"])).__call__ is not classes["BasePress"].__call__
           or press_classes(spec) & UNSEEDED}

    def build(keys):
        built = {key: build_press(job["presses"][key], classes, job["ratio"]) for key in keys}
        for press_ in built.values():
            if isinstance(press_, classes["QFilterPress"]):
                given_filters(press_, job["q_filters"])
            if isinstance(press_, classes["ExpectedAttentionStatsPress"]):
                given_stats(press_, job["query_stats"])
            if isinstance(press_, classes["DuoAttentionPress"]):
                given_head_scores(job["duo_head_scores"])
            if isinstance(press_, classes["KVzapPress"]):
                given_kvzap(press_, job["kvzap"])
            if isinstance(press_, classes["FastKVzipPress"]):
                given_gates(press_, job["fastkvzip"])
            if isinstance(press_, classes["LUKVPress"]):
                given_curve(press_, job["lukv_curve"])
        return built

    shared = [key for key in job["presses"] if key not in own]
    ids = torch.tensor(job["samples"][0][: job["check"] + job["continuation"]])[None]
    together = run_shared(model, ids, job["check"], build(shared))
    for key, built in build(shared).items():
        kept, logprobs = run_each(model, ids, job["check"], built)
        same = torch.equal(logprobs, together[key][1]) and all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(kept, together[key][0]))
        if not same:
            raise RuntimeError(f"kvpress: one shared prefill differs from the press's own for {job['presses'][key]}")
    for s, sample in enumerate(job["samples"]):
        ids = torch.tensor(sample)[None]
        results = run_shared(model, ids, length, build(shared))
        torch.save({"logprobs": results.pop("full")}, out / f"full-{s}.pt")
        for key, built in build(own).items():
            torch.manual_seed(0)
            results[key] = run_each(model, ids, length, built)
        for key, (kept, logprobs) in results.items():
            torch.save({"kept": kept, "logprobs": logprobs}, out / f"{key}-{s}.pt")
        print(f"kvpress: sample {s + 1}/{len(job['samples'])} done", file=sys.stderr, flush=True)
    return {"checked": shared, "check_tokens": job["check"]}


def kvpress_step_child(job: dict) -> list:
    """``press.compress`` per press on one random Llama-3-8B-shaped layer: time or peak memory."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    from compress_step import D, HIDDEN, HKV, HQ, time_and_peak

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dt, n = getattr(torch, job["dtype"]), job["length"]
    config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D,
                         num_hidden_layers=1, max_position_embeddings=n + 1024, rope_theta=500000.0)
    config._attn_implementation = "sdpa"
    module = LlamaAttention(config, layer_idx=0).to(dt).eval()
    module.rotary_emb = LlamaRotaryEmbedding(config)  # as a press's __call__ sets it
    hidden = torch.randn(1, n, HIDDEN, dtype=dt)
    keys, values = torch.randn(1, HKV, n, D, dtype=dt), torch.randn(1, HKV, n, D, dtype=dt)
    cos, sin = module.rotary_emb(hidden, torch.arange(n)[None])
    kwargs = {"hidden_states": hidden, "position_embeddings": (cos.to(dt), sin.to(dt)),
              "cache_position": torch.arange(n)}
    classes = _kvpress_classes()
    calls = []
    for spec in job["presses"]:
        built = build_press(spec, classes, job["ratio"])
        if isinstance(built, classes["QFilterPress"]):  # its cost does not depend on the filters' values
            built.q_filters = torch.randn(1, HKV, D, dtype=dt)
        if isinstance(built, classes["ExpectedAttentionStatsPress"]):  # nor on the statistics
            built.mu = torch.randn(1, HQ, D, dtype=dt)
            built.cov = torch.eye(D, dtype=dt).expand(1, HQ, D, D).contiguous()
        if isinstance(built, classes["DuoAttentionPress"]):  # half the heads streaming
            built.sink_size, built.recent_size = 128, 256
            built.streaming_mask = (torch.arange(HKV) < HKV // 2)[None]
        if isinstance(built, classes["KVzapPress"]):  # nor KVzap's on its weights': a random MLP
            from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

            built.kvzap_model = KVzapModel(KVzapConfig(input_dim=HIDDEN, output_dim=HKV, hidden_dim=512,
                                                       n_modules=1)).to(dt).eval()
        if isinstance(built, classes["LUKVPress"]):  # nor LU-KV's on its curve's values
            built._budget_curves = torch.rand(99, 1, HKV, generator=torch.Generator().manual_seed(0)).numpy()
        if type(built).compress is classes["BasePress"].compress:  # compresses through its own hooks (KVzip, Composed)
            print(f"kvpress step: {describe_press(spec)} has no one-layer compress step", file=sys.stderr)
            calls.append(None)
        else:
            calls.append(lambda p=built: p.compress(module, hidden, keys, values, None, kwargs))
    with torch.no_grad():
        results = iter(time_and_peak([c for c in calls if c], job["reps"], job["memory"], job.get("slow")))
    return [next(results) if c else None for c in calls]


def kvpress_versions(job: dict) -> dict:
    import kvpress  # noqa: F401
    import torch
    import transformers
    from importlib.metadata import version

    return {"kvpress": version("kvpress"), "transformers": transformers.__version__, "torch": torch.__version__,
            "classes": sorted(_kvpress_classes())}


CHILDREN = {"model": kvpress_model_child, "step": kvpress_step_child, "versions": kvpress_versions}


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))  # compress_step.py (-I leaves the script's folder out)
    print(json.dumps(CHILDREN[sys.argv[1]](json.load(sys.stdin))))
