"""Randomized smoothing beside the deterministic certificates, on one model.

A user with a standard ViT (LayerNorm, GELU) who wants a certified number at
ε = 0.25 turns to randomized smoothing (Cohen, Rosenfeld & Kolter 2019). Its
certificate is probabilistic and holds for the *smoothed* classifier, not the
network. This script puts the two kinds of guarantee side by side, on the
same test points of one Fashion-MNIST standard ViT trained under noise:

- ``smoothing`` at σ = ``--sigma`` (``lipvit certify --method smoothing``,
  ``--n-noise`` estimation draws): probabilistic, the smoothed classifier;
- ``taylor`` and ``crown`` on the network itself, where they fit: ``taylor``
  on the first ``--taylor-n`` of the points, ``crown`` on the first
  ``--crown-n`` within ``--crown-timeout`` seconds and ``--crown-memory`` GB
  of address space (``--n`` k takes the first k of the same seeded
  permutation, so these are subsets of the points);
- attack radii: on the network (``lipvit attack --radius``, PGD-ℓ2 and APGD)
  and against the smoothed classifier (Salman et al. 2019's noise-averaged
  PGD, :mod:`lipvit.analysis.smoothing_attack`, on the points it classifies
  correctly, PREDICT deciding each flip).

It also runs one lipschitz-family model (``--lip-ckpt``, or the digits
lipschitz model it trains: ``lipvit train --family lipschitz --msvp 1e-3``,
without noise) on ``--lip-n`` points: ``taylor`` on the network and
``smoothing`` at the same σ, with both attack radii. Every step is a
``lipvit`` command (printed) or one library call, writing its JSON under
``--work`` (default ``--out``/steps); a rerun skips the steps whose JSON
exists. It prints one markdown table and writes it to
``--out``/smoothing_side_by_side.json, with the figure
``--out``/smoothing-fmnist.png (certified accuracy against ε, attacks as
empirical ceilings).

Usage (Fashion-MNIST from ``apt-get install dataset-fashion-mnist``)::

    lipvit train --dataset fashion-mnist --family standard --noise-sd 0.25 \\
        --threads 1 --out runs/smooth/fmnist-std-noise025.pt
    python bench/user/smoothing_side_by_side.py --work runs/smooth \\
        --std-ckpt runs/smooth/fmnist-std-noise025.pt --out docs/figures
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from lipvit.analysis.smoothing_attack import (
    SmoothAttackSettings,
    smoothed_attack_radius,
)

from lipvit.commands import _common as C

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402

FIGURE = "smoothing-fmnist.png"
"""The figure's file name in ``--out``."""

GRID = (0.0002, 0.0005, 0.001, 0.01, 0.1, 0.25, 0.5, 1.0)
TABLE_EPS = (0.001, 0.1, 0.25, 0.5, 1.0)
CROWN_EPS = (0.001, 0.01)  # CROWN runs once per (point, ε): minutes each here


