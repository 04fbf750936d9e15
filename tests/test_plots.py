"""Tests for lipvit.analysis.plots: Figures with the expected axes, series, scales."""

from __future__ import annotations

import numpy as np
import pytest
from lipvit.analysis import plots as P
from matplotlib.collections import LineCollection, PathCollection
from matplotlib.figure import Figure

EPS = np.array([0.01, 0.02, 0.05, 0.1])


def _legend(ax) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend else []


def test_certified_accuracy_series_and_labels(tmp_path):
    curves = {"lofast": (EPS, [0.9, 0.8, 0.5, 0.2]),
              "crown": (EPS, [0.9, 0.85, 0.6, 0.3])}
    empirical = {"PGD": (EPS, [0.95, 0.9, 0.8, 0.7])}
    fig = P.plot_certified_accuracy(curves, empirical, x_label="ε (ℓ2)", title="t")
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    ax = fig.axes[0]
    lines = ax.get_lines()
    assert [ln.get_label() for ln in lines] == ["lofast", "crown", "PGD"]
    assert _legend(ax) == ["lofast", "crown", "PGD"]
    np.testing.assert_allclose(lines[1].get_ydata(), [0.9, 0.85, 0.6, 0.3])
    assert lines[2].get_linestyle() == "--"  # the empirical ceiling is dashed
    assert ax.get_xlabel() == "ε (ℓ2)" and ax.get_ylabel() == "accuracy"
    assert ax.get_ylim() == (0.0, 1.02) and ax.get_title() == "t"
    assert ax.get_xscale() == "log"  # ε spans a decade
    lo, hi = ax.get_xlim()
    assert 0.005 < lo < 0.01 and 0.1 < hi < 0.2  # fitted to the data
    assert not list(tmp_path.iterdir())  # nothing saved without a path


def test_certified_accuracy_estimates_dashed_below_and_zero_curves_named():
    curves = {"lofast": (EPS, [0.9, 0.8, 0.5, 0.2]),
              "lofast-fast (estimate)": (EPS, [0.9, 0.8, 0.5, 0.2]),
              "specformer": (EPS, [0.0, 0.0, 0.0, 0.0])}
    ax = P.plot_certified_accuracy(curves).axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    hidden = "lofast-fast (estimate) — same as lofast, drawn over it"
    sound, estimate = lines["lofast"], lines[hidden]
    assert sound.get_linestyle() == "-" and estimate.get_linestyle() == "--"
    assert sound.get_zorder() > estimate.get_zorder()  # the certificate on top
    assert "specformer — 0 at every ε" in _legend(ax)
    # a curve that differs anywhere is not called the same
    curves["lofast-fast (estimate)"] = (EPS, [0.9, 0.8, 0.5, 0.3])
    differs = P.plot_certified_accuracy(curves).axes[0]
    assert "lofast-fast (estimate)" in _legend(differs)
    linear = P.plot_certified_accuracy({"a": ([0.01, 0.02], [0.5, 0.4])}).axes[0]
    assert linear.get_xscale() == "linear" and linear.get_xlim()[1] < 0.03


def test_certified_accuracy_steps_and_styles():
    fig = P.plot_certified_accuracy({"r": (EPS, [1.0, 0.5, 0.5, 0.0])}, step=True,
                                    styles={"r": {"color": "red", "marker": "o"}})
    line = fig.axes[0].get_lines()[0]
    assert line.get_drawstyle() == "steps-post" and line.get_color() == "red"


def test_certified_accuracy_rejects_mismatch():
    with pytest.raises(ValueError, match="expected 4"):
        P.plot_certified_accuracy({"a": (EPS, [0.1, 0.2])})
    with pytest.raises(ValueError, match="nothing"):
        P.plot_certified_accuracy({})


def _band(mean):
    mean = np.asarray(mean, dtype=float)
    return mean, 0.8 * mean, 1.2 * mean


