"""The run settings a record depends on besides its knobs: the backend and dtype (in every label when not
the default) and the prompt settings a rerun into the same folder must match."""


# ``--dtype`` choices: names of torch dtypes.
DTYPE_NAMES = ("bfloat16", "float16", "float32")
BACKENDS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
# Run settings that change a record, with their defaults: one that differs is in every label.
SETTINGS = {"attn_implementation": "sdpa", "dtype": "float32"}


def run_settings(args):
    """The run settings of ``args`` that change a record (:data:`SETTINGS`): ``{name: value}``."""
    return {name: getattr(args, name, default) for name, default in SETTINGS.items()}


def settings_suffix(args):
    """Label suffix of the settings that differ from their defaults (``-attn_implementation=eager``)."""
    return "".join(f"-{k}={v}" for k, v in run_settings(args).items() if v != SETTINGS[k])


def prompt_settings(args):
    """The settings besides the labels' that change a record of a run with one file per label (what a
    rerun into the same folder must match): chat template, prompt cap, new tokens, template set, questions
    per context."""
    names = ("chat_template", "max_length", "max_new_tokens", "template", "context_length", "max_turns")
    return {name: getattr(args, name) for name in names if hasattr(args, name)}
