"""Randomized smoothing beside the deterministic certificates, on one model.

A user with a standard ViT (LayerNorm, GELU) who wants a certified number at
ε = 0.25 turns to randomized smoothing (Cohen, Rosenfeld & Kolter 2019). Its
certificate is probabilistic and holds for the *smoothed* classifier, not the
network. This script puts the two kinds of guarantee side by side, on the
same test points of one Fashion-MNIST standard ViT trained under noise:

- ``smoothing`` at σ = ``--sigma`` (``lipvit certify --method smoothing``,
  ``--n-noise`` estimation draws): probabilistic, the smoothed classifier;
- ``taylor`` and ``crown`` on the network itself, where they fit: ``taylor``
  on ``--taylor-n`` of the points, ``crown`` on ``--crown-n`` of them within
  ``--crown-timeout`` seconds and ``--crown-memory`` GB of address space
  (``--n`` k takes the first k of one seeded permutation of the test set,
  sorted by test-set index, so a smaller k gives a subset of the points,
  though not their first k in index order; ``--crown-n 0`` skips ``crown``,
  whose row then says so);
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
exists.

**One set of points per panel.** Each panel of the figure, and each group of
rows of the table, compares methods on exactly one set of test points, named
in its title and in the table's ``points`` column: the standard ViT's
``--n`` points (``smoothing`` and both attacks), then the ``--taylor-n`` of
them that ``taylor`` ran on (with ``smoothing`` and both attacks restricted
to those points; ``crown``'s ``--crown-n`` likewise, where it ran), and the
lipschitz model's ``--lip-n`` points. Every step's JSON has per-point
records with their test-set index; a panel restricts them by index, and the
script stops when a step lacks one of the panel's points, when the points
of a smaller run are not among the larger run's, or when two runs meant
for one panel ran on different points. The attack curves are empirical
ceilings: a deterministic certificate (``taylor``, ``crown``) that
certifies a point at ε where the network attack found an adversarial point
within ε, whose certified radius reaches its attack radius, or whose curve
exceeds its panel's network-attack curve, is a soundness bug and stops the
script (AssertionError). ``smoothing`` is checked against the attack on the
smoothed classifier, a probabilistic comparison: it is counted and
reported, never asserted.

It prints one markdown table (a ``points`` column gives each row's points)
and writes it to ``--out``/smoothing_side_by_side.json with every panel's
curves, test-set indices and the machine, and the figure
``--out``/smoothing-fmnist.png (certified accuracy against ε, attacks as
empirical ceilings).

Usage (Fashion-MNIST from ``apt-get install dataset-fashion-mnist``)::

    lipvit train --dataset fashion-mnist --family standard --noise-sd 0.25 \\
        --threads 1 --out runs/smooth/fmnist-std-noise025.pt
    python bench/user/smoothing_side_by_side.py --work runs/smooth \\
        --std-ckpt runs/smooth/fmnist-std-noise025.pt --out docs/figures \\
        --crown-n 0   # crown did not fit on a 2-core CPU with 24 GB
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
CERTIFICATES = ("smoothing", "taylor", "crown")
DETERMINISTIC = ("taylor", "crown")
"""The certificates of the network itself: never above the network attack's
curve on the same points (the script asserts it)."""
ATTACKS = {"network": "the network: PGD-ℓ2, APGD",
           "smoothed": "the smoothed classifier: noise-averaged PGD"}
"""The attack curves, empirical ceilings: the network's for the deterministic
certificates, the smoothed classifier's for ``smoothing``."""
CROWN_EARLIER = (
    "not rerun (--crown-n 0): in this script's run of 2026-11-28 (--crown-n 2, "
    "--crown-timeout 1200, before --crown-memory existed) crown did not fit: "
    "on the first point at ε = 0.001 its process grew to 16.3 GB resident in "
    "about six minutes and the kernel's out-of-memory killer ended it")
"""What the table says of ``crown`` when ``--crown-n 0`` skips it: the earlier
measurement, labelled as such."""


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
             ",".join(method), "--n", str(n), "--radius", *extra, "--threads", "1",
             "--json", str(out)], timeout, memory_gb)
    return json.loads(out.read_text()) if out.exists() else None


