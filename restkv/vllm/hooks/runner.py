"""The model runner's side (each tensor-parallel rank), common to both of vLLM's runners (V1:
``vllm.v1.worker.gpu_model_runner``, the CPU backend's and ``VLLM_USE_V2_MODEL_RUNNER=0``; V2:
``vllm.v1.worker.gpu.model_runner``, the CUDA default; each runner's own hooks: ``runner_v1``,
``runner_v2``):

- ``__init__``: the ``Worker``; block-table rows widened for the fresh blocks of a first eviction
  (V1 ``InputBatch.__init__``, V2 ``BlockTables.__init__``);
- ``load_model``: each layer's o_proj, read on its own device;
- ``execute_model``: the step's ``Worker`` visible to the attention layers, its cuts kept for the
  next step (V2: not for its dummy runs);
- ``sample_tokens`` (and ``execute_model`` when it returns the output): what the worker's evictions
  did (``restkv.vllm.outcome``) goes to the scheduler with the step's output (``report``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect

import numpy as np
import torch

from ...strategies.layers import evicted_layers
from .. import outcome, settings
from ..ranks import Ranks
from ..worker import Worker
from . import refusals
from .requests import engine

CURRENT: list = [None]  # the Worker of the step in flight (read by the attention wrapper)
_WIDER: list = [0]  # blocks added to every block-table row (set while a runner is built)


def runner_init(orig):
    @functools.wraps(orig)
    def init(self, vllm_config, *args, **kwargs):
        cfg = settings.from_env(vllm_config.additional_config)
        cache = vllm_config.cache_config
        max_len = vllm_config.model_config.max_model_len
        if cfg is not None:  # in this process too (a tensor-parallel rank's): its tables, before its sizes
            refusals.bind_model(vllm_config, cfg)
        _WIDER[0] = 0 if cfg is None else settings.extra_blocks(cfg, max_len, cache.block_size)
        orig(self, vllm_config, *args, **kwargs)
        caching = bool(cache.enable_prefix_caching)
        self._restkv = None
        if cfg is not None:
            self._restkv = Worker(cfg, self.max_num_reqs, caching, cache.block_size, engine(vllm_config, cfg))

    return init


def widened(argument: str):
    """A wrapper of a constructor whose per-group row widths ``argument`` get ``_WIDER`` more blocks."""

    def wrap(orig):
        signature = inspect.signature(orig)

        @functools.wraps(orig)
        def init(self, *args, **kwargs):
            if not _WIDER[0]:
                return orig(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs)
            bound.arguments[argument] = [n + _WIDER[0] for n in bound.arguments[argument]]
            return orig(*bound.args, **bound.kwargs)

        return init

    return wrap


def load_model(orig):
    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        worker = getattr(self, "_restkv", None)
        if worker is not None and worker.tensor_parallel > 1:
            worker.ranks = tensor_ranks()
        if worker is not None:
            layers = [m.attn for m in self.model.modules() if hasattr(getattr(m, "attn", None), "layer_name")]
            heads = {getattr(a, "num_heads", None) for a in layers}  # this rank's Hq, one for all layers
            model = self.vllm_config.model_config  # a pipeline stage holds some of its layers
            evicted = list(evicted_layers(model.hf_text_config, range(model.get_total_num_hidden_layers())))
            worker.index_layers(o_proj_readers(self.model), heads.pop() if len(heads) == 1 else None, evicted)
        return out

    return wrapped


def tensor_ranks() -> Ranks:
    """This rank among vLLM's tensor-parallel group: the scores gathered over its device group, host
    counts' maxima and the step's outcomes over its CPU group."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()

    def most(values: list) -> list:
        counts = torch.tensor(values, dtype=torch.int64)
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
        return counts.tolist()

    def share(value) -> list:
        every = [None] * group.world_size
        torch.distributed.all_gather_object(every, value, group=group.cpu_group)
        return every

    return Ranks(group.rank_in_group, group.world_size, lambda x: group.all_gather(x.contiguous(), dim=1), most, share)


def o_proj_readers(model) -> dict:
    """{attention layer name: a function returning its o_proj weight W_O [hidden, Hq d] on this
    worker (its own heads' columns), read at each call and not kept: the W_O factor is computed from
    it once (``Worker.index_layers``), a selection that reads the weight itself reads it for its
    step (``restkv.vllm.memory``)}, for the layers the plugin evicts: not a hybrid model's sliding-window
    ones (vLLM's ``Attention.sliding_window``)."""
    readers = {}
    for module in model.modules():
        attn, o_proj = getattr(module, "attn", None), getattr(module, "o_proj", None)
        name = getattr(attn, "layer_name", None)
        if name is not None and getattr(attn, "sliding_window", None) is None:
            readers[name] = None if o_proj is None else functools.partial(o_proj_weight, o_proj)
    return readers


@torch.no_grad()
def o_proj_weight(o_proj) -> torch.Tensor:
    """W_O [hidden, in] of a row-parallel linear layer on this worker: its quantization method's
    product with the identity, without the bias or the reduction over ranks (products with 1 and 0
    are exact), on the layer's device. vLLM's CPU layers drop their dense weight after repacking
    it, and a quantized layer holds none: the product is the weight the layer applies."""
    weight = o_proj.weight
    eye = torch.eye(o_proj.input_size_per_partition, dtype=o_proj.params_dtype, device=weight.device)
    return o_proj.quant_method.apply(o_proj, eye, bias=None).t().contiguous()


