"""Where `taylor`'s margin-drop bound goes, site by site.

For each ε, on the points' hardest wrong class (the smallest margin minus its
first-order drop ``‖c_jᵀJ‖ε``), prints the median over the points of: the
margin, the first-order drop, and each site's share of the remainder bound
(``TaylorBound.walk``: the LayerNorm / LayerProject, attention, activation and
final-norm sites of every block; all **upper bounds**), with the stream
budgets ``β`` (whole token matrix) after every sub-block. A point is
certified at ε when the first order plus the remainder stays below the
margin, so the site whose share first reaches the margin's order is what
limits the radius.

The figures also go to ``--out``/taylor_sites.json.

Usage::

    python bench/studies/taylor_sites.py --ckpt msvp.pt --n 20 --eps 1e-4 1e-3 1e-2
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
from lipvit.certify.taylor.certificate import taylor_bound

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: helpers
from _out import add_out, write_json  # noqa: E402
from _points import float64_points  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2])
    add_out(parser, __file__)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, x, y, _ = float64_points(args.ckpt, args.n)
    right = model(x).argmax(1) == y
    x, y = x[right], y[right]
    B = len(y)
    tb = taylor_bound(model, x, y)
    rows = torch.arange(B)
    print(f"{args.ckpt}: {B} correctly classified of {args.n} points, "
          f"{model.config.family} family; {platform.node()}, "
          f"{time.strftime('%Y-%m-%d')}; medians over the points")
    radius, first_order = tb.radius().median(), tb.first_order_radius().median()
    print(f"median certified radius {radius:.3g}, first-order "
          f"limit {first_order:.3g}")
    record = {"ckpt": args.ckpt, "correct": B, "n": args.n,
              "family": model.config.family, "node": platform.node(),
              "date": time.strftime('%Y-%m-%d'), "args": vars(args),
              "median_radius": radius, "median_first_order_limit": first_order,
              "eps": []}
    with torch.no_grad():
        for eps in args.eps:
            e = torch.full((B,), eps, dtype=torch.float64)
            sites, budgets, _ = tb.walk(e)
            first = tb.grad_norm * e[:, None]
            j = (tb.margins - first).argmin(1)  # the hardest wrong class
            entry = {"eps": eps, "margin": tb.margins[rows, j].median(),
                     "first_order": first[rows, j].median(),
                     "remainder": tb.remainder(e)[rows, j].median()}
            print(f"\neps {eps:g}: margin {entry['margin']:.3e}, "
                  f"first order {entry['first_order']:.3e}, remainder "
                  f"{entry['remainder']:.3e}")
            entry["sites"] = {}
            for name, share in sites.items():
                print(f"  {name:16s} {share[rows, j].median():.3e}")
                entry["sites"][name] = share[rows, j].median()
            entry["stream_budgets"] = [float(b.all.median()) for b in budgets]
            print("  stream budgets " + " ".join(
                f"{v:.2e}" for v in entry["stream_budgets"]))
            record["eps"].append(entry)
    write_json(args.out, __file__, record)


if __name__ == "__main__":
    main()
