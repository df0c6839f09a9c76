"""Command-line flags every runner shares, with the original ReST-KV names.

Imports no torch or transformers itself, so a runner can parse and check its arguments before the
heavy imports.
"""

import argparse

# ``--dtype`` choices: the keys of ``restkv.bench.models.DTYPES``.
DTYPE_NAMES = ("bfloat16", "float16", "float32")


def str2bool(text):
    """Parse ``1/0/true/false/yes/no`` (any case) into a bool for argparse."""
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "y", "on"):
        return True
    if value in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (1/0/true/false), got {text!r}")


def add_common_args(parser):
    """Add the flags every runner shares to ``parser`` and return it.

    Eviction knobs default to ``None`` and are then not forwarded, so the
    core's own defaults apply.
    """
    g = parser.add_argument_group("model and methods")
    g.add_argument("--method", nargs="+", default=None,
                   help="one or more methods (space or comma separated), e.g. restkv snapkv fullkv "
                        "(default: restkv, the needle runner restkv snapkv fullkv; none when only --variant is given)")
    g.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "KNOBS"),
                   help="an extra config per budget labelled NAME_<budget>, with KNOBS (knob=value,... over the "
                        "command line's knobs; method restkv unless given), e.g. restkv_paper preset=paper (repeatable)")
    g.add_argument("--model_path", default="smollm2-135m",
                   help="registry name (smollm2-135m, gemma3-270m), local path or hub id")
    g.add_argument("--max_capacity_prompts", nargs="+", type=int, default=[128],
                   help="KV budgets per head and layer; one run per budget")
    g.add_argument("--attn_implementation", default="sdpa")
    g.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    g.add_argument("--device", default="cpu")
    g.add_argument("--batch_size", type=int, default=1)
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--save_dir", default="results")
    g.add_argument("--chat_template", default="auto", choices=("auto", "on", "off"),
                   help="apply the model's chat template (auto: when it has one)")
    g.add_argument("--max_length", type=int, default=None,
                   help="prompt length cap in tokens (default: the model's max context)")
    g.add_argument("--no_sweep", action="store_true",
                   help="one prefill per config (configure + generate) instead of one shared prefill")
    g.add_argument("--device_map", default=None,
                   help="load with this device map (e.g. auto: layers spread over the GPUs, then CPU/disk)")
    g.add_argument("--offload_folder", default=None, help="folder of disk-offloaded weights (--device_map)")
    k = parser.add_argument_group("eviction knobs (unset: the core's defaults)")
    k.add_argument("--window_size", type=int)
    k.add_argument("--kernel_size", type=int)
    k.add_argument("--pooling", choices=("avgpool", "maxpool", "adaptive", "none"))
    k.add_argument("--use_wo", type=str2bool)
    k.add_argument("--use_norm", type=str2bool)
    k.add_argument("--use_ema", type=str2bool)
    k.add_argument("--alpha", type=float)
    k.add_argument("--metric_mode", choices=("before", "after"))
    k.add_argument("--scale", type=float)
    k.add_argument("--tau", type=float)
    k.add_argument("--use_pyramid", type=str2bool)
    k.add_argument("--beta", type=float)
    k.add_argument("--merge", choices=("none", "pivot"))
    k.add_argument("--gqa_agg", choices=("mean", "max", "sum_norm", "rank"))
    k.add_argument("--sink_tokens", type=int)
    k.add_argument("--preset", choices=("paper",), help="named knob set; explicit knobs override it")
    h = parser.add_argument_group("per-head budgets (unset: the core's defaults)")
    h.add_argument("--head_budget", choices=("uniform", "adakv", "headkv"))
    h.add_argument("--floor", type=float, help="AdaKV: least share of the per-head budget")
    h.add_argument("--normalize", type=str2bool, help="AdaKV: weight heads by their top-B mass")
    h.add_argument("--head_importance", help="HeadKV: JSON file of per-layer, per-head scores")
    h.add_argument("--headkv_beta", type=float)
    h.add_argument("--varlen", type=str2bool, help="pack per-head budgets (false: padded, masked layout)")
    q = parser.add_argument_group("KV quantization of the kept entries (unset: full precision)")
    q.add_argument("--quant_method", choices=("quanto", "hqq"))
    q.add_argument("--nbits", type=int)
    q.add_argument("--residual_length", type=int)
    q.add_argument("--q_group_size", type=int)
    return parser


def parse_methods(values):
    """Flatten ``["restkv,snapkv", "fullkv"]`` into ``["restkv", "snapkv", "fullkv"]`` (order kept, no repeats)."""
    out = []
    for value in values:
        for name in str(value).split(","):
            name = name.strip().lower()
            if name and name not in out:
                out.append(name)
    return out


def add_dataset_args(parser):
    """Flags of the dataset runners (LongBench, InfiniteBench): example cap and generation-length override."""
    parser.add_argument("--max_num_examples", type=int, default=None,
                        help="first N records of each dataset only")
    parser.add_argument("--max_new_tokens", type=int, default=None,
                        help="override the official number of new tokens of every dataset")
    return parser
