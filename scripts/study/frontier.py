"""The quality-cost frontier of the held-out fidelity study: per model and budget, mean KL to the
full cache against the compression step's cost as a multiple of SnapKV's, every config, the default
marked, the Pareto frontier drawn.

Two steps (``bash scripts/study/frontier_costs.sh`` runs the measurements and the first):

    python scripts/study/frontier.py costs --step results/study/frontier/compress_step.json \\
        --passes results/study/frontier/passes.json --output results/study/frontier/costs.json
    python scripts/study/frontier.py plot --costs docs/frontier_costs.json \\
        --results results/study/fidelity_held_out --models smollm2-135m gemma3-270m --docs docs

Cost of a config (``costs``), in CPU time with one thread, as a multiple of SnapKV's step on the
same layer (``benchmarks/compress_step.py``: one Llama-3-8B-shaped layer):

- ``step``: its compression step on that layer (scoring, budgets, top-B and gather).
- ``global`` (``layer_budget="global"``: the layers share one top-k after the prefill): the same
  per-layer step; the top-k over all layers is not timed, and holding every layer's full cache
  until the prefill ends is memory, not time.
- ``passes`` (the model reads its prompt again after the prefill: KVzip's passes): the step plus
  the per-layer share of the passes, their CPU time (scoring included) over the full-cache
  prefill's on SmolLM2 (``benchmarks/deferred_cost.py``), times the forward of the same layer over
  the prompt (the ``layer_forward`` row of compress_step). The step on that layer scores from the
  window's queries only, so it counts the top-B and the gather of the final selection once more
  and part of the scoring twice (a few x SnapKV, small beside the passes). SmolLM2's scoring is
  a larger share of its forward than a Llama-3-8B layer's, which makes the passes' share an upper
  estimate for an 8B model; ``low_x`` leaves the passes' scoring out (a lower estimate).

Per-model constants computed once (Q-Filters' filters, the query statistics, DuoAttention's head
scores, KVzap's and Fast KVzip's trained weights) are not counted.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "benchmarks"))

from held_out_table import mean_se, split  # noqa: E402

BUDGETS = (128, 256, 512)
DEFAULT = "restkv"


def pareto(points: dict) -> set:
    """``{name: (cost, kl)}`` -> the names no other point dominates (another with cost <= and
    kl <=, one of them strictly lower). Equal points are both kept. O(n log n): a sweep by cost
    that keeps the lowest KL so far."""
    order = sorted(points, key=lambda n: points[n])
    front = set()
    best = math.inf
    i = 0
    while i < len(order):
        cost = points[order[i]][0]
        group = []
        while i < len(order) and points[order[i]][0] == cost:
            group.append(order[i])
            i += 1
        lowest = points[group[0]][1]
        if lowest < best:
            front.update(n for n in group if points[n][1] == lowest)
            best = lowest
    return front


def global_budget(spec: str) -> bool:
    """The config of a compress_step spec shares one top-k across the layers
    (``layer_budget="global"``)."""
    from compress_step import parse_method

    from restkv.config import CompressionConfig

    cfg = CompressionConfig.from_kwargs(
        max_capacity_prompt=512, window_size=32, **parse_method(spec)
    )
    return cfg.get("layer_budget") == "global"


def combine(step: dict, passes: dict) -> dict:
    """compress_step's and deferred_cost's ``--json`` -> the cost of every config (module doc)."""
    rows = {r["name"]: r for r in step["rows"]}
    for needed in ("snapkv", "layer_forward"):
        if needed not in rows:
            raise ValueError(f"--step: no {needed!r} row in the compress_step file")
    snapkv = rows["snapkv"]["cpu"]
    forward = rows["layer_forward"]["cpu"]
    full = passes["rows"]["fullkv"]["prefill_cpu"]
    configs = {}
    for name, r in rows.items():
        if name == "layer_forward":
            continue
        entry = {
            "spec": r["spec"],
            "step_ms": r["cpu"] * 1e3,
            "step_x": r["cpu"] / snapkv,
            "peak_x_kv": r["peak_x_kv"],
            "kind": "step",
            "passes_x": 0.0,
        }
        replay = passes["rows"].get(name)
        if replay is not None and replay["pass_tokens"] > 0:
            share = replay["pass_cpu"] / full
            forward_share = (replay["pass_cpu"] - replay["pass_scoring_cpu"]) / full
            entry["kind"] = "passes"
            entry["pass_share_of_prefill"] = share
            entry["passes_x"] = share * forward / snapkv
            entry["low_x"] = entry["step_x"] + forward_share * forward / snapkv
        elif global_budget(r["spec"]):
            entry["kind"] = "global"
        entry["cost_x"] = entry["step_x"] + entry["passes_x"]
        entry.setdefault("low_x", entry["cost_x"])
        configs[name] = entry
    return {
        "step_settings": step["settings"],
        "pass_settings": passes["settings"],
        "length": rows["snapkv"]["length"],
        "snapkv_step_ms": snapkv * 1e3,
        "layer_forward_x": forward / snapkv,
        "configs": configs,
    }


def load_kl(folder: Path) -> tuple[dict, list]:
    """The held-out files of one model folder (``held_out.json``, then every other
    ``held_out*.json`` by name) -> ({config: {budget: [KL per sample]}}, files read). A config in
    several files keeps its first; every file must be on the same windows (a file still being
    written may hold fewer samples)."""
    table: dict = {}
    starts = None
    read = []
    others = sorted(p for p in folder.glob("held_out*.json") if p.name != "held_out.json")
    for path in [folder / "held_out.json", *others]:
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            print(f"{path}: not read (not valid JSON: still being written?)")
            continue
        if starts is not None and data["starts"] != starts:
            raise ValueError(f"{path}: its windows differ from those of {read[0]}")
        starts = data["starts"]
        read.append(path)
        for label, values in data["kl"].items():
            config, budget = split(label)
            table.setdefault(config, {}).setdefault(budget, values)
    return table, read


def frontier_rows(table: dict, costs: dict) -> tuple[list, list]:
    """-> (rows, names without a cost); a row: ``{"name", "cost", "stats": {budget: (mean, se)},
    "n": {budget: samples}, "on": {budgets where it is on the frontier}}``, by cost."""
    priced = {n: per for n, per in table.items() if n in costs}
    fronts = {}
    for b in BUDGETS:
        points = {
            n: (costs[n]["cost_x"], mean_se(per[b])[0]) for n, per in priced.items() if b in per
        }
        fronts[b] = pareto(points)
    rows = []
    for name, per in sorted(priced.items(), key=lambda kv: costs[kv[0]]["cost_x"]):
        row = {"name": name, "cost": costs[name]["cost_x"], "low": costs[name]["low_x"]}
        row["stats"] = {b: mean_se(per[b]) for b in BUDGETS if b in per}
        row["n"] = {b: len(per[b]) for b in BUDGETS if b in per}
        row["on"] = {b for b in BUDGETS if name in fronts[b]}
        rows.append(row)
    return rows, sorted(set(table) - set(priced))


def draw(rows: list, model: str, path: Path, length: int) -> None:
    """Three panels (one per budget): KL ± s.e. against cost (log-log), every config labelled,
    the default marked, the frontier drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(BUDGETS), figsize=(15, 6.5))
    for ax, b in zip(axes, BUDGETS):
        front = []
        for i, row in enumerate(rows):  # by cost: neighbours' labels go above and below by turns
            if b not in row["stats"]:
                continue
            name = row["name"]
            cost = row["cost"]
            on = row["on"]
            mean, se = row["stats"][b]
            default = name == DEFAULT
            color = "#d62728" if default else ("#1f77b4" if b in on else "#7f7f7f")
            ax.errorbar(
                cost,
                mean,
                yerr=se,
                fmt="*" if default else "o",
                ms=13 if default else 4,
                color=color,
                ecolor=color,
                elinewidth=0.7,
                capsize=1.5,
                zorder=3 if default else 2,
            )
            ax.annotate(
                name,
                (cost, mean),
                xytext=(3, 2 if i % 2 == 0 else -8),
                textcoords="offset points",
                fontsize=6,
                color=color,
                weight="bold" if default else "normal",
            )
            if row["low"] < cost:  # the passes' share without their scoring: a lower estimate
                ax.hlines(mean, row["low"], cost, color=color, lw=0.8, ls=":")
            if b in on:
                front.append((cost, mean))
        front.sort()
        ax.plot(
            [c for c, _ in front],
            [m for _, m in front],
            ls="--",
            lw=0.9,
            color="#1f77b4",
            zorder=1,
            drawstyle="steps-post",
            label="Pareto frontier",
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"B={b}", fontsize=10)
        ax.set_xlabel(
            f"compression-step cost, x SnapKV's (CPU time, one layer, L={length})", fontsize=8
        )
        ax.grid(True, which="both", lw=0.3, alpha=0.5)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("KL(full || evicted), held-out mean ± s.e.", fontsize=8)
    axes[0].legend(fontsize=7, loc="upper right")
    fig.suptitle(
        f"{model}: quality against cost (red star: the default restkv; blue: on the frontier; "
        "dotted: down to the cost without the passes' scoring)",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def markdown(rows: list, costs: dict) -> str:
    """The table of a model: cost, KL ± s.e. at each budget (bold: on the frontier; ``n=``: fewer
    samples than the others), the budgets where it is on the frontier."""
    head = " | ".join(f"KL B={b}" for b in BUDGETS)
    most = max(n for row in rows for n in row["n"].values())
    columns = "| config | cost x SnapKV | of which passes | without their scoring | kind |"
    lines = [
        f"{columns} {head} | on the frontier at |",
        "|---|---|---|---|---|" + "---|" * len(BUDGETS) + "---|",
    ]
    for row in rows:
        name = row["name"]
        cost = row["cost"]
        on = row["on"]
        cells = []
        for b in BUDGETS:
            if b not in row["stats"]:
                cells.append("")
                continue
            text = "{:.4f} ± {:.4f}".format(*row["stats"][b])
            if row["n"][b] < most:
                text += f" (n={row['n'][b]})"
            cells.append(f"**{text}**" if b in on else text)
        label = f"**{name}** (default)" if name == DEFAULT else name
        where = ", ".join(f"B={b}" for b in sorted(on)) or "none"
        passes = costs[name]["passes_x"]
        low = f"{costs[name]['low_x']:.2f}" if costs[name]["kind"] == "passes" else ""
        lines.append(
            f"| {label} | {cost:.2f} | {passes:.2f} | {low} | {costs[name]['kind']} | "
            + " | ".join(cells)
            + f" | {where} |"
        )
    return "\n".join(lines)


def order(rows: list):
    """A sort key putting rows in the order of ``rows`` (by name)."""
    place = {r["name"]: i for i, r in enumerate(rows)}
    return lambda row: place[row["name"]]


def plot(args) -> None:
    costs_file = json.loads(args.costs.read_text())
    costs = costs_file["configs"]
    for model in args.models:
        folder = args.results / model
        if not (folder / "held_out.json").exists():
            print(f"## {model}\n\nskipped: no {folder / 'held_out.json'}\n")
            continue
        table, read = load_kl(folder)
        rows, unpriced = frontier_rows(table, costs)
        png = args.docs / f"frontier_{model}.png"
        draw(rows, model, png, costs_file["length"])
        sizes = sorted({len(v) for per in table.values() for v in per.values()})
        samples = "/".join(str(n) for n in sizes)
        files = ", ".join(p.name for p in read)
        print(f"## {model}\n\n{samples} samples; files: {files}; figure: {png}\n")
        print(markdown(rows, costs))
        low = {n: {**c, "cost_x": c["low_x"]} for n, c in costs.items()}
        changed = [
            f"{r['name']} ({sorted(r['on'])} -> {sorted(q['on'])})"
            for r, q in zip(rows, sorted(frontier_rows(table, low)[0], key=order(rows)))
            if r["on"] != q["on"]
        ]
        print(
            "\nwith the passes' lower cost estimate the frontier "
            + (f"changes: {'; '.join(changed)}" if changed else "is the same")
        )
        if unpriced:
            print(f"\nwithout a cost (not on the axes): {', '.join(unpriced)}")
        print()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("costs", help="combine compress_step's and deferred_cost's --json files")
    c.add_argument("--step", type=Path, required=True)
    c.add_argument("--passes", type=Path, required=True)
    c.add_argument("--output", type=Path, required=True)
    d = sub.add_parser("plot", help="figures and tables per model")
    d.add_argument("--costs", type=Path, required=True)
    d.add_argument("--results", type=Path, default=Path("results/study/fidelity_held_out"))
    d.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    d.add_argument("--docs", type=Path, default=Path("docs"))
    args = p.parse_args(argv)
    if args.command == "costs":
        for flag in ("step", "passes"):
            if not getattr(args, flag).exists():
                raise ValueError(f"--{flag}: {getattr(args, flag)} does not exist")
        out = combine(json.loads(args.step.read_text()), json.loads(args.passes.read_text()))
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(out, indent=1) + "\n")
        for name, entry in sorted(out["configs"].items(), key=lambda kv: kv[1]["cost_x"]):
            print(f"{name}: {entry['cost_x']:.2f} ({entry['kind']})")
        return
    if not args.costs.exists():
        raise ValueError(f"--costs: {args.costs} does not exist")
    plot(args)


if __name__ == "__main__":
    main()
