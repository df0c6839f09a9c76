"""What of the plugin's hook table (``restkv.vllm.hooks``) a vLLM has, and which wrapped sources
moved: ``python -m restkv.vllm.audit [--against DIR] [--record VERSION]`` (``make vllm-audit``) in an
environment with any vLLM installed.

``report`` prints, for every function of ``hooks.TARGETS``, whether the running vLLM has it with the
parameters its wrapper binds (``lacks``: the lines ``hooks.unhooked`` refuses an engine with; a
module that does not import here, an attention backend without its package, is read from its
source instead); for every class of ``hooks.READS``, the attributes its instances lack
(``attributes``); for every target, its source's digest against the digests recorded for each
version in ``targets.json`` (``--record VERSION`` writes the installed version's); with ``--against
DIR`` (an unpacked vLLM source tree or wheel), a unified diff of each target's source between the
installed vLLM and DIR. Exit status 0 when every target and attribute is present, 1 otherwise, 2
(one line) for a bad flag.

Sources are read from files (``Tree``), never imported, so DIR need not import; nothing here imports
vLLM or the hook table (``__main__`` does), so the same checks run on fake modules.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
import textwrap
from pathlib import Path

RECORDED = Path(__file__).resolve().parents[1] / "targets.json"  # version -> target -> digest


@dataclasses.dataclass(frozen=True)
class Target:
    """One wrapped function, ``module.owner.name``, and the parameters its wrapper binds by name."""

    module: str
    owner: str
    name: str
    binds: tuple = ()

    @property
    def path(self) -> str:
        return f"{self.module}.{self.owner}.{self.name}"


def entry(value) -> tuple:
    """(wrapper, parameters it binds) of a table entry: a wrapper, or that pair."""
    return value if isinstance(value, tuple) else (value, ())


def targets(table: dict) -> list[Target]:
    """The table's functions (module -> owner -> {name: entry}), in its order."""
    return [
        Target(module, owner, name, tuple(entry(e)[1]))
        for module, owners in table.items()
        for owner, functions in owners.items()
        for name, e in functions.items()
    ]


def import_error(module: str) -> str | None:
    """Why ``module`` does not import here, in one line, or None."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        return f"module {module} ({e})"
    return None


def lacks(target: Target) -> str | None:
    """What the running Python lacks of ``target``, in one line: its module (``import_error``), the
    function among its owner's own definitions, or parameters the wrapper binds; None if nothing."""
    error = import_error(target.module)
    if error:
        return error
    cls = getattr(sys.modules[target.module], target.owner, None)
    function = None if cls is None else cls.__dict__.get(target.name)
    if function is None:
        return target.path
    absent = [p for p in target.binds if p not in inspect.signature(function).parameters]
    return f"{target.path}: no parameter {', '.join(absent)}" if absent else None


def attributes(cls) -> set:
    """Names an instance of ``cls`` has: class attributes, properties, methods and slots (``dir``),
    dataclass fields, and every ``self.x`` assigned in the source of the class or its bases."""
    names = set(dir(cls))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    for klass in cls.__mro__:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        names |= {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id == "self"
        }  # fmt: skip
    return names


def lacks_attributes(path: str, names) -> str | None:
    """What the class ``path`` (``module.Class``) lacks of the attributes ``names``, in one line
    (its module, the class, the attributes), or None."""
    module, _, owner = path.rpartition(".")
    error = import_error(module)
    if error:
        return error
    cls = getattr(sys.modules[module], owner, None)
    if not isinstance(cls, type):
        return f"{module} has no class {owner}"
    missing = [a for a in names if a not in attributes(cls)]
    return f"{path}: no {', '.join(missing)}" if missing else None


