"""The KV pool sized without the plugin's own memory: ``determine_available_memory`` of vLLM's GPU
``Worker`` and ``CPUWorker`` (the bytes a worker gives its KV cache), less the plugin's peak
(``restkv.vllm.memory``), which vLLM's profiling run never sees (the run does not evict).

- vLLM sizes the pool from memory (no ``kv_cache_memory_bytes``): the plugin's fixed bytes come off
  what vLLM found, and of the rest the share ``f / (1 + f)`` its per-token terms need (``f``:
  ``memory.fraction``), so the pool and the plugin at its peak fit where the pool alone did. The GPU
  worker's own figures (``available_kv_cache_memory_bytes``, ``peak_activation_memory``, which its
  suggested ``--kv-cache-memory`` and a saved start-up plan read) move with it. The CPU worker counts
  the process's resident memory, which already holds the W_O factors computed when the model loaded:
  those are not taken twice.
- The operator gives ``kv_cache_memory_bytes``: that is the pool's own size, as vLLM documents it
  (activations are not taken from it either), and the operator may have sized it for a number of
  requests; it is kept, and the worker logs the plugin's bytes outside it, for the operator to leave
  free.

Either way the worker's log says, in one line at start-up, the bytes the plugin takes.
"""

from __future__ import annotations

import functools
import logging

from .. import memory, model_sizes

logger = logging.getLogger("vllm.restkv")  # under vLLM's logger: its handler and level


def model_of(worker) -> memory.Model:
    """This rank's sizes from vLLM's config, its pool's element from its cache config."""
    return config_model(worker.model_config, worker.parallel_config, cache=worker.cache_config)


def config_model(config, parallel, cache=None) -> memory.Model:
    """One rank's sizes from vLLM's model, parallel and cache configs: of its layers the sliding-window ones (``model_sizes.layer_kinds``
    of this pipeline stage's), the pool's element (``cache.cache_dtype``; 'auto': the model's dtype)."""
    start, end = config.get_layers_start_end_indices(parallel)
    slides, window = model_sizes.layer_kinds(config.hf_text_config.to_dict())
    sliding = sum(slides[start:end])
    dtype = getattr(cache, "cache_dtype", "auto")
    return memory.Model(
        layers=config.get_num_layers(parallel),
        heads=config.get_num_attention_heads(parallel),
        kv_heads=config.get_num_kv_heads(parallel),
        head_dim=config.get_head_size(),
        hidden=config.get_hidden_size(),
        dtype_bytes=config.dtype.itemsize,
        ranks=parallel.tensor_parallel_size,
        sliding=sliding,
        window=window if sliding else 0,
        cache_bytes=model_sizes.KV_CACHE_DTYPES.get(dtype),
    )


def determine_available_memory(resident: bool):
    """The wrapper; ``resident``: the worker counts the process's resident memory (CPU)."""

    def wrap(orig):
        @functools.wraps(orig)
        def wrapped(self, *args, **kwargs):
            available = orig(self, *args, **kwargs)
            plugin = getattr(self.model_runner, "_restkv", None)
            if plugin is None:
                return available
            model = model_of(self)
            seqs, length = self.scheduler_config.max_num_seqs, self.model_config.max_model_len
            sizes = (seqs, length, self.scheduler_config.max_num_batched_tokens)
            fixed = sum(memory.fixed_bytes(plugin.cfg, model, *sizes, plugin.block_size).values())
            per_token = memory.per_token(plugin.cfg, model)
            if self.cache_config.kv_cache_memory_bytes:
                tokens = available // model.block_bytes(1)  # token slots of the pool's blocks
                logger.info(
                    "restkv: the plugin takes up to %.3f GiB beyond the KV pool of kv_cache_memory_bytes "
                    "(%.3f GiB fixed, %d B per pooled token, max_num_seqs %d, max_model_len %d): leave it free",
                    (fixed + tokens * per_token) / 2**30, fixed / 2**30, per_token, seqs, length,
                )
                return available
            held = sum(f.nbytes for f in plugin.factors.values()) if resident else 0
            reserve = memory.reserved(plugin.cfg, model, *sizes[:2], available, sizes[2], plugin.block_size) - held
            if reserve >= available:
                raise ValueError(
                    f"restkv: the plugin needs {reserve / 2**30:.3f} GiB of the {available / 2**30:.3f} GiB "
                    "vLLM found for the KV cache: lower max_num_seqs (--max-num-seqs) or max_model_len "
                    "(--max-model-len), or raise gpu_memory_utilization (--gpu-memory-utilization)"
                )
            logger.info(
                "restkv: reserved %.3f GiB for the plugin out of the %.3f GiB for the KV cache (%.3f GiB "
                "fixed, %d B per pooled token; max_num_seqs %d, max_model_len %d)",
                reserve / 2**30, available / 2**30, fixed / 2**30, per_token, seqs, length,
            )
            for name, sign in (("available_kv_cache_memory_bytes", -1), ("peak_activation_memory", 1)):
                if isinstance(getattr(self, name, None), (int, float)):
                    setattr(self, name, getattr(self, name) + sign * reserve)
            return available - reserve

        return wrapped

    return wrap
