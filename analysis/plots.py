"""Figures from arrays: certified accuracy, certification gap, tightness, spectra,
Jacobian violins, t-SNE.

Every function takes plain arrays, returns a :class:`matplotlib.figure.Figure`
and writes a file only when given ``path`` (PNG unless the suffix says
otherwise; ``pdf=True`` adds a PDF beside it). Figures are built without
``pyplot`` on an Agg canvas: nothing is displayed, no global figure state is
kept, and library code never needs a display.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from matplotlib import cbook, mlab
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import NullFormatter, PercentFormatter

from lipvit.files import atomic_path, check_writable

ArrayLike = Sequence[float] | np.ndarray
Band = tuple[ArrayLike, ArrayLike, ArrayLike]  # (mean, lo, hi)
PathLike = str | os.PathLike

DECADES = 2.0  # a value range of 10**DECADES or more gets a log axis


def new_figure(width: float = 6.4, height: float = 4.2, nrows: int = 1, ncols: int = 1,
               **subplot_kw) -> tuple[Figure, np.ndarray]:
    """A constrained-layout Figure on an Agg canvas and its ``(nrows, ncols)`` axes."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, **subplot_kw)
    return fig, axes


def figure_paths(path: PathLike, pdf: bool = False) -> list[Path]:
    """The files :func:`save_figure` writes: ``path`` (``.png`` appended if it has
    no suffix) and, with ``pdf``, a ``.pdf`` beside it."""
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(".png")
    return [path] + ([path.with_suffix(".pdf")]
                     if pdf and path.suffix.lower() != ".pdf" else [])


def save_figure(fig: Figure, path: PathLike, pdf: bool = False, dpi: int = 150,
                force: bool = True) -> list[Path]:
    """Write ``fig`` to :func:`figure_paths` ``(path, pdf)``, each file atomically.

    The one figure writer of lipvit (library and commands): readers never see
    a half-written figure. Without ``force`` an existing file is refused
    (:class:`lipvit.errors.LipvitError`) before anything is written. Returns
    the paths written.
    """
    paths = figure_paths(path, pdf)
    check_writable(paths, force)
    for target in paths:
        with atomic_path(target, force) as tmp:
            fig.savefig(tmp, dpi=dpi)
    return paths


def spans_decades(*arrays: ArrayLike, decades: float = DECADES) -> bool:
    """True when the positive finite values range over ``≥ 10**decades``."""
    values = np.concatenate([np.ravel(np.asarray(a, dtype=float)) for a in arrays])
    values = values[np.isfinite(values) & (values > 0)]
    return values.size > 1 and values.max() >= 10**decades * values.min()


def _vector(a: ArrayLike, n: int, what: str) -> np.ndarray:
    v = np.asarray(a, dtype=float).ravel()
    if v.shape[0] != n:
        raise ValueError(f"{what} has {v.shape[0]} values, expected {n}")
    return v


def _math(name: str) -> str:
    """``W_q`` → ``$W_q$``, ``W_v W_o`` → ``$W_v W_o$`` (mathtext); others unchanged."""
    if re.fullmatch(r"W_\w+(\s*W_\w+)*", name):
        return "$" + re.sub(r"(W_)(\w+)", r"\1{\2}", name) + "$"
    return name


def _finish(fig: Figure, path: PathLike | None, pdf: bool) -> Figure:
    if path is not None:
        save_figure(fig, path, pdf=pdf)
    return fig


