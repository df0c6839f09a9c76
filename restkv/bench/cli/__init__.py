"""Command-line flags every runner shares, with the original ReST-KV names.

Imports no torch or transformers itself, so a runner can parse and check its arguments before the
heavy imports. ``arg_types`` (the flags' types), ``help`` (``--help`` and one-line errors), ``flags`` and
``knob_flags`` (the shared flags, one per knob), ``checks`` (before any work), ``settings`` (what a record
depends on besides its knobs); :class:`Runner` puts them together.
"""

import sys

from .arg_types import add_switch, str2bool, typed
from .checks import (
    FLASH_PACKAGES,
    TABULATE,
    check_backend,
    check_common,
    check_save_dir,
    other_results,
    results_dir,
    startup,
)
from ...methods import ALIASES as METHOD_ALIASES  # the original's other method names
from .flags import add_common_args, add_dataset_args, add_tasks_arg, parse_methods
from .help import EXAMPLES, ArgumentParser, HelpFormatter
from .knob_flags import add_knob_args, knob_flags
from .settings import BACKENDS, DTYPE_NAMES, SETTINGS, prompt_settings, run_settings, settings_suffix

__all__ = [
    "BACKENDS", "DTYPE_NAMES", "EXAMPLES", "FLASH_PACKAGES", "METHOD_ALIASES", "SETTINGS", "TABULATE",
    "ArgumentParser", "HelpFormatter", "Runner", "add_common_args", "add_dataset_args", "add_knob_args",
    "add_switch", "add_tasks_arg", "check_backend", "check_common", "check_save_dir", "knob_flags",
    "other_results", "parse_methods", "prompt_settings", "results_dir", "run_settings", "settings_suffix",
    "startup", "str2bool", "typed",
]


class Runner:
    """A runner script: its flags (the ``add`` functions), its checks before any work (``prepare(args) ->
    plan``, see :func:`startup`) and its work (``run(args, plan)``)."""

    def __init__(self, description, adders, prepare, run):
        self.description = description
        self.adders = adders
        self.prepare = prepare
        self.run = run

    def build_parser(self):
        parser = ArgumentParser(description=self.description)
        for add in self.adders:
            add(parser)
        return parser

    def parse_args(self, argv=None):
        return self.build_parser().parse_args(argv)

    def main(self, argv=None):
        """Parse, check (:func:`startup`) and run. Ctrl-C ends the run with one line and exit code 130:
        every finished record is on disk (each is written as it is made), so the same command resumes."""
        parser = self.build_parser()
        args = parser.parse_args(argv)
        try:
            return self.run(args, startup(parser, self.prepare, args))
        except KeyboardInterrupt:
            print("\ninterrupted: rerun the same command to resume", file=sys.stderr)
            raise SystemExit(130) from None
