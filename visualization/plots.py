"""Plots of the needle sweep and of what eviction keeps.

Every function writes one PNG and returns its path.
"""

import os
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap, LogNorm  # noqa: E402

CMAP = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])


def _save(fig, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _mark_needle(ax, span):
    """Dashed lines at the needle's first and last token, labelled above the axes."""
    if span is not None:
        for x in (span[0] - 0.5, span[1] - 0.5):
            ax.axvline(x, color="#00b4ff", lw=0.9, ls="--")
        ax.annotate("needle", xy=((span[0] + span[1]) / 2, 1.0), xycoords=("data", "axes fraction"),
                    ha="center", va="bottom", fontsize=8, color="#0077cc")


def _depth_length_grid(records, metric, lengths=None, depths=None):
    """``(lengths, depths, grid [depths, lengths])``: the mean ``metric`` of each (depth, length) cell (NaN:
    no record), over ``lengths`` and ``depths`` (default: those of ``records``)."""
    lengths = lengths or sorted({r["length"] for r in records})
    depths = depths or sorted({r["depth"] for r in records})
    cells = defaultdict(list)
    for r in records:
        cells[(r["depth"], r["length"])].append(r[metric])
    grid = np.array([[np.mean(cells[(d, L)]) if cells[(d, L)] else np.nan for L in lengths] for d in depths])
    return lengths, depths, grid


def _draw_grid(ax, lengths, depths, grid, numbers=True):
    """One depth x length image on ``ax`` (score colours in [0, 1]), each cell's mean written in it."""
    im = ax.imshow(grid, cmap=CMAP, vmin=0, vmax=1, aspect="auto")
    if numbers:
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(lengths)), [str(L) for L in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    return im


def depth_length_heatmap(records, path, metric="score", title=None, name=None):
    """Depth (rows) x context length (columns) grid of the mean ``metric`` of ``records`` (``name``: the
    metric's name in the title and colour bar, default ``metric``)."""
    name = name or metric
    lengths, depths, grid = _depth_length_grid(records, metric)
    fig, ax = plt.subplots(figsize=(1.5 + 0.9 * len(lengths), 1.2 + 0.4 * len(depths)))
    im = _draw_grid(ax, lengths, depths, grid)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (%)")
    ax.set_title(title or f"{name}: mean {np.nanmean(grid):.3f}", fontsize=9)
    fig.colorbar(im, ax=ax, label=name)
    return _save(fig, path)


def needle_heatmaps(records, path, metric="score", name=None, order=None, columns=6):
    """Every config's :func:`depth_length_heatmap` side by side in one figure: a row of panels per needle
    (``columns`` panels a row at most; a needle with more configs takes several rows), one colour scale.

    ``order``: the labels' order (default: sorted). Returns ``path``.
    """
    name = name or metric
    labels = list(order) if order is not None else sorted({r["label"] for r in records})
    needles = sorted({r["needle"] for r in records})
    lengths = sorted({r["length"] for r in records})
    depths = sorted({r["depth"] for r in records})
    ncols = max(1, min(columns, len(labels)))
    per_needle = -(-len(labels) // ncols)
    nrows = per_needle * len(needles)
    width, height = 1.0 + 0.7 * len(lengths), 0.9 + 0.32 * len(depths)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols + 1.2, (height + 0.45) * nrows + 0.5),
                             squeeze=False, sharex=True, sharey=True, layout="constrained")
    numbers = len(lengths) * len(depths) <= 60
    im = None
    for n, needle in enumerate(needles):
        for k, label in enumerate(labels):
            ax = axes[n * per_needle + k // ncols, k % ncols]
            rows = [r for r in records if r["needle"] == needle and r["label"] == label]
            if not rows:
                ax.set_axis_off()
                continue
            grid = _depth_length_grid(rows, metric, lengths, depths)[2]  # every panel on the whole grid
            im = _draw_grid(ax, lengths, depths, grid, numbers)
            ax.set_title(f"{label} · {needle}\nmean {np.mean([r[metric] for r in rows]):.3f} · "
                         f"{len(rows)} prompt{'s' * (len(rows) != 1)}", fontsize=8)
        for k in range(len(labels), per_needle * ncols):
            axes[n * per_needle + k // ncols, k % ncols].set_axis_off()
    for ax in axes[-1]:
        ax.set_xlabel("context length (tokens)", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("needle depth (%)", fontsize=8)
    fig.suptitle(f"mean {name} per needle depth and context length, each config", fontsize=10)
    if im is not None:
        fig.colorbar(im, ax=axes, label=name, shrink=min(1.0, 0.5 + 0.25 * nrows))
    return _save(fig, path)


def line_name(record):
    """A record's config without its budget: ``restkv_paper_128`` -> ``restkv_paper``,
    ``restkv_128-use_ema=True`` -> ``restkv-use_ema=True``, ``fullkv`` -> ``fullkv``."""
    budget = record.get("budget")
    return record["label"] if budget is None else record["label"].replace(f"_{budget}", "", 1)


def _per_config(records, metric):
    """``{line name: {budget: [metric values]}}`` of ``records``."""
    lines = defaultdict(lambda: defaultdict(list))
    for r in records:
        lines[line_name(r)][r.get("budget")].append(r[metric])
    return lines


def _prompts_per_config(lines) -> str:
    """``"4 prompts"`` (``"1 prompt"``): the most prompts any (config, budget) point of ``lines`` holds."""
    n = max((len(v) for budgets in lines.values() for v in budgets.values()), default=0)
    return f"{n} prompt{'s' * (n != 1)}"


def budget_curve(records, path, metric="score", ylim=(-0.02, 1.02), log_y=False, title=None, name=None):
    """Mean ``metric`` against the budget, one line per config (:func:`line_name`, so two knob sets of
    one method are two lines); ``fullkv`` as a dashed level. ``name``: the metric's name in the labels
    and title (default ``metric``).

    With a single budget there is no curve to draw: the configs' means are bars instead (with their
    standard errors, ``fullkv`` as the dashed level), so a one-budget run still compares its methods.
    """
    budgets = sorted({r["budget"] for r in records if r.get("budget") is not None})
    if len(budgets) < 2:
        return budget_bars(records, path, metric, ylim=ylim, log_y=log_y, title=title, name=name)
    name = name or metric
    lines = _per_config(records, metric)
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.set_prop_cycle(color=plt.cm.tab20.colors)
    for config in sorted(set(lines) - {"fullkv"}):
        points = sorted(lines[config])
        ax.plot(points, [np.mean(lines[config][b]) for b in points], marker="o", label=config,
                ls="-" if config.startswith("restkv") else "--")
    if "fullkv" in lines:
        ax.axhline(np.mean(lines["fullkv"][None]), color="k", ls=":", lw=1, label="fullkv")
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.minorticks_off()
    ax.set_xlabel("KV budget per head (max_capacity_prompt)")
    ax.set_ylabel(f"mean {name}")
    _y_axis(ax, ylim, log_y)
    ax.set_title(title or f"mean {name} against the KV budget · {_prompts_per_config(lines)} per point",
                 fontsize=9)
    ax.grid(alpha=0.3)
    if len(lines) > 8:  # beside the axes, off the data
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    else:
        ax.legend(fontsize=8)
    return _save(fig, path)


def budget_bars(records, path, metric="score", ylim=(-0.02, 1.02), log_y=False, title=None, name=None):
    """Mean ``metric`` of each config as a bar with its standard error (one budget, or none), ``fullkv`` last
    and as a dashed level, each bar labelled with its mean (``name``: as :func:`budget_curve`)."""
    name = name or metric
    lines = _per_config(records, metric)
    names = sorted(set(lines) - {"fullkv"}) + (["fullkv"] if "fullkv" in lines else [])
    values = [[v for vs in lines[n].values() for v in vs] for n in names]
    means = [float(np.mean(v)) for v in values]
    errors = [float(np.std(v, ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0 for v in values]
    fig, ax = plt.subplots(figsize=(1.6 + 0.7 * len(names), 3.4))
    colors = ["#7f7f7f" if n == "fullkv" else plt.cm.tab20.colors[i % 20] for i, n in enumerate(names)]
    bars = ax.bar(range(len(names)), means, yerr=errors, capsize=3, color=colors)
    ax.bar_label(bars, [f"{m:.3f}" for m in means], fontsize=7, padding=2)
    if "fullkv" in lines:
        ax.axhline(means[-1], color="k", ls=":", lw=1)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_xlabel("config (run label without its budget)")
    ax.set_ylabel(f"mean {name} (± s.e.)")
    _y_axis(ax, ylim and (ylim[0], max([ylim[1]] + [1.1 * (m + e) for m, e in zip(means, errors)])), log_y)
    budgets = sorted({r["budget"] for r in records if r.get("budget") is not None})
    at = f" at KV budget{'s' * (len(budgets) > 1)} {', '.join(map(str, budgets))}" if budgets else ""
    n = max(map(len, values), default=0)
    ax.set_title(title or f"mean {name}{at} · {n} prompt{'s' * (n != 1)} per config", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def _y_axis(ax, ylim, log_y):
    if log_y:
        ax.set_yscale("log")
    elif ylim:
        ax.set_ylim(*ylim)


@torch.inference_mode()
def window_attention(model, input_ids, window=32):
    """Attention of the last ``window`` queries over every position, per layer (mean over heads and queries).

    Runs one forward with eager attention (restored afterwards).

    Returns
    -------
    numpy.ndarray
        ``[layers, positions]``.
    """
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        ids = torch.as_tensor(input_ids).reshape(1, -1).to(next(model.parameters()).device)
        out = model(ids, output_attentions=True, use_cache=False)
        return torch.stack([a[0, :, -window:, :].float().mean((0, 1)) for a in out.attentions]).cpu().numpy()
    finally:
        model.set_attn_implementation(previous)


def attention_heatmap(attn, path, needle_span=None, title=None):
    """Layers x positions image of :func:`window_attention` (log color scale), the needle marked."""
    attn = np.asarray(attn, dtype=float)
    positive = attn[attn > 0]
    norm = LogNorm(vmin=max(positive.min(), 1e-6), vmax=positive.max()) if positive.size else None
    return _layer_image(np.clip(attn, 1e-6, None), path, needle_span, "key position",
                        title or "attention of the observation window", "attention", norm=norm, cmap="magma")


def _layer_image(rows, path, needle_span, xlabel, title, label, **imshow):
    """A layers x positions image with the needle marked, saved to ``path``."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    im = ax.imshow(rows, aspect="auto", interpolation="nearest", **imshow)
    _mark_needle(ax, needle_span)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9, pad=14)
    fig.colorbar(im, ax=ax, label=label)
    return _save(fig, path)


def kept_map(kept, length, index=0):
    """Fraction of KV heads keeping each position, per layer: ``[layers, length]`` (NaN rows: not evicted)."""
    rows = np.full((len(kept), length), np.nan)
    for layer, positions in enumerate(kept):
        if positions is not None:
            p = positions[index].cpu()
            p = p[(p >= 0) & (p < length)]
            counts = torch.zeros(length).index_add_(0, p, torch.ones(p.numel()))
            rows[layer] = (counts / positions.shape[1]).numpy()
    return rows


def kept_positions_plot(kept, length, path, needle_span=None, index=0, title=None):
    """Layers x positions image of :func:`kept_map` for ``restkv.kept_positions(model)``, the needle marked."""
    return _layer_image(kept_map(kept, length, index), path, needle_span, "prompt position",
                        title or "kept KV entries", "fraction of KV heads keeping it", cmap="Greys", vmin=0, vmax=1)