def plot_certified_accuracy(
    curves: Mapping[str, tuple[ArrayLike, ArrayLike]],
    empirical: Mapping[str, tuple[ArrayLike, ArrayLike]] | None = None,
    *,
    x_label: str = "ε (ℓ2)",
    y_label: str = "accuracy",
    title: str | None = None,
    step: bool = False,
    styles: Mapping[str, Mapping[str, Any]] | None = None,
    ax: Any = None,
    legend_below: bool | None = None,
    path: PathLike | None = None,
    pdf: bool = False,
) -> Figure:
    """Certified accuracy against ε (or radius), with attacks as an empirical ceiling.

    Args:
        curves: label → ``(x, certified accuracy)``, accuracies in ``[0, 1]``.
            Drawn as solid lines (steps with ``step``, for curves over radii);
            a label with "estimate" (:func:`is_estimate`) dashed beneath the
            certificates, one with "probabilistic" (:func:`is_probabilistic`,
            randomized smoothing: a guarantee of the smoothed classifier with
            probability ``1 − α``, not of the network) dotted with star markers,
            its own series.
        empirical: label → ``(ε, robust accuracy)`` under attack; drawn
            dashed. Robust accuracy under attack is an upper bound of the true
            robust accuracy, certified accuracy a lower bound.
        x_label, y_label, title: axis texts.
        step: draw ``curves`` as right-continuous steps (accuracy at radius r).
        styles: label → matplotlib line keywords (``color``, ``marker``,
            ``linestyle``, ...) overriding the defaults, e.g. one colour per
            method and one marker per run.
        ax: draw into these axes (a panel of a larger figure, e.g. from
            :func:`new_figure`) instead of a new figure; its figure is returned.
        legend_below: the legend under the axes instead of beside them;
            ``None``: below where a label is longer than :data:`LONG_LABEL`
            characters (beside, it would squeeze the axes).
        path, pdf: where to save (see :func:`save_figure`).
    """
    if not curves and not empirical:
        raise ValueError("nothing to plot: no curves given")
    styles = styles or {}
    if ax is None:
        fig, axes = new_figure(width=9.0)
        ax = axes[0, 0]
    fig = ax.figure
    # Estimates first, dashed and underneath; then the probabilistic curves,
    # dotted; sound curves solid and on top.
    order = sorted(curves.items(), key=lambda kv: _layer(kv[0]))
    xs = []
    for label, (x, acc) in order:
        x = np.asarray(x, dtype=float)
        acc = _vector(acc, x.size, f"certified accuracy of {label!r}")
        xs.append(x)
        shown = label + (" — 0 at every ε" if np.all(acc == 0) else "")
        shown += "".join(f" — same as {other}, drawn over it" for other in
                         _covering(label, x, acc, order, curves))
        estimate, probabilistic = is_estimate(label), is_probabilistic(label)
        kw = {"linewidth": 1.4 if estimate else 1.9, **styles.get(label, {}),
              "zorder": 2 + _layer(label) / 2}
        kw["linestyle"] = "--" if estimate else ":" if probabilistic else kw.get(
            "linestyle", "-")
        if estimate:
            kw["alpha"] = 0.8
        if probabilistic:
            kw["marker"] = "*"
        if step:
            kw.pop("marker", None)
            ax.step(x, acc, where="post", label=shown, **kw)
        else:
            kw = {"marker": "o", "markersize": 4, **kw}
            ax.plot(x, acc, label=shown, **kw)
    for label, (x, acc) in (empirical or {}).items():
        x = np.asarray(x, dtype=float)
        acc = _vector(acc, x.size, f"robust accuracy of {label!r}")
        xs.append(x)
        kw = {"linestyle": "--", "marker": "x", "markersize": 5, "linewidth": 1.2,
              "alpha": 0.9, "zorder": 1, **styles.get(label, {})}
        ax.plot(x, acc, label=label, **kw)
    _fit_x(ax, np.concatenate(xs), log=not step)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_ylim(0, 1.02)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.grid(True, which="both", alpha=0.3)
    # Beside (or below) the axes: no curve is ever hidden under the legend.
    if legend_below is None:
        legend_below = max(map(len, ax.get_legend_handles_labels()[1])) > LONG_LABEL
    if legend_below:
        ax.legend(fontsize="x-small", loc="upper center",
                  bbox_to_anchor=(0.5, -0.14), borderaxespad=0.0)
    else:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0),
                  borderaxespad=0.0)
    if title:
        ax.set_title(title)
    return _finish(fig, path, pdf)


LONG_LABEL = 60
"""Legend labels longer than this put :func:`plot_certified_accuracy`'s legend
under the axes."""


