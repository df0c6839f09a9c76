"""The README's Python code blocks run as pasted (in order, in one namespace), on the packaged SmolLM2."""

import re

import pytest

from helpers import ROOT


def python_blocks():
    return re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S | re.M)


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
def test_readme_python_blocks_run_verbatim(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    namespace = {"__name__": "__readme__"}
    for i, block in enumerate(python_blocks()):
        exec(compile(block, f"README.md (python block {i + 1})", "exec"), namespace)
    # the Use snippet evicts: a 621-token prompt, 128 entries per KV head kept in every layer
    assert tuple(namespace["input_ids"].shape) == (1, 621)
    assert all(k is not None and tuple(k.shape) == (1, 3, 128) for k in namespace["kept"])
    assert "71" in capsys.readouterr().out
