"""``lipvit plot``: figures from the JSON results of other commands.

``plot`` is a click group; each figure kind is a subcommand (``certified``,
``gap``, ``tradeoff``; others may be added with ``@plot.command``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
import numpy as np

from lipvit.commands import _common as C
from lipvit.errors import LipvitError


@click.group("plot")
def plot() -> None:
    """Draw figures from results files (PNG; PDF with --pdf)."""


def _kind(path: Path, data: Any) -> str:
    """``"certify"`` or ``"attack"`` by content; anything else is an error."""
    rows = data.get("results") if isinstance(data, Mapping) else None
    if isinstance(rows, list) and rows and all(isinstance(r, Mapping) for r in rows):
        if all({"method", "eps", "certified_accuracy"} <= set(r) for r in rows):
            return "certify"
        if all({"attack", "eps", "robust_accuracy"} <= set(r) for r in rows):
            return "attack"
    raise LipvitError(f"{path}: not the --json output of `lipvit certify` or "
                      "`lipvit attack` (no results with method/eps/certified_accuracy "
                      "or attack/eps/robust_accuracy)")


def _labels(paths: list[Path]) -> dict[Path, str]:
    """A short prefix per file when several are overlaid: the file stem (or path)."""
    if len(paths) <= 1:
        return {p: "" for p in paths}
    stems = [p.stem for p in paths]
    names = stems if len(set(stems)) == len(stems) else [str(p) for p in paths]
    return {p: f"{name}: " for p, name in zip(paths, names, strict=True)}


Curve = tuple[str, str, np.ndarray, np.ndarray]  # (label, method, x, accuracy)


def _series_name(method: str, rows: list[Mapping]) -> str:
    """The method as its series is labelled: ``smoothing (probabilistic:
    smoothed classifier, σ = ..., 1 − α = ...)`` for a probabilistic guarantee,
    ``name (estimate)`` for an estimate, else the bare name."""
    from lipvit.analysis.plots import probabilistic_label

    if any(r.get("guarantee") == "probabilistic" for r in rows):
        return probabilistic_label(method, rows[0].get("sigma"), rows[0].get("alpha"))
    estimate = any(r.get("exact") is False for r in rows)
    return method + (" (estimate)" if estimate else "")


def _method_curves(data: Mapping, prefix: str) -> list[Curve]:
    by_method: dict[str, list] = {}
    for row in data["results"]:
        by_method.setdefault(row["method"], []).append(row)
    curves = []
    for method, rows in by_method.items():
        rows = sorted(rows, key=lambda r: float(r["eps"]))
        label = f"{prefix}{_series_name(method, rows)}"
        curves.append((label, method, np.array([float(r["eps"]) for r in rows]),
                       np.array([float(r["certified_accuracy"]) for r in rows])))
    return curves


def _radius_curve(path: Path, data: Mapping, prefix: str) -> list[Curve]:
    """Certified accuracy at radius r: correctly classified and radius ≥ r.

    One curve per method of the per-sample ``radii`` mapping when present,
    else one from the per-sample ``radius``.
    """
    samples = data.get("samples") or []
    if samples and all(isinstance(s.get("radii"), Mapping) and s["radii"]
                       for s in samples):
        methods = list(dict.fromkeys(m for s in samples for m in s["radii"]))
        per = {m: [s["radii"].get(m) for s in samples] for m in methods}
    else:
        per = {data.get("radius_method") or "": [s.get("radius") for s in samples]}
    if not samples or all(r is None for radii in per.values() for r in radii):
        raise LipvitError(
            f"{path}: no per-sample radii (run `lipvit certify --radius`)")
    correct = np.array([s.get("prediction") == s.get("label") for s in samples])
    rows: dict[str, list] = {}
    for row in data.get("results") or []:
        rows.setdefault(row.get("method"), []).append(row)
    curves = []
    for method, radii in per.items():
        if method == "smoothing":  # the smoothed classifier's own prediction
            correct_m = np.array([(s.get("smoothing") or {}).get("prediction")
                                  == s.get("label") for s in samples])
        else:
            correct_m = correct
        ok = correct_m & np.array([r is not None for r in radii])
        r = np.array([float(x) if x is not None else 0.0 for x in radii])
        r = np.where(ok, r, -np.inf)  # misclassified: certified at no radius
        top = float(r[ok].max()) if ok.any() else 0.0
        grid = np.linspace(0.0, 1.1 * top if top > 0 else 1.0, 400)
        acc = (r[None, :] >= grid[:, None]).mean(axis=1)  # (400,)
        name = _series_name(method, rows[method]) if method in rows else method
        label = f"{prefix}certified radius" + (f" ({name})" if name else "")
        curves.append((label, method, grid, acc))
    return curves


def _empirical(path: Path, data: Mapping, prefix: str) -> list[Curve]:
    norm = data.get("norm")
    if norm != "l2":
        raise LipvitError(f"{path}: attack results are in the {norm} threat model; "
                          "certified accuracy is l2 (run `lipvit attack --norm l2`)")
    rows = sorted((r for r in data["results"] if r["attack"] == "worst-case"),
                  key=lambda r: float(r["eps"]))
    attacks = data.get("attacks") or sorted(
        {r["attack"] for r in data["results"]} - {"worst-case"})
    if not rows:  # a file without the worst-case rows: one curve per attack
        rows_by = {a: sorted((r for r in data["results"] if r["attack"] == a),
                             key=lambda r: float(r["eps"])) for a in attacks}
    else:
        rows_by = {", ".join(attacks): rows}
    return [(f"{prefix}under attack ({name})", "attack",
             np.array([float(r["eps"]) for r in rs]),
             np.array([float(r["robust_accuracy"]) for r in rs]))
            for name, rs in rows_by.items()]


def _styles(cert: list[list[Curve]], attacks: list[list[Curve]]) -> dict[str, dict]:
    # Colour per method (per run if one method), marker and line style per run;
    # attacks in greys.
    methods = list(dict.fromkeys(c[1] for run in cert for c in run))
    markers, dashes = "osD^v<>p", ["-", "-.", ":", (0, (5, 1))]
    styles = {}
    for i, run in enumerate(cert):
        for label, method, _, _ in run:
            colour = i if len(methods) == 1 else methods.index(method)
            styles[label] = {"color": f"C{colour % 10}",
                             "marker": markers[i % len(markers)],
                             "linestyle": dashes[i % len(dashes)]}
    greys = ["black", "dimgray", "darkgray", "silver"]
    for i, run in enumerate(attacks):
        for j, (label, *_) in enumerate(run):
            styles[label] = {"color": greys[(i + j) % len(greys)],
                             "marker": "xP+*"[i % 4]}
    return styles


@plot.command("certified")
@click.argument("results", nargs=-1, required=True,
                type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="figure file (.png; .pdf for PDF)")
@click.option("--x", "x_axis", type=click.Choice(["eps", "radius"]), default="eps",
              show_default=True,
              help="eps: certified accuracy per method at each eps; radius: "
                   "fraction certified at each radius (needs certify --radius)")
@click.option("--title", default=None)
@C.pdf_option
@C.force_option
def certified(results: tuple[Path, ...], out: Path, x_axis: str, title: str | None,
              pdf: bool, force: bool) -> None:
    """Certified accuracy against eps or radius from `lipvit certify --json`
    files, several runs and methods overlaid; `lipvit attack --json` files
    (l2) add the attacks' robust accuracy as the empirical ceiling."""
    from lipvit.analysis.plots import (  # matplotlib: a slow import
        figure_paths,
        plot_certified_accuracy,
        save_figure,
    )

    targets = figure_paths(out, pdf)
    C.check_writable(targets, force)
    loaded = [(p, C.read_json(p)) for p in results]
    kinds = {p: _kind(p, d) for p, d in loaded}
    cert = [p for p in results if kinds[p] == "certify"]
    if not cert:
        raise LipvitError("no `lipvit certify --json` file given")
    prefix = _labels(cert) | _labels([p for p in results if kinds[p] == "attack"])
    cert_runs, attack_runs = [], []
    for path, data in loaded:
        if kinds[path] == "certify":
            cert_runs.append(_method_curves(data, prefix[path]) if x_axis == "eps"
                             else _radius_curve(path, data, prefix[path]))
        else:
            attack_runs.append(_empirical(path, data, prefix[path]))
    curves = {c[0]: (c[2], c[3]) for run in cert_runs for c in run}
    empirical = {c[0]: (c[2], c[3]) for run in attack_runs for c in run}
    x_label = "ε (ℓ2 radius of the input ball)" if x_axis == "eps" \
        else "radius r (ℓ2)"
    y_label = "certified accuracy" + (" / robust accuracy under attack"
                                      if empirical else "")
    fig = plot_certified_accuracy(curves, empirical or None, x_label=x_label,
                                  y_label=y_label, title=title, step=x_axis == "radius",
                                  styles=_styles(cert_runs, attack_runs))
    save_figure(fig, out, pdf, force=force)
    click.echo(C.format_table(
        ["curve", "points", "max accuracy"],
        [[label, len(x), f"{float(np.max(acc)):.4f}"]
         for label, (x, acc) in {**curves, **empirical}.items()]))
    click.echo(f"wrote {', '.join(str(t) for t in targets)}")


