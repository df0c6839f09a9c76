"""The API reference: ``python docs/api.py DIR`` writes restkv's reference as HTML to DIR (``make docs``: build/api).

pdoc renders the docstrings of ``MODULES``: ``restkv`` (``configure``, ``compressing``, ``kept_positions``,
``detach``, ``load``, ...), ``restkv.methods`` (the registry; its page gains a section listing each method's
knobs, read from their declarations) and ``restkv.vllm.settings`` (the vLLM plugin's configuration). Any
warning of the build is printed and makes the command exit 1.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

MODULES = ("restkv", "restkv.methods", "restkv.vllm.settings")


def knobs_section() -> str:
    """Markdown: each registered method, its registration's defaults and the knobs its score reads."""
    from restkv.methods import REGISTRY

    lines = [
        "# Each method's knobs",
        "",
        "The knobs each method's score reads, with this registration's defaults. Every method also reads the "
        "general knobs and the strategies' (budgets, merging, ranking, decoding): `restkv.knob_table()` lists "
        "every knob.",
    ]
    for name, method in REGISTRY.items():
        lines += ["", f"## `{name}`", "", method.doc.rstrip(".") + "."]
        if method.evicts:
            lines += ["", f"Scorer: `{method.scorer}`."]
        if method.defaults:
            given = ", ".join(f"`{k}={v!r}`" for k, v in method.defaults.items())
            lines += ["", f"Registered with {given}."]
        if method.knobs:
            lines += ["", "| knob | default | values | read when | meaning |", "|---|---|---|---|---|"]
            for k in method.knobs:
                values = " \\| ".join(map(str, k.choices)) if k.choices else (k.rule or k.kind.__name__)
                lines.append(f"| `{k.name}` | `{k.default!r}` | {values} | {k.condition() or 'always'} | {k.help} |")
    return "\n".join(lines)


def modules() -> dict:
    """``MODULES`` as pdoc's ``Module`` documents, by name (imports torch: ``restkv``'s functions load on use)."""
    import importlib

    import pdoc.doc
    import pdoc.render

    restkv = importlib.import_module("restkv")
    for name in restkv.__all__:  # the names ``restkv`` imports on first use
        getattr(restkv, name)
    for name in MODULES:
        importlib.import_module(name)
    pdoc.render.configure(docformat="numpy", search=True, show_source=True)
    found = {name: pdoc.doc.Module.from_name(name) for name in MODULES}
    for module in found.values():  # link only the documented submodules
        module.submodules = [m for m in module.submodules if m.modulename in found]
    registry = found["restkv.methods"]
    registry.docstring = registry.docstring + "\n\n" + knobs_section()
    return found


def build(out: Path) -> list[str]:
    """Write the reference's HTML pages (one per module, ``index.html``, ``search.js``) to ``out``; returns the
    build's warnings (empty: a clean build)."""
    import pdoc.render

    found = modules()  # outside the record: importing torch may warn about torch itself
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out.mkdir(parents=True, exist_ok=True)
        for name, module in found.items():
            page = out / f"{name.replace('.', '/')}.html"
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(pdoc.render.html_module(module, found))
        (out / "index.html").write_text(pdoc.render.html_index(found))
        (out / "search.js").write_text(pdoc.render.search_index(found))
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def main(argv: list[str]) -> int:
    """``python docs/api.py [DIR]`` (default ``build/api``): 1 if the build warned."""
    out = Path(argv[0] if argv else "build/api")
    problems = build(out)
    for line in problems:
        print(line, file=sys.stderr)
    print(f"{out}/index.html" if not problems else f"{len(problems)} warning(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
