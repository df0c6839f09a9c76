"""The plugin's hook table (``restkv.vllm.hooks``) against the installed vLLM's own code: every wrapped
function exists with the parameters its wrapper binds, every attribute the wrappers read exists on
vLLM's classes (``restkv.vllm.audit``'s checks), and what does not exist is refused.

Runs in both supported builds: 0.32.0 (``make vllm-test``) and the CUDA build 0.33.0 (``make
vllm033-test``, where modules that need CUDA at import are read from their source instead).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

vllm = pytest.importorskip("vllm")

from restkv.vllm import SUPPORTED, audit, hooks  # noqa: E402
from restkv.vllm.hooks import refusals  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.quick]


def test_the_installed_vllm_is_one_the_table_was_read_from():
    assert vllm.__version__.split("+")[0] in SUPPORTED


def test_every_target_and_parameter_exists_in_this_vllm():
    assert hooks.unhooked() == []


@pytest.mark.parametrize("backend", sorted(hooks.BACKENDS))
def test_every_backend_forward_binds_in_its_source(backend):
    """Each hooked backend's ``forward``, read from its source (a module that needs its kernel
    package or CUDA to import is read, not imported): the parameters the wrapper binds, in order."""
    module, impl, _ = hooks.BACKENDS[backend]
    forward = audit.Tree.installed().function(module, impl, "forward")
    assert forward is not None, f"{impl} defines no forward"
    _, binds = hooks.TARGETS[module][impl]["forward"]
    assert forward.parameters[1 : 1 + len(binds)] == binds


@pytest.mark.parametrize("path", sorted(hooks.reading()))
def test_every_attribute_the_hooks_read_exists(path):
    assert audit.lacks_attributes(path, hooks.reading()[path]) is None


def test_v2_prepare_attn_returns_the_pair_the_hook_unpacks():
    """``GPUModelRunner.prepare_attn`` (V2) returns (block tables, slot mappings): its annotation and
    its own return statements are pairs (the other path is prefill context parallelism's, which the
    plugin refuses)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    tree = ast.parse(textwrap.dedent(inspect.getsource(GPUModelRunner.prepare_attn)))
    function = tree.body[0]
    annotation = function.returns
    assert isinstance(annotation, ast.Subscript) and len(annotation.slice.elts) == 2
    returns = [n.value for n in ast.walk(function) if isinstance(n, ast.Return)]
    own = [r for r in returns if "pcp_manager" not in ast.unparse(r)]
    assert own and all(isinstance(r, ast.Tuple) and len(r.elts) == 2 for r in own)
    assert len(returns) - len(own) <= 1


def test_a_missing_function_or_parameter_is_listed(monkeypatch):
    """A table entry the installed vLLM lacks (a renamed function, a renamed parameter) comes back
    from ``unhooked()``, one line each."""
    scheduler = "vllm.v1.core.sched.scheduler"
    entry = {**hooks.TARGETS[scheduler]["Scheduler"]}
    entry["schedule_renamed"] = lambda f: f
    entry["update_from_output"] = (entry["update_from_output"][0], ("scheduler_output", "renamed"))
    monkeypatch.setitem(hooks.TARGETS, scheduler, {"Scheduler": entry})
    assert hooks.unhooked() == [
        f"{scheduler}.Scheduler.update_from_output: no parameter renamed",
        f"{scheduler}.Scheduler.schedule_renamed",
    ]


def _engine_config(knobs):
    from vllm.engine.arg_utils import EngineArgs

    from restkv.integration.models import cache_dir

    model = cache_dir("smollm2-135m")
    if not (model / "config.json").is_file():
        pytest.skip(f"the packaged model's folder is needed: {model}")
    args = EngineArgs(
        model=str(model), dtype="float32", max_model_len=1024, enforce_eager=True,
        additional_config={"restkv": knobs}, skip_tokenizer_init=True,
    )  # fmt: skip
    return args.create_engine_config()


def _platform():
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        pytest.skip("vLLM detects no platform here (the CUDA build without a GPU): no engine config")


def test_an_engine_with_an_unhooked_target_is_refused_at_start_up(monkeypatch):
    """``EngineArgs.create_engine_config`` (the first thing ``LLM(...)`` and ``vllm serve`` do) with
    a table entry vLLM lacks: a ValueError naming it, one line; without the plugin's config the
    engine is built."""
    _platform()
    hooks.install()
    scheduler = "vllm.v1.core.sched.scheduler"
    entry = {**hooks.TARGETS[scheduler]["Scheduler"], "schedule_renamed": lambda f: f}
    monkeypatch.setitem(hooks.TARGETS, scheduler, {"Scheduler": entry})
    with pytest.raises(ValueError) as refused:
        _engine_config({"method": "snapkv", "max_capacity_prompt": 128})
    assert str(refused.value) == (
        f"RESTKV_VLLM: vLLM lacks {scheduler}.Scheduler.schedule_renamed, which the plugin wraps"
    )
    monkeypatch.setenv("RESTKV_VLLM", "")
    assert _engine_config(None) is not None


