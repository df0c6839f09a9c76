"""Entry point of the restkv vLLM plugin (the code is ``restkv.vllm``)."""

from __future__ import annotations


def register() -> None:
    from restkv.vllm import register as install

    install()
