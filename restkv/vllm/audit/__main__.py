"""``python -m restkv.vllm.audit``: ``report`` of the installed vLLM against the plugin's hook table
(``restkv.vllm.hooks``), which this imports, and so vLLM."""

from __future__ import annotations

import sys

from . import RECORDED, Tree, parse, read, record, report, targets


def main(argv=None) -> int:
    try:
        import vllm
    except ImportError as e:
        vllm, missing = None, e
    args = parse(argv, vllm and vllm.__version__)
    if vllm is None:
        sys.exit(f"python -m restkv.vllm.audit: no vLLM here ({missing})")
    from .. import hooks

    tree = Tree.installed()
    print(f"vLLM {vllm.__version__}")
    optional = {module for module, _, _ in hooks.BACKENDS.values()}
    table = {module: owners for module, owners in hooks.TARGETS.items() if module not in hooks.absent() - optional}
    other = hooks.metadata_fields()
    present = report(table, hooks.reading(), optional, other, tree, against=args.against)
    if args.record:
        record(args.record, read(targets(hooks.TARGETS), tree))
        print(f"recorded {args.record}'s digests in {RECORDED}")
    return 0 if present else 1


if __name__ == "__main__":
    sys.exit(main())
