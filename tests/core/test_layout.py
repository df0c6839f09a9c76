"""The package layout: stages that import only the stages below them, no import circle, a core free of
the benchmark layer. Every import counts, those inside functions too, so that none can hide a circle."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "restkv"

# Stages, lowest first: a module may import its own stage and the ones before it.
STAGES = (
    ("lazy", "knobs", "compat"),
    ("data", "scoring", "observe"),
    ("methods",),
    ("strategies",),
    ("config",),
    ("cache",),
    ("eviction",),
    ("integration", "vllm", "train"),
    ("bench",),
)
RANK = {name: rank for rank, names in enumerate(STAGES) for name in names}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """The restkv modules ``path`` imports, anywhere in it (absolute names)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("restkv")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("restkv"):
                continue
            for alias in node.names:  # ``from .x import y``: y may be a module of x
                candidate = f"{target}.{alias.name}"
                is_module = (ROOT.parent / candidate.replace(".", "/")).with_suffix(".py").is_file() or (
                    ROOT.parent / candidate.replace(".", "/")).is_dir()
                found.add(candidate if is_module else target)
    return found


def graph() -> dict[str, set[str]]:
    """Every restkv module -> the restkv modules it imports (read once per tree)."""
    return _graph(ROOT)


@functools.lru_cache(maxsize=None)
def _graph(root: Path) -> dict[str, set[str]]:
    return {module_name(p): imported(p) for p in root.rglob("*.py")}


def stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_no_import_circle():
    edges = graph()
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if nxt == "restkv" or nxt not in edges:
                continue
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])


@pytest.mark.parametrize("source", sorted(m for m in graph() if stage(m)))
def test_each_stage_imports_only_the_stages_below(source):
    rank = RANK[stage(source)]
    above = sorted(t for t in graph()[source] if stage(t) and RANK[stage(t)] > rank)
    assert not above, f"{source} imports a later stage: {', '.join(above)}"


def test_the_core_never_imports_the_benchmark_layer():
    offenders = sorted(f"{m} -> {t}" for m, targets in graph().items() for t in targets
                       if stage(t) == "bench" and stage(m) != "bench")
    assert not offenders, offenders


def test_the_stage_list_covers_every_package():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    modules = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    assert packages | modules == set(RANK)


def test_the_checker_sees_a_circle_and_a_function_level_import(tmp_path, monkeypatch):
    fake = tmp_path / "restkv"
    (fake / "cache").mkdir(parents=True)
    (fake / "integration").mkdir()
    (fake / "integration" / "attach.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "cache" / "__init__.py").write_text("")
    (fake / "cache" / "a.py").write_text("from .b import x\n")
    (fake / "cache" / "b.py").write_text("def f():\n    from ..integration import attach\n    from .a import y\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert imported(fake / "cache" / "b.py") == {"restkv.integration.attach", "restkv.cache.a"}
    with pytest.raises(pytest.fail.Exception, match="import circle"):
        test_no_import_circle()
