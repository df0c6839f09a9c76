"""A model runner checked once its model and KV cache exist (``check_runner``, ``hooks.covered``): every
wrapper of the table reached along its classes' MRO, every attention layer's backend one the plugin
hooks, read once through its layout; then the worker's layers bound to their backends (``Worker.backends``,
the per-head path's attention and pool of pages). A step in which a layer's attention ran without the
plugin raises later (``restkv.vllm.worker.Worker.end``). Also: vLLM's ``CommonAttentionMetadata`` against
the fields ``attention.single_head`` gives (``metadata_fields``).
"""

from __future__ import annotations

import importlib
import inspect

from .. import paged, settings, startup
from ..heads import Space
from . import attention, refusals


def metadata_fields() -> list[str]:
    """vLLM's ``CommonAttentionMetadata`` as ``attention.single_head`` builds it: every field it needs
    given, every field given known."""
    import dataclasses

    try:
        from vllm.v1.attention.backend import CommonAttentionMetadata
    except ImportError as e:
        return [f"vllm.v1.attention.backend.CommonAttentionMetadata ({e})"]
    fields = dataclasses.fields(CommonAttentionMetadata)
    needed = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    given = set(attention.COMMON_FIELDS)
    wrong = sorted((needed - given) | (given - {f.name for f in fields}))
    return [f"vllm.v1.attention.backend.CommonAttentionMetadata: field {x}" for x in wrong]


def reached(obj, name: str) -> bool:
    """Whether calling ``obj.name`` runs the plugin's wrapper: the first definition along the class's
    MRO that is not an override calling ``super().name`` is the wrapper."""
    for klass in type(obj).__mro__:
        function = klass.__dict__.get(name)
        if function is None:
            continue
        if getattr(function, "_restkv", False):
            return True
        try:
            source = inspect.getsource(function)
        except (OSError, TypeError):
            return False
        if f"super().{name}(" not in source:
            return False
    return False


def check_runner(model_runner, wrapped: list, backends: dict) -> None:
    """Refuse (one line) a model runner the plugin runs in whose path a wrapper does not reach
    (``wrapped``: (owner class, function name, wrapper) of each target, ``hooks.targets()``): a
    runner class or model state that overrides a wrapped function, or an attention layer whose
    backend is not in ``backends`` (``hooks.BACKENDS``); then read each layer's cache through its layout once (a shape
    the layout cannot read is refused here, before any request). Hands the worker each layer's
    backend name (``Worker.backends``) and logs the start-up line (``restkv.vllm.startup``)."""
    worker = getattr(model_runner, "_restkv", None)
    if worker is None:
        if refusals.configured(model_runner.vllm_config):
            raise RuntimeError(
                f"restkv.vllm: vLLM's model runner {type(model_runner).__qualname__} is not one the plugin "
                "hooks (the V1 or V2 GPUModelRunner and their subclasses): unset the plugin's config"
            )
        startup.log(None)
        return
    parts = [model_runner, getattr(model_runner, "model_state", None)]
    for owner, name, _ in wrapped:
        for part in parts:
            if isinstance(part, owner) and not reached(part, name):
                raise RuntimeError(
                    f"restkv.vllm: {type(part).__qualname__}.{name} overrides the function the plugin wraps "
                    f"({owner.__module__}.{owner.__qualname__}.{name}); this model runner is not supported"
                )
    if parts[1] is not None and not any(isinstance(parts[1], o) for o, n, _ in wrapped if n == "prepare_attn"):
        raise RuntimeError(
            f"restkv.vllm: the V2 model runner's model state {type(parts[1]).__qualname__} is not one the "
            "plugin hooks (DefaultModelState)"
        )
    layouts = {}
    for name, (module, impl, layout) in backends.items():
        try:
            layouts[name] = (getattr(importlib.import_module(module), impl), layout)
        except ImportError:
            continue
    group = refusals.evicted_group(model_runner.kv_cache_config)
    worker.leave(group, model_runner.kv_cache_config.kv_cache_groups[group].layer_names)
    worker.backends = {}
    builders: dict = {}  # the per-head path's metadata builders, one per backend and geometry
    layers = refusals.attention_layers(model_runner.vllm_config)
    for layer_name, layer in layers.items():
        backend = next((n for n, (cls, _) in layouts.items() if isinstance(layer.impl, cls)), None)
        if backend is None or not reached(layer.impl, "forward"):
            raise RuntimeError(
                f"restkv.vllm: layer {layer_name}'s attention backend {type(layer.impl).__qualname__} is not one "
                f"the plugin hooks ({', '.join(backends)}): {refusals.BACKEND_FLAG}"
            )
        layouts[backend][1](layer.impl, layer, layer.kv_cache, worker.block_size)
        worker.backends[layer_name] = backend
        if settings.per_head(worker.cfg) and layer_name in worker.layer_index:  # a layer the plugin evicts
            if backend not in attention.HEAD_PAGES:
                raise RuntimeError(
                    f"restkv.vllm: {settings.budget_knobs(worker.cfg)} runs on the "
                    f"{', '.join(attention.HEAD_PAGES)} backends; layer {layer_name} runs {backend} "
                    f"({type(model_runner).__qualname__}): "
                    f"{refusals.HEAD_BACKEND_FLAG}, or uniform budgets"
                )
            try:
                paged.head_pages(layer.kv_cache)
            except ValueError as e:
                raise RuntimeError(f"{e}; {settings.budget_knobs(worker.cfg)} needs VLLM_KV_CACHE_LAYOUT=HND") from None
            worker.attends[layer_name] = attention.single_head(
                layer, model_runner.vllm_config, worker.block_size, model_runner.device, builders
            )
    if settings.per_head(worker.cfg):  # every evicted layer's pages in one pool (``restkv.vllm.heads``)
        evicted = {name: layer for name, layer in layers.items() if name in worker.layer_index}
        tensor, first = paged.whole({name: layer.kv_cache for name, layer in evicted.items()})
        layer = next(iter(evicted.values()))
        worker.space = Space(first, tensor.shape[1])
        worker.whole = layouts[worker.backends[layer.layer_name]][1](layer.impl, layer, tensor, worker.block_size)
    startup.log(worker.cfg, worker.backends.values(), type(model_runner))