@dataclasses.dataclass(frozen=True)
class Source:
    """A function as its file defines it: the file under the tree's root, its first line (its first
    decorator's), its lines dedented, its parameters."""

    file: str
    line: int
    text: str
    parameters: tuple

    @property
    def digest(self) -> str:
        """The first 16 hex digits of the SHA-256 of ``text``."""
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Tree:
    """The Python sources under ``root``, the folder that holds the ``vllm`` package (site-packages,
    a source checkout, an unpacked wheel), read without importing."""

    root: Path

    @staticmethod
    def installed() -> Tree:
        """The tree of the ``vllm`` the running Python imports."""
        return Tree(Path(importlib.util.find_spec("vllm").origin).parents[1])

    def file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)

    def function(self, module: str, owner: str, name: str, hops: int = 3) -> Source | None:
        """``owner.name`` as ``module``'s file defines it (a class the module imports from another
        followed, ``hops`` times at most), or None."""
        path = self.file(module)
        if path is None or hops < 0:
            return None
        text, tree = _parsed(path)
        cls = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == owner), None)
        if cls is None:
            origin = _imported_from(tree, module, path.name == "__init__.py", owner)
            return origin and self.function(origin, owner, name, hops - 1)
        functions = (ast.FunctionDef, ast.AsyncFunctionDef)
        node = next((n for n in reversed(cls.body) if isinstance(n, functions) and n.name == name), None)
        if node is None:
            return None
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        lines = text.splitlines(keepends=True)[first - 1 : node.end_lineno]
        a = node.args
        parameters = [x.arg for x in a.posonlyargs + a.args + ([a.vararg] if a.vararg else []) + a.kwonlyargs]
        parameters += [a.kwarg.arg] if a.kwarg else []
        file = str(path.relative_to(self.root))
        return Source(file, first, textwrap.dedent("".join(lines)), tuple(parameters))


@functools.lru_cache(maxsize=64)
def _parsed(path: Path) -> tuple:
    """(text, syntax tree) of a file, read once."""
    text = path.read_text()
    return text, ast.parse(text)


def _imported_from(tree: ast.Module, module: str, package: bool, name: str) -> str | None:
    """The module a top-level ``from X import name`` of ``module`` takes ``name`` from, or None."""
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
    node = next((n for n in imports if any(a.name == name and a.asname in (None, name) for a in n.names)),
                None)
    if node is None or not node.level:
        return node and node.module
    parts = module.split(".")
    return ".".join(parts[: len(parts) - node.level + package] + ([node.module] if node.module else []))


def read(wrapped: list[Target], tree: Tree) -> dict:
    """target path -> its ``Source`` in ``tree``, or None."""
    return {t.path: tree.function(t.module, t.owner, t.name) for t in wrapped}


def binds_in_source(source: Source | None, target: Target) -> str | None:
    """What ``source`` lacks of ``target`` (the function, parameters), as ``lacks`` says it."""
    if source is None:
        return target.path
    absent = [p for p in target.binds if p not in source.parameters]
    return f"{target.path}: no parameter {', '.join(absent)}" if absent else None


def recorded(path: Path | None = None) -> dict:
    """version -> target path -> digest, as ``record`` wrote them."""
    path = path or RECORDED
    return json.loads(path.read_text()) if path.is_file() else {}


def record(version: str, sources: dict, path: Path | None = None) -> None:
    """Write the digests of ``sources`` (target path -> Source or None) as ``version``'s."""
    path = path or RECORDED
    versions = recorded(path)
    versions[version] = {t: s.digest for t, s in sources.items() if s is not None}
    path.write_text(json.dumps(versions, indent=1, sort_keys=True) + "\n")


def moved(path: str, source: Source | None, versions: dict) -> str:
    """Whether ``path``'s source equals the one recorded for each version: the versions it equals,
    or that it changed since every version that recorded it."""
    if source is None:
        return "absent"
    same = [v for v, digests in versions.items() if digests.get(path) == source.digest]
    if same:
        return f"same as {', '.join(same)}"
    had = [v for v, digests in versions.items() if path in digests]
    return f"changed since {', '.join(had)}" if had else "not recorded"