def _covering(label: str, x: np.ndarray, acc: np.ndarray, order: list,
              curves: Mapping[str, tuple[ArrayLike, ArrayLike]]) -> list[str]:
    """The curves drawn after ``label`` (in ``order``) with exactly its points:
    they hide it, so its legend entry says so (at most the first one)."""
    names = [name for name, _ in order]
    for other in names[names.index(label) + 1:]:
        ox, oacc = (np.asarray(v, dtype=float) for v in curves[other])
        if np.array_equal(ox, x) and np.array_equal(oacc, acc):
            return [other]
    return []


def plot_certification_gap(
    attack_radius: ArrayLike,
    certified: Mapping[str, ArrayLike],
    *,
    first_order: ArrayLike | None = None,
    estimates: Collection[str] = (),
    probabilistic: Collection[str] = (),
    log: bool | None = None,
    title: str | None = None,
    path: PathLike | None = None,
    pdf: bool = False,
) -> Figure:
    """Certified radius against attack radius per sample, with ``y = x``.

    A sound certified radius is at most the true robust radius, which is at
    most the attack radius: every sound point lies on or below ``y = x`` (the
    shaded region above it is impossible for a certificate). Samples without a
    finite positive attack radius (misclassified, or no adversarial point
    found) are left out and counted in the legend.

    Args:
        attack_radius: ``(n,)`` verified distances of the closest adversarial
            points (upper bounds of the true radii).
        certified: method → ``(n,)`` certified radii (0: uncertified, drawn as
            hollow triangles on the bottom edge). The legend gives each
            method's median of certified/attack over the drawn samples.
        first_order: ``(n,)`` first-order limits, drawn as grey crosses and
            labelled as an estimate; ``None`` to omit.
        estimates: methods whose radii are estimates (hollow markers, drawn
            beneath the certificates, labelled).
        probabilistic: methods whose radii are a smoothed classifier's, with
            probability ``1 − α`` (randomized smoothing): star markers,
            labelled; they are not the network's radii, so they may lie above
            ``y = x`` when the attack radius is the network's.
        log: log-log axes; ``None`` when the values span decades.
        path, pdf: where to save (see :func:`save_figure`).
    """
    from lipvit.analysis.gap import median_ratio

    if not certified:
        raise ValueError("nothing to plot: no certified radii given")
    a = np.asarray(attack_radius, dtype=float).ravel()
    cert = {m: _vector(r, a.size, f"certified radii of {m!r}")
            for m, r in certified.items()}
    fo = None if first_order is None else _vector(first_order, a.size,
                                                  "first-order limits")
    keep = np.isfinite(a) & (a > 0)
    if not keep.any():
        raise ValueError("no sample has a finite positive attack radius")
    if any(np.any(np.isnan(r) | (r < 0)) for r in cert.values()):
        raise ValueError("certified radii must be >= 0")
    a_k = a[keep]
    shown = [a_k, *(r[keep] for r in cert.values())]
    if fo is not None:
        shown.append(fo[keep][np.isfinite(fo[keep])])
    use_log = spans_decades(*shown) if log is None else log
    positive = np.concatenate([v[(v > 0) & np.isfinite(v)] for v in shown])
    if use_log:
        lo, hi = positive.min() / 1.6, positive.max() * 1.6
        floor = lo * 1.15  # uncertified points, just inside the bottom edge
    else:
        lo, hi, floor = 0.0, positive.max() * 1.08, 0.0
    fig, axes = new_figure(6.4, 5.6)
    ax = axes[0, 0]
    ax.fill_between([lo, hi], [lo, hi], [hi, hi], color="0.92", linewidth=0,
                    zorder=0, label="above y = x: impossible for a sound radius"
                    + (" of the network" if set(probabilistic) & set(cert) else ""))
    ax.plot([lo, hi], [lo, hi], color="black", linestyle="--", linewidth=1.2,
            zorder=1, label="y = x (attack radius)")
    markers = "osD^P*"
    any_zero = False
    for k, (m, r) in enumerate(cert.items()):
        r_k = r[keep]
        pos = r_k > 0
        estimate = m in estimates
        colour = f"C{k % 10}"
        ratio = median_ratio(r_k, a_k)
        kind = (" (probabilistic: smoothed classifier)" if m in probabilistic
                else " (estimate)" if estimate else "")
        label = (f"{m}{kind}: median certified/attack "
                 f"{ratio:.3g}, {int(pos.sum())}/{pos.size} certified")
        marker = "*" if m in probabilistic else markers[k % len(markers)]
        style = {"marker": marker, "s": 40 if m in probabilistic else 22,
                 "edgecolors": colour, "linewidths": 1.0,
                 "facecolors": "none" if estimate else colour,
                 "zorder": 2 if estimate else 4}
        ax.scatter(a_k[pos], r_k[pos], label=label, **style)
        if (~pos).any():
            any_zero = True
            ax.scatter(a_k[~pos], np.full(int((~pos).sum()), floor), marker="v",
                       s=22, facecolors="none", edgecolors=colour, linewidths=1.0,
                       zorder=3, clip_on=False)
    if fo is not None:
        f_k = fo[keep]
        ok = np.isfinite(f_k) & (f_k > 0)
        ratio = median_ratio(f_k[ok], a_k[ok])
        ax.scatter(a_k[ok], f_k[ok], marker="x", s=18, color="0.45", linewidths=0.8,
                   zorder=2, label=f"first-order limit (estimate, not a bound): "
                                   f"median first-order/attack {ratio:.3g}")
    handles, labels = ax.get_legend_handles_labels()
    if any_zero:
        handles.append(Line2D([], [], linestyle="none", marker="v", color="0.3",
                              markerfacecolor="none"))
        labels.append("uncertified (radius 0), on the bottom edge")
    left_out = int((~keep).sum())
    if left_out:
        handles.append(Line2D([], [], linestyle="none"))
        noun = "sample" if left_out == 1 else "samples"
        labels.append(f"{left_out} {noun} not drawn (misclassified, or no "
                      "adversarial point found)")
    if use_log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    ax.set_xlabel("smallest adversarial radius found by attacks (ℓ2, upper bound)")
    ax.set_ylabel("certified radius (ℓ2)")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(handles, labels, fontsize="x-small", loc="upper left")
    if title:
        ax.set_title(title)
    return _finish(fig, path, pdf)


