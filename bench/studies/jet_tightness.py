"""How tight the second-order Taylor models are (docs/taylor.md §12).

For each test point of a standard-family checkpoint and its hardest wrong
class (smallest margin): the bound ``R(ε)`` on the margin's rest beyond second
order against the largest rest projected gradient ascent finds (a lower
bound of the true one), and the certified radius of the jets alone with the
rests back-substituted at the margins only, at the default targets (token
matrices) and at every non-linear input (more memory), with the bytes of
``|J|`` each holds.

Usage (the tables also go to ``--out``/jet_tightness.json)::

    python bench/studies/jet_tightness.py --ckpt runs/demo/models/msvp.pt --n 3
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from lipvit.analysis.pgd import pgd_taylor_rest
from lipvit.certify.taylor.margin_jets import JetMargins
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: helpers
from _out import add_out, write_json  # noqa: E402
from _points import float64_points, largest  # noqa: E402


def radius(jm: JetMargins, margins: torch.Tensor, wrong: torch.Tensor) -> float:
    """Largest ε (bisection in ``log ε`` to 0.1 %) the jets alone certify."""
    def ok(e: float) -> bool:
        drop = jm.drop(torch.tensor(e, dtype=margins.dtype))
        return bool((drop[wrong] < margins[wrong]).all())

    return largest(ok, 1e-6, 10.0, 1.001) or 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--n", type=int, default=3)
    p.add_argument("--eps", type=float, nargs="+", default=[1e-3, 1e-2, 2e-2])
    p.add_argument("--threads", type=int, default=1)
    add_out(p, __file__)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, x, y, index = float64_points(args.ckpt, args.n)
    for q in model.parameters():
        q.requires_grad_(False)
    print("point  eps      R(eps)     PGD rest   R / PGD")
    radii = []
    record = {"args": vars(args), "rests": [], "misclassified": [], "radii": []}
    for b in range(len(x)):
        xb, yb = x[b], int(y[b])

        def margin(z: torch.Tensor, xb=xb, yb=yb) -> torch.Tensor:
            out = model(z.reshape(-1, *xb.shape))
            out = out[:, yb, None] - out  # (M, K)
            return out[0] if z.dim() == 1 else out

        with torch.no_grad():
            m = margin(xb.flatten())
        wrong = torch.arange(m.numel()) != yb
        if (m[wrong] <= 0).any():
            print(f"{index[b]:5d}  misclassified")
            record["misclassified"].append(index[b])
            continue
        k = int(torch.where(wrong, m, torch.full_like(m, math.inf)).argmin())
        t0 = time.perf_counter()
        jm = JetMargins(model, xb, yb)
        built = time.perf_counter() - t0
        with sdpa_kernel(SDPBackend.MATH):
            for eps in args.eps:
                R = jm.remainder(torch.tensor(eps, dtype=x.dtype))[k].item()
                found = pgd_taylor_rest(lambda z, k=k: margin(z)[:, k], xb.flatten(),
                                        jm.gradient[k], jm.hessian[k], eps, seed=k)
                print(f"{index[b]:5d}  {eps:<7.0e}  {R:.3e}  {found:.3e}  "
                      f"{R / found:.3g}")
                record["rests"].append({"point": index[b], "eps": eps, "R": R,
                                        "pgd_rest": found, "R_over_pgd": R / found})
        margins_only = JetMargins(model, xb, yb, back_max=0)
        full = JetMargins(model, xb, yb, back_max=math.inf)
        radii.append((radius(margins_only, m, wrong), radius(jm, m, wrong),
                      jm.back.nbytes(), built, radius(full, m, wrong),
                      full.back.nbytes()))
        record["radii"].append(dict(zip(
            ("margins_only", "default_targets", "default_bytes", "built_s",
             "every_nonlinear_input", "every_nonlinear_input_bytes"),
            radii[-1], strict=True), point=index[b]))
    print("\nradius of the jets alone (rests back-substituted at the margins only"
          " | default targets | every non-linear input)")
    for r0, r, nb, built, rf, nbf in radii:
        print(f"  {r0:.5f} | {r:.5f} ({nb / 2**20:.0f} MiB, built in {built:.1f} s)"
              f" | {rf:.5f} ({nbf / 2**20:.0f} MiB)")
    write_json(args.out, __file__, record)


if __name__ == "__main__":
    main()