def test_tightness_log_scale_and_ratio():
    bounds = {"naive": _band(100 * EPS), "LoFAST": _band(1.05 * EPS)}
    fig = P.plot_tightness(EPS, bounds, _band(EPS))
    top, bottom = fig.axes
    assert top.get_yscale() == "log" and top.get_xscale() == "log"
    assert _legend(top) == ["naive", "LoFAST", "PGD (lower bound)"]
    assert len(top.collections) == 3  # one shaded band per series
    ratios = {ln.get_label(): ln.get_ydata() for ln in bottom.get_lines()
              if not ln.get_label().startswith("_")}
    # The ratio panel is clipped to the range of interest: naive (100×) is
    # named off the scale, LoFAST's 1.05× is readable on a linear axis.
    assert "naive" not in ratios
    assert "off scale: naive: 100–100×" in bottom.get_title(loc="left")
    np.testing.assert_allclose(ratios["LoFAST"], 1.05)
    assert bottom.get_yscale() == "linear" and bottom.get_ylim()[1] < 1.4
    mid = P.plot_tightness(EPS, {"a": _band(8 * EPS), "b": _band(1.01 * EPS)},
                           _band(EPS)).axes[1]
    assert {ln.get_label() for ln in mid.get_lines()} >= {"a", "b"}
    assert mid.get_ylim()[1] < P.RATIO_CLIP
    assert bottom.get_ylabel() == "bound / PGD" and bottom.get_xlabel() == "ε (ℓ2)"
    # Every bound far off: the tightest is still drawn, the others named.
    far = P.plot_tightness(EPS, {"thm": _band(1e58 * EPS), "LoFAST": _band(60 * EPS)},
                           _band(EPS)).axes[1]
    assert [ln.get_label() for ln in far.get_lines()
            if not ln.get_label().startswith("_")] == ["LoFAST"]
    assert far.get_title(loc="left") == "off scale: thm: 1e+58–1e+58×"
    assert far.get_yscale() == "log" and 60 < far.get_ylim()[1] < 100
    single = P.plot_tightness(EPS, bounds, None)
    assert len(single.axes) == 1 and single.axes[0].get_yscale() == "log"
    with pytest.raises(ValueError, match="expected 4"):
        P.plot_tightness(EPS, {"x": _band([1.0, 2.0])}, None)


def test_spectra_bars_per_head_and_checkpoint():
    rng = np.random.default_rng(0)
    sigma = {"vanilla": {"W_q": rng.uniform(1, 2, (3, 4)),
                         "W_v W_o": rng.uniform(1, 2, (3, 4))},
             "MSVP": {"W_q": rng.uniform(0.5, 1, (3, 4)),
                      "W_v W_o": rng.uniform(0.001, 0.01, (3, 4))}}
    fig = P.plot_spectra(sigma)
    ax_q, ax_vo = fig.axes
    assert len(ax_q.patches) == 2 * 3 * 4  # checkpoints × layers × heads
    heights = [p.get_height() for p in ax_q.patches]
    np.testing.assert_allclose(heights[:12], sigma["vanilla"]["W_q"].ravel())
    assert ax_q.get_yscale() == "linear"  # within a decade
    assert ax_vo.get_yscale() == "log"  # spans three decades
    assert ax_q.get_ylabel() == "σ_max($W_{q}$)"  # mathtext
    assert ax_vo.get_ylabel() == "σ_max($W_{v} W_{o}$)"
    assert _legend(ax_q) == ["vanilla", "MSVP"]
    assert [t.get_text() for t in ax_q.get_xticklabels()] == ["block 0", "block 1",
                                                              "block 2"]
    with pytest.raises(ValueError, match="different shapes"):
        P.plot_spectra({"a": {"W_q": np.ones((2, 2))}, "b": {"W_q": np.ones((3, 2))}})


