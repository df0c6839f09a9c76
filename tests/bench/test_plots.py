"""Every plot has a title; a one-budget run draws its configs as bars (there is no curve to draw)."""

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
    plots.needle_heatmaps(rs, str(tmp_path))
    plots.depth_length_heatmap(rs, str(tmp_path / "h.png"))
    plots.budget_curve(rs, str(tmp_path / "c.png"))
    plots.budget_bars(rs, str(tmp_path / "b.png"))
    plots.attention_heatmap(torch.rand(3, 20).numpy(), str(tmp_path / "a.png"), (4, 6))
    plots.kept_positions_plot([torch.tensor([[[0, 5, 9]]]), None], 10, str(tmp_path / "k.png"), (4, 6))
    assert len(titles) == 5 + 1 + 1 + 1 + 2 and all(t.strip() for t in titles)
    assert "against the KV budget · 4 prompts per point" in titles[6]


def test_one_budget_draws_bars_of_each_config_with_its_mean(tmp_path, titles, monkeypatch):
    drawn = []
    real = plots.plt.Axes.bar
    monkeypatch.setattr(plots.plt.Axes, "bar", lambda ax, x, h, **kw: drawn.append(list(h)) or real(ax, x, h, **kw))
    lines = []
    monkeypatch.setattr(plots.plt.Axes, "plot", lambda *a, **k: lines.append(a))
    path = plots.budget_curve(records([128]), str(tmp_path / "budget_curve.png"))
    assert (tmp_path / "budget_curve.png").is_file() and path.endswith("budget_curve.png")
    assert not lines and drawn == [pytest.approx([0.25, 0.45, 1.0])]  # restkv, snapkv, then fullkv
    assert titles == ["mean score at KV budget 128 · 4 prompts per config (one budget: no curve)"]
