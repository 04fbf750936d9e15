"""How much of what attacks leave standing each certificate proves, on
checkpoints of the lipschitz family (hybrid ViT, CaiT with class attention's
content logits held at a norm: ``lipvit train ... --content-norm C``).

On the first ``--n`` Fashion-MNIST test images, for each ``--ckpt NAME=PATH``:

- certified accuracy at every ``--eps`` by ``global`` (the proven global
  constant), ``ball`` (local constants over the ε-ball) and ``margin`` (the
  margin's first-order term through attention plus proven remainders, never
  weaker than ``ball``), and each one's median certified radius;
- robust accuracy under PGD-ℓ2 and APGD (``--steps`` steps, ``--restarts``
  random starts), and with ``--attack-radius`` their median radius: the ε,
  found by bisection, at which they leave half the points standing (the
  per-point search of :func:`lipvit.analysis.attack_radius.attack_radius`,
  with CW and APGD-T, takes about 100 s a point here);
- the certified points that the attacks break (none, or a bound is wrong).

The attacks do not depend on the certificates: ``--attacks-from`` an earlier
``gap_table.json`` keeps each model's (points standing per ε, attack radii)
and measures only the certificates anew.

Writes ``OUT/gap_table.json`` and ``OUT/gap_table.png`` (one panel per model:
certified accuracy of each method and the attacks' ceiling against ε).

Usage::

    python bench/studies/gap_table.py --ckpt c2=runs/c2.pt --ckpt hybrid=runs/h.pt \\
        --data-dir /usr/share/datasets/fashion-mnist --n 300 --out docs/figures
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from lipvit.analysis.attacks import robust_accuracy  # noqa: E402
from lipvit.certify.evaluate import certify_samples  # noqa: E402

from lipvit.checkpoint import load_checkpoint  # noqa: E402
from lipvit.data import load_dataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402

METHODS = ("global", "ball", "margin")


def attacks(model, x, y, eps_list, steps: int, restarts: int, search: bool) -> dict:
    """The attacks' side, which no certificate changes: per ε the points
    that PGD-ℓ2 and APGD leave standing, and with ``search`` their median
    radius (:func:`median_attack_radius`)."""
    model64 = model.double().eval()

    def standing(e: float) -> list[bool]:
        return torch.as_tensor(robust_accuracy(
            model64, x.double(), y, ["pgd-l2", "apgd"], e, norm="l2", steps=steps,
            restarts=restarts).worst_case).tolist()

    out = {"steps": steps, "restarts": restarts,
           "alive": {str(e): standing(e) for e in eps_list}}
    if search:
        share = {e: sum(a) / len(a) for e, a in zip(
            eps_list, out["alive"].values(), strict=True)}
        out["median_search"] = median_attack_radius(
            lambda e: sum(standing(e)) / len(y), share)
        out["radius_median"] = out["median_search"]["radius"]
    return out


def median_attack_radius(share: Callable[[float], float], known: dict,
                         rtol: float = 0.02) -> dict:
    """The least ε, to ``rtol``, at which the attacks leave at most half the
    points standing: the median over the points of the smallest adversarial
    radius they find (0 where misclassified; one bisection for all points,
    each probe a whole PGD-ℓ2 and APGD run). ``known``: shares standing at ε
    already measured. An upper end is sought by doubling. Returns the
    radius (the upper end: the attacks break half the points there) and
    every probe."""
    probes = dict(known)
    above = [e for e, a in probes.items() if a > 0.5]
    below = [e for e, a in probes.items() if a <= 0.5]
    lo, hi = max(above, default=0.0), min(below, default=None)
    while hi is None:
        e = 2 * max(probes)
        probes[e] = share(e)
        lo, hi = (e, None) if probes[e] > 0.5 else (lo, e)
    while hi - lo > rtol * hi:
        e = (lo + hi) / 2
        probes[e] = share(e)
        lo, hi = (e, hi) if probes[e] > 0.5 else (lo, e)
    return {"radius": hi, "rtol": rtol,
            "probes": {str(e): a for e, a in sorted(probes.items())}}


def measure(model, x, y, eps_list, radius_tol: float, attacked: dict) -> dict:
    """Certified accuracy and median radius of every method, the attacks'
    robust accuracy (and median radius, where ``attacked`` has the radii) and
    the certified points the attacks break."""
    t0 = time.perf_counter()
    report = certify_samples(model, x, y, list(METHODS), eps_list, radius=True,
                             radius_tol=radius_tol, batch_size=50)
    seconds = time.perf_counter() - t0
    out = {"clean": report.clean_accuracy, "certify_seconds": seconds,
           "seconds_per_point_per_eps": {
               r.method: r.seconds_per_sample for r in report.results
               if r.eps == eps_list[0]}}
    for method in METHODS:
        r = report.radii[method].cpu()
        out[method] = {"certified": {e: float((r >= e).double().mean())
                                     for e in eps_list},
                       "median_radius": float(r.median())}
    best = torch.stack([report.radii[m].cpu() for m in METHODS]).amax(dim=0)
    out["attacked"], out["broken"] = {}, {}
    for e in eps_list:
        alive = torch.tensor(attacked["alive"][str(e)])
        out["attacked"][e] = float(alive.double().mean())
        out["broken"][e] = int(((best >= e) & ~alive).sum())
    if "radius_median" in attacked:
        out["attack_median_radius"] = attacked["radius_median"]
    out["attacks"] = attacked
    return out


def plot(results: dict, eps_list, path: Path, n: int, machine: str) -> None:
    fig, axes = plt.subplots(1, len(results),
                             figsize=(max(6.0, 4.2 * len(results)), 3.8),
                             squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items(), strict=True):
        attacked = {float(k): v for k, v in r["attacked"].items()}
        ax.plot(eps_list, [attacked[e] for e in eps_list], "k--", marker="x",
                label="attacked (PGD-ℓ2, APGD)")
        # Where the methods agree their markers nest: global's open triangles
        # around ball's squares around margin's dots, none hidden.
        for method, style, marker, size, face in zip(
                METHODS, ("C2:", "C0-", "C3-"), "^so", (14, 8, 4),
                ("none", None, None), strict=True):
            ax.plot(eps_list, [r[method]["certified"][str(e)] if str(e) in
                               r[method]["certified"] else r[method]["certified"][e]
                               for e in eps_list], style, marker=marker,
                    markersize=size, markerfacecolor=face,
                    label=f"{method} (certified)")
        radii = (f"\nmedian radius: margin {r['margin']['median_radius']:.3f}, "
                 f"attacks {r['attack_median_radius']:.2f}"
                 if "attack_median_radius" in r else "")
        ax.set_title(f"{name}: clean {100 * r['clean']:.1f} %{radii}", fontsize=10)
        ax.set_xlabel("ε (ℓ2, pixels in [0, 1])")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Certified vs attacked, first {n} Fashion-MNIST test points\n"
                 f"({machine})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", action="append", default=[], help="NAME=PATH")
    p.add_argument("--merge", nargs="*", type=Path, default=[],
                   help="instead of measuring: earlier gap_table.json files, "
                        "their models side by side in one JSON and figure")
    p.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                   help="with --merge: show model OLD as NEW")
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--eps", default="0.1,0.25,0.5,1.0")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--restarts", type=int, default=2)
    p.add_argument("--attack-radius", action="store_true",
                   help="also find the attacks' median radius (bisection on "
                        "the ε where they leave half the points standing)")
    p.add_argument("--attacks-from", type=Path, default=None,
                   help="an earlier gap_table.json: each model of the same name, "
                        "points, eps, steps and restarts (and radii, with "
                        "--attack-radius) keeps its attacks; the certificates "
                        "are measured anew")
    p.add_argument("--radius-tol", type=float, default=1e-2,
                   help="relative tolerance of the certified radii's bisection")
    p.add_argument("--threads", type=int, default=1)
    add_out(p, __file__)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    eps_list = [float(e) for e in args.eps.split(",")]
    machine = (f"{platform.machine()} CPU, {os.cpu_count()} cores, "
               f"{args.threads} thread(s), torch {torch.__version__}")
    if args.merge:
        runs = [json.loads(f.read_text()) for f in args.merge]
        renamed = dict(text.split("=", 1) for text in args.rename)
        results = {renamed.get(k, k): v for run in runs
                   for k, v in run["results"].items()}
        eps_list = runs[0]["eps"]
        machine = runs[0]["machine"] + (f", {runs[0]['threads']} thread(s)"
                                        if "threads" in runs[0] else "")
        args.n = next(iter(results.values()))["n"]
    else:
        if not args.ckpt:
            p.error("give --ckpt NAME=PATH (or --merge)")
        results = measured(args, eps_list)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, eps_list, args.out / "gap_table.png", args.n, machine)
    write_json(args.out, __file__, {"eps": eps_list, "machine": machine,
                                    "results": results})


def measured(args, eps_list) -> dict:
    """Every ``--ckpt`` measured (:func:`measure`), one line printed each."""
    data = load_dataset("fashion-mnist", args.data_dir)
    x, y = data.x_test[:args.n], data.y_test[:args.n]
    earlier = (json.loads(args.attacks_from.read_text())
               if args.attacks_from else {"eps": [], "results": {}})
    results = {}
    for text in args.ckpt:
        name, _, path = text.partition("=")
        model = load_checkpoint(path).model.eval()
        attacked = reusable(earlier, name, args, eps_list)
        if attacked is None:
            attacked = attacks(model, x, y, eps_list, args.steps, args.restarts,
                               args.attack_radius)
        else:
            print(f"{name}: the attacks of {args.attacks_from}", flush=True)
        results[name] = {"checkpoint": path, "n": args.n,
                         **measure(model, x, y, eps_list, args.radius_tol, attacked)}
        r = results[name]
        print(f"{name}: clean {r['clean']:.3f}; "
              + "; ".join(f"{m} " + "/".join(f"{r[m]['certified'][e]:.3f}"
                                            for e in eps_list)
                          + f" median {r[m]['median_radius']:.3f}" for m in METHODS)
              + "; attacked " + "/".join(f"{r['attacked'][e]:.3f}" for e in eps_list)
              + (f" median {r['attack_median_radius']:.3f}"
                 if "attack_median_radius" in r else "")
              + f"; broken {sum(r['broken'].values())}", flush=True)
    return results


def reusable(earlier: dict, name: str, args, eps_list) -> dict | None:
    """Model ``name``'s attacks in an earlier run, where they were made with
    the same points, ε, steps and restarts (and radii where asked for)."""
    r = earlier["results"].get(name)
    if r is None or "attacks" not in r or r["n"] != args.n:
        return None
    a = r["attacks"]
    same = (earlier["eps"] == eps_list and a["steps"] == args.steps
            and a["restarts"] == args.restarts)
    return a if same and ("radius_median" in a or not args.attack_radius) else None


if __name__ == "__main__":
    sys.exit(main())