def is_estimate(label: str) -> bool:
    """A curve labelled as an estimate (not a certificate): drawn dashed, below."""
    return "estimate" in label


def is_probabilistic(label: str) -> bool:
    """A curve labelled as a probabilistic guarantee (randomized smoothing: the
    smoothed classifier, with probability ``1 − α``): drawn dotted, its own
    series, never merged with the deterministic certificates."""
    return "probabilistic" in label


PROBABILISTIC = "probabilistic: smoothed classifier"
"""What a ``smoothing`` series' label says (:func:`probabilistic_label`)."""


def probabilistic_label(method: str, sigma: float | None = None,
                        alpha: float | None = None) -> str:
    """``smoothing (probabilistic: smoothed classifier, σ = 0.25, 1 − α = 0.999)``."""
    parts = [PROBABILISTIC]
    if sigma is not None:
        parts.append(f"σ = {sigma:g}")
    if alpha is not None:
        parts.append(f"1 − α = {1 - alpha:g}")
    return f"{method} ({', '.join(parts)})"


def _layer(label: str) -> int:
    """Drawing order: estimates 0, probabilistic guarantees 1, certificates 2."""
    return 0 if is_estimate(label) else 1 if is_probabilistic(label) else 2


def _fit_x(ax, x: np.ndarray, log: bool) -> None:
    """Log x where the positive values span a decade or more; limits fitted."""
    pos = x[np.isfinite(x) & (x > 0)]
    if pos.size == 0:
        return
    if log and spans_decades(pos, decades=1.0):
        ax.set_xscale("log")
        ax.set_xlim(pos.min() / 1.4, pos.max() * 1.4)
        ax.xaxis.set_minor_formatter(NullFormatter())  # labels only at decades
    else:
        ax.set_xlim(0, pos.max() * 1.05)