@plot.command("gap")
@click.argument("certify_json", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("attack_json", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="figure file (.png; .pdf for PDF)")
@click.option("--method", "method_text", default=None,
              help="comma list of certification methods (default: every method "
                   "with radii in CERTIFY_JSON)")
@click.option("--first-order/--no-first-order", default=True, show_default=True,
              help="also draw the first-order limits (an estimate)")
@click.option("--title", default=None)
@C.pdf_option
@C.force_option
def gap(certify_json: Path, attack_json: Path, out: Path, method_text: str | None,
        first_order: bool, title: str | None, pdf: bool, force: bool) -> None:
    """Certification gap: per sample, the certified radius (`lipvit certify --radius
    --json`) against the smallest adversarial radius (`lipvit attack --radius
    --json`), matched by sample index, with the y = x line."""
    from lipvit.analysis.gap import join, summary_rows, violations
    from lipvit.analysis.plots import (  # matplotlib: a slow import
        figure_paths,
        plot_certification_gap,
        save_figure,
    )

    targets = figure_paths(out, pdf)
    C.check_writable(targets, force)
    cert = C.read_json(certify_json)
    methods = (C.parse_names(method_text, _radius_methods(cert), "method")
               if method_text else None)
    data = join(cert, C.read_json(attack_json), str(certify_json), str(attack_json),
                methods)
    fig = plot_certification_gap(data.attack, data.certified,
                                 first_order=data.first_order if first_order else None,
                                 estimates=data.estimates,
                                 probabilistic=data.probabilistic, title=title)
    save_figure(fig, out, pdf, force=force)
    click.echo(C.format_table(
        ["method", "points", "n", "median certified", "median attack",
         "median ratio", "median first-order"],
        [[r.label, r.points, r.n,
          r.median_certified, r.median_attack, r.median_ratio, r.median_first_order]
         for r in summary_rows(data)]))
    bad = {m: k for m, k in violations(data).items() if k}
    if bad:
        click.echo(f"warning: certified radius above the attack radius (unsound?): "
                   f"{bad}", err=True)
    click.echo(f"wrote {', '.join(str(t) for t in targets)}")


def _radius_methods(data: Any) -> list[str]:
    samples = data.get("samples") if isinstance(data, Mapping) else None
    return list(dict.fromkeys(m for s in samples or [] if isinstance(s, Mapping)
                              for m in (s.get("radii") or {})))


@plot.command("tradeoff")
@click.argument("results", nargs=-1, required=True,
                type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="figure file (.png; .pdf for PDF)")
@click.option("--eps", "eps_text", required=True,
              help="comma list of radii to plot (each file must hold them)")
@click.option("--method", default="taylor", show_default=True,
              help="the certification method of the y axis")
@click.option("--label", "labels", multiple=True,
              help="one name per file, in order (repeat the option) [default: "
                   "the file stems]")
@click.option("--clean", type=click.Choice(["points", "test"]), default="points",
              show_default=True,
              help="x axis: clean accuracy on the certified points, or on the whole "
                   "test set (the training summary beside the checkpoint); "
                   "--method smoothing: the smoothed classifier's accuracy on the "
                   "certified points (points only)")
@click.option("--title", default=None)
@C.pdf_option
@C.force_option
def tradeoff(results: tuple[Path, ...], out: Path, eps_text: str, method: str,
             labels: tuple[str, ...], clean: str, title: str | None, pdf: bool,
             force: bool) -> None:
    """Clean accuracy against certified accuracy at EPS, one point per training
    setting: each RESULTS file is the `lipvit certify --json` output of one
    model (e.g. plain, --margin, --relu-stability, --cert-eps). With --method
    smoothing the clean point is the smoothed classifier's accuracy
    (abstentions count as wrong), not the network's."""
    from lipvit.analysis.plots import figure_paths
    from lipvit.analysis.tradeoff import (
        TradeoffPoint,
        certified_at,
        plot_tradeoff,
        smoothed_accuracy,
    )
    from lipvit.train import summary_path

    targets = figure_paths(out, pdf)
    C.check_writable(targets, force)
    eps_list = C.parse_floats(eps_text, "eps")
    smoothed = method == "smoothing"
    if smoothed and clean == "test":
        raise LipvitError("--clean test is the network's test accuracy; smoothing's "
                          "clean point is the smoothed classifier's accuracy on the "
                          "certified points: use --clean points")
    if labels and len(labels) != len(results):
        raise LipvitError(f"--label given {len(labels)} times for {len(results)} "
                          "files; give one per file or none")
    names = list(labels) or [label.rstrip(": ") or p.stem
                             for p, label in _labels(list(results)).items()]
    points = []
    for path, name in zip(results, names, strict=True):
        data = C.read_json(path)
        if _kind(path, data) != "certify":
            raise LipvitError(f"{path}: an attack file; tradeoff needs "
                              "`lipvit certify --json` files")
        if smoothed:
            acc = smoothed_accuracy(data, str(path))
        elif clean == "points":
            acc = data.get("clean_accuracy")
        else:
            ckpt = data.get("checkpoint")
            summary = summary_path(ckpt) if ckpt else None
            if summary is None or not summary.is_file():
                raise LipvitError(f"{path}: no training summary beside its checkpoint "
                                  f"({summary}); use --clean points")
            acc = C.read_json(summary).get("test_acc")
        if not isinstance(acc, (int, float)):
            raise LipvitError(f"{path}: no clean accuracy")
        points.append(TradeoffPoint(name, float(acc), {
            e: certified_at(data, method, e, str(path)) for e in eps_list}))
    x_label = ("smoothed classifier accuracy (certified points)" if smoothed
               else "clean accuracy (certified points)" if clean == "points"
               else "test accuracy")
    plot_tradeoff(points, method=method, clean_label=x_label, title=title, path=out,
                  pdf=pdf)
    click.echo(C.format_table(
        ["setting", x_label] + [f"{method} @ {C.format_eps(e)}" for e in eps_list],
        [[p.label, f"{p.clean:.4f}"] + [f"{p.certified[e]:.4f}" for e in eps_list]
         for p in points]))
    click.echo(f"wrote {', '.join(str(t) for t in targets)}")