def network_attack(ckpt: Path, out: Path, n: int) -> dict | None:
    if not out.exists():
        run(["attack", "--ckpt", str(ckpt), "--radius", "--attack", "pgd-l2,apgd",
             "--steps", "20", "--restarts", "1", "--radius-tol", "0.05", "--n", str(n),
             "--threads", "1", "--json", str(out)])
    return json.loads(out.read_text()) if out.exists() else None


def smoothed_attack(ckpt: Path, cert: dict, out: Path, sigma: float, n: int,
                    ) -> dict | None:
    """Salman et al.'s PGD on the smoothed classifier, from each point's
    certified radius, on the first ``n`` points it classifies correctly."""
    if out.exists():
        return json.loads(out.read_text())
    loaded = C.load_checkpoint(ckpt)
    data = C.load_test_set(loaded, n=cert["n"])
    if [int(i) for i in data.index] != _indices(cert, "smoothing"):
        raise ValueError(f"{ckpt}: the test points differ from the smoothing run's")
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


def _indices(step: dict, what: str) -> list[int]:
    """The test-set indices of a step's points, in its order."""
    index = [int(s["index"]) for s in step["samples"]]
    if len(set(index)) != len(index):
        raise ValueError(f"{what}: a test-set index appears twice")
    return index


def _restrict(step: dict, points: list[int], what: str) -> list[dict]:
    """The per-point records of ``step`` for ``points`` (test-set indices), in
    that order; every one must be there."""
    by_index = {int(s["index"]): s for s in step["samples"]}
    missing = [i for i in points if i not in by_index]
    if missing:
        raise ValueError(f"{what} lacks {len(missing)} of the panel's test points "
                         f"(indices {missing[:5]}...)")
    return [by_index[i] for i in points]


def _certified(records: list[dict], method: str) -> dict[float, np.ndarray]:
    """ε → whether ``method`` certifies each point at ε (bools, in order)."""
    out = {}
    for key in records[0]["certified"]:
        name, _, eps = key.rpartition("@")
        if name == method:
            out[float(eps)] = np.array([bool(s["certified"][key]) for s in records])
    return dict(sorted(out.items()))


def _median(values: np.ndarray) -> float | None:
    """Median of the positive finite values (None where there are none)."""
    values = values[(values > 0) & np.isfinite(values)]
    return float(np.median(values)) if values.size else None


