"""restkv's clone imported as ``restkv``: a script saved beside the clone (``git clone`` names the folder
``restkv``, and Python searches the script's folder first) would otherwise import this folder as an empty
namespace package (``module 'restkv' has no attribute 'load'``). The package proper is the ``restkv/`` folder
inside: imported under the name ``restkv``, this file puts that package in its place."""

if __name__ == "restkv":
    import importlib.util
    import sys
    from pathlib import Path

    _inner = Path(__file__).resolve().parent / "restkv"
    _spec = importlib.util.spec_from_file_location(
        __name__, _inner / "__init__.py", submodule_search_locations=[str(_inner)]
    )
    sys.modules[__name__] = _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
