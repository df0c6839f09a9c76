"""``restkv.vllm.audit`` on fake modules written to a temporary folder (no vLLM): a parameter that
moved, an attribute gone, a changed source, a module that needs a missing package, bad flags."""

from __future__ import annotations

import hashlib
import importlib
import itertools
import sys
import textwrap

import pytest

from restkv.vllm import audit

_names = itertools.count()

STEP = '''\
@staticmethod_free
def step(self, scheduler_output, dummy_run=False):
    """One step."""
    return scheduler_output
'''

ENGINE = '''\
import dataclasses


def staticmethod_free(f):
    return f


class Runner:
    kind = "gpu"

    def __init__(self, config):
        self.device = "cpu"
        self.rows, self.cols = 1, 2
        if config:
            self.extra: int = 3

    @property
    def model(self):
        return None

{step}

class Special(Runner):
    def __init__(self, config):
        super().__init__(config)
        self.special = True


@dataclasses.dataclass
class Output:
    sampled: list
    index: dict = dataclasses.field(default_factory=dict)


class Slotted:
    __slots__ = ("table",)
'''

KERNEL = '''\
import restkv_no_such_kernel_package


class Impl:
    def forward(self, layer, query, {more}):
        return query
'''


def _write(root, name, step=STEP, more="kv_cache"):
    """Package ``name`` under ``root``: ``engine`` (``Runner.step`` from ``step``), ``kernel`` (a module
    whose import fails, ``Impl.forward`` with the parameters ``more``), ``again`` (``Runner``
    re-exported from ``engine``)."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / "engine.py").write_text(ENGINE.format(step=textwrap.indent(step, "    ")))
    (folder / "kernel.py").write_text(KERNEL.format(more=more))
    (folder / "again.py").write_text("from .engine import Runner  # noqa: F401\n")
    return audit.Tree(root)


@pytest.fixture
def package(tmp_path, monkeypatch):
    """``make(**kw)``: a fresh importable package (``_write``): its name and tree."""
    made = []

    def make(**kw):
        name = f"restkv_fake_vllm{next(_names)}"
        tree = _write(tmp_path / name, name, **kw)
        monkeypatch.syspath_prepend(str(tree.root))
        importlib.invalidate_caches()
        made.append(name)
        return name, tree

    yield make
    for name in made:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]


def _table(name):
    wrap = object()
    return {
        f"{name}.engine": {
            "Runner": {"__init__": (wrap, ("config",)), "step": (wrap, ("scheduler_output", "dummy_run"))}
        },
        f"{name}.kernel": {"Impl": {"forward": (wrap, ("layer", "query", "kv_cache"))}},
        f"{name}.again": {"Runner": {"step": wrap}},
    }


def _report(table, tree, reads=None, **kw):
    lines = []
    optional = {m for m in table if m.endswith(".kernel")}
    present = audit.report(table, reads or {}, optional, tree=tree, versions=kw.pop("versions", {}),
                           out=lines.append, **kw)  # fmt: skip
    return present, lines


def test_every_target_present_reads_ok(package):
    name, tree = package()
    present, lines = _report(_table(name), tree)
    assert present
    rows = [line for line in lines if line.startswith(("  ok", "  MISSING"))]
    assert rows == [
        f"  ok       {name}.engine.Runner.__init__ (config)",
        f"  ok       {name}.engine.Runner.step (scheduler_output, dummy_run)",
        f"  ok       {name}.kernel.Impl.forward (layer, query, kv_cache) (read from source: module "
        + f"{name}.kernel (No module named 'restkv_no_such_kernel_package'))",
        f"  ok       {name}.again.Runner.step",
    ]


def test_a_moved_parameter_is_missing(package):
    """``dummy_run`` moved out of ``step`` (to another function): its line, the status False; the
    same in a module read from its source."""
    moved = STEP.replace("scheduler_output, dummy_run=False", "scheduler_output")
    moved += "\ndef run(self, dummy_run):\n    pass\n"
    name, tree = package(step=moved, more="cache")
    table = _table(name)
    step = next(t for t in audit.targets(table) if t.path == f"{name}.engine.Runner.step")
    assert audit.lacks(step) == f"{name}.engine.Runner.step: no parameter dummy_run"
    present, lines = _report(table, tree)
    assert not present
    assert f"  MISSING  {name}.engine.Runner.step: no parameter dummy_run" in lines
    kernel = f"  MISSING  {name}.kernel.Impl.forward: no parameter kv_cache"
    assert any(line.startswith(kernel) for line in lines)
    assert f"  ok       {name}.again.Runner.step" in lines  # binds nothing by name


def test_a_missing_function_class_or_module(package):
    name, tree = package()
    wrap = object()
    table = {  # Special inherits step: not its own, not wrappable on it
        f"{name}.engine": {"Runner": {"renamed": wrap}, "Gone": {"step": wrap}, "Special": {"step": wrap}},
        f"{name}.removed": {"Runner": {"step": wrap}},
    }
    assert [audit.lacks(t) for t in audit.targets(table)] == [
        f"{name}.engine.Runner.renamed",
        f"{name}.engine.Gone.step",
        f"{name}.engine.Special.step",
        f"module {name}.removed (No module named '{name}.removed')",
    ]
    present, lines = _report(table, tree)
    assert not present and sum(line.startswith("  MISSING") for line in lines) == 4


def test_attributes_of_instances_and_a_missing_one(package):
    """Assigned ``self.x`` (unpacked, annotated, under a branch, in a base class), class attributes,
    properties, dataclass fields without default, slots; ``gone`` is missing."""
    name, tree = package()
    engine = importlib.import_module(f"{name}.engine")
    expected = {"kind", "device", "rows", "cols", "extra", "model", "step", "special"}
    assert expected <= audit.attributes(engine.Special)
    assert {"sampled", "index"} <= audit.attributes(engine.Output)
    assert "table" in audit.attributes(engine.Slotted)
    assert "special" not in audit.attributes(engine.Runner)
    reads = {
        f"{name}.engine.Special": tuple(sorted(expected)) + ("gone",),
        f"{name}.engine.Output": ("sampled", "index"),
        f"{name}.engine.Nothing": ("x",),
        f"{name}.removed.Runner": ("device",),
    }
    assert [audit.lacks_attributes(p, n) for p, n in reads.items()] == [
        f"{name}.engine.Special: no gone",
        None,
        f"{name}.engine has no class Nothing",
        f"module {name}.removed (No module named '{name}.removed')",
    ]
    present, lines = _report({}, tree, reads)
    assert not present
    assert f"  MISSING  {name}.engine.Special: no gone" in lines


def test_a_changed_source_is_moved_and_diffed(package):
    """One line of ``step`` changed: its digest (SHA-256 of the dedented text) differs from the one
    recorded, the re-exported class's too, ``__init__``'s not; the diff shows that line alone."""
    name, tree = package()
    table = _table(name)
    path = f"{name}.engine.Runner.step"
    source = tree.function(f"{name}.engine", "Runner", "step")
    assert source.text == STEP
    assert source.digest == hashlib.sha256(STEP.encode()).hexdigest()[:16]
    engine = ENGINE.format(step=textwrap.indent(STEP, "    ")).splitlines()
    assert source.line == engine.index("    @staticmethod_free") + 1
    assert tree.function(f"{name}.again", "Runner", "step") == source

    record = tree.root / "targets.json"
    audit.record("1.0", audit.read(audit.targets(table), tree), record)
    versions = audit.recorded(record)
    assert versions["1.0"][path] == source.digest
    present, lines = _report(table, tree, versions=versions)
    assert present and f"  same as 1.0: {path} ({name}/engine.py:{source.line})" in lines

    changed = STEP.replace("return scheduler_output", "return scheduler_output[0]")
    other = _write(tree.root.parent / "changed", name, step=changed)
    mine, theirs = source, other.function(f"{name}.engine", "Runner", "step")
    assert audit.moved(path, theirs, versions) == "changed since 1.0"
    init = f"{name}.engine.Runner.__init__"
    same = other.function(f"{name}.engine", "Runner", "__init__")
    assert audit.moved(init, same, versions) == "same as 1.0"
    assert audit.moved(init, None, versions) == "absent"
    assert audit.moved(init, theirs, {"0.9": {}}) == "not recorded"
    lines = audit.diff(path, mine, theirs, "DIR")
    assert [line for line in lines if line[:1] in "+-" and line[:3] not in ("+++", "---")] == [
        "-    return scheduler_output",
        "+    return scheduler_output[0]",
    ]
    assert audit.diff(path, mine, mine, "DIR") == []
    assert audit.diff(path, None, theirs, "DIR") == [f"{path}: only in DIR"]


def test_report_diffs_against_another_tree(package):
    """``against``: the tree of the same package, changed: the diff of each changed target only."""
    name, tree = package()
    changed = STEP.replace("return scheduler_output", "return None")
    other = _write(tree.root.parent / "other", name, step=changed).root
    present, lines = _report(_table(name), tree, against=audit.Tree(other))
    assert present
    at = lines.index(f"against {other}:")
    changes = [line for line in lines[at:] if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    # engine's Runner, and again's (the same class, re-exported)
    assert changes == ["-    return scheduler_output", "+    return None"] * 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--against", "/no/such"], "--against /no/such: no vLLM sources there (no vllm/__init__.py)"),
        (["--record", "0.34.0"], "--record 0.34.0: the installed vLLM is 0.32.0"),
        (["--record"], "argument --record: expected one argument"),
    ],
)
def test_bad_flags_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        audit.parse(argv, "0.32.0")
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"python -m restkv.vllm.audit: {message}\n"


def test_flags(tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    for given in (tmp_path, tmp_path / "vllm"):
        args = audit.parse(["--against", str(given), "--record", "0.32.0"], "0.32.0+cpu")
        assert args.against == audit.Tree(tmp_path.resolve()) and args.record == "0.32.0"
    with pytest.raises(SystemExit):
        audit.parse(["--record", "0.32.0"], None)


def test_digests_recorded_for_every_supported_version():
    from restkv.vllm import SUPPORTED

    versions = audit.recorded()
    assert set(SUPPORTED) <= set(versions)
    assert all(len(digests[v]) == 16 for digests in versions.values() for v in digests)