def test_jacobian_violin_log_and_medians():
    rng = np.random.default_rng(1)
    series = {"σ_max": {f"block {i}": rng.lognormal(2 * i, 0.2, 40) for i in range(3)},
              "estimate": {f"block {i}": rng.lognormal(2 * i + 1, 0.2, 40)
                           for i in range(3)}}
    fig = P.plot_jacobian_violin(series)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"  # values span ~5 decades
    assert _legend(ax) == ["σ_max", "estimate"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["block 0", "block 1",
                                                            "block 2"]
    # The first series' median segments sit at the data medians.
    lines = [c for c in ax.collections if isinstance(c, LineCollection)]
    levels = np.array([seg[0, 1] for c in lines for seg in c.get_segments()
                       if seg[0, 1] == seg[1, 1]])  # horizontal marks
    for values in series["σ_max"].values():  # median, min and max marks
        for want in (np.median(values), values.min(), values.max()):
            assert np.isclose(levels, want, rtol=1e-9).any()
    plain = P.plot_jacobian_violin({"block 1": [1.0, 1.1, 1.2], "block 2": [2.0, 2.0]})
    assert plain.axes[0].get_yscale() == "linear" and _legend(plain.axes[0]) == []
    with pytest.raises(ValueError, match="finite"):
        P.plot_jacobian_violin({"b": [1.0, np.nan]})


def test_tsne_two_groups_and_title():
    rng = np.random.default_rng(2)
    emb = rng.normal(size=(30, 2))
    attacked = np.arange(30) >= 10
    fig = P.plot_tsne(emb, np.arange(30) % 3, attacked, a_distance=0.25,
                      attacked_label="PGD")
    ax = fig.axes[0]
    sizes = [len(c.get_offsets()) for c in ax.collections]
    assert sizes == [10, 20]
    assert _legend(ax) == ["clean (n=10)", "PGD (n=20)"]
    assert "A-distance" in ax.get_title() and "0.250" in ax.get_title()
    assert ax.get_xlabel() == "t-SNE 1"
    by_class = P.plot_tsne(emb, np.arange(30) % 3, attacked, color_by="class")
    assert sum(len(c.get_offsets()) for c in by_class.axes[0].collections) == 30
    with pytest.raises(ValueError, match="same length"):
        P.plot_tsne(emb, np.arange(29), attacked)


def test_save_png_and_pdf(tmp_path):
    fig = P.plot_certified_accuracy({"a": (EPS, [0.5, 0.4, 0.3, 0.2])},
                                    path=tmp_path / "cert", pdf=True)
    assert isinstance(fig, Figure)
    png, pdf = tmp_path / "cert.png", tmp_path / "cert.pdf"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pdf.read_bytes()[:5] == b"%PDF-"
    written = P.save_figure(fig, tmp_path / "sub" / "x.pdf", pdf=True)
    assert written == [tmp_path / "sub" / "x.pdf"]


def test_spans_decades():
    assert P.spans_decades([1.0, 150.0])
    assert not P.spans_decades([1.0, 50.0], [0.0, -3.0])


def test_certification_gap_series_line_and_log_axes(tmp_path):
    attack = np.array([0.0, 0.1, 0.2, 0.4, 0.8, np.inf])  # misclassified, ..., none
    cert = {"lofast": np.array([0.0, 0.002, 0.0, 0.01, 0.02, 0.0]),
            "fast": np.array([0.0, 0.003, 0.004, 0.011, 0.021, 0.0])}
    fig = P.plot_certification_gap(attack, cert, first_order=0.8 * attack,
                                   estimates={"fast"}, title="gap")
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"  # 0.002 .. 0.8
    assert ax.get_xlim() == ax.get_ylim()
    (diag,) = ax.get_lines()
    np.testing.assert_allclose(diag.get_xdata(), diag.get_ydata())  # y = x
    assert diag.get_linestyle() == "--"
    labels = _legend(ax)
    # lofast: ratios over the 4 drawn samples 0.02, 0, 0.025, 0.025 -> median 0.0225
    assert any(t.startswith("lofast: median certified/attack 0.0225, 3/4") for t in
               labels)
    assert any(t.startswith("fast (estimate): median certified/attack 0.0269, 4/4")
               for t in labels)
    assert any("first-order limit (estimate" in t for t in labels)
    assert any(t.startswith("uncertified (radius 0)") for t in labels)
    offsets = [c.get_offsets() for c in ax.collections
               if isinstance(c, PathCollection)]
    # lofast certified, lofast uncertified (at the floor), fast, first-order
    sizes = sorted(len(o) for o in offsets)
    assert sizes == [1, 3, 4, 4]
    floor = [o for o in offsets if len(o) == 1][0]
    np.testing.assert_allclose(floor[0], [0.2, ax.get_ylim()[0] * 1.15])
    assert labels[-1] == ("2 samples not drawn (misclassified, or no adversarial "
                          "point found)")
    assert ax.get_title() == "gap"
    assert not list(tmp_path.iterdir())
    P.plot_certification_gap(attack, cert, path=tmp_path / "g")
    assert (tmp_path / "g.png").is_file()


def test_certification_gap_linear_axes_and_bad_input():
    attack = np.array([0.2, 0.3, 0.4])
    fig = P.plot_certification_gap(attack, {"m": [0.1, 0.15, 0.0]}, log=None)
    ax = fig.axes[0]
    assert ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0
    assert not any(t.startswith("first-order") for t in _legend(ax))
    with pytest.raises(ValueError, match="expected 3"):
        P.plot_certification_gap(attack, {"m": [0.1]})
    with pytest.raises(ValueError, match=">= 0"):
        P.plot_certification_gap(attack, {"m": [0.1, np.nan, 0.0]})
    with pytest.raises(ValueError, match="no sample"):
        P.plot_certification_gap([0.0, np.inf], {"m": [0.0, 0.0]})
    with pytest.raises(ValueError, match="nothing"):
        P.plot_certification_gap(attack, {})