def plot_tightness(
    eps: ArrayLike,
    bounds: Mapping[str, Band],
    pgd: Band | None,
    *,
    x_label: str = "ε (ℓ2)",
    y_label: str = "output deviation ‖F(X′) − F(X)‖",
    title: str | None = None,
    ratio: bool = True,
    path: PathLike | None = None,
    pdf: bool = False,
) -> Figure:
    """Upper bounds against the PGD lower bound across ε, log y (LoFAST Fig. 1).

    Args:
        eps: radii, ``(E,)``.
        bounds: name → ``(mean, lo, hi)`` over samples, each ``(E,)``; the band
            ``lo..hi`` is shaded (e.g. min–max or a percentile range).
        pgd: ``(mean, lo, hi)`` of the PGD deviation (a lower bound of the
            true maximal deviation), drawn black dashed; ``None`` to omit.
        ratio: add a lower panel with ``bound mean / PGD mean`` per ε (log y,
            1 marked), the tightness factor.
        path, pdf: where to save.
    """
    eps = np.asarray(eps, dtype=float).ravel()
    if not bounds:
        raise ValueError("nothing to plot: no bounds given")
    ratio = ratio and pgd is not None
    fig, axes = new_figure(6.4, 6.4 if ratio else 4.2, nrows=2 if ratio else 1,
                           sharex=True, gridspec_kw={"height_ratios": [3, 2]} if ratio
                           else None)
    ax = axes[0, 0]
    means = {}
    bands = {name: [_vector(a, eps.size, f"bound {name!r}") for a in band]
             for name, band in bounds.items()}
    top = OFF_SCALE * (float(np.max(pgd[2])) if pgd is not None else 0.0)
    if not top > 0:
        top = OFF_SCALE * min(hi.max() for _, _, hi in bands.values())
    clipped = False
    # Estimates dashed and underneath; sound bounds solid and on top.
    for name, (mean, lo, hi) in sorted(bands.items(),
                                       key=lambda kv: not is_estimate(kv[0])):
        estimate = is_estimate(name)
        label = name
        if 0 < top < mean.min():  # named, not drawn
            ax.plot([], [], linestyle="none", label=f"{name}: off the scale, "
                    f"{mean.min():.2g}–{mean.max():.2g}")
            means[name] = (mean, "grey", "-")
            continue
        if 0 < top < hi.max():
            clipped = True
            label = f"{name} (up to {hi.max():.2g}, above the axis)"
        (line,) = ax.plot(eps, mean, marker="o", markersize=4, label=label,
                          linestyle="--" if estimate else "-",
                          linewidth=1.3 if estimate else 1.8,
                          zorder=2 if estimate else 3)
        ax.fill_between(eps, lo, hi, color=line.get_color(), alpha=0.18, linewidth=0)
        means[name] = (mean, line.get_color(), line.get_linestyle())
    if pgd is not None:
        p_mean, p_lo, p_hi = (_vector(a, eps.size, "pgd") for a in pgd)
        ax.plot(eps, p_mean, color="black", linestyle="--", marker="s", markersize=3,
                label="PGD (lower bound)", zorder=4)
        ax.fill_between(eps, p_lo, p_hi, color="black", alpha=0.12, linewidth=0)
    ax.set_yscale("log")
    if clipped:
        ax.set_ylim(top=top)
    if spans_decades(eps, decades=1.0):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel(y_label)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize="small", loc="best")
    if title:
        ax.set_title(title)
    if ratio:
        _ratio_panel(axes[1, 0], eps, means, p_mean)
        axes[1, 0].set_xlabel(x_label)
    else:
        ax.set_xlabel(x_label)
    return _finish(fig, path, pdf)


OFF_SCALE = 1e6
"""The bound panel's top: ``OFF_SCALE`` times PGD's largest value (else the
tightest bound's). A bound whose mean lies above it at every ε is named in the
legend with its range instead of drawn, one that crosses it is drawn and its
legend entry gives its largest value: SpecFormer's 1e23 would otherwise
flatten every other curve to one line."""

RATIO_CLIP = 30.0
"""Span of the ratio panel: factors above ``RATIO_CLIP`` times the tightest
bound's (and above ``RATIO_CLIP``) are off the scale (annotated), so that
factors such as 1× and 8× stay distinguishable."""


