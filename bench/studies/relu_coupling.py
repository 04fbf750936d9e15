"""How much of `taylor`'s ReLU charge is the chords' per-unit worst case.

The chord bound (docs/taylor.md §5) charges every ReLU unit that can flip its
own worst case, as if all flipped at once. For a margin weight ``g_i > 0``
and ``h_i > 0`` the remainder of unit ``i`` also obeys the quadratic bound

    r_i ≤ (Δz_i + s_i (h_i − a_i))² / (4 h_i),   a_i = |z_i|,
    s_i = +1 where z_i ≤ 0, −1 where z_i > 0

(``relu(v) ≤ (v + h)²/(4h)`` for every ``v``), and with ``c_i = g_i⁺/(4h_i)``
the units' sum is a quadratic form in the image perturbation ``Γ``: writing
``Δz = JΓ + e`` (``J`` the image-to-pre-activation Jacobian, all blocks
stacked), ``Σ_i g_i r_i ≤ (√λ ε + ‖C^{1/2} T‖)²`` with ``λ = λ_max(Jᵀ C J)``
and ``T_i`` the largest ``|e_i + s_i(h_i − a_i)|`` over ``e_i``'s interval.
The eigenvalue couples the units through the image: they cannot all reach
their worst case along one ``Γ``.

Per point and ε, on the class with the least room, this prints the margin,
the certificate's drop bound (box and chord, as ``taylor`` takes them), the
first-order term, the other sites' box shares (norms, attention, final norm)
and three charges for the ReLU units:

* ``ReLU, certificate``: the drop bound minus the first order and the other
  sites (the chords' constants and linear parts, or the box);
* ``quad``: the quadratic form with ``e`` in the intervals the certificate
  uses (``Chord.rest_up``, ``Chord.rest_down``: the earlier flips as a box and
  the propagated remainders): **a sound bound**, best of four ``h`` choices;
* ``quad, e = 0``: the same with ``e = 0``, i.e. the first-order moves of the
  units only: **not a bound** (an oracle for a treatment of the earlier flips
  as exact as the first order).

``J`` is formed (``jacfwd``, units × image): small images only.

The table also goes to ``--out``/relu_coupling.json.

Usage::

    python bench/studies/relu_coupling.py --ckpt lipschitz.pt --n 100 \\
        --index 4133 4039 --eps 0.2 0.25
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
from lipvit.certify.taylor.certificate import taylor_bound
from lipvit.certify.taylor.forward import forward
from lipvit.certify.taylor.sites import site_gradients

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: helpers
from _out import add_out, write_json  # noqa: E402
from _points import float64_points  # noqa: E402

H_SCALES = (0.0, 0.25, 0.5, 1.0)
"""``h_i = max(a_i, κ·reach_i)`` for these ``κ`` (``κ = 0``: ``h = a``)."""


@torch.no_grad()
def quadratic_charge(J: torch.Tensor, g: torch.Tensor, z: torch.Tensor,
                     reach: torch.Tensor, rest_up: torch.Tensor,
                     rest_down: torch.Tensor, can_flip: torch.Tensor,
                     eps: float) -> float:
    """``min_κ (√λ ε + ‖C^{1/2} T‖)²`` over :data:`H_SCALES` (module docstring);
    every argument but ``J`` ``(units, n)`` is ``(units,)``."""
    live = can_flip & (g > 0)
    a, s = z.abs()[live], torch.where(z > 0, -1.0, 1.0).to(z)[live]
    J_l = J[live]
    best = float("inf")
    for kappa in H_SCALES:
        h = torch.maximum(a, kappa * reach[live]).clamp_min(1e-300)
        c = g[live] / (4 * h)
        tau = s * (h - a)
        T = torch.maximum((tau + rest_up[live]).abs(), (tau - rest_down[live]).abs())
        lam = torch.linalg.eigvalsh(J_l.T @ (J_l * c[:, None]))[-1].clamp_min(0)
        best = min(best, float((lam.sqrt() * eps + (c * T * T).sum().sqrt()) ** 2))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--index", type=int, nargs="*", default=None,
                        help="test-set indices among the --n points (default: all)")
    parser.add_argument("--eps", type=float, nargs="+", default=[0.1, 0.2])
    add_out(parser, __file__)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, x, y, index = float64_points(args.ckpt, args.n)
    if model.config.family != "lipschitz":
        raise SystemExit("relu_coupling: a lipschitz model (ReLU units) is needed")
    missing = sorted(set(args.index or []) - set(index))
    if missing:
        raise SystemExit(f"relu_coupling: test indices {missing} are not among the "
                         f"--n {args.n} points")
    keep = [index.index(i) for i in args.index] if args.index else range(len(y))
    x, y, index = x[list(keep)], y[list(keep)], [index[i] for i in keep]
    right = model(x).argmax(1) == y
    x, y = x[right], y[right]
    index = [i for i, r in zip(index, right.tolist(), strict=True) if r]
    K = len(model.blocks)
    tb = taylor_bound(model, x, y)
    grads = site_gradients(model, x, y)
    print(f"{args.ckpt}: {len(y)} correctly classified points; "
          f"{platform.node()}, {time.strftime('%Y-%m-%d')}; the class with least room")
    print("| index | ε | margin | drop bound | first order | other sites "
          "| ReLU, certificate | quad | quad, e = 0 (not a bound) |")
    print("|---|---|---|---|---|---|---|---|---|")
    record = {"ckpt": args.ckpt, "points": len(y), "node": platform.node(),
              "date": time.strftime('%Y-%m-%d'), "args": vars(args), "rows": []}

    def pre_activations(image: torch.Tensor) -> torch.Tensor:
        _, rec = forward(model, image[None])
        return torch.cat([rec.act_in[k].reshape(-1) for k in range(K)])

    for b in range(len(y)):
        J = torch.func.jacfwd(pre_activations)(x[b]).reshape(-1, x[b].numel())
        J = J.detach()  # (units, n): ∇_x z_i per row
        for eps in args.eps:
            record["rows"].append(_row(tb, grads, J, b, index[b], int(y[b]), eps, K))
    write_json(args.out, __file__, record)


@torch.no_grad()
def _row(tb, grads, J: torch.Tensor, b: int, index: int, label: int, eps: float,
         K: int) -> dict:
    """Print the table's row of point ``b`` at ``eps`` (module docstring) and
    return its numbers."""
    e = torch.full((len(tb.margins),), eps, dtype=torch.float64)
    drop = tb.margin_drop(e)[b]
    sites, _, _ = tb.walk(e)
    chords = tb.chords(e)

    def flat(name: str) -> torch.Tensor:
        return torch.cat([getattr(c, name)[b].reshape(-1) for c in chords])

    z, rho = flat("z"), flat("rho")
    reach = J.norm(dim=1) * eps
    other = sum(v[b] for n, v in sites.items() if not n.endswith(".act"))
    rows = []
    for j in range(len(tb.margins[b])):
        if j == label:
            continue
        g = torch.cat([grads.sites[(k, "act")][b, j].reshape(-1)
                       for k in range(K)]).clamp_min(0)
        first = float(tb.grad_norm[b, j]) * eps
        quad = quadratic_charge(J, g, z, reach, flat("rest_up"), flat("rest_down"),
                                rho > 0, eps)
        oracle = quadratic_charge(J, g, z, reach, 0 * z, 0 * z, rho > 0, eps)
        rest = float(other[j])
        rows.append((float(tb.margins[b, j]), float(drop[j]), first, rest,
                     float(drop[j]) - first - rest, quad, oracle))
    m, d, f, r, ch, q, o = max(rows, key=lambda row: row[1] / row[0])
    print(f"| {index} | {eps:g} | {m:.4f} | {d:.4f} | {f:.4f} | {r:.4f} "
          f"| {ch:.4f} | {q:.4f} | {o:.4f} |", flush=True)
    return {"index": index, "eps": eps, "margin": m, "drop_bound": d,
            "first_order": f, "other_sites": r, "relu_certificate": ch,
            "quad": q, "quad_e0_not_a_bound": o}

if __name__ == "__main__":
    main()
