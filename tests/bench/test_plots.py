"""Every plot has a title naming its metric; a one-budget run draws its configs as bars (there is no curve to
draw); the needle heatmaps of every config are side by side in one figure."""

import pytest
import torch

from visualization import plots


def records(budgets, labels=("restkv", "snapkv")):
    out = [{"label": "fullkv", "method": "fullkv", "budget": None, "needle": "passkey", "length": L, "depth": d,
            "score": 1.0} for L in (256, 512) for d in (0, 100)]
    for i, label in enumerate(labels):
        for b in budgets:
            out += [{"label": f"{label}_{b}", "method": label, "budget": b, "needle": "passkey", "length": L,
                     "depth": d, "score": (i + 1) * 0.2 + 0.1 * (d == 100)} for L in (256, 512) for d in (0, 100)]
    return out


@pytest.fixture
def titles(monkeypatch):
    seen = []
    real = plots.plt.Axes.set_title
    monkeypatch.setattr(plots.plt.Axes, "set_title", lambda ax, text, **kw: seen.append(text) or real(ax, text, **kw))
    return seen


def test_every_plot_has_a_title(tmp_path, titles):
    rs = records([128, 256])
    plots.needle_heatmaps(rs, str(tmp_path / "heatmaps.png"), name="graded score")
    plots.depth_length_heatmap(rs, str(tmp_path / "h.png"))
    plots.budget_curve(rs, str(tmp_path / "c.png"), name="graded score")
    plots.budget_bars(rs, str(tmp_path / "b.png"), name="graded score")
    plots.attention_heatmap(torch.rand(3, 20).numpy(), str(tmp_path / "a.png"), (4, 6))
    plots.kept_positions_plot([torch.tensor([[[0, 5, 9]]]), None], 10, str(tmp_path / "k.png"), (4, 6))
    assert len(titles) == 5 + 1 + 1 + 1 + 2 and all(t.strip() for t in titles)
    assert titles[6] == "mean graded score against the KV budget · 4 prompts per point"
    assert titles[7] == "mean graded score at KV budgets 128, 256 · 8 prompts per config"


def test_one_budget_draws_bars_of_each_config_with_its_mean(tmp_path, titles, monkeypatch):
    drawn = []
    real = plots.plt.Axes.bar
    monkeypatch.setattr(plots.plt.Axes, "bar", lambda ax, x, h, **kw: drawn.append(list(h)) or real(ax, x, h, **kw))
    lines = []
    monkeypatch.setattr(plots.plt.Axes, "plot", lambda *a, **k: lines.append(a))
    path = plots.budget_curve(records([128]), str(tmp_path / "budget_curve.png"))
    assert (tmp_path / "budget_curve.png").is_file() and path.endswith("budget_curve.png")
    assert not lines and drawn == [pytest.approx([0.25, 0.45, 1.0])]  # restkv, snapkv, then fullkv
    assert titles == ["mean score at KV budget 128 · 4 prompts per config"]


def test_the_heatmaps_of_every_config_are_panels_of_one_figure(tmp_path, titles, monkeypatch):
    drawn = []
    real = plots.plt.Axes.imshow
    monkeypatch.setattr(plots.plt.Axes, "imshow", lambda ax, grid, **kw: drawn.append(grid) or real(ax, grid, **kw))
    saved = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.append((fig, path)) or path)
    rs = records([128, 256]) + [dict(r, needle="sf") for r in records([128])]
    order = ["restkv_128", "restkv_256", "snapkv_128", "snapkv_256", "fullkv"]
    plots.needle_heatmaps(rs, str(tmp_path / "heatmaps.png"), order=order, columns=3)
    ((fig, path),) = saved  # one file
    assert path.endswith("heatmaps.png") and fig._suptitle.get_text().startswith("mean score per needle depth")
    assert len(drawn) == 5 + 3  # passkey: every config; sf: the three it has
    assert titles[:5] == [f"{label} · passkey\nmean {m:.3f} · 4 prompts" for label, m in
                          zip(order, (0.25, 0.25, 0.45, 0.45, 1.0))]
    # restkv_128 on passkey: depth 0 scores 0.2, depth 100 scores 0.3, at both lengths
    assert drawn[0].ravel().tolist() == pytest.approx([0.2, 0.2, 0.3, 0.3])
    assert len(fig.axes) == 2 * 2 * 3 + 1  # two rows of three per needle, and the colour bar


def _table(path, header, rows):
    path.write_text("\n".join(",".join(map(str, r)) for r in [header, *rows]) + "\n")
    return str(path)


def test_a_score_table_becomes_curves_against_the_budget_or_a_swept_knob(tmp_path):
    from visualization import curve

    longbench = _table(tmp_path / "results.csv", ["label", "qasper", "avg"], [
        ["smollm2-135m/fullkv", 30, 30.0], ["smollm2-135m/restkv_128-kernel_size=5-temporal=ema", 20, 20.0],
        ["smollm2-135m/restkv_512-kernel_size=5-temporal=ema", 25, 25.0], ["smollm2-135m/snapkv_128", 10, 10.0],
        ["smollm2-135m/snapkv_512", "", ""]])  # a row without its score is left out
    lines, levels = curve.series(curve.row_names(longbench))
    assert lines == {"restkv-kernel_size=5-temporal=ema": {128: 20.0, 512: 25.0}, "snapkv": {128: 10.0}}
    assert levels == {"fullkv": 30.0}
    ablation = _table(tmp_path / "ablation.csv", ["label", "avg"], [
        ["alpha_0.1/smollm2-135m/restkv_128-alpha=0.1-kernel_size=5-temporal=ema", 31.5],
        ["alpha_0.3/smollm2-135m/restkv_128-kernel_size=5-temporal=ema", 32.0],
        ["mean/smollm2-135m/restkv_128-kernel_size=5", 30.5]])
    lines, levels = curve.series(curve.row_names(ablation), "alpha")
    assert lines == {"smollm2-135m/restkv_128-kernel_size=5-temporal=ema": {0.1: 31.5, 0.3: 32.0}}
    assert levels == {"mean/smollm2-135m/restkv_128-kernel_size=5": 30.5}
    ruler = _table(tmp_path / "ruler_results.csv", ["model", "context_length", "method", "samples", "vt", "avg"], [
        ["smollm2-135m", 4096, "fullkv", 2, 50, 50.0], ["smollm2-135m", 4096, "snapkv_128", 2, 10, 10.0],
        ["smollm2-135m", 4096, "snapkv_256", 2, 20, 20.0]])
    assert curve.series(curve.row_names(ruler)) == ({"snapkv": {128: 10.0, 256: 20.0}}, {"fullkv": 50.0})
    assert curve.main([longbench]).endswith("results_budget.png") and (tmp_path / "results_budget.png").is_file()
    assert curve.main([ablation, "--x", "alpha", "--out", str(tmp_path / "a.png")]) == str(tmp_path / "a.png")
    with pytest.raises(SystemExit):
        curve.main([ablation, "--x", "scale"])  # no row names a scale
