"""The flags every runner shares (model, methods, budgets, backend, folders) and the dataset runners'."""

from ...methods import method_key
from .arg_types import add_switch
from .knob_flags import add_knob_args
from .settings import BACKENDS, DTYPE_NAMES, SETTINGS


def add_common_args(parser):
    """Add the flags every runner shares to ``parser`` and return it.

    Eviction knobs default to ``None`` and are then not forwarded, so the
    core's own defaults apply.
    """
    g = parser.add_argument_group("model and methods")
    g.add_argument(
        "--method",
        nargs="+",
        default=None,
        metavar="METHOD",
        help="one or more methods (space or comma separated), e.g. restkv snapkv fullkv "
        "(default: restkv, the needle runner restkv snapkv fullkv; none when only --variant is given)",
    )
    g.add_argument(
        "--variant",
        nargs=2,
        action="append",
        metavar=("NAME", "KNOBS"),
        help="an extra config per budget labelled NAME_<budget>, with KNOBS (knob=value,... over the "
        "command line's knobs; method restkv unless given), e.g. restkv_paper preset=paper (repeatable)",
    )
    model = g.add_argument(
        "--model_path",
        "--model_name",
        default="smollm2-135m",
        help="registry name (smollm2-135m, gemma3-270m), local path or hub id "
        "(--model_name: the original needle runner's name)",
    )
    model.example = "meta-llama/Llama-3.1-8B-Instruct"
    budgets = g.add_argument(
        "--max_capacity_prompts",
        "--max_capacity_prompt",
        nargs="+",
        type=int,
        help="KV budgets per head and layer (window included); one run per "
        "budget (default: 128, or none with --max_capacity_prompts_ratio)",
    )
    budgets.example = "128 512"
    ratios = g.add_argument(
        "--max_capacity_prompts_ratio",
        nargs="+",
        type=float,
        help="budgets as a fraction of each prompt instead: round(L * ratio) "
        "(window included); one run per ratio, labelled <method>_r<ratio>",
    )
    ratios.example = "0.1 0.2"
    g.add_argument(
        "--attn_implementation",
        default=SETTINGS["attn_implementation"],
        choices=BACKENDS,
        help="attention backend (flash_attention_2: CUDA and the flash-attn package, "
        "pip install -e '.[flash]'); not sdpa: in each label",
    )
    g.add_argument(
        "--dtype",
        default=SETTINGS["dtype"],
        choices=DTYPE_NAMES,
        help="model weights and activations; not float32: in each label",
    )
    g.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda, cuda:N, or auto (cuda when there is one, else cpu with a note)",
    )
    g.add_argument(
        "--batch_size", "--eval_batch_size", type=int, default=1, help="prompts per forward"
    )
    g.add_argument("--seed", type=int, default=42)
    threads = g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads of torch's operators (torch.set_num_threads; default: torch's own, one per core): "
        "1 on a machine other jobs share is often several times faster; scores do not change",
    )
    threads.example = "1"
    g.add_argument(
        "--save_dir", default="results", help="results folder (records of other settings never mix)"
    )
    add_switch(
        g,
        "--use_cache",
        default=True,
        help="the original's flag: decoding always runs on the (evicted) KV cache; only "
        "true is accepted",
    )
    g.add_argument(
        "--chat_template",
        default="auto",
        choices=("auto", "on", "off"),
        help="apply the model's chat template (auto: when it has one)",
    )
    g.add_argument(
        "--max_length",
        type=int,
        default=None,
        help="prompt length cap in tokens (default: the model's max context)",
    )
    g.add_argument(
        "--no_sweep",
        action="store_true",
        help="one prefill per config (configure + generate) instead of one shared prefill",
    )
    g.add_argument(
        "--query_agnostic",
        action="store_true",
        help="compress each prompt's context (the prompt up to where its question starts) without its "
        "question, then read the question and answer on the compressed cache "
        "(restkv.compress_context): a context compressed once serves any question",
    )
    g.add_argument(
        "--device_map",
        default=None,
        help="load with this device map (e.g. auto: layers spread over the GPUs, then CPU/disk)",
    )
    g.add_argument(
        "--offload_folder", default=None, help="folder of disk-offloaded weights (--device_map)"
    )
    add_knob_args(parser)
    return parser


def add_dataset_args(parser):
    """Flags of the dataset runners (LongBench, InfiniteBench): example cap and generation-length override."""
    parser.add_argument(
        "--max_num_examples", type=int, default=None, help="first N records of each dataset only"
    )
    parser.add_argument(
        "--max_new_tokens",
        type=int,
        default=None,
        help="override the official number of new tokens of every dataset",
    )
    return parser


def add_tasks_arg(parser, tasks, note: str = ""):
    """``--tasks``: a subset of a benchmark's ``tasks`` (default: all), ``note`` appended to its help."""
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=tasks,
        choices=tasks,
        metavar="TASK",
        help=f"tasks to run (default: all {len(tasks)}): {' '.join(tasks)}{note}",
    )


def parse_methods(values):
    """Flatten ``["restkv,snapkv", "fullkv"]`` into ``["restkv", "snapkv", "fullkv"]`` (order kept, no
    repeats; the names as ``configure`` reads them: any case, the original's ``full`` for ``fullkv``,
    ``restkv.methods.method_key``)."""
    out = []
    for value in values:
        for name in str(value).split(","):
            name = method_key(name)
            if name and name not in out:
                out.append(name)
    return out