def run(args: list[str], timeout: float | None = None,
        memory_gb: float | None = None) -> bool:
    """Run ``python -m lipvit ARGS`` on one thread (printed first); False when it
    ran past ``timeout``, past ``memory_gb`` of address space (an allocation
    fails in it, rather than the kernel killing some process of the machine)
    or failed otherwise (its last lines printed)."""
    cmd = [sys.executable, "-m", "lipvit", *args]
    print("$ lipvit " + shlex.join(args), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def cap() -> None:
        limit = int(memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=timeout, preexec_fn=cap if memory_gb else None)
    except subprocess.TimeoutExpired:
        print(f"  (stopped after {timeout:.0f} s: does not fit)", flush=True)
        return False
    if done.returncode != 0:
        print("  failed: " + " | ".join(done.stderr.strip().splitlines()[-3:]),
              flush=True)
        return False
    print("\n".join("  " + line for line in done.stdout.strip().splitlines()
                    if not line.startswith("certify:")), flush=True)
    return True


def eps_text(values) -> str:
    return ",".join(f"{e:g}" for e in values)


def certify(ckpt: Path, out: Path, method: list[str], n: int, extra: list[str] = (),
            timeout: float | None = None, eps=GRID,
            memory_gb: float | None = None) -> dict | None:
    """``lipvit certify --radius`` at every ``eps`` (its JSON, or None where it
    did not finish)."""
    if not out.exists():
        run(["certify", "--ckpt", str(ckpt), "--eps", eps_text(eps), "--method",
             ",".join(method), "--n", str(n), "--radius", *extra, "--json", str(out)],
            timeout, memory_gb)
    return json.loads(out.read_text()) if out.exists() else None


def network_attack(ckpt: Path, out: Path, n: int) -> dict | None:
    if not out.exists():
        run(["attack", "--ckpt", str(ckpt), "--radius", "--attack", "pgd-l2,apgd",
             "--steps", "20", "--restarts", "1", "--radius-tol", "0.05", "--n", str(n),
             "--json", str(out)])
    return json.loads(out.read_text()) if out.exists() else None


def smoothed_attack(ckpt: Path, cert: dict, out: Path, sigma: float, n: int,
                    ) -> dict | None:
    """Salman et al.'s PGD on the smoothed classifier, from each point's
    certified radius, on the first ``n`` points it classifies correctly."""
    if out.exists():
        return json.loads(out.read_text())
    loaded = C.load_checkpoint(ckpt)
    data = C.load_test_set(loaded, n=cert["n"])
    right = [i for i, s in enumerate(cert["samples"])
             if s["smoothing"]["prediction"] == s["label"]][:n]
    start = torch.tensor([cert["samples"][i]["smoothing"]["radius"] for i in right])
    settings = SmoothAttackSettings(sigma=sigma, steps=10, m=16, n_predict=1000,
                                    rtol=0.05)
    print(f"$ smoothed_attack_radius({ckpt}, {len(right)} points, {settings})",
          flush=True)
    torch.set_num_threads(1)
    res = smoothed_attack_radius(loaded.model, data.x[right], data.y[right],
                                 settings, start=start)
    record = {"settings": res.settings,
              "seconds_per_sample": res.seconds / max(len(right), 1),
              "samples": res.to_records(data.index[right])}
    out.write_text(json.dumps(record) + "\n")
    return record


def _row(name: str, method: str, cert: dict | None, attack_median: float | None,
         holds: str) -> list[str]:
    if cert is None:
        return [name, f"`{method}`", holds, *("did not fit" for _ in TABLE_EPS), "-",
                "-", "-"]
    rows = {(r["method"], float(r["eps"])): r for r in cert["results"]}
    acc = [rows.get((method, e)) for e in TABLE_EPS]
    radii = [s["radii"][method] for s in cert["samples"] if "radii" in s]
    seconds = next(r["seconds_per_sample"] for r in cert["results"]
                   if r["method"] == method)
    return [name, f"`{method}`", holds,
            *(f"{100 * a['certified_accuracy']:.0f} %" if a else "-" for a in acc),
            f"{np.median(radii):.3g}" if radii else "-",
            f"{attack_median:.3g}" if attack_median is not None else "-",
            f"{seconds:.3g} ({cert['n']} points)"]


def _median_attack(attack: dict | None) -> float | None:
    if attack is None:
        return None
    radii = [s["radius"] for s in attack["samples"] if 0 < s["radius"] < np.inf]
    return float(np.median(radii)) if radii else None


def _attack_curve(attack: dict | None, n: int) -> np.ndarray | None:
    """Accuracy under attack at each ε of :data:`GRID`: the fraction of the ``n``
    points whose attack radius exceeds ε (misclassified: radius 0)."""
    if attack is None:
        return None
    radii = np.array([s["radius"] for s in attack["samples"]], dtype=float)
    return np.array([(radii > e).sum() / n for e in GRID])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out(p, __file__)
    p.add_argument("--work", type=Path, default=None,
                   help="folder for the steps' JSON and the models trained here "
                        "(default: OUT/steps); a rerun skips the steps found there")
    p.add_argument("--std-ckpt", type=Path, default=None)
    p.add_argument("--lip-ckpt", type=Path, default=None)
    p.add_argument("--sigma", type=float, default=0.25)
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--n-noise", type=int, default=10_000)
    p.add_argument("--taylor-n", type=int, default=20)
    p.add_argument("--crown-n", type=int, default=2)
    p.add_argument("--crown-timeout", type=float, default=1200.0)
    p.add_argument("--crown-memory", type=float, default=12.0,
                   help="GB of address space CROWN may take (it grew past 16 GB "
                        "on one Fashion-MNIST point here)")
    p.add_argument("--smooth-attack-n", type=int, default=100)
    p.add_argument("--lip-n", type=int, default=40)
    a = p.parse_args()
    work = a.work = a.work or a.out / "steps"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    std = a.std_ckpt or work / "fmnist-std-noise.pt"
    if not std.exists():
        run(["train", "--dataset", "fashion-mnist", "--family", "standard",
             "--noise-sd", f"{a.sigma:g}", "--threads", "1", "--no-progress",
             "--out", str(std)])
    lip = a.lip_ckpt or work / "digits-lipschitz.pt"
    if not lip.exists():
        run(["train", "--family", "lipschitz", "--msvp", "1e-3", "--threads", "1",
             "--no-progress", "--out", str(lip)])
    smooth = ["--sigma", f"{a.sigma:g}", "--n-noise", str(a.n_noise)]
    res: dict = {}
    res["std_smoothing"] = certify(std, work / "std-smoothing.json", ["smoothing"],
                                   a.n, smooth)
    res["std_taylor"] = certify(std, work / "std-taylor.json", ["taylor"],
                                a.taylor_n)
    res["std_crown"] = certify(std, work / "std-crown.json", ["crown"], a.crown_n,
                               timeout=a.crown_timeout, eps=CROWN_EPS,
                               memory_gb=a.crown_memory)
    res["std_attack"] = network_attack(std, work / "std-attack.json", a.n)
    res["std_smooth_attack"] = smoothed_attack(
        std, res["std_smoothing"], work / "std-smooth-attack.json", a.sigma,
        a.smooth_attack_n)
    res["lip_taylor"] = certify(lip, work / "lip-taylor.json", ["taylor"], a.lip_n)
    res["lip_smoothing"] = certify(lip, work / "lip-smoothing.json", ["smoothing"],
                                   a.lip_n, smooth)
    res["lip_attack"] = network_attack(lip, work / "lip-attack.json", a.lip_n)
    res["lip_smooth_attack"] = smoothed_attack(
        lip, res["lip_smoothing"], work / "lip-smooth-attack.json", a.sigma,
        a.smooth_attack_n)

    prob = "smoothed classifier, probability ≥ 1 − α"
    net = "network, deterministic"
    fm = f"Fashion-MNIST standard ViT (--noise-sd {a.sigma:g})"
    dg = "digits lipschitz ViT (no noise)"
    headers = ["model", "method", "guarantee for", *(f"ε = {e:g}" for e in TABLE_EPS),
               "median certified radius", "median attack radius", "s/point"]
    table = [
        _row(fm, "smoothing", res["std_smoothing"],
             _median_attack(res["std_smooth_attack"]), prob),
        _row(fm, "taylor", res["std_taylor"], _median_attack(res["std_attack"]), net),
        _row(fm, "crown", res["std_crown"], _median_attack(res["std_attack"]), net),
        _row(dg, "taylor", res["lip_taylor"], _median_attack(res["lip_attack"]), net),
        _row(dg, "smoothing", res["lip_smoothing"],
             _median_attack(res["lip_smooth_attack"]), prob),
    ]
    print()
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in table:
        print("| " + " | ".join(row) + " |")
    for key, name in (("std", fm), ("lip", dg)):
        ckpt = C.load_checkpoint(std if key == "std" else lip)
        sm = res[f"{key}_smoothing"]
        right = sum(s["smoothing"]["prediction"] == s["label"] for s in sm["samples"])
        abstain = sum(s["smoothing"]["prediction"] < 0 for s in sm["samples"])
        print(f"{name}: network test accuracy {ckpt.summary['test_acc']:.4f} (all "
              f"test images), on the {sm['n']} points {sm['clean_accuracy']:.2f}; "
              f"smoothed classifier {right / sm['n']:.2f} ({abstain} abstained)")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, one thread; {datetime.date.today()}; "
          f"{time.perf_counter() - t0:.0f} s")
    write_json(a.out, __file__, {"headers": headers, "rows": table,
                                 "args": {k: str(v) for k, v in vars(a).items()}})
    figure(res, a, fm, dg)


