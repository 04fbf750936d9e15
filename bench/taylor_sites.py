"""Where `taylor`'s margin-drop bound goes, site by site (issue 23).

For each ε, on the points' hardest wrong class (the smallest margin minus its
first-order drop ``‖c_jᵀJ‖ε``), prints the median over the points of: the
margin, the first-order drop, and each site's share of the remainder bound
(``TaylorBound.walk``: the LayerNorm / LayerProject, attention, activation and
final-norm sites of every block; all **upper bounds**), with the stream
budgets ``β`` (whole token matrix) after every sub-block. A point is
certified at ε when the first order plus the remainder stays below the
margin, so the site whose share first reaches the margin's order is what
limits the radius.

Usage::

    python bench/taylor_sites.py --ckpt msvp.pt --n 20 --eps 1e-4 1e-3 1e-2
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from _points import float64_points
from lipvit.certify.taylor.certificate import taylor_bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2])
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
    print(f"median certified radius {tb.radius().median():.3g}, first-order "
          f"limit {tb.first_order_radius().median():.3g}")
    with torch.no_grad():
        for eps in args.eps:
            e = torch.full((B,), eps, dtype=torch.float64)
            sites, budgets, _ = tb.walk(e)
            first = tb.grad_norm * e[:, None]
            j = (tb.margins - first).argmin(1)  # the hardest wrong class
            print(f"\neps {eps:g}: margin {tb.margins[rows, j].median():.3e}, "
                  f"first order {first[rows, j].median():.3e}, remainder "
                  f"{tb.remainder(e)[rows, j].median():.3e}")
            for name, share in sites.items():
                print(f"  {name:16s} {share[rows, j].median():.3e}")
            print("  stream budgets " + " ".join(
                f"{float(b.all.median()):.2e}" for b in budgets))


if __name__ == "__main__":
    main()
