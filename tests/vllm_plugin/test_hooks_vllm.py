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


@pytest.mark.parametrize("path", sorted(hooks.READS))
def test_every_attribute_the_hooks_read_exists(path):
    assert audit.lacks_attributes(path, hooks.READS[path]) is None


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