def build_panel(res: dict, key: str, model: str, where: str,
                points: list[int]) -> dict:
    """Every curve of one panel, computed on exactly ``points`` (test-set
    indices): each certificate whose step holds all of them, the network
    attack and the attack on the smoothed classifier (0 on the points the
    smoothed classifier gets wrong or abstains on: it is not accurate there)."""
    panel = {"model": model, "points": where, "n": len(points), "index": points,
             "certificates": {}, "attacks": {}, "notes": []}
    for method in CERTIFICATES:
        step = res.get(f"{key}_{method}")
        if step is None or not set(points) <= set(_indices(step, method)):
            continue
        records = _restrict(step, points, f"{key} {method}")
        rows = [r for r in step["results"] if r["method"] == method]
        certified = _certified(records, method)
        if len(points) == step["n"] and any(  # the records read as the step did
                abs(certified[float(r["eps"])].mean() - r["certified_accuracy"])
                > 1e-6 for r in rows):  # float32 there
            raise ValueError(f"{key} {method}: the per-point records disagree "
                             "with the step's certified accuracy")
        panel["certificates"][method] = {
            "certified": certified,
            "radii": np.array([s["radii"][method] for s in records], dtype=float),
            "network_correct": int(sum(s["prediction"] == s["label"]
                                       for s in records)),
            "alpha": rows[0].get("alpha"),
            "seconds_per_point": rows[0]["seconds_per_sample"],  # at one ε
            "step_points": step["n"]}
        if method == "smoothing":
            smoothed = [s["smoothing"]["prediction"] for s in records]
            panel["certificates"][method].update(
                smoothed_correct=[p == s["label"] for p, s in
                                  zip(smoothed, records, strict=True)],
                abstained=int(sum(p < 0 for p in smoothed)))
    net = res[f"{key}_attack"]
    panel["attacks"]["network"] = {
        "radii": np.array([s["radius"] for s in
                           _restrict(net, points, f"{key} network attack")], float),
        "seconds_per_point": net["summary"]["seconds_per_sample"],
        "step_points": net["n"]}
    smooth, attack = (panel["certificates"].get("smoothing"),
                      res.get(f"{key}_smooth_attack"))
    if smooth is not None and attack is not None:
        attacked = {int(s["index"]): s["radius"] for s in attack["samples"]}
        right = [i for i, ok in
                 zip(points, smooth["smoothed_correct"], strict=True) if ok]
        if not set(attacked) & set(points) <= set(right):
            raise ValueError(f"{key}: the smoothed attack ran on a point the "
                             "smoothed classifier gets wrong")
        missing = [i for i in right if i not in attacked]
        if missing:  # --smooth-attack-n below the points it classifies right
            panel["notes"].append(f"no attack on the smoothed classifier: "
                                  f"{len(missing)} of its correct points were not "
                                  "attacked (--smooth-attack-n)")
        else:
            panel["attacks"]["smoothed"] = {
                "radii": np.array([attacked.get(i, 0.0) for i in points], float),
                "seconds_per_point": attack["seconds_per_sample"],
                "step_points": len(attacked)}
    check_sound(panel)
    return panel


def check_sound(panel: dict) -> None:
    """A deterministic certificate never certifies a point at ε where the network
    attack found an adversarial point within ε, so its curve never exceeds the
    network attack's on the same points: an AssertionError (a soundness bug of
    the certificate, or points mismatched by this script) otherwise. The
    smoothed classifier's certificate against its attack is probabilistic
    (each point with probability ≥ 1 − α): counted in the panel's notes."""
    net = panel["attacks"]["network"]["radii"]
    for method in DETERMINISTIC:
        cert = panel["certificates"].get(method)
        if cert is None:
            continue
        radii = cert["radii"]
        if ((radii > 0) & (radii >= net)).any():
            i = int(np.flatnonzero((radii > 0) & (radii >= net))[0])
            raise AssertionError(
                f"soundness bug: {method}'s certified radius {radii[i]:.4g} of test "
                f"point {panel['index'][i]} ({panel['model']}) reaches the "
                f"distance {net[i]:.4g} of an adversarial point the network "
                "attack found")
        for eps, certified in cert["certified"].items():
            broken = certified & ~(net > eps)
            if broken.any():
                i = int(np.flatnonzero(broken)[0])
                raise AssertionError(
                    f"soundness bug: {method} certifies test point "
                    f"{panel['index'][i]} ({panel['model']}) at ε = {eps:g}, but "
                    f"the network attack found an adversarial point at distance "
                    f"{net[i]:.4g}")
            if certified.mean() > (net > eps).mean():
                raise AssertionError(
                    f"soundness bug: {method}'s certified accuracy "
                    f"{certified.mean():.3f} exceeds the network's accuracy under "
                    f"attack {(net > eps).mean():.3f} at ε = {eps:g} on "
                    f"{panel['points']} ({panel['model']})")
    smooth, attack = (panel["certificates"].get("smoothing"),
                      panel["attacks"].get("smoothed"))
    if smooth is not None and attack is not None:
        above = (smooth["radii"] > 0) & (smooth["radii"] >= attack["radii"])
        if above.any():
            panel["notes"].append(
                f"smoothing's certified radius reaches the smoothed attack's on "
                f"{int(above.sum())} point(s) (test indices "
                f"{[panel['index'][i] for i in np.flatnonzero(above)]}): possible "
                "with probability ≤ α per point, suspicious otherwise")