def test_knobs_set_by_the_environment_travel_in_the_engines_config(monkeypatch):
    """``RESTKV_VLLM`` alone: its knobs go into ``additional_config['restkv']``, which vLLM hands every
    process of the engine, so a worker whose environment lacks the variable (a Ray worker on another
    node) runs the same config."""
    import json

    from restkv.vllm import settings

    _platform()
    hooks.install()
    knobs = {"method": "snapkv", "max_capacity_prompt": 128}
    monkeypatch.setenv("RESTKV_VLLM", json.dumps(knobs))
    config = _engine_config(None)
    assert config.additional_config["restkv"] == knobs
    monkeypatch.delenv("RESTKV_VLLM")
    assert settings.from_env(config.additional_config) == settings.from_env({"restkv": knobs})


def test_a_worker_without_the_plugin_stops_the_engine_before_any_request():
    """``EngineCore._initialize_kv_caches``, then every worker's answer (``refusals.worker_config``):
    one that runs no plugin, or other knobs, stops the engine naming it (the scheduler would free
    blocks it still reads)."""
    from types import SimpleNamespace

    from restkv.vllm import settings

    _platform()
    config = _engine_config({"method": "snapkv", "max_capacity_prompt": 128})
    mine = refusals.worker_config(
        SimpleNamespace(model_runner=SimpleNamespace(_restkv=SimpleNamespace(cfg=settings.from_env(config.additional_config))))
    )
    other = refusals.worker_config(
        SimpleNamespace(model_runner=SimpleNamespace(_restkv=SimpleNamespace(cfg=settings.from_env({"restkv": {"method": "snapkv", "max_capacity_prompt": 64}}))))
    )
    assert refusals.worker_config(SimpleNamespace(model_runner=SimpleNamespace())) is None

    def core(*answers):
        return SimpleNamespace(model_executor=SimpleNamespace(collective_rpc=lambda method: list(answers)))

    initialize = refusals.workers_agree(lambda self, vllm_config: "kv cache config")
    assert initialize(core(mine, mine, mine), config) == "kv cache config"
    with pytest.raises(RuntimeError, match="worker 1 of this engine runs without the plugin"):
        initialize(core(mine, None, mine), config)
    with pytest.raises(RuntimeError, match="worker 2 of this engine runs other knobs"):
        initialize(core(mine, mine, other), config)


def test_an_attention_backend_outside_the_table_is_refused(monkeypatch):
    _platform()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    hooks.install()
    config = _engine_config({"method": "snapkv", "max_capacity_prompt": 128})
    config.attention_config.backend = AttentionBackendEnum.FLEX_ATTENTION
    lines = refusals.unreached(config, hooks.BACKENDS)
    assert len(lines) == 1 and lines[0].startswith("attention backend FLEX_ATTENTION is not one the plugin hooks")
    assert "--attention-backend" in lines[0]
    config.attention_config.backend = AttentionBackendEnum.FLASH_ATTN
    assert refusals.unreached(config, hooks.BACKENDS) == []


def test_per_head_attention_metadata_fields_are_checked(monkeypatch):
    """``single_head`` builds vLLM's ``CommonAttentionMetadata`` from its own list of fields: one the
    running vLLM needs and the list lacks, or one it lists that vLLM does not have, is listed (and so
    refused at start-up)."""
    from restkv.vllm.hooks import attention

    fields = attention.COMMON_FIELDS
    monkeypatch.setattr(attention, "COMMON_FIELDS", fields[1:] + ("no_such_field",))
    lines = hooks.unhooked()
    assert any(line.endswith("field query_start_loc") for line in lines)
    assert any(line.endswith("field no_such_field") for line in lines)


