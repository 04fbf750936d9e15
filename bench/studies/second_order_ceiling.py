"""How far an exact second-order certificate could reach on a standard ViT.

For each test point of a standard-family checkpoint and its hardest wrong
class ``j`` (smallest margin): the margin ``m``, its gradient norm and
first-order radius ``m/‖g‖``, the exact Hessian ``H`` in the image (autograd,
float64) and, at each ε, the exact minimum of the quadratic model ``gᵀδ +
½δᵀHδ`` over the ball (the trust-region bound of docs/taylor.md §12.7) and the
largest rest beyond it that projected gradient ascent finds (a **lower**
bound of the true rest). The *ceiling* is the largest ε at which ``m +
min q − (PGD rest) > 0``: no certificate built on the exact quadratic model
can certify beyond it, since its rest bound is at least the true rest. Then
the exact Hessian norm ``‖∇²z‖₂`` of a few residual-stream entries ``z``
after every sub-block (class token, the entries of largest gradient), and
its Frobenius norm's ratio to it: the curvature a certificate must carry
through the network.

This needs the full ``n × n`` Hessians, so it is a measurement, not a
certificate (seconds per point at 784 pixels on one CPU thread).

The tables also go to ``--out``/second_order_ceiling.json.

Usage::

    python bench/studies/second_order_ceiling.py --ckpt runs/fmnist/models/msvp.pt \\
        --n 10
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from lipvit.analysis.pgd import pgd_taylor_rest
from lipvit.certify.taylor.jets import QuadraticForm
from torch.func import grad, jacfwd, jacrev
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: helpers
from _out import add_out, write_json  # noqa: E402
from _points import float64_points, largest  # noqa: E402


def streams(model, z: torch.Tensor, shape: torch.Size) -> list[torch.Tensor]:
    """The residual stream ``(N, D)`` after every sub-block, at image ``z`` ``(n,)``."""
    t = model.embed(z.view(1, *shape))
    out = []
    for block in model.blocks:
        t = t + block.attn(block.norm1(t))
        out.append(t[0])
        t = t + block.mlp(block.norm2(t))
        out.append(t[0])
    return out


def ceiling(m: float, form: QuadraticForm, rest, lo: float, hi: float) -> float:
    """Largest ε in ``[lo, hi]`` (bisection in ``log ε`` to 1 %) with
    ``m + min q(ε) − rest(ε) > 0``; ``lo`` if none."""
    def ok(e: float) -> bool:
        q = float(form.minimum(torch.tensor(e, dtype=torch.float64)))
        return m + q - rest(e) > 0

    return largest(ok, lo, hi, 1.01) or lo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--eps", type=float, nargs="+", default=[0.005, 0.0125, 0.025, 0.05])
    p.add_argument("--elements", type=int, default=2,
                   help="stream entries per sub-block whose Hessian is measured")
    p.add_argument("--attack", help="an `lipvit attack --radius --json` file of the "
                   "same points: the ceilings are also given as fractions of the "
                   "attack radii")
    p.add_argument("--threads", type=int, default=1)
    add_out(p, __file__)
    args = p.parse_args()
    attack = {}
    if args.attack:
        with open(args.attack) as f:
            attack = {s["index"]: s["radius"] for s in json.load(f)["samples"]}
    torch.set_num_threads(args.threads)
    model, x, y, index = float64_points(args.ckpt, args.n)
    for q in model.parameters():
        q.requires_grad_(False)
    print(f"# {platform.machine()} {platform.processor() or ''}, torch "
          f"{torch.__version__}, {args.threads} thread(s), {time.strftime('%Y-%m-%d')}")
    print("point  m      |g|     m/|g|    |H|      eps      min q       PGD rest")
    ceilings, first, of_attack, curv = [], [], [], {}
    record = {"machine": f"{platform.machine()} {platform.processor() or ''}",
              "torch": torch.__version__, "date": time.strftime('%Y-%m-%d'),
              "args": vars(args), "points": [], "misclassified": []}
    with sdpa_kernel(SDPBackend.MATH):
        for b in range(len(x)):
            xb, yb, z0 = x[b], int(y[b]), x[b].flatten()
            with torch.no_grad():
                out = model(xb[None])[0]
            m_all = out[yb] - out
            m_all[yb] = math.inf
            if (m_all <= 0).any():
                print(f"{index[b]:5d}  misclassified")
                record["misclassified"].append(index[b])
                continue
            k = int(m_all.argmin())

            def margin(z: torch.Tensor, yb=yb, k=k, shape=xb.shape) -> torch.Tensor:
                o = model(z.reshape(-1, *shape))  # a flat image or a batch
                r = o[:, yb] - o[:, k]
                return r[0] if z.dim() == 1 else r

            m = float(m_all[k])
            g = grad(margin)(z0)
            H = jacfwd(jacrev(margin))(z0)
            H = 0.5 * (H + H.T)
            form = QuadraticForm(g, H)
            gn, hn = float(g.norm()), float(torch.linalg.eigvalsh(H).abs().max())

            def rest(e: float, margin=margin, z0=z0, g=g, H=H, k=k) -> float:
                return pgd_taylor_rest(lambda z: -margin(z), z0, -g, -H, e,
                                       steps=40, restarts=2, seed=k)

            point = {"index": index[b], "margin": m, "grad_norm": gn,
                     "first_order_radius": m / gn, "hessian_norm": hn, "eps": []}
            for i, e in enumerate(args.eps):
                q = float(form.minimum(torch.tensor(e, dtype=torch.float64)))
                head = (f"{index[b]:5d}  {m:<6.3f} {gn:<7.3f} {m / gn:<8.4f} {hn:<8.2f}"
                        if i == 0 else " " * 39)
                found = rest(e)
                print(f"{head} {e:<8.4f} {q:<11.4e} {found:.3e}")
                point["eps"].append({"eps": e, "min_q": q, "pgd_rest": found})
            c = ceiling(m, form, rest, 1e-4, m / gn)
            ceilings.append(c / (m / gn))
            first.append(m / gn)
            a = attack.get(index[b])
            if a:
                of_attack.append(c / a)
            print(f"{'':39} ceiling {c:.4f} = {c / (m / gn):.2f} × m/|g|"
                  + (f" = {c / a:.2f} × the attack radius {a:.4f}" if a else ""))
            point.update(ceiling=c, ceiling_over_first_order=c / (m / gn),
                         attack_radius=a, ceiling_over_attack=c / a if a else None)
            record["points"].append(point)
            for s in range(2 * len(model.blocks)):
                def cls(z: torch.Tensor, s=s, shape=xb.shape) -> torch.Tensor:
                    return streams(model, z, shape)[s][0]  # (D,): the class token

                J = jacrev(cls)(z0)  # (D, n)
                for u in J.norm(dim=1).argsort(descending=True)[: args.elements]:
                    Hu = jacfwd(jacrev(lambda z, cls=cls, u=int(u): cls(z)[u]))(z0)
                    Hu = 0.5 * (Hu + Hu.T)
                    lam = float(torch.linalg.eigvalsh(Hu).abs().max())
                    curv.setdefault(s, []).append((lam, float(Hu.norm()) / lam))
    if not first:
        print("\nno correctly classified point among the chosen ones: nothing to "
              "summarise")
        write_json(args.out, __file__, record)
        return
    print(f"\nmedian first-order radius m/|g| {statistics.median(first):.4f}; "
          f"median ceiling / (m/|g|) {statistics.median(ceilings):.2f}"
          + (f"; median ceiling / attack radius {statistics.median(of_attack):.2f}"
             if of_attack else ""))
    print("exact Hessian norms of class-token stream entries after each sub-block"
          " (largest-gradient entries): median, largest; Frobenius / spectral norm:"
          " median, largest")
    record["summary"] = {
        "median_first_order_radius": statistics.median(first),
        "median_ceiling_over_first_order": statistics.median(ceilings),
        "median_ceiling_over_attack": (statistics.median(of_attack) if of_attack
                                       else None)}
    record["curvature"] = []
    for s, got in curv.items():
        lams, ratios = zip(*got, strict=True)
        print(f"  block {s // 2} {'attention' if s % 2 == 0 else 'MLP':9s} "
              f"{statistics.median(lams):8.2f} {max(lams):8.2f}   "
              f"{statistics.median(ratios):5.2f} {max(ratios):5.2f}")
        record["curvature"].append({
            "block": s // 2, "sub_block": "attention" if s % 2 == 0 else "MLP",
            "hessian_norm_median": statistics.median(lams),
            "hessian_norm_max": max(lams),
            "frobenius_over_spectral_median": statistics.median(ratios),
            "frobenius_over_spectral_max": max(ratios)})
    write_json(args.out, __file__, record)


if __name__ == "__main__":
    main()