def ratios(panel: dict) -> dict[str, dict]:
    """Certified radius over its attack radius (the network's for the
    deterministic certificates, the smoothed classifier's for ``smoothing``),
    on the panel's points where both are positive and finite."""
    out = {}
    for method, cert in panel["certificates"].items():
        attack = panel["attacks"].get("smoothed" if method == "smoothing"
                                      else "network")
        if attack is None:
            continue
        r, a = cert["radii"], attack["radii"]
        ok = (r > 0) & (a > 0) & np.isfinite(a)
        if ok.any():
            q = r[ok] / a[ok]
            out[method] = {"points": int(ok.sum()), "median": float(np.median(q)),
                           "max": float(q.max())}
    return out


def _pct(value: float) -> str:
    return f"{100 * value:.3g} %"


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def table_rows(panel: dict, sigma: float) -> list[list[str]]:
    """The panel's rows: one per certificate, then one per attack (accuracy
    under attack: an empirical ceiling), every one on the panel's points."""
    rows = []
    for method, cert in panel["certificates"].items():
        probabilistic = method == "smoothing"
        attack = panel["attacks"].get("smoothed" if probabilistic else "network")
        acc = [_pct(cert["certified"][e].mean()) if e in cert["certified"] else "-"
               for e in TABLE_EPS]
        rows.append([
            panel["model"], panel["points"], f"`{method}`",
            (f"smoothed classifier (σ = {sigma:g}), probability ≥ 1 − α"
             if probabilistic else "network, deterministic"),
            *acc, _g(float(np.median(cert["radii"]))),
            "-" if attack is None else
            f"{_g(_median(attack['radii']))} "
            f"({'smoothed' if probabilistic else 'network'})",
            f"{cert['seconds_per_point']:.3g} (run on {cert['step_points']})"])
    for name, attack in panel["attacks"].items():
        rows.append([
            panel["model"], panel["points"], f"attack on {ATTACKS[name]}",
            "none: accuracy under attack, a ceiling for the "
            + ("smoothed classifier" if name == "smoothed" else "network"),
            *(_pct((attack["radii"] > e).mean()) for e in TABLE_EPS), "-",
            _g(_median(attack["radii"])),
            f"{attack['seconds_per_point']:.3g} (run on {attack['step_points']})"])
    return rows


def panel_record(panel: dict, sigma: float) -> dict:
    """The panel as JSON: its points, each curve and the radius ratios."""
    curves = {m: {"eps": list(c["certified"]),
                  "accuracy": [float(v.mean()) for v in c["certified"].values()],
                  "median_radius": float(np.median(c["radii"])),
                  "alpha": c["alpha"]}
              for m, c in panel["certificates"].items()}
    attacks = {n: {"eps": list(GRID),
                   "accuracy": [float((a["radii"] > e).mean()) for e in GRID],
                   "median_radius": _median(a["radii"])}
               for n, a in panel["attacks"].items()}
    smooth = panel["certificates"].get("smoothing")
    any_cert = next(iter(panel["certificates"].values()), None)
    return {"model": panel["model"], "points": panel["points"], "n": panel["n"],
            "test_index": panel["index"],
            "network_correct": any_cert and any_cert["network_correct"],
            "smoothed_correct": smooth and int(sum(smooth["smoothed_correct"])),
            "smoothed_abstained": smooth and smooth["abstained"],
            "sigma": sigma, "certified": curves, "under_attack": attacks,
            "radius_ratio": ratios(panel), "notes": panel["notes"]}


