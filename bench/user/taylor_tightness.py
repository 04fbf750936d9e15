"""Tightness, radius and speed of the taylor certificate against LoFAST.

On the test points of a checkpoint (the same seeded subsample as ``lipvit
certify --n``), in one run:

* at ``--eps``: per point, ``max_j`` (bound on the margin drop of class j) over
  ``max_j`` (largest drop PGD finds, :func:`lipvit.analysis.pgd.pgd_margin_drop`),
  for ``taylor`` (its per-class bounds) and ``lofast`` (``√2 δ_out``, Prop. 1);
  medians over the points where PGD finds a positive drop;
* the median certified radius of each (bisection, tolerance ``--tol``) and the
  first-order limit ``min_j margin_j/‖∇margin_j‖`` (an estimate);
* process CPU seconds per sample of building each certificate and of finding
  its radii (``time.process_time``; the machine may be shared: compare the
  ratios).

The table also goes to ``--out``/taylor_tightness.json.

Usage::

    python bench/user/taylor_tightness.py --ckpt lip.pt --n 100 --eps 0.01
    python bench/user/taylor_tightness.py --ckpt lip.pt --n 12 --max-symbols 256
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from lipvit.analysis.pgd import pgd_margin_drop
from lipvit.certify.certification import certified_radius, margin
from lipvit.certify.lofast.network import network_bound
from lipvit.certify.taylor.certificate import taylor_bound

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: helpers
from _out import add_out, write_json  # noqa: E402
from _points import float64_points  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--eps", type=float, default=0.01)
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--max-symbols", type=int, default=None,
                        help="ReLU symbols per sample and block (taylor_bound)")
    add_out(parser, __file__)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, x, y, _ = float64_points(args.ckpt, args.n)

    t0 = time.process_time()
    tb = taylor_bound(model, x, y, max_symbols=args.max_symbols)
    t_taylor = time.process_time() - t0
    t0 = time.process_time()
    nb = network_bound(model, x, "lofast")
    t_lofast = time.process_time() - t0

    pgd = pgd_margin_drop(model, x, y, args.eps, steps=args.steps).amax(1).detach()
    taylor = tb.margin_drop(args.eps).amax(1).detach()
    lofast = math.sqrt(2) * nb.delta_out(args.eps)
    seen = pgd > 0
    t0 = time.process_time()
    r_taylor = tb.radius(rtol=0, tol=args.tol)
    t_taylor_r = time.process_time() - t0
    t0 = time.process_time()
    r_lofast = certified_radius(margin(nb.logits, y), nb.delta_out, rtol=0,
                                  tol=args.tol)
    t_lofast_r = time.process_time() - t0
    correct = margin(nb.logits, y) > 0
    n = len(y)
    print(f"{args.ckpt}: n={n}, eps={args.eps}, max_symbols={args.max_symbols}, "
          f"{int(seen.sum())} points with a positive PGD drop")
    print("| method | median bound/PGD at eps | median certified radius "
          "| CPU s/sample (build) | CPU s/sample (radius) |")
    print("|---|---|---|---|---|")
    record = {"ckpt": args.ckpt, "n": n, "eps": args.eps,
              "max_symbols": args.max_symbols, "pgd_positive": int(seen.sum()),
              "args": vars(args), "rows": []}
    for name, bound, r, t, tr in (
            ("taylor", taylor, r_taylor, t_taylor, t_taylor_r),
            ("lofast", lofast, r_lofast, t_lofast, t_lofast_r)):
        ratio = (bound[seen] / pgd[seen]).median()
        print(f"| {name} | {float(ratio):.3f} | {float(r.median()):.5f} "
              f"| {t / n:.4f} | {tr / n:.4f} |")
        record["rows"].append({"method": name, "median_bound_over_pgd": float(ratio),
                               "median_radius": float(r.median()),
                               "cpu_s_per_sample_build": t / n,
                               "cpu_s_per_sample_radius": tr / n})
    first = tb.first_order_radius()[correct]
    record.update(
        median_first_order_limit=float(first.median()),
        median_radius_ratio=float(
            (r_taylor / r_lofast)[correct & (r_lofast > 0)].median()),
        taylor_over_lofast_time=t_taylor / t_lofast)
    print(f"median first-order limit (estimate): "
          f"{record['median_first_order_limit']:.4f}; "
          f"median radius ratio taylor/lofast (correct points, lofast > 0): "
          f"{record['median_radius_ratio']:.3f}; "
          f"taylor/lofast time: {record['taylor_over_lofast_time']:.2f}")
    write_json(args.out, __file__, record)


if __name__ == "__main__":
    main()
