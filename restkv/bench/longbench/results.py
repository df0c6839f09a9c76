"""Finding prediction files and printing the results table (shared by both evaluators).

Predictions live in ``<root>/.../<task>/<label>.jsonl``; a table row is named
by the folders between ``root`` and the task folder plus the file's stem, e.g.
``smollm2-135m/restkv_128``.
"""

import csv
import os

from ..results import read_jsonl


def find_predictions(root, names):
    """Prediction files under ``root`` whose folder is one of ``names``.

    Returns
    -------
    dict
        ``{row label: {task name: path}}``, rows in sorted order.
    """
    rows = {}
    for folder, _, files in sorted(os.walk(root)):
        task = os.path.basename(folder)
        if task not in names:
            continue
        prefix = os.path.relpath(os.path.dirname(folder), root)
        for name in sorted(files):
            if name.endswith(".jsonl"):
                label = (
                    name[: -len(".jsonl")]
                    if prefix == "."
                    else f"{prefix}/{name[: -len('.jsonl')]}"
                )
                rows.setdefault(label, {})[task] = os.path.join(folder, name)
    return dict(sorted(rows.items()))


def load_predictions(path):
    """Records of a predictions file; a malformed line raises ``ValueError`` with ``path:line``."""
    records = list(read_jsonl(path))
    for i, r in enumerate(records):
        if "pred" not in r or "answers" not in r:
            raise ValueError(f"{path}: record {i + 1} lacks 'pred' or 'answers'")
    return records


def avg_stats(per_cell):
    """``(prompts per cell as "n" or "min-max", standard error of the row's avg)`` of one row, from
    ``{column: [per-prompt scores x 100]}``: the avg is the mean of the column means, so its s.e. is
    ``sqrt(sum se_c^2) / C`` (each column's s.e. from its prompts); None when a column holds a single prompt
    (one prompt has no standard error) or none does."""
    sizes = [len(v) for v in per_cell.values() if v]
    if not sizes:
        return "-", None
    shown = str(min(sizes)) if min(sizes) == max(sizes) else f"{min(sizes)}-{max(sizes)}"
    if min(sizes) < 2:
        return shown, None
    variances = []
    for values in filter(None, per_cell.values()):
        mean = sum(values) / len(values)
        variances.append(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))
    return shown, round((sum(variances) ** 0.5) / len(variances), 2)


def se_text(shown, se) -> str:
    """The printed ``avg s.e.`` of :func:`avg_stats`: ``±1.23``; ``n=1`` for single prompts (no standard error);
    ``-`` for a row with a single prompt in some columns only, or with none."""
    if se is not None:
        return f"±{se}"
    return "n=1" if shown == "1" else "-"


def write_table(rows, columns, csv_path, title=None, extra=(), stats=None, about=None):
    """Print a score table with an ``avg`` column and write it as CSV.

    Parameters
    ----------
    rows : dict
        ``{row label: {column: score or None}}``.
    columns : list of str
        Column order; ``avg`` (mean of the row's present scores) is appended.
    csv_path : str
    title : str, optional
        Printed above the table.
    extra : sequence of str
        Columns placed after ``avg`` and left out of it.
    stats : dict, optional
        ``{row label: {column: [per-prompt scores]}}``: printed as the prompts per cell and the standard error
        of ``avg`` (:func:`avg_stats`); the prompts per cell are the CSV's last column, ``prompts``, too.
    about : str, optional
        What a score is, printed under the title.

    Returns
    -------
    list of list
        The table, header first.
    """
    table = [["label"] + list(columns) + ["avg"] + list(extra)]
    for label, scores in rows.items():
        present = [scores[c] for c in columns if scores.get(c) is not None]
        avg = round(sum(present) / len(present), 2) if present else None
        table.append(
            [label] + [scores.get(c) for c in columns] + [avg] + [scores.get(c) for c in extra]
        )
    cells = [["-" if v is None else str(v) for v in row] for row in table]
    written = table
    if stats is not None:
        cells[0] += ["prompts/cell", "avg s.e."]
        written = [table[0] + ["prompts"]]
        for row, values in zip(cells[1:], table[1:]):
            shown, se = avg_stats(stats.get(row[0], {}))
            row += [shown, se_text(shown, se)]
            written.append(values + [None if shown == "-" else shown])
    os.makedirs(os.path.dirname(os.path.abspath(csv_path)), exist_ok=True)
    with open(csv_path, "w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows([["" if v is None else v for v in row] for row in written])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    if title:
        print(title)
    if about:
        print(about)
    for row in cells:
        print(
            "  ".join(
                v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))
            )
        )
    print(f"table written to {csv_path}")
    return table