def panels(res: dict, fm: str, dg: str) -> list[dict]:
    """The figure's panels, one set of points each: the standard ViT's ``--n``
    points, the ``--taylor-n`` (and ``--crown-n``, where crown ran) of them
    that its deterministic certificates ran on, and the lipschitz model's
    ``--lip-n`` points."""
    std = _indices(res["std_smoothing"], "std smoothing")
    if set(_indices(res["std_attack"], "std attack")) != set(std):
        raise ValueError("the standard ViT's attack ran on other points than its "
                         "smoothing")
    out = [build_panel(res, "std", fm, f"{len(std)} test points (--n {len(std)})",
                       std)]
    sizes = sorted({res[f"std_{m}"]["n"] for m in DETERMINISTIC
                    if res.get(f"std_{m}") is not None}, reverse=True)
    for k in sizes:
        if k == len(std):  # already in the first panel
            continue
        chosen = {m: set(_indices(res[f"std_{m}"], m)) for m in DETERMINISTIC
                  if res.get(f"std_{m}") is not None and res[f"std_{m}"]["n"] == k}
        first = next(iter(chosen.values()))
        if not first <= set(std) or any(c != first for c in chosen.values()):
            raise ValueError(f"the {k} points of {', '.join(chosen)} are not {k} "
                             f"of the {len(std)} (--n k takes a seeded "
                             "permutation's first k: another seed or dataset?)")
        out.append(build_panel(res, "std", fm,
                               f"{k} of those {len(std)} points (--n {k})",
                               [i for i in std if i in first]))
    lip = _indices(res["lip_smoothing"], "lip smoothing")
    for m in ("taylor", "attack"):
        if set(_indices(res[f"lip_{m}"], f"lip {m}")) != set(lip):
            raise ValueError(f"the lipschitz model's {m} ran on other points than "
                             "its smoothing")
    out.append(build_panel(res, "lip", dg, f"{len(lip)} test points (--n {len(lip)})",
                           lip))
    return out


def machine() -> dict:
    """Where the numbers were measured."""
    return {"uname": " ".join(platform.uname()), "cpus": os.cpu_count(),
            "threads": 1, "torch": torch.__version__,
            "gpu": (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                    else None),
            "date": str(datetime.date.today())}


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
    p.add_argument("--crown-n", type=int, default=2,
                   help="points for crown (a subset of the --n); 0 skips it, "
                        "the table then quoting the earlier run's outcome")
    p.add_argument("--crown-timeout", type=float, default=1200.0)
    p.add_argument("--crown-memory", type=float, default=12.0,
                   help="GB of address space CROWN may take (it grew past 16 GB "
                        "on one Fashion-MNIST point here)")
    p.add_argument("--smooth-attack-n", type=int, default=100)
    p.add_argument("--lip-n", type=int, default=40)
    a = p.parse_args()
    for name in ("taylor_n", "crown_n"):
        if not 0 <= getattr(a, name) <= a.n:
            p.error(f"--{name.replace('_', '-')} must be in [0, --n]")
    work = a.work = a.work or a.out / "steps"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    reused = sorted(p.name for p in work.iterdir()  # what this run skips
                    if p.suffix in (".json", ".pt"))
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
    res["std_taylor"] = (certify(std, work / "std-taylor.json", ["taylor"],
                                 a.taylor_n) if a.taylor_n else None)
    res["std_crown"] = (certify(std, work / "std-crown.json", ["crown"], a.crown_n,
                                timeout=a.crown_timeout, eps=CROWN_EPS,
                                memory_gb=a.crown_memory) if a.crown_n else None)
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

    fm = f"Fashion-MNIST standard ViT (--noise-sd {a.sigma:g})"
    dg = "digits lipschitz ViT (no noise)"
    drawn = panels(res, fm, dg)
    headers = ["model", "points", "method", "guarantee for",
               *(f"ε = {e:g}" for e in TABLE_EPS), "median certified radius",
               "median attack radius", "s/point"]
    table = []
    for i, panel in enumerate(drawn):
        table += table_rows(panel, a.sigma)
        if i == len(drawn) - 2 and res["std_crown"] is None:  # the last std panel
            what = (CROWN_EARLIER if not a.crown_n else
                    f"did not fit ({a.crown_timeout:g} s and {a.crown_memory:g} "
                    "GB of address space per run)")
            table.append([fm, (f"{a.crown_n} of those {a.n} points (--n "
                               f"{a.crown_n})" if a.crown_n else "-"), "`crown`",
                          "network, deterministic", what,
                          *("" for _ in TABLE_EPS[1:]), "-", "-", "-"])
    print()
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in table:
        print("| " + " | ".join(row) + " |")
    records = [panel_record(panel, a.sigma) for panel in drawn]
    for rec in records:
        ckpt = C.load_checkpoint(std if rec["model"] == fm else lip)
        print(f"{rec['model']}, {rec['points']}: network test accuracy "
              f"{ckpt.summary['test_acc']:.4f} (all test images), right on "
              f"{rec['network_correct']} of these {rec['n']}; smoothed classifier "
              f"right on {rec['smoothed_correct']} ({rec['smoothed_abstained']} "
              "abstained)")
        for method, q in rec["radius_ratio"].items():
            print(f"  {method}: certified / attack radius, median {q['median']:.3g}, "
                  f"largest {q['max']:.3g} ({q['points']} points)")
        for note in rec["notes"]:
            print(f"  note: {note}")
    where = machine()
    seconds = time.perf_counter() - t0
    print(f"machine: {where['uname']}; {where['cpus']} CPUs, one thread, torch "
          f"{where['torch']}, GPU {where['gpu']}; {where['date']}; {seconds:.0f} s "
          f"(steps found in --work, not rerun: {', '.join(reused) or 'none'})")
    write_json(a.out, __file__, {"headers": headers, "rows": table,
                                 "panels": records, "machine": where,
                                 "seconds": seconds, "steps_reused": reused,
                                 "args": {k: str(v) for k, v in vars(a).items()}})
    figure(records, a, where)


