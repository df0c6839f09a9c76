"""Per-request knobs in vLLM (``restkv.vllm.per_request``): the engine a request's knobs are checked
against, from vLLM's config (the same numbers in the front end, the scheduler and every worker), and the
front end's check.

- ``InputProcessor._validate_params``: after vLLM's own checks, a request whose ``extra_args['restkv']``
  is bad, or asks for what this engine cannot serve, raises vLLM's ``VLLMValidationError``: the OpenAI
  server answers it with HTTP 400 naming the field, ``LLM.generate`` raises it; the engine never sees
  the request and the others run on.
"""

from __future__ import annotations

import functools

from vllm.exceptions import VLLMValidationError

from .. import per_request, settings
from . import refusals
from .memory import config_model


def engine(vllm_config, cfg) -> per_request.Engine:
    """What requests are checked against in an engine of ``vllm_config`` running ``cfg``."""
    parallel, scheduler = vllm_config.parallel_config, vllm_config.scheduler_config
    return per_request.Engine(
        cfg,
        config_model(vllm_config.model_config, parallel, cache=vllm_config.cache_config),
        scheduler.max_num_seqs,
        vllm_config.model_config.max_model_len,
        scheduler.max_num_batched_tokens,
        vllm_config.cache_config.block_size,
        parallel.tensor_parallel_size,
        refusals.replicated(vllm_config),
    )


def validate_params(orig):
    """``InputProcessor._validate_params``: then the request's restkv knobs, if it gives any."""

    @functools.wraps(orig)
    def wrapped(self, params, *args, **kwargs):
        out = orig(self, params, *args, **kwargs)
        knobs = per_request.knobs_of(getattr(params, "extra_args", None))
        if knobs is None:
            return out
        checked = getattr(self, "_restkv", None)
        if checked is None:
            cfg = settings.from_env(self.vllm_config.additional_config)
            checked = self._restkv = engine(self.vllm_config, cfg)
        try:
            per_request.resolve(checked, knobs)
        except ValueError as e:
            raise VLLMValidationError(str(e), parameter="vllm_xargs.restkv") from None
        return out

    return wrapped
