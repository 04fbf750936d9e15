"""Print every figure docs/results/digits.md (and the README's headline table)
quotes from a pipeline run, with the machine and date.

Usage::

    lipvit pipeline --out runs/demo          # or: python -m lipvit pipeline ...
    python bench/user/readme_figures.py runs/demo

It only reads the run's JSON files (nothing is recomputed), so its output is
exactly what that run measured; the same figures, as numbers, go to
``--out``/readme_figures.json. Which numbers depend on the machine: the
timings (wall seconds; on a shared machine several times the CPU time) and,
through floating-point summation order in the BLAS, the trained weights, hence
accuracies, spectra, ratios and certified accuracies in their second or third
digit. The bounds' soundness does not depend on the machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    return (f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} "
            f"CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"python {platform.python_version()}")


def _ratio_range(rows: list[dict], method: str) -> tuple[float, float] | None:
    values = [r["ratio"] for r in rows if r["method"] == method]
    return (min(values), max(values)) if values else None


def _ratios(rows: list[dict], method: str) -> str:
    span = _ratio_range(rows, method)
    if span is None:
        return "-"
    lo, hi = span
    return f"{lo:.3g}×" if f"{lo:.3g}" == f"{hi:.3g}" else f"{lo:.3g}–{hi:.3g}×"


def report(out: Path, figures: dict | None = None) -> list[str]:
    """The README's figures from the run directory ``out``, one line each (and,
    as numbers, into ``figures`` if given)."""
    fig: dict[str, Any] = {} if figures is None else figures
    now = dt.datetime.now(dt.UTC)
    fig.update(run=str(out), machine=machine(), date=f"{now:%Y-%m-%d %H:%M} UTC")
    lines = [f"run {out}", f"machine: {fig['machine']}", f"date: {fig['date']}"]
    record = _read(out / "pipeline.json") or {}
    if record:
        lines.append(
            f"pipeline: {record.get('total_seconds', 0):.0f} s wall over all steps "
            f"(last run {record.get('last_run_seconds', 0):.0f} s; fast="
            f"{record.get('fast')})")
        fig["pipeline"] = {"total_seconds": record.get("total_seconds", 0),
                           "last_run_seconds": record.get("last_run_seconds", 0),
                           "fast": record.get("fast")}
    for name in ("vanilla", "msvp", "lipschitz"):
        summary = _read(out / "models" / f"{name}.json")
        if summary:
            sig = summary.get("sigma_max") or {}
            lines.append(f"training {name}: test accuracy "
                         f"{100 * summary['test_acc']:.1f} %, mean σ_max(W_q,W_k,W_v) "
                         f"{sig.get('mean', float('nan')):.3g}")
            fig.setdefault("training", {})[name] = {
                "test_acc": summary["test_acc"],
                "sigma_max_mean": sig.get("mean", float("nan"))}
    spec = _read(out / "spectrum" / "spectrum.json")
    if spec:
        for row in (spec.get("comparison") or {}).get("rows", []):
            if row.get("layer") == 0:
                labels = list(spec["weights"])
                values = " → ".join(f"{row[lb]:.3g}" for lb in labels)
                lines.append(f"spectrum block 0 {row['matrix']}: {values} "
                             f"({' → '.join(labels)})")
                fig.setdefault("spectrum_block_0", {})[row["matrix"]] = {
                    lb: row[lb] for lb in labels}
        for label, jac in (spec.get("jacobian") or {}).items():
            lines.append(f"Jacobian σ_max block 0 ({label}): "
                         f"{jac['sigma_mean'][0]:.3g}")
            fig.setdefault("jacobian_sigma_max_block_0", {})[label] = (
                jac["sigma_mean"][0])
    for key in ("layer", "layer-residual", "layer-vanilla", "network"):
        data = _read(out / "tightness" / key / "tightness.json")
        if not data:
            continue
        methods = list(dict.fromkeys(r["method"] for r in data["rows"]))
        ratios = ", ".join(f"{m} {_ratios(data['rows'], m)}" for m in methods)
        lines.append(f"tightness {key} (bound/PGD over ε {min(data['eps']):g}–"
                     f"{max(data['eps']):g}): {ratios}")
        notes = [n for n in data.get("notes") or [] if n.startswith("degenerate")]
        for note in notes:
            lines.append(f"  note: {note}")
        fig.setdefault("tightness", {})[key] = {
            "eps": [min(data["eps"]), max(data["eps"])],
            "bound_over_pgd": {m: _ratio_range(data["rows"], m) for m in methods},
            "notes": notes}
    for name in ("vanilla", "msvp", "lipschitz"):
        attacked = _read(out / "attack" / f"{name}.json")
        if attacked:
            rows = [r for r in attacked["results"] if r["attack"] == "worst-case"]
            worst = ", ".join(f"ε = {r['eps']:g}: {r['robust_accuracy']:.3g}"
                              for r in rows)
            clean = attacked["clean_accuracy"]
            lines.append(f"attack {name} ({'+'.join(attacked['attacks'])}, "
                         f"n = {attacked['n']}, clean {clean:.3g}) "
                         f"robust accuracy, worst case: {worst}")
            fig.setdefault("attack", {})[name] = {
                "attacks": attacked["attacks"], "n": attacked["n"],
                "clean_accuracy": clean,
                "worst_case": {r["eps"]: r["robust_accuracy"] for r in rows}}
    radius = _read(out / "attack" / "radius.json")
    if radius:
        summary = radius["summary"]
        lines.append(f"attack radii of lipschitz ({'+'.join(radius['attacks'])}): "
                     f"median {summary['median_radius']:.3g} over "
                     f"{summary['n_radius']} points, "
                     f"{summary['seconds_per_sample']:.3g} s/sample")
        fig["attack_radius_lipschitz"] = {
            "attacks": radius["attacks"], "median_radius": summary["median_radius"],
            "n_radius": summary["n_radius"],
            "seconds_per_sample": summary["seconds_per_sample"]}
    for name in ("lipschitz", "msvp"):
        cert = _read(out / "certify" / f"{name}.json")
        if not cert:
            continue
        lines.append(f"certify {name} (n = {cert['n']}, clean accuracy "
                     f"{cert['clean_accuracy']:.3g}):")
        entry = fig.setdefault("certify", {})[name] = {
            "n": cert["n"], "clean_accuracy": cert["clean_accuracy"], "results": [],
            "median_radius": {}}
        for r in cert["results"]:
            lines.append(f"  {r['method']:<12} ε = {r['eps']:<7g} certified "
                         f"{r['certified_accuracy']:.3g}  {r['seconds_per_sample']:.3g}"
                         f" s/sample  {'certificate' if r['exact'] else 'estimate'}")
            entry["results"].append({k: r[k] for k in (
                "method", "eps", "certified_accuracy", "seconds_per_sample",
                "exact")})
        samples = cert.get("samples", [])
        correct = [r for r in samples if r["label"] == r["prediction"]]
        for method in dict.fromkeys(m for r in correct for m in r.get("radii", {})):
            radii = sorted(r["radii"][method] for r in correct)
            if radii:
                lines.append(f"  {method}: median certified radius "
                             f"{radii[len(radii) // 2]:.3g} over the {len(radii)} "
                             f"correctly classified points")
                entry["median_radius"][method] = {
                    "radius": radii[len(radii) // 2], "points": len(radii)}
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", type=Path, default=Path("runs/demo"),
                        help="the pipeline run's folder (default: runs/demo)")
    add_out(parser, __file__)
    args = parser.parse_args(argv)
    out = args.run
    if not (out / "pipeline.json").is_file():
        print(f"{out}: no pipeline run here (run `lipvit pipeline --out {out}`)",
              file=sys.stderr)
        return 1
    figures: dict[str, Any] = {}
    print("\n".join(report(out, figures)))
    write_json(args.out, __file__, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
