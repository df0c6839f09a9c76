"""The scripts' python (scripts/lib/python.sh): $PY, else a `python` with restkv's packages, else the clone's
.venv/bin/python; and every script runs its python files through it. The top-level runners choose alike
(restkv.lazy.use_restkvs_python)."""

import re
import shutil
import subprocess
import sys

from helpers import ROOT


def chosen(clone, path, **env):
    out = subprocess.run(["bash", "-c", "source scripts/lib/python.sh; echo \"$PY\""], cwd=clone,
                         env={"PATH": path, **env}, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_the_clone_s_venv_when_python_lacks_restkv(tmp_path):
    (tmp_path / "scripts" / "lib").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "lib" / "python.sh", tmp_path / "scripts" / "lib")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "python").symlink_to(shutil.which("python3") or "/usr/bin/python3")  # no torch here
    system = f"{bare}:/usr/bin:/bin"
    assert chosen(tmp_path, system) == "python3"  # no .venv: python3
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    assert chosen(tmp_path, system) == str(venv / "python")
    assert chosen(tmp_path, system, PY="mine") == "mine"
    full = tmp_path / "full"
    full.mkdir()
    (full / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # an environment with restkv
    (full / "python").chmod(0o755)
    assert chosen(tmp_path, f"{full}:/usr/bin:/bin") == "python"


def test_a_runner_started_with_a_python_without_restkvs_packages_uses_the_clones_venv(tmp_path):
    shutil.copy(ROOT / "run_ruler.py", tmp_path)  # a clone: a runner beside the package
    (tmp_path / "restkv").symlink_to(ROOT / "restkv")
    bare = [sys.executable, "-S", "run_ruler.py", "--help"]  # -S: no site-packages, so no torch nor tqdm
    out = subprocess.run(bare, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (2, ""), out.stderr[-2000:]
    (line,) = out.stderr.splitlines()  # no .venv: how to set it up, in one line
    assert line.startswith(f"run_ruler.py: this Python ({sys.executable}) lacks restkv's packages (torch, ")
    assert f"`make install` in {tmp_path} sets up .venv" in line
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # an environment with restkv
    (venv / "python").chmod(0o755)
    out = subprocess.run(bare, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: run_ruler.py"), out.stderr[-2000:]


def test_every_script_runs_python_through_it():
    for script in sorted((ROOT / "scripts").glob("*/*.sh")):
        text = script.read_text()
        bare = [line for line in text.splitlines() if re.match(r"\s*python3? \S", line)]
        assert not bare, (script, bare)
        if '"$PY"' in text and script.parent.name != "lib":
            assert re.search(r"^source .*(lib/python|lib/original|ablation_common)\.sh", text, re.M), script
