"""The paper's ablation (Table 3 and appendix Table 12) as ReST-KV knob sets, and its tables.

    python scripts/ablation/table.py variants              # the --variant flags of every row
    python scripts/ablation/table.py longbench results/ablation/longbench/smollm2-135m/results.csv
    python scripts/ablation/table.py fidelity results/ablation/fidelity/smollm2-135m/ablation.json

Rows (one config each, all on the same prompts in one run). Table 3 (the components): ``attention top-k``
(window attention, averaged, no smoothing), ``w/o LOR`` (the attention indicator with ReST-KV's EMA and
adaptive window: no layer-wise output reconstruction), ``w/o EMA`` (reconstruction, mean over the
window), ``w/o AWS`` (reconstruction with the EMA, no spatial smoothing) and ``ReST-KV`` (the published
knobs, ``preset=paper``). The authors' code documents no flag combination for Table 3's rows; these
knob sets are how restkv reads them. Table 12 is the grid of the authors' ``ablation_indicator.sh``
(their ``--method ablation``): the indicator with no smoothing, the temporal smoothing of the
reconstruction indicator with no spatial smoothing, the spatial smoothing with the EMA.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys

P = "preset=paper"
TABLE3 = {  # row: (variant name, knobs)
    "attention top-k": ("abl_attn_topk", f"{P},indicator=attn,temporal=mean,pooling=none"),
    "w/o LOR": ("abl_no_lor", f"{P},indicator=attn"),
    "w/o EMA": ("abl_no_ema", f"{P},temporal=mean"),
    "w/o AWS": ("abl_no_aws", f"{P},pooling=none"),
    "ReST-KV": ("abl_full", P),
}
TABLE12 = {
    "indicator": {
        "random": ("abl_ind_random", f"{P},indicator=random"),
        "attn": ("abl_ind_attn", f"{P},indicator=attn,temporal=mean,pooling=avgpool"),
        "attn-v": ("abl_ind_attnv", f"{P},indicator=attn-v,temporal=mean,pooling=avgpool"),
        "reconstruction": ("abl_ind_recon", f"{P},temporal=last,pooling=none"),
    },
    "temporal (no spatial)": {
        "none (last query)": ("abl_ind_recon", f"{P},temporal=last,pooling=none"),
        "mean": ("abl_ts_mean", f"{P},temporal=mean,pooling=none"),
        "inv-ema": ("abl_ts_invema", f"{P},temporal=inv-ema,pooling=none"),
        "ema": ("abl_no_aws", f"{P},pooling=none"),
    },
    "spatial (with EMA)": {
        "none": ("abl_no_aws", f"{P},pooling=none"),
        "avgpool": ("abl_ss_avgpool", f"{P},pooling=avgpool"),
        "maxpool": ("abl_ss_maxpool", f"{P},pooling=maxpool"),
        "adaptive": ("abl_full", P),
    },
}


def variants() -> dict:
    """Every distinct (variant name -> knobs) of both tables."""
    rows = dict(TABLE3.values())
    for block in TABLE12.values():
        rows.update(dict(block.values()))
    return rows


def variant_flags() -> list[str]:
    return [x for name, knobs in variants().items() for x in ("--variant", name, knobs)]


def _value(scores: dict, name: str, budget: int):
    return scores.get(f"{name}_{budget}")


def render(scores: dict, budget: int, what: str, fmt) -> str:
    """Both tables in the paper's layout; ``scores`` {label: (value, s.e. or None)}."""
    lines = [f"Table 3 ({what}, B={budget})", "", f"| variant | {what} |", "|---|---|"]
    for row, (name, _) in TABLE3.items():
        lines.append(f"| {row} | {fmt(_value(scores, name, budget))} |")
    lines += ["", f"Table 12 ({what}, B={budget})", ""]
    for block, rows in TABLE12.items():
        lines += [f"| {block} | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows),
                  f"| {what} | " + " | ".join(fmt(_value(scores, name, budget)) for name, _ in rows.values()) + " |", ""]
    return "\n".join(lines)


def longbench_scores(path: str) -> dict:
    """{label: (average over the datasets, None)} from eval.py's results.csv."""
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))
    header = rows[0]
    avg = header.index("avg") if "avg" in header else len(header) - 1
    return {r[0]: (float(r[avg]), None) for r in rows[1:] if r[avg] not in ("", "None")}


def fidelity_scores(path: str) -> dict:
    """{label: (mean KL, standard error)} from benchmarks/fidelity.py's --output JSON."""
    kl = json.load(open(path, encoding="utf-8"))["kl"]
    return {label: (statistics.mean(v), statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else None)
            for label, v in kl.items() if v}


def _fmt(decimals: int):
    def fmt(cell):
        if cell is None:
            return "-"
        value, se = cell
        return f"{value:.{decimals}f}" + (f" ± {se:.{decimals}f}" if se is not None else "")
    return fmt


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("variants", "longbench", "fidelity"):
        sys.exit("usage: table.py variants | longbench <results.csv> [budget] | fidelity <file.json> [budget]")
    if argv[0] == "variants":
        print(" ".join(f"'{x}'" if "," in x else x for x in variant_flags()))
        return
    budget = int(argv[2]) if len(argv) > 2 else 128
    if argv[0] == "longbench":
        print(render(longbench_scores(argv[1]), budget, "LongBench average", _fmt(2)))
    else:
        print(render(fidelity_scores(argv[1]), budget, "KL to the full cache", _fmt(4)))


if __name__ == "__main__":
    main()
