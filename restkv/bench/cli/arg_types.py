"""The flags' argument types: typed converters (their name shown by ``--help``), booleans, switches."""

import argparse


def typed(convert, name):
    """``convert`` (an argparse ``type``) marked with the type name that ``--help`` shows."""

    def parse(text):
        return convert(text)

    parse.type_name = name
    parse.__name__ = name  # argparse's "invalid float value: 'x'"
    return parse


def str2bool(text):
    """Parse ``1/0/true/false/yes/no`` (any case) into a bool for argparse."""
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "y", "on"):
        return True
    if value in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (1/0/true/false), got {text!r}")


def add_switch(group, *names, help="", **kwargs):
    """A boolean flag as the original's switches: ``--use_wo`` sets it, ``--use_wo false``
    (1/0/true/false) still gives a value. Returns the action."""
    action = group.add_argument(*names, nargs="?", const=True, type=str2bool, help=help, **kwargs)
    action.switch = True
    return action
