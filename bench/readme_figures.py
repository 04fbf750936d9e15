"""Print every figure docs/results.md (and the README's headline table) quotes from
a pipeline run, with the machine and date.

Usage::

    lipvit pipeline --out runs/demo          # or: python -m lipvit pipeline ...
    python bench/readme_figures.py runs/demo

It only reads the run's JSON files (nothing is recomputed), so its output is
exactly what that run measured. Which numbers depend on the machine: the
timings (wall seconds; on a shared machine several times the CPU time) and,
through floating-point summation order in the BLAS, the trained weights, hence
accuracies, spectra, ratios and certified accuracies in their second or third
digit. The bounds' soundness does not depend on the machine.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any


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


def _ratios(rows: list[dict], method: str) -> str:
    values = [r["ratio"] for r in rows if r["method"] == method]
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{lo:.3g}×" if f"{lo:.3g}" == f"{hi:.3g}" else f"{lo:.3g}–{hi:.3g}×"


def report(out: Path) -> list[str]:
    """The README's figures from the run directory ``out``, one line each."""
    lines = [f"run {out}", f"machine: {machine()}",
             f"date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC"]
    record = _read(out / "pipeline.json") or {}
    if record:
        lines.append(
            f"pipeline: {record.get('total_seconds', 0):.0f} s wall over all steps "
            f"(last run {record.get('last_run_seconds', 0):.0f} s; fast="
            f"{record.get('fast')})")
    for name in ("vanilla", "msvp", "lipschitz"):
        summary = _read(out / "models" / f"{name}.json")
        if summary:
            sig = summary.get("sigma_max") or {}
            lines.append(f"training {name}: test accuracy "
                         f"{100 * summary['test_acc']:.1f} %, mean σ_max(W_q,W_k,W_v) "
                         f"{sig.get('mean', float('nan')):.3g}")
    spec = _read(out / "spectrum" / "spectrum.json")
    if spec:
        for row in (spec.get("comparison") or {}).get("rows", []):
            if row.get("layer") == 0:
                labels = list(spec["weights"])
                values = " → ".join(f"{row[lb]:.3g}" for lb in labels)
                lines.append(f"spectrum block 0 {row['matrix']}: {values} "
                             f"({' → '.join(labels)})")
        for label, jac in (spec.get("jacobian") or {}).items():
            lines.append(f"Jacobian σ_max block 0 ({label}): "
                         f"{jac['sigma_mean'][0]:.3g}")
    for key in ("layer", "layer-residual", "layer-vanilla", "network"):
        data = _read(out / "tightness" / key / "tightness.json")
        if not data:
            continue
        methods = list(dict.fromkeys(r["method"] for r in data["rows"]))
        ratios = ", ".join(f"{m} {_ratios(data['rows'], m)}" for m in methods)
        lines.append(f"tightness {key} (bound/PGD over ε {min(data['eps']):g}–"
                     f"{max(data['eps']):g}): {ratios}")
        for note in data.get("notes") or []:
            if note.startswith("degenerate"):
                lines.append(f"  note: {note}")
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
    radius = _read(out / "attack" / "radius.json")
    if radius:
        summary = radius["summary"]
        lines.append(f"attack radii of lipschitz ({'+'.join(radius['attacks'])}): "
                     f"median {summary['median_radius']:.3g} over "
                     f"{summary['n_radius']} points, "
                     f"{summary['seconds_per_sample']:.3g} s/sample")
    for name in ("lipschitz", "msvp"):
        cert = _read(out / "certify" / f"{name}.json")
        if not cert:
            continue
        lines.append(f"certify {name} (n = {cert['n']}, clean accuracy "
                     f"{cert['clean_accuracy']:.3g}):")
        for r in cert["results"]:
            lines.append(f"  {r['method']:<12} ε = {r['eps']:<7g} certified "
                         f"{r['certified_accuracy']:.3g}  {r['seconds_per_sample']:.3g}"
                         f" s/sample  {'certificate' if r['exact'] else 'estimate'}")
        samples = cert.get("samples", [])
        correct = [r for r in samples if r["label"] == r["prediction"]]
        for method in dict.fromkeys(m for r in correct for m in r.get("radii", {})):
            radii = sorted(r["radii"][method] for r in correct)
            if radii:
                lines.append(f"  {method}: median certified radius "
                             f"{radii[len(radii) // 2]:.3g} over the {len(radii)} "
                             f"correctly classified points")
    return lines


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path("runs/demo")
    if not (out / "pipeline.json").is_file():
        print(f"{out}: no pipeline run here (run `lipvit pipeline --out {out}`)",
              file=sys.stderr)
        return 1
    print("\n".join(report(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