STYLES = {"smoothing": {"color": "tab:blue"}, "taylor": {"color": "tab:orange"},
          "crown": {"color": "tab:purple"},
          "network": {"color": "tab:green", "marker": "x", "markersize": 9,
                      "linestyle": "--", "linewidth": 3.5, "alpha": 0.55},
          "smoothed": {"color": "tab:red", "marker": "+", "markersize": 11,
                       "linestyle": "-.", "linewidth": 1.3}}
"""One colour per method and attack in every panel; the network attack's line
is wide and pale, the smoothed classifier's thin, and the markers differ, so
that where curves agree the one beneath still shows around the other."""


def figure(records: list[dict], a, where: dict) -> None:
    """One panel per set of points: certified accuracy against ε per method (the
    smoothed classifier's dotted, labelled probabilistic) and accuracy under
    attack (the network's and the smoothed classifier's) as ceilings, every
    curve on the panel's points (its title)."""
    from lipvit.analysis.plots import (
        new_figure,
        plot_certified_accuracy,
        probabilistic_label,
        save_figure,
    )

    fig, axes = new_figure(6.0 * len(records), 6.8, ncols=len(records))
    for ax, rec in zip(axes[0], records, strict=True):
        curves, empirical, styles = {}, {}, {}
        for method, c in rec["certified"].items():
            label = (probabilistic_label(method, a.sigma, c["alpha"])
                     if method == "smoothing" else f"{method} (deterministic: the "
                     "network)")
            curves[label] = (c["eps"], c["accuracy"])
            styles[label] = STYLES[method]
        for name, c in rec["under_attack"].items():
            label = f"under attack ({ATTACKS[name]})"
            empirical[label] = (c["eps"], c["accuracy"])
            styles[label] = STYLES[name]
        plot_certified_accuracy(curves, empirical, ax=ax, styles=styles,
                                legend_below=True,
                                title=f"{rec['model']}\n{rec['points']}",
                                x_label="ε (ℓ2 radius, pixels in [0, 1])",
                                y_label="certified accuracy / accuracy under attack")
        for text in ax.get_legend().get_texts():
            text.set_fontsize("small")
    gpu = f"GPU {where['gpu']}" if where["gpu"] else "no GPU"
    fig.suptitle("Deterministic certificates of the network beside randomized "
                 "smoothing, each panel on one set of test points; "
                 f"{where['cpus']}-core {platform.machine()} CPU, one thread, {gpu}, "
                 f"{where['date']}", fontsize="medium")
    save_figure(fig, a.out / FIGURE)
    print(f"wrote {a.out / FIGURE}")


if __name__ == "__main__":
    main()
