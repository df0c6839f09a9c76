"""The API reference (``make docs``, ``docs/api.py``): it builds without a warning, and every public name of
``restkv.__all__`` and of the documented modules has a docstring."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pdoc = pytest.importorskip("pdoc")

API = Path(__file__).resolve().parents[2] / "docs" / "api.py"


@pytest.fixture(scope="module")
def api():
    spec = importlib.util.spec_from_file_location("restkv_api_docs", API)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def public(doc):
    """Every public member of a pdoc module or class document, recursively (``__init__`` aside)."""
    for member in doc.own_members:
        if member.name.startswith("_"):
            continue
        yield member
        if isinstance(member, pdoc.doc.Class):
            yield from public(member)


def listed(name: str, owner) -> bool:
    """A class attribute described in its class's numpy ``Attributes`` or ``Parameters`` section."""
    return isinstance(owner, pdoc.doc.Class) and re.search(rf"^\s*{name} :", owner.docstring, re.M) is not None


def test_the_reference_builds_without_a_warning(api, tmp_path):
    assert api.build(tmp_path) == []
    pages = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.html")}
    assert {"index.html", "restkv.html", "restkv/methods.html", "restkv/vllm/settings.html"} <= pages
    page = (tmp_path / "restkv.html").read_text()
    for name in ("configure", "compressing", "kept_positions", "detach", "load"):
        assert f'id="{name}"' in page, name
    registry = (tmp_path / "restkv" / "methods.html").read_text()
    assert 'id="each-methods-knobs"' in registry and "<td><code>kernel_size</code></td>" in registry


def test_every_public_name_has_a_docstring(api):
    import restkv

    found = api.modules()
    assert set(restkv.__all__) <= {m.name for m in found["restkv"].own_members}
    owners = {}
    for module in found.values():
        for doc in public(module):
            owners[doc.fullname] = doc
    missing = sorted(
        name for name, doc in owners.items()
        if not doc.docstring.strip() and not listed(doc.name, owners.get(name.rsplit(".", 1)[0]))
    )
    assert not missing, f"public names without a docstring: {', '.join(missing)}"


def test_the_knobs_section_lists_every_method_and_its_knobs(api):
    from restkv.methods import REGISTRY

    section = api.knobs_section()
    for name, method in REGISTRY.items():
        assert f"## `{name}`" in section
        for knob in method.knobs:
            assert f"| `{knob.name}` | `{knob.default!r}` |" in section
