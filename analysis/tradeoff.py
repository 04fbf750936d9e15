"""Accuracy against certified accuracy, one point per trained model (``lipvit plot
tradeoff``).

Each ``lipvit certify --json`` file is one training setting: its clean accuracy
(on the certified points, or the model's whole test set from the training
summary) on the x axis and its certified accuracy at each requested ε, for one
method, on the y axis. Training for certificates (``--margin``,
``--relu-stability``, ``--cert-eps``) moves a model along this plane: up is
more certified points, left is less accuracy.

``smoothing`` certifies the *smoothed* classifier, not the network: its clean
point is the smoothed classifier's accuracy on the certified points
(:func:`smoothed_accuracy`, abstentions counting as wrong), never the network's
``clean_accuracy``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from lipvit.analysis.plots import PathLike, _finish, new_figure
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import PercentFormatter


@dataclass(frozen=True)
class TradeoffPoint:
    """One training setting: its clean accuracy and certified accuracy per ε."""

    label: str
    clean: float
    certified: dict[float, float]  # ε → certified accuracy


def certified_at(data: Mapping, method: str, eps: float, where: str) -> float:
    """The certified accuracy of ``method`` at ``eps`` in a certify JSON's results
    (ε matched to a relative 1e-9); ``ValueError`` naming ``where`` if absent."""
    for row in data.get("results") or []:
        if row.get("method") == method and np.isclose(float(row["eps"]), eps,
                                                        rtol=1e-9, atol=0.0):
            return float(row["certified_accuracy"])
    have = sorted({(r.get("method"), float(r["eps"]))
                   for r in data.get("results") or []})
    raise ValueError(f"{where}: no {method} result at eps {eps:g} "
                     f"(it has {', '.join(f'{m}@{e:g}' for m, e in have) or 'none'})")


def smoothed_accuracy(data: Mapping, where: str) -> float:
    """The smoothed classifier's accuracy in a certify JSON with ``smoothing``:
    its ``smoothing.smoothed_accuracy`` or, in a file written before that key,
    the fraction of ``samples`` whose ``smoothing.prediction`` is the label
    (abstentions, −1, count as wrong). ``ValueError`` naming ``where`` if the
    file has neither."""
    block = data.get("smoothing")
    acc = block.get("smoothed_accuracy") if isinstance(block, Mapping) else None
    if isinstance(acc, int | float) and not isinstance(acc, bool):
        return float(acc)
    samples = data.get("samples") or []
    if samples and all(isinstance(s, Mapping) and isinstance(s.get("smoothing"),
                                                             Mapping)
                       for s in samples):
        right = sum(s["smoothing"].get("prediction") == s.get("label")
                    for s in samples)
        return right / len(samples)
    raise ValueError(f"{where}: no smoothed classifier accuracy (smoothing."
                     "smoothed_accuracy, or per-sample smoothing predictions): "
                     "certify it with `lipvit certify --method smoothing --json`")


def _label_coinciding(ax, p: TradeoffPoint, colour: str) -> None:
    """Say in words where several ε of one setting share a point (only the top
    marker would show), e.g. a setting that certifies nothing at any ε."""
    groups: dict[float, list[float]] = {}
    for e in sorted(p.certified):
        groups.setdefault(p.certified[e], []).append(e)
    for acc, es in groups.items():
        if len(es) > 1:
            ax.annotate(f"ε = {', '.join(f'{e:g}' for e in es)}: all {acc:.0%}",
                        (p.clean, acc), xytext=(8, 6), textcoords="offset points",
                        fontsize="small", color=colour, zorder=4)


def plot_tradeoff(points: Sequence[TradeoffPoint], *, method: str,
                  clean_label: str = "clean accuracy", title: str | None = None,
                  path: PathLike | None = None, pdf: bool = False) -> Figure:
    """Certified accuracy (y) against clean accuracy (x): one colour per setting,
    one marker per ε, a setting's points at several ε joined by a thin line of
    its colour; ε that share a point are named beside it. Axes fit the data
    (with a margin), both in percent."""
    if not points:
        raise ValueError("nothing to plot: no training settings given")
    eps_values = sorted({e for p in points for e in p.certified})
    fig, axes = new_figure(width=8.0, height=4.8)
    ax = axes[0, 0]
    markers = "osD^v<>pP*Xh"
    xs, ys = [], []
    for i, p in enumerate(points):
        colour = f"C{i % 10}"
        es = sorted(p.certified)
        ax.plot([p.clean] * len(es), [p.certified[e] for e in es], color=colour,
                linewidth=1.0, alpha=0.6, zorder=1)
        for e in es:
            ax.plot(p.clean, p.certified[e], color=colour, linestyle="none",
                    marker=markers[eps_values.index(e) % len(markers)],
                    markersize=8, markeredgecolor="black", markeredgewidth=0.5,
                    zorder=3, clip_on=False)
            xs.append(p.clean)
            ys.append(p.certified[e])
        _label_coinciding(ax, p, colour)
    xs_a, ys_a = np.array(xs), np.array(ys)
    xpad = max(0.01, 0.08 * float(xs_a.max() - xs_a.min()))
    ypad = max(0.02, 0.08 * float(ys_a.max() - ys_a.min()))
    ax.set_xlim(max(0.0, xs_a.min() - xpad), min(1.0, xs_a.max() + xpad) + 1e-9)
    ax.set_ylim(max(0.0, ys_a.min() - ypad), min(1.0, ys_a.max() + ypad) + 1e-9)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel(clean_label)
    ax.set_ylabel(f"certified accuracy ({method})")
    ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], color=f"C{i % 10}", linewidth=2.0, label=p.label)
               for i, p in enumerate(points)]
    handles += [Line2D([], [], color="0.5", marker=markers[i % len(markers)],
                       markeredgecolor="black", markeredgewidth=0.5, linestyle="none",
                       label=f"ε = {e:g}") for i, e in enumerate(eps_values)]
    ax.legend(handles=handles, fontsize="small", loc="upper left",
              bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    if title:
        ax.set_title(title)
    return _finish(fig, path, pdf)