def execute_model(orig):
    """Around the original: the step's Worker for the attention layers; then, once the step has
    run, its cuts (``Worker.end``, which raises if a layer's attention ran without the plugin).
    Under pipeline parallelism the earlier stages' outcome comes with the tensors this stage
    receives and its own goes on with those it sends (``relayed``)."""
    signature = inspect.signature(orig)

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        worker = getattr(self, "_restkv", None)
        if worker is None or _dummy(signature, self, args, kwargs):
            return orig(self, *args, **kwargs)
        arguments = signature.bind(self, *args, **kwargs).arguments
        worker.relayed = relayed(arguments.get("intermediate_tensors"))
        CURRENT[0] = worker
        try:
            out = orig(self, *args, **kwargs)
        finally:
            CURRENT[0] = None
        worker.end(arguments["scheduler_output"].total_num_scheduled_tokens)
        if isinstance(getattr(out, "tensors", None), dict):  # a stage before the last: on with its tensors
            if worker.outcome:
                ranks = self.vllm_config.parallel_config.tensor_parallel_size
                out.tensors[outcome.KEY] = outcome.packed(worker.report(), ranks)
            return out
        return report(worker, out)

    return wrapped


def relayed(intermediate):
    """The earlier pipeline stages' ``outcome.Outcome``, taken out of the tensors this stage received
    (vLLM's runner copies each of them into its own buffers), or None."""
    tensors = getattr(intermediate, "tensors", None)
    if not isinstance(tensors, dict) or outcome.KEY not in tensors:
        return None
    return outcome.unpacked(tensors.pop(outcome.KEY))


def sample_tokens(orig):
    """After the original: the step's output carries the kept counts the worker measured."""

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        worker = getattr(self, "_restkv", None)
        return out if worker is None else report(worker, out)

    return wrapped


def report(worker: Worker, out):
    """``out``, a ``ModelRunnerOutput``, with ``restkv``: the worker's ``outcome.Outcome`` since the last
    report (each eviction's counts, which the scheduler checks and frees by, the failed requests, its
    time evicting per method: ``step_output.update_from_output``, ``metrics``); a copy, as vLLM returns
    one shared output for an empty step. Any other output passes."""
    if not worker.outcome or not hasattr(out, "sampled_token_ids"):
        return out
    out = copy.copy(out)
    out.restkv = worker.report()
    return out


def _dummy(signature, runner, args, kwargs) -> bool:
    if "dummy_run" not in signature.parameters:
        return False
    return bool(signature.bind(runner, *args, **kwargs).arguments.get("dummy_run"))


def record_blocks(worker: Worker, scheduler_output, resumed_replace: bool) -> None:
    """The step's block ids into the worker's copy: a new request's, a resumed one's (V1:
    ``resumed_req_ids``) in place of its old ones, a running one's appended; a new request's config
    (``Worker.admit``), a finished one's forgotten."""
    worker.finish(scheduler_output.finished_req_ids)
    g = worker.group
    for new in scheduler_output.scheduled_new_reqs:
        worker.admit(new.req_id, getattr(new.sampling_params, "extra_args", None))
        worker.blocks[new.req_id] = list(new.block_ids[g])
    cached = scheduler_output.scheduled_cached_reqs
    resumed = cached.resumed_req_ids if resumed_replace else ()
    for req_id, ids in zip(cached.req_ids, cached.new_block_ids):
        if req_id in resumed:
            worker.blocks[req_id] = list(ids[g]) if ids is not None else []
        elif ids is not None:
            worker.blocks.setdefault(req_id, []).extend(ids[g])


def build_metadata(orig):
    """``AttentionGroup.build_metadata`` (both runners): a group the plugin leaves alone (a hybrid model's
    sliding window, not ``Worker.group``) gets the logical sequence lengths back (``logical_lengths``); the
    runner's are those of the entries held."""

    @functools.wraps(orig)
    def wrapped(self, common_attn_metadata, *args, **kwargs):
        worker = CURRENT[0]
        if worker is not None and self.kv_cache_group_id != worker.group and worker.request_offsets.any():
            common_attn_metadata = logical_lengths(common_attn_metadata, worker)
        return orig(self, common_attn_metadata, *args, **kwargs)

    return wrapped


def logical_lengths(common, worker: Worker):
    """vLLM's ``CommonAttentionMetadata`` of the held entries' lengths with each request's offset added back:
    its sequence lengths [R] on the device, their CPU bound and the longest (the bound's, else an upper
    bound: the held longest plus the largest offset)."""
    n, offsets = len(worker.request_offsets), worker.request_offsets
    lengths = common.seq_lens.clone()
    lengths[:n] += worker.request_offsets_device.to(lengths.dtype)
    bound = getattr(common, "seq_lens_cpu_upper_bound", None)
    if bound is None:
        return dataclasses.replace(common, seq_lens=lengths, max_seq_len=common.max_seq_len + int(offsets.max()))
    bound = shifted(bound, offsets)
    longest = max(common.max_seq_len, int(bound[:n].max()))
    return dataclasses.replace(common, seq_lens=lengths, seq_lens_cpu_upper_bound=bound, max_seq_len=longest)


def shifted(bound, offsets: np.ndarray):
    """A CPU bound (a tensor or an array over the padded batch) plus the requests' ``offsets``."""
    padded = np.zeros(len(bound), dtype=np.int64)
    padded[: len(offsets)] = offsets
    if isinstance(bound, torch.Tensor):
        return bound + torch.from_numpy(padded).to(bound.dtype)
    return bound + padded.astype(bound.dtype)
