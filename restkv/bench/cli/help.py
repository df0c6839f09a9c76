"""``--help``: each flag's type and an example value, switches as switches; errors in one line."""

import argparse


def _type_name(action):
    kind = action.type
    if kind is None:
        return "text"
    named = getattr(kind, "type_name", None)
    return named or {int: "int", float: "float", str: "text"}.get(kind, "value")


# Example values for ``--help`` of flags without a default worth showing, by destination.
EXAMPLES = {
    "max_length": "4096",
    "offload_folder": "offload",
    "pruning_ratio": "0.5",
    "head_importance": "heads/Llama-3.1-8B-Instruct.json",
    "tokenizer": "meta-llama/Llama-3.1-8B-Instruct",
    "max_num_examples": "10",
    "max_new_tokens": "64",
    "datasets": "qasper hotpotqa",
    "tasks": "niah_single_1 vt",
    "num_samples": "20",
    "context_length": "4096",
    "haystack_dir": "data/PaulGrahamEssays",
    "needle": "'The secret code is {key}.'",
    "retrieval_question": "'What is the secret code?'",
    "answer": "'{key}'",
    "s_len": "1000",
    "e_len": "32001",
    "step": "200",
    "model_provider": "Mistral",
    "model_version": "Mistral_restkv_128",
    "variant": "restkv_paper preset=paper",
    "device_map": "auto",
    "chunk_size": "8",
}


def _example(action):
    """An example value of ``action``'s flag for ``--help`` (None: no example worth showing)."""
    if getattr(action, "example", None) is not None:
        return action.example
    if action.dest in EXAMPLES:
        return EXAMPLES[action.dest]
    if action.choices:
        return None  # listed by argparse already
    default = action.default
    if default is None or default is argparse.SUPPRESS or isinstance(default, bool):
        return None
    if isinstance(default, (list, tuple)):
        return " ".join(map(str, default)) or None
    return str(default)


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` that shows each flag's type (``--alpha FLOAT``), an example value, and switches as
    switches (``--use_wo``: on when given; a value, ``--use_wo false``, still accepted)."""

    def _get_default_metavar_for_optional(self, action):
        return _type_name(action).upper()

    def _format_args(self, action, default_metavar):
        if getattr(action, "switch", False):
            return "[true|false]"
        return super()._format_args(action, default_metavar)

    def _format_usage(self, usage, actions, groups, prefix):
        return super()._format_usage(usage, actions, groups, prefix).replace(" [true|false]", "")

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.nargs == 0:
            return text
        if getattr(action, "switch", False):
            flag = action.option_strings[0]
            return f"{text} [switch: {flag} turns it on, {flag} false off]".strip()
        if action.choices:
            return text
        example = _example(action)
        kind = _type_name(action)
        flag = next(f for f in action.option_strings if f.startswith("--"))
        tail = f"{kind}, e.g. {flag} {example}" if example is not None else kind
        return f"{text} [{tail}]".strip()


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, its errors one line: ``prog: error: message (see --help)``, exit code 2 (argparse's
    own print the whole usage first: dozens of lines for a runner); ``--help`` by
    :class:`HelpFormatter`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
