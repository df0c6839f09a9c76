"""Turn the study's results into a results page (markdown) with paired comparisons.

    python scripts/study/report.py --fidelity results/study/fidelity/* --needle results/study/needle/smollm2-135m \\
        --ruler results/ruler_smollm2_4k/smollm2-135m --plots docs > docs/results.md

Three arms, each a table ``{config: {budget: per-sample values}}`` with the samples in the same order for
every config: fidelity (per-sample KL to the full cache, lower is better; folders of ``fidelity.py``
JSONs), needle (graded pass-key score per needle, higher is better; a needle runner folder) and RULER
(string_match_all x100 per sample, higher is better; a ``run_ruler.py`` model folder).

For every budget: each config's mean with its standard error, and for each ReST-KV variant the paired
difference to the best baseline and to the paper's knobs (same samples, so the sample-to-sample variation
cancels); a difference is called a win/loss only when it exceeds twice its standard error. With
``--plots DIR`` it also draws each arm's metric against the budget (PNG).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from restkv.bench.results import read_jsonl
from restkv.bench.ruler.metrics import METRICS, postprocess
from restkv.bench.ruler.tasks import FAMILIES, family_of


def split_label(label: str) -> tuple[str, int | None]:
    """``"restkv_paper_128"`` -> ``("restkv_paper", 128)``; ``"fullkv"`` -> ``("fullkv", None)``."""
    head = label.split("-", 1)[0]
    name, _, budget = head.rpartition("_")
    return (name, int(budget)) if budget.isdigit() and name else (head, None)


def load_fidelity(folder: Path) -> dict[str, dict[int, list[float]]]:
    """{config: {budget: per-sample KL}} from every JSON in ``folder`` (a plain ``restkv`` label takes
    the file's name)."""
    table = {}
    for path in sorted(folder.glob("*.json")):
        for label, values in json.loads(path.read_text())["kl"].items():
            name, budget = split_label(label)
            own = name == "restkv" and path.stem != "study"  # one file per variant: the file names it
            table.setdefault(path.stem if own else name, {})[budget] = values
    return table


def _paired_table(rows: dict[str, dict[tuple, float]]) -> dict[str, dict[int | None, list[float]]]:
    """{label: {sample key: value}} -> {config: {budget: values}} over the sample keys every label has."""
    keys = sorted(set.intersection(*(set(v) for v in rows.values()))) if rows else []
    table = {}
    for label, values in rows.items():
        name, budget = split_label(label)
        table.setdefault(name, {})[budget] = [values[k] for k in keys]
    return table


def needle_rows(folder: Path) -> dict[str, dict[tuple, float]]:
    """{label: {(needle, length, depth): graded score}} from a needle runner's ``results.jsonl``."""
    rows = {}
    for line in (folder / "results.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows.setdefault(r["label"], {})[(r["needle"], r["length"], r["depth"])] = float(r["score"])
    return rows


def ruler_rows(folder: Path) -> dict[str, dict[tuple, float]]:
    """{label: {(length, task, index): string_match_all x100}} from a ``run_ruler.py`` model folder."""
    rows = {}
    for path in sorted(folder.rglob("*.jsonl")):
        for r in read_jsonl(path):
            metric = METRICS[FAMILIES[family_of(r["task"])]["metric"]]
            rows.setdefault(r["method"], {})[(r["max_seq_length"], r["task"], r["index"])] = (
                100.0 * metric(postprocess(r["pred"]), r["outputs"]))
    return rows


def load_needle(folder: Path) -> dict[str, dict[int | None, list[float]]]:
    """{config: {budget: graded score per needle}} from a needle runner's ``results.jsonl``."""
    return _paired_table(needle_rows(folder))


def load_ruler(folder: Path) -> dict[str, dict[int | None, list[float]]]:
    """{config: {budget: string_match_all x100 per sample}} from a ``run_ruler.py`` model folder."""
    return _paired_table(ruler_rows(folder))


def degradation(title: str, aware: dict, agnostic: dict, digits: int) -> str:
    """Markdown: per config and budget, the score with the question inside the compressed prompt, read
    after compression, and the paired change (agnostic - aware) over the samples every label of both has."""
    labels = sorted(set(aware) & set(agnostic))
    keys = sorted(set.intersection(*(set(aware[lb]) & set(agnostic[lb]) for lb in labels))) if labels else []
    by_name = {}
    for lb in labels:
        name, budget = split_label(lb)
        by_name.setdefault(name, {})[budget] = ([aware[lb][k] for k in keys], [agnostic[lb][k] for k in keys])
    budgets = sorted({b for per in by_name.values() for b in per if b is not None})
    lines = [f"### {title} ({len(keys)} samples, each config on the same ones in both modes)", "",
             "Question inside the compressed prompt -> read after compression (mean); the paired change, bold "
             "when beyond 2 s.e.:", "", "| config | " + " | ".join(f"B={b}" for b in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    order = sorted(by_name, key=lambda n: (n != "fullkv", not n.startswith("restkv"), n))
    for name in order:
        cells = []
        for b in budgets:
            pair = by_name[name].get(None if None in by_name[name] else b)
            if pair is None:
                cells.append("")
                continue
            before, after = pair
            m, se = mean_se([y - x for x, y in zip(before, after)])
            change = f"{m:+.{digits}f} ± {se:.{digits}f}"
            change = f"**{change}**" if abs(m) > 2 * se and round(m, digits) != 0 else change
            cells.append(f"{mean_se(before)[0]:.{digits}f} -> {mean_se(after)[0]:.{digits}f} ({change})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def mean_se(values) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return float(t.mean()), float(t.std() / math.sqrt(len(t))) if len(t) > 1 else float("nan")


def report(title: str, table: dict, lower_is_better: bool, digits: int = 4) -> str:
    """Markdown: the table of means ± s.e. and the paired differences of every ReST-KV variant."""
    budgets = sorted(b for b in {b for per in table.values() for b in per} if b is not None)
    baselines = [n for n in table if not n.startswith("restkv") and n != "fullkv"]
    samples = sorted({len(v) for per in table.values() for v in per.values()})
    fmt = f"%.{digits}f ± %.{digits}f"
    lines = [f"### {title} ({'/'.join(map(str, samples))} samples, "
             f"{'lower' if lower_is_better else 'higher'} is better)", "",
             "| config | " + " | ".join(f"B={b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for name in sorted(table, key=lambda n: (n != "fullkv", not n.startswith("restkv"), n)):
        if None in table[name]:  # the full cache: one value for every budget
            lines.append(f"| {name} | " + " | ".join([fmt % mean_se(table[name][None])] * len(budgets)) + " |")
            continue
        cells = [(fmt % mean_se(table[name][b])) if b in table[name] else "" for b in budgets]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    def best_baseline(b):
        present = [n for n in baselines if b in table[n]]
        best = min if lower_is_better else max
        return best(present, key=lambda n: mean_se(table[n][b])[0]) if present else None

    lines += standing(table, budgets, lower_is_better, digits)
    better = "negative: the variant is closer to the full cache" if lower_is_better else "positive: the variant scores higher"
    lines += paired(table, budgets, best_baseline, "the best baseline at each budget", better, digits)
    if "restkv_paper" in table:
        lines += paired(table, budgets, lambda b: "restkv_paper", "ReST-KV with the paper's knobs", better, digits)
    if "restkv" in table and len([n for n in table if n.startswith("restkv")]) > 2:
        lines += paired(table, budgets, lambda b: "restkv", "the default ReST-KV", better, digits)
    return "\n".join(lines) + "\n"


def standing(table, budgets, lower_is_better: bool, digits: int) -> list[str]:
    """Per budget: the rank of the default ``restkv`` and of ``restkv_paper`` among every config, and the
    three best configs."""
    lines = ["", "Where ReST-KV stands (rank among all configs by mean, equal means sharing one; differences within the noise are not ties here):", "",
             "| budget | configs | `restkv` rank | `restkv_paper` rank | best three |", "|---|---|---|---|---|"]
    for b in budgets:
        present = sorted((n for n in table if b in table[n]), key=lambda n: mean_se(table[n][b])[0],
                         reverse=not lower_is_better)
        mean = {n: mean_se(table[n][b])[0] for n in present}
        ahead = (lambda x, y: x < y) if lower_is_better else (lambda x, y: x > y)
        rank = {n: 1 + sum(ahead(mean[o], mean[n]) for o in present) if n in present else ""
                for n in ("restkv", "restkv_paper")}  # equal means share a rank
        best = ", ".join(f"{n} {mean_se(table[n][b])[0]:.{digits}f}" for n in present[:3])
        lines.append(f"| {b} | {len(present)} | {rank['restkv']} | {rank['restkv_paper']} | {best} |")
    return lines


def paired(table, budgets, reference, what: str, better: str, digits: int) -> list[str]:
    """Rows of paired differences (same samples) of every ReST-KV variant to ``reference(budget)``."""
    lines = ["", f"Paired difference to {what} ({better}; bold when |diff| > 2 s.e.):", "",
             "| variant | " + " | ".join(f"B={b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for name in sorted(n for n in table if n.startswith("restkv")):
        cells = []
        for b in budgets:
            ref = reference(b)
            if b not in table[name] or ref is None or b not in table[ref] or ref == name:
                cells.append("")
                continue
            mine, theirs = table[name][b], table[ref][b]
            n = min(len(mine), len(theirs))  # sample i is the same text in every file of a folder (one seed)
            m, se = mean_se((torch.tensor(mine[:n]) - torch.tensor(theirs[:n])).tolist())
            text = f"{m:+.{digits}f} ± {se:.{digits}f} vs {ref}" + (f" (first {n})" if n < max(len(mine), len(theirs)) else "")
            cells.append(f"**{text}**" if abs(m) > 2 * se and round(m, digits) != 0 else text)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def plot(table: dict, title: str, metric: str, path: Path, log: bool) -> Path:
    """Mean metric vs budget for every config (the full cache as a level), drawn by the needle runner's
    ``budget_curve``, written to ``path``."""
    from visualization.plots import budget_curve  # matplotlib is optional

    records = [{"label": name if budget is None else f"{name}_{budget}", "budget": budget, metric: v}
               for name, per in table.items() for budget, values in per.items() for v in values]
    return Path(budget_curve(records, str(path), metric, ylim=None, log_y=log, title=title))


ARMS = {  # flag: (loader, title, y label, lower is better, digits)
    "fidelity": (load_fidelity, "fidelity, {name}: KL to the full cache", "KL to full cache", True, 4),
    "needle": (load_needle, "needle, {name}: graded pass-key score", "graded score", False, 3),
    "needle_query_agnostic": (load_needle, "needle, {name}, the question read after compression (query-agnostic): "
                              "graded pass-key score", "graded score", False, 3),
    "ruler": (load_ruler, "RULER, {name}: string_match_all x100 over all tasks", "score x100", False, 2),
    "ruler_query_agnostic": (load_ruler, "RULER, {name}, the question read after compression (query-agnostic): "
                             "string_match_all x100 over all tasks", "score x100", False, 2),
}
MODES = {"needle": (needle_rows, "needle", 3), "ruler": (ruler_rows, "RULER", 2)}  # arms run in both modes


def gap_closed(table: dict, ceiling: dict, reference: str = "streamingllm", digits: int = 2) -> str:
    """Markdown: per fidelity config and budget, the share of the gap from ``reference`` to each hindsight
    ceiling it closes, ``(KL_ref - KL_x) / (KL_ref - KL_ceiling)``, from means over the samples both have
    (``ceiling``: benchmarks/ceiling.py's JSON on the same samples; its ``kl`` {row: {budget: [per sample]}})."""
    ceilings = [c for c in ("future_attention", "future_restkv", "future_setlevel") if c in ceiling["kl"]]
    budgets = sorted(b for b in {b for per in table.values() for b in per} if b is not None)
    lines = [f"Share of the {reference}-to-ceiling gap closed (1: as good as the hindsight selection; "
             f"ceilings: {', '.join(ceilings)}, the continuation's own queries choosing):", "",
             "| config | " + " | ".join(f"B={b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for c in ceilings:
        cells = []
        for b in budgets:
            kl = ceiling["kl"][c].get(str(b), ceiling["kl"][c].get(b))
            cells.append("" if kl is None else f"KL {sum(kl) / len(kl):.4f}")
        lines.append(f"| ({c}) | " + " | ".join(cells) + " |")
    for name in sorted(n for n in table if None not in table[n]):
        cells = []
        for b in budgets:
            ref, mine = table.get(reference, {}).get(b), table[name].get(b)
            tops = [ceiling["kl"][c].get(str(b), ceiling["kl"][c].get(b)) for c in ceilings]
            if ref is None or mine is None or any(t is None for t in tops):
                cells.append("")
                continue
            n = min(len(ref), len(mine), *(len(t) for t in tops))
            mean = lambda v: sum(v[:n]) / n  # noqa: E731
            cells.append(" / ".join(f"{(mean(ref) - mean(mine)) / (mean(ref) - mean(t)):.{digits}f}" for t in tops))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for arm in ARMS:
        parser.add_argument(f"--{arm}", nargs="*", default=[], type=Path, help=f"{arm} result folders")
    parser.add_argument("--plots", type=Path, default=None, help="folder for the PNGs")
    parser.add_argument("--ceiling", nargs="*", default=[], type=Path,
                        help="benchmarks/ceiling.py JSONs named <model>.json, beside that model's fidelity arm")
    args = parser.parse_args(argv)
    ceilings = {path.stem: json.loads(path.read_text()) for path in args.ceiling if path.is_file()}
    for arm, (loader, title, ylabel, lower, digits) in ARMS.items():
        for folder in getattr(args, arm):
            try:
                table = loader(folder)
            except FileNotFoundError:
                continue  # an arm not run for this model
            if not table:
                continue
            name = folder.name
            print(report(title.format(name=name), table, lower, digits))
            if arm == "fidelity" and name in ceilings:
                print(gap_closed(table, ceilings[name]))
            if args.plots:
                path = plot(table, title.format(name=name), ylabel, args.plots / f"{arm}_{name}.png", log=lower)
                print(f"![{arm} {name}]({path.name})\n")
    for arm, (rows, what, digits) in MODES.items():
        agnostic = {folder.name: folder for folder in getattr(args, f"{arm}_query_agnostic")}
        for folder in getattr(args, arm):
            if folder.name not in agnostic:
                continue
            try:
                aware, after = rows(folder), rows(agnostic[folder.name])
            except FileNotFoundError:
                continue  # an arm not run in both modes for this model
            if aware and after:
                print(degradation(f"{what}, {folder.name}: what is lost when the question comes after compression",
                                  aware, after, digits))


if __name__ == "__main__":
    main()