def figure(res: dict, a, fm: str, dg: str) -> None:
    """Two panels, one per model: certified accuracy against ε per method (the
    smoothed classifier's dotted, labelled probabilistic) and accuracy under
    attack (the network's and the smoothed classifier's) as ceilings."""
    from lipvit.analysis.plots import (
        new_figure,
        plot_certified_accuracy,
        probabilistic_label,
        save_figure,
    )

    fig, axes = new_figure(13.0, 6.6, ncols=2)
    for panel, (key, name) in enumerate((("std", fm), ("lip", dg))):
        curves, empirical = {}, {}
        for method in ("smoothing", "taylor", "crown"):
            cert = res.get(f"{key}_{method}")
            if cert is None:
                continue
            rows = sorted((r for r in cert["results"] if r["method"] == method),
                          key=lambda r: r["eps"])
            label = (probabilistic_label(method, a.sigma, rows[0]["alpha"])
                     if method == "smoothing" else method)
            curves[f"{label}, {cert['n']} points"] = (
                [r["eps"] for r in rows], [r["certified_accuracy"] for r in rows])
        n = res[f"{key}_smoothing"]["n"]
        for attack, what in (("attack", "the network: PGD-ℓ2, APGD"),
                             ("smooth_attack", "the smoothed classifier: "
                              "noise-averaged PGD")):
            curve = _attack_curve(res.get(f"{key}_{attack}"), n)
            if curve is not None:
                empirical[f"under attack ({what})"] = (list(GRID), curve)
        plot_certified_accuracy(curves, empirical, ax=axes[0, panel],
                                legend_below=True, title=name,
                                x_label="ε (ℓ2 radius, pixels in [0, 1])",
                                y_label="certified accuracy / accuracy under attack")
    fig.suptitle("Deterministic certificates of the network beside randomized "
                 f"smoothing; this project's 2-core x86_64 CPU, no GPU, "
                 f"{datetime.date.today()}", fontsize="medium")
    save_figure(fig, a.out / FIGURE)
    print(f"wrote {a.out / FIGURE}")


if __name__ == "__main__":
    main()