def diff(path: str, mine: Source | None, theirs: Source | None, label: str) -> list[str]:
    """Unified diff lines of ``path``'s source, installed to ``label`` (empty when equal)."""
    if mine is None or theirs is None:
        return [] if mine is theirs else [f"{path}: only {'in ' + label if mine is None else 'installed'}"]
    if mine.text == theirs.text:
        return []
    return list(difflib.unified_diff(
        mine.text.splitlines(), theirs.text.splitlines(), lineterm="",
        fromfile=f"installed {mine.file}:{mine.line} {path}",
        tofile=f"{label} {theirs.file}:{theirs.line} {path}",
    ))  # fmt: skip


def report(table: dict, reads: dict, optional=(), other=(), tree: Tree | None = None, versions=None,
           against: Tree | None = None, out=print) -> bool:
    """Print the audit (see the module's docstring) of the running Python's modules and of ``tree``'s
    sources against ``table`` (``hooks.TARGETS``) and ``reads`` (``hooks.READS``): ``optional``, the
    modules that may lack their packages (read from source then); ``other``, lines of further checks
    that failed; ``versions``, the recorded digests. Whether everything is present."""
    tree = tree or Tree.installed()
    wrapped = targets(table)
    sources = read(wrapped, tree)
    present = True
    out(f"targets (the functions the plugin wraps, and the parameters each wrapper binds), in {tree.root}:")
    for t in wrapped:
        line, note = lacks(t), ""
        if line and t.module in optional and line.startswith("module "):
            line, note = binds_in_source(sources[t.path], t), f" (read from source: {line})"
        out(_row(t.path + _parameters(t), line) + note)
        present &= line is None
    out("attributes (what the wrappers read of vLLM's instances):")
    for path, names in reads.items():
        line = lacks_attributes(path, names)
        out(_row(f"{path}: {', '.join(names)}", line))
        present &= line is None
    for line in other:
        out(f"  MISSING  {line}")
        present = False
    versions = recorded() if versions is None else versions
    out(f"sources (digests recorded for {', '.join(versions) or 'no version'}):")
    for t in wrapped:
        where = sources[t.path] and f" ({sources[t.path].file}:{sources[t.path].line})"
        out(f"  {moved(t.path, sources[t.path], versions)}: {t.path}{where or ''}")
    if against is not None:
        out(f"against {against.root}:")
        theirs = read(wrapped, against)
        for t in wrapped:
            for line in diff(t.path, sources[t.path], theirs[t.path], str(against.root)):
                out(line)
    return present


def _row(name: str, lacking: str | None) -> str:
    """``ok`` and ``name``, or ``MISSING`` and what lacks (after ``name``'s path unless it starts with it)."""
    if lacking is None:
        return f"  ok       {name}"
    path = name.split(" ")[0].rstrip(":")
    return f"  MISSING  {lacking if lacking.startswith(path) else f'{path}: {lacking}'}"


def _parameters(target: Target) -> str:
    return f" ({', '.join(target.binds)})" if target.binds else ""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2
        self.exit(2, f"{self.prog}: {message}\n")


def parse(argv, version: str | None) -> argparse.Namespace:
    """The command line, checked before any work (one line and exit status 2 for a bad flag):
    ``--against DIR`` holds a ``vllm`` package (or is one); ``--record`` names ``version``, the
    installed vLLM's (None: no vLLM installed)."""
    p = _Parser(prog="python -m restkv.vllm.audit", description=__doc__.split("\n\n")[0])
    p.add_argument("--against", metavar="DIR", help="an unpacked vLLM source tree or wheel: diff each "
                   "target's source")
    p.add_argument("--record", metavar="VERSION", help=f"write the installed vLLM's digests to {RECORDED}")
    args = p.parse_args(argv)
    if args.against is not None:
        root = Path(args.against)
        root = root.parent if root.name == "vllm" and (root / "__init__.py").is_file() else root
        if not (root / "vllm" / "__init__.py").is_file():
            p.error(f"--against {args.against}: no vLLM sources there (no vllm/__init__.py)")
        args.against = Tree(root.resolve())
    if args.record is not None and args.record != (version or "").split("+")[0]:
        p.error(f"--record {args.record}: the installed vLLM is {version or 'none'}")
    return args