def test_kv_connectors_and_offloading_are_refused_at_start_up():
    """A KV connector (``kv_transfer_config``) or KV offloading (``kv_offloading_size``, which installs
    vLLM's offloading connector) with the plugin: refused when the engine's config is made, one line
    naming both flags; without the plugin the same engine is built."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    from restkv.integration.models import cache_dir

    _platform()
    hooks.install()
    connector = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    for extra in ({"kv_offloading_size": 1}, {"kv_transfer_config": connector}):
        args = EngineArgs(
            model=str(cache_dir("smollm2-135m")), dtype="float32", max_model_len=1024, enforce_eager=True,
            skip_tokenizer_init=True, additional_config={"restkv": {"method": "snapkv"}}, **extra,
        )  # fmt: skip
        with pytest.raises(ValueError) as refused:
            args.create_engine_config()
        (line,) = str(refused.value).splitlines()
        assert "KV connector or KV offloading" in line and "--kv-transfer-config, --kv-offloading-size" in line
        args.additional_config = {}
        assert args.create_engine_config() is not None


MODELS = {  # config.json of models the plugin cannot evict -> what its refusal says
    "falcon-alibi": (
        {"model_type": "falcon", "architectures": ["FalconForCausalLM"], "alibi": True, "multi_query": True},
        "ALiBi",
    ),
    "jamba": (
        {"model_type": "jamba", "architectures": ["JambaForCausalLM"], "num_key_value_heads": 2,
         "attn_layer_period": 2, "attn_layer_offset": 1},
        "Mamba or linear-attention state",
    ),
    "llama4-chunked": (
        {"model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"], "num_key_value_heads": 2,
         "attention_chunk_size": 256, "head_dim": 16},
        "chunked-local attention",
    ),
    "deepseek-mla": (
        {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "kv_lora_rank": 32,
         "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
         "num_key_value_heads": 4},
        "latent per token (MLA)",
    ),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_whose_cache_the_plugin_cannot_evict_are_refused(name, tmp_path):
    """vLLM's own ``ModelConfig`` of an ALiBi model (its bias reads each key's index, which eviction
    changes), a Mamba hybrid, chunked-local attention and MLA: ``check_config`` refuses each in one
    line naming the model and what it has."""
    import json

    from vllm.config import ModelConfig

    _platform()
    config = _engine_config({"method": "snapkv", "max_capacity_prompt": 128})
    body, said = MODELS[name]
    sizes = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 128,
             "intermediate_size": 128, "max_position_embeddings": 1024}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({**sizes, **body}))
    config.model_config = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=512)
    with pytest.raises(ValueError) as refused:
        refusals.check_config(config)
    (line,) = str(refused.value).splitlines()
    assert said in line and str(tmp_path) in line


def test_kv_cache_groups_other_than_one_of_full_attention_and_sliding_windows_are_refused():
    """vLLM's own KV cache groups: one group of plain full attention passes, and so do sliding-window groups
    beside it (a hybrid model's: the plugin evicts the full-attention group, wherever it is); a sliding window
    recorded on a full-attention spec (the hybrid manager off), chunked-local attention, MLA,
    cross-attention, Mamba state, no full-attention group or two, are refused one line each."""
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec, CrossAttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
        MambaSpec, MLAAttentionSpec, SlidingWindowSpec,
    )  # fmt: skip

    kw = dict(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32)

    def groups(*specs):
        return KVCacheConfig(1, [], [KVCacheGroupSpec([f"layers.{i}"], s) for i, s in enumerate(specs)])

    full, sliding = FullAttentionSpec(**kw), SlidingWindowSpec(**kw, sliding_window=512)
    assert refusals.cache_groups(groups(full)) == []
    for hybrid, evicted in ((groups(full, sliding, sliding), 0), (groups(sliding, sliding, full), 2)):
        assert refusals.cache_groups(hybrid) == []
        assert refusals.evicted_group(hybrid) == evicted
    others = [
        FullAttentionSpec(**kw, sliding_window=512),
        ChunkedLocalAttentionSpec(**kw, attention_chunk_size=256),
        MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32),
        CrossAttentionSpec(**kw),
        MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,)),
    ]
    for spec in others:
        (line,) = refusals.cache_groups(groups(full, spec))
        assert type(spec).__name__ in line and "neither plain full attention nor a sliding window" in line
        assert line.endswith("the plugin evicts one full-attention group")
    (line,) = refusals.cache_groups(groups(sliding))
    assert "has 0 groups of full attention" in line
    (line,) = refusals.cache_groups(groups(full, sliding, full))
    assert "has 2 groups of full attention" in line


def test_the_extensible_kv_cache_is_refused():
    """vLLM 0.34.0's extensible KV cache (on by default on CUDA) sizes the pool after its warm-up, past the
    plugin's memory the worker takes out of it: ``check_config`` refuses it in one line naming the flag."""
    _platform()
    config = _engine_config({"method": "snapkv", "max_capacity_prompt": 128})
    assert refusals.check_config(config) is not None
    config.cache_config.enable_extensible_kv_cache = True
    with pytest.raises(ValueError) as refused:
        refusals.check_config(config)
    (line,) = str(refused.value).splitlines()
    assert "--no-enable-extensible-kv-cache" in line
