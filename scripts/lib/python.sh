# Sourced by the scripts: PY, the python that runs restkv. $PY when set; else `python` when it has restkv's
# packages (an activated .venv, or an install of your own); else the clone's .venv/bin/python (what `make demo`
# and `make install` set up); else python3.
if [[ -z "${PY:-}" ]]; then
    _clone="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
    if command -v python >/dev/null 2>&1 && python -c 'import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ("torch", "transformers", "restkv")))' >/dev/null 2>&1; then
        PY=python
    elif [[ -x "$_clone/.venv/bin/python" ]]; then
        PY="$_clone/.venv/bin/python"
    else
        PY=python3
    fi
    unset _clone
fi