def _ratio_panel(rax, eps: np.ndarray, means: Mapping[str, tuple],
                 p_mean: np.ndarray) -> None:
    """``bound / PGD`` per ε, clipped to ``[~1, clip]`` with ``clip`` =
    ``RATIO_CLIP`` × max(1, the tightest bound's smallest factor): the tightest
    bound is always drawn; off-scale methods are named with their range above
    the panel, one per line."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = {name: mean / p_mean for name, (mean, _, _) in means.items()}
    finite = {name: r[np.isfinite(r)] for name, r in ratios.items()}
    lows = [f.min() for f in finite.values() if f.size]
    clip = RATIO_CLIP * max(1.0, min(lows, default=1.0))
    off, shown = [], []
    for name, (_, color, style) in means.items():
        r, f = ratios[name], finite[name]
        if f.size and f.min() > clip:
            off.append(f"{name}: {f.min():.3g}–{f.max():.3g}×")
            continue
        if f.size and f.max() > clip:
            off.append(f"{name}: up to {f.max():.3g}×")
        rax.plot(eps, np.minimum(r, clip), marker="o", markersize=4,
                 color=color, linestyle=style, label=name)
        shown.append(f)
    values = np.concatenate(shown) if shown else np.array([1.0])
    top = min(clip, max(1.1, values.max() * 1.25))
    bottom = min(0.95, values.min() * 0.95)
    rax.axhline(1.0, color="black", linestyle=":", linewidth=1)
    if top / bottom >= 10:
        rax.set_yscale("log")
    rax.set_ylim(bottom, top)
    rax.set_ylabel("bound / PGD")
    rax.grid(True, which="both", alpha=0.25)
    if off:  # above the panel, clear of the curves
        rax.set_title("off scale: " + "\n".join(off), loc="left", fontsize="small")


def plot_spectra(
    sigma: Mapping[str, Mapping[str, ArrayLike]],
    *,
    log: bool | None = None,
    title: str | None = None,
    path: PathLike | None = None,
    pdf: bool = False,
) -> Figure:
    """σ_max per layer and head, checkpoints side by side (SpecFormer Fig. 2a).

    Args:
        sigma: checkpoint label → matrix name (``"W_q"``, ``"W_k"``, ``"W_v"``,
            ``"W_v W_o"``, ...) → array ``(L, H)`` (layers × heads) or ``(L,)``.
            One panel per matrix; bars grouped by layer, one colour per
            checkpoint.
        log: log y; ``None`` chooses it per panel when values span decades.
        path, pdf: where to save.
    """
    if not sigma:
        raise ValueError("nothing to plot: no checkpoints given")
    labels = list(sigma)
    matrices = list(dict.fromkeys(m for per in sigma.values() for m in per))
    fig, axes = new_figure(max(6.4, 1.2 + 0.9 * _n_layers(sigma)),
                           1.0 + 2.1 * len(matrices), nrows=len(matrices))
    colors = [f"C{i}" for i in range(len(labels))]
    for row, matrix in enumerate(matrices):
        ax = axes[row, 0]
        arrays = {}
        for label in labels:
            if matrix not in sigma[label]:
                raise ValueError(f"checkpoint {label!r} has no values for {matrix!r}")
            a = np.asarray(sigma[label][matrix], dtype=float)
            arrays[label] = a.reshape(a.shape[0], -1)  # (L, H)
        shapes = {a.shape for a in arrays.values()}
        if len(shapes) != 1:
            raise ValueError(f"{matrix}: checkpoints have different shapes {shapes}")
        L, H = shapes.pop()
        width = 0.8 / len(labels)
        for k, (label, a) in enumerate(arrays.items()):
            pos = (np.arange(L)[:, None] * (H + 1) + np.arange(H)[None, :]).ravel()
            ax.bar(pos + (k - (len(labels) - 1) / 2) * width, a.ravel(), width=width,
                   color=colors[k], label=label)
        ax.set_xticks(np.arange(L) * (H + 1) + (H - 1) / 2)
        ax.set_xticklabels([f"block {i}" for i in range(L)])
        use_log = spans_decades(*arrays.values()) if log is None else log
        if use_log:
            ax.set_yscale("log")
        ax.set_ylabel(f"σ_max({_math(matrix)})")
        ax.grid(True, axis="y", which="both", alpha=0.25)
        if row == 0:
            ax.legend(fontsize="small", loc="best")
            if title:
                ax.set_title(title)
    axes[-1, 0].set_xlabel(f"transformer block (bars within a block: heads 1–{H})"
                           if H > 1 else "transformer block")
    return _finish(fig, path, pdf)


def _n_layers(sigma: Mapping[str, Mapping[str, ArrayLike]]) -> int:
    return max(np.asarray(a).shape[0] for per in sigma.values() for a in per.values())


def _kde(values: np.ndarray, coords: np.ndarray) -> np.ndarray:
    # A Gaussian KDE; constant data (no spread) gets a flat profile.
    if values.size < 2 or np.ptp(values) == 0:
        return np.ones_like(coords)
    return mlab.GaussianKDE(values, "scott").evaluate(coords)


def plot_jacobian_violin(
    series: Mapping[str, Mapping[str, ArrayLike]] | Mapping[str, ArrayLike],
    *,
    y_label: str = "σ_max of the block Jacobian",
    log: bool | None = None,
    title: str | None = None,
    styles: Mapping[str, Mapping[str, Any]] | None = None,
    path: PathLike | None = None,
    pdf: bool = False,
) -> Figure:
    """Per-block distributions over samples as violins (Cauchy-problem paper Fig. 3).

    Args:
        series: series label (e.g. ``"vanilla: σ_max"``, ``"MSVP: √(‖J‖₁‖J‖∞)"``)
            → block label → per-sample values ``(n,)``; violins of one block
            stand side by side. A plain mapping block → values is one series.
        log: log y; ``None`` when values span decades. On a log axis the
            densities are estimated on ``log10`` of the values, so the shapes
            are true densities of the plotted scale.
        styles: series label → ``{"color": ..., "hatch": ...}`` (e.g. one colour
            per model, one hatch per estimator); default one colour per series.
        path, pdf: where to save.
    """
    if not series:
        raise ValueError("nothing to plot: no data given")
    styles = styles or {}
    first = next(iter(series.values()))
    if not isinstance(first, Mapping):
        series = {"": series}  # type: ignore[dict-item]
    blocks = list(dict.fromkeys(b for per in series.values() for b in per))
    data = {s: {b: np.asarray(per[b], dtype=float).ravel() for b in per}
            for s, per in series.items()}
    all_values = [v for per in data.values() for v in per.values()]
    if any(v.size == 0 or not np.all(np.isfinite(v)) for v in all_values):
        raise ValueError("every block needs at least one finite value")
    use_log = spans_decades(*all_values) if log is None else log
    if use_log and any(np.any(v <= 0) for v in all_values):
        raise ValueError("a log axis needs positive values")
    fig, axes = new_figure(max(6.4, 1.5 + 1.1 * len(blocks) * max(1, len(series) / 2)),
                           4.2)
    ax = axes[0, 0]
    n_series = len(data)
    width = 0.8 / n_series
    handles = []
    for k, (label, per) in enumerate(data.items()):
        color = styles.get(label, {}).get("color", f"C{k}")
        hatch = styles.get(label, {}).get("hatch")
        pos = [blocks.index(b) + (k - (n_series - 1) / 2) * width for b in per]
        raw = list(per.values())
        stats = cbook.violin_stats([np.log10(v) for v in raw] if use_log else raw, _kde)
        for st, v in zip(stats, raw, strict=True):
            if use_log:  # densities of log10 values, drawn at the values themselves
                st["coords"] = 10 ** np.asarray(st["coords"])
            st.update(mean=v.mean(), median=np.median(v), min=v.min(), max=v.max())
        parts = ax.violin(stats, positions=pos, widths=width * 0.95, showmedians=True,
                          showextrema=True)
        for body in parts["bodies"]:
            body.set_facecolor(color)
            body.set_edgecolor(color)
            body.set_alpha(0.45)
            body.set_hatch(hatch)
        for key in ("cmedians", "cmins", "cmaxes", "cbars"):
            if key in parts:
                parts[key].set_color(color)
        if label:
            handles.append(Patch(facecolor=color, edgecolor=color, alpha=0.45,
                                 hatch=hatch, label=label))
    if use_log:
        ax.set_yscale("log")
    ax.set_xticks(range(len(blocks)))
    ax.set_xticklabels(blocks)
    ax.set_xlabel("block")
    ax.set_ylabel(y_label)
    ax.grid(True, axis="y", which="both", alpha=0.25)
    if handles:
        ax.legend(handles=handles, fontsize="small", loc="best")
    if title:
        ax.set_title(title)
    return _finish(fig, path, pdf)


def plot_tsne(
    embedding: ArrayLike,
    labels: ArrayLike,
    attacked: ArrayLike,
    *,
    a_distance: float | None = None,
    color_by: Literal["source", "class"] = "source",
    attacked_label: str = "attacked",
    title: str | None = None,
    class_names: Sequence[str] | None = None,
    path: PathLike | None = None,
    pdf: bool = False,
) -> Figure:
    """t-SNE of clean and attacked features (SpecFormer Fig. 2b–c).

    Args:
        embedding: ``(m, 2)`` t-SNE coordinates.
        labels: ``(m,)`` true classes.
        attacked: ``(m,)`` bool, the point is an attacked image's feature.
        a_distance: shown in the title when given.
        color_by: ``"source"``: clean green, attacked orange (the paper's
            colours); ``"class"``: colour by class, marker by source.
        attacked_label: legend text for attacked points (e.g. ``"PGD ε=8/255"``).
        class_names: ``color_by="class"``: legend name of class ``c`` is
            ``class_names[c]`` (:attr:`lipvit.data.Dataset.class_names`);
            ``None``: the class number.
        path, pdf: where to save.
    """
    emb = np.asarray(embedding, dtype=float)
    if emb.ndim != 2 or emb.shape[1] != 2:
        raise ValueError(f"embedding must have shape (m, 2), got {emb.shape}")
    labels = np.asarray(labels).ravel()
    attacked = np.asarray(attacked, dtype=bool).ravel()
    if labels.size != emb.shape[0] or attacked.size != emb.shape[0]:
        raise ValueError("embedding, labels and attacked need the same length")
    fig, axes = new_figure(6.0, 5.6)
    ax = axes[0, 0]
    if color_by == "source":
        for mask, name, color in ((~attacked, "clean", "tab:green"),
                                  (attacked, attacked_label, "tab:orange")):
            ax.scatter(emb[mask, 0], emb[mask, 1], s=9, c=color, alpha=0.7,
                       linewidths=0, label=f"{name} (n={int(mask.sum())})")
        ax.legend(fontsize="small", loc="best", markerscale=2)
    elif color_by == "class":
        classes = np.unique(labels)
        for i, cls in enumerate(classes):
            for mask, marker in ((~attacked, "o"), (attacked, "x")):
                sel = mask & (labels == cls)
                ax.scatter(emb[sel, 0], emb[sel, 1], s=10, marker=marker,
                           c=f"C{i % 10}", alpha=0.7,
                           linewidths=0.8 if marker == "x" else 0)
        handles = [Patch(color=f"C{i % 10}",
                         label=str(c) if class_names is None else class_names[c])
                   for i, c in enumerate(classes)]
        ax.legend(handles=handles, title="class (o clean, x attacked)",
                  fontsize="x-small", loc="best", ncols=2)
    else:
        raise ValueError(f"color_by must be 'source' or 'class', got {color_by!r}")
    ax.set_xlabel("t-SNE 1")
    ax.set_ylabel("t-SNE 2")
    ax.set_xticks([])
    ax.set_yticks([])
    parts = [title] if title else []
    if a_distance is not None:
        parts.append(f"A-distance (clean vs attacked) = {a_distance:.3f}")
    if parts:
        ax.set_title("\n".join(parts), fontsize="medium")
    return _finish(fig, path, pdf)
