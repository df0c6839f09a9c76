"""The needle sweep's results: a summary table per metric, and the plots."""

import os

from ...lazy import LazyModule

np = LazyModule("numpy")


def summary_table(records, metric="score"):
    """Mean ``metric`` per label (rows) and length (columns), over depths and needles, plus an ``all`` column."""
    lengths = sorted({r["length"] for r in records})
    order = {r["label"]: (r["method"] == "fullkv", r["method"], r["budget"] or 0) for r in records}
    labels = sorted(order, key=order.get)
    width = max([len("method")] + [len(s) for s in labels])
    lines = [f"{'method':<{width}} " + " ".join(f"{L:>7}" for L in lengths) + f" {'all':>7}"]
    for label in labels:
        rows = [r for r in records if r["label"] == label]
        cells = [np.mean([r[metric] for r in rows if r["length"] == L] or [np.nan]) for L in lengths]
        lines.append(f"{label:<{width}} " + " ".join(f"{c:7.3f}" for c in cells)
                     + f" {np.mean([r[metric] for r in rows]):7.3f}")
    return "\n".join(lines)


def show(path, records, plots=True):
    """Print the results file and the summary tables of ``records``; draw the plots beside the file.

    Returns
    -------
    list of str
        The PNGs drawn (none without records or with ``plots`` off).
    """
    print(f"\nresults: {path}")
    if not records:
        return []
    for metric in ("score", "rouge1_f"):
        print(f"\n{metric} (mean over depths and needles)\n{summary_table(records, metric)}")
    if not plots:
        return []
    from visualization.plots import budget_curve, needle_heatmaps  # matplotlib is optional

    out_dir = os.path.dirname(path)
    pngs = needle_heatmaps(records, out_dir) + [budget_curve(records, os.path.join(out_dir, "budget_curve.png"))]
    print("\nplots:\n" + "\n".join(pngs))
    return pngs
