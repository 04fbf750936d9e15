"""Where ``margin`` spends its budget (docs/math.md §11): per site of the chain,
its remainder bound, and class attention's remainder against what gradient
ascent finds on the same ball.

On the first ``--n`` Fashion-MNIST test points of a lipschitz hybrid ViT or
CaiT, at each ``--eps``: the share certified by ``margin``, by ``ball`` and by
the first-order ceiling ``m_j > ε ‖∇m_j‖`` (not a certificate), and the
share each site's remainder bound holds back: what the same cuts (eq. 11.8)
would certify were that one bound halved or removed, and were every site's
scaled by 1/2, 1/4 or 1/10 at once (not certificates: where a tighter bound
would pay); for each point the ceiling certifies and ``ball`` does not, the
factor all remainder bounds would need; then, at each
correctly classified point's tightest wrong class (the least slack under
``margin``), the medians of the margin, its first-order term, ``ball``'s and
``margin``'s drop bounds and every site's remainder bound (the site terms
and the what-ifs are those of the gradient's linearisation; the share it
certifies without the stem's chords, eq. 11.13, and the chords' first-order
term and stem remainders are reported beside); on a CaiT, the
median of class attention's remainder bound along that margin and of the
largest remainder projected gradient ascent finds inside the ball of its
input (``--steps`` steps from ``--starts`` random points, both signs: a lower
bound of the true one); and, to see where the rest goes, the second-order
bound (eq. 11.9–11.10) with the attention held at the point (its envelope
not grown: not a bound) and ``δ²/2`` times the largest eigenvalue magnitude
of the Hessian there (power iteration, from below: the remainder's
second-order term, were the ball small).

Usage (JSON in OUT/margin_terms.json)::

    python bench/studies/margin_terms.py --ckpt c2.pt --n 60 --eps 0.25 0.5 \\
        --out runs/margin_terms
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from lipvit.certify.ball.attention import class_ball
from lipvit.certify.ball.network import ball_chain
from lipvit.certify.follow.network import least_cut, margin_certificate
from lipvit.certify.follow.variation import class_attention_remainder

from lipvit.checkpoint import load_checkpoint
from lipvit.data import load_dataset
from lipvit.lipschitz_blocks import ClassAttention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402


def ascended_remainder(ca, X: torch.Tensor, u: torch.Tensor, delta: torch.Tensor,
                       steps: int, starts: int) -> torch.Tensor:
    """Largest ``|uᵀ(c(X′) − c(X)) − ∇(uᵀc)(X)·(X′ − X)|`` found per point
    ``(B,)`` over ``‖X′ − X‖_F ≤ δ``."""
    def along(Z):
        return (ca(Z) * u).sum(dim=-1)

    X = X.detach()
    with torch.enable_grad():
        X0 = X.clone().requires_grad_(True)
        f0 = along(X0)
        (g0,) = torch.autograd.grad(f0.sum(), X0)
    f0 = f0.detach()
    radius = delta[:, None, None]
    best = torch.zeros_like(delta)
    gen = torch.Generator().manual_seed(0)
    for sign in (1.0, -1.0):
        for _ in range(starts):
            D = torch.randn(X.shape, generator=gen, dtype=X.dtype)
            D = D / D.flatten(1).norm(dim=1)[:, None, None] * radius
            for _ in range(steps):
                D = D.detach().requires_grad_(True)
                with torch.enable_grad():
                    r = along(X + D) - f0 - (g0 * D).sum(dim=(1, 2))
                    (g,) = torch.autograd.grad((sign * r).sum(), D)
                best = torch.maximum(best, r.detach().abs())
                D = D + 0.2 * radius * g / g.flatten(1).norm(dim=1).clamp_min(
                    1e-30)[:, None, None]
                D = D / (D.flatten(1).norm(dim=1)[:, None, None] / radius).clamp(min=1)
    return best


def hessian_term(ca, X: torch.Tensor, u: torch.Tensor, delta: torch.Tensor,
                 steps: int = 60) -> torch.Tensor:
    """``δ²/2 · |λ|_max`` of the Hessian of ``uᵀc`` at ``X`` per point ``(B,)``,
    by power iteration on Hessian-vector products (from below: a lower bound
    of the remainder's second-order term, not a bound of anything)."""
    out = torch.zeros_like(delta)
    gen = torch.Generator().manual_seed(0)
    for b in range(X.shape[0]):
        Xb = X[b:b + 1].detach().requires_grad_(True)
        with torch.enable_grad():
            (g,) = torch.autograd.grad((ca(Xb) * u[b]).sum(), Xb, create_graph=True)
            v = torch.randn(Xb.shape, generator=gen, dtype=X.dtype)
            for _ in range(steps):
                v = v / v.norm()
                (hv,) = torch.autograd.grad(g, Xb, v, retain_graph=True)
                v = hv.detach()
        out[b] = v.norm()
    return delta**2 / 2 * out


def needed_scale(M, first, rest, points) -> list[float]:
    """For each of ``points`` (``(B,)`` bool): the factor every remainder
    bound would need (at most) for the first-order-plus-remainders cut to
    certify it, ``min_j (m_j − first_j) / Σ rest_j`` (not a certificate),
    sorted."""
    scale = ((M - first) / sum(rest).clamp_min(1e-300)).amin(dim=0)
    return sorted(float(v) for v in scale[points])


def measure(model, x, y, eps: float, steps: int, starts: int) -> dict:
    mc = margin_certificate(model, x, y)
    e = torch.full((len(y),), eps, dtype=x.dtype)
    first, rest, cuts, ball = mc.terms(e)  # (K, B) each, unrounded
    own, ball_drop = (t.mT for t in mc.drops(e))  # rounded up
    M = mc.margins.mT
    slack = torch.where(torch.isfinite(M - own), M - own, torch.inf)
    k, idx, ok = slack.argmin(dim=0), torch.arange(len(y)), mc.correct

    def med(t: torch.Tensor) -> float:
        return float(t[k, idx][ok].median())

    def certifies(bound: torch.Tensor) -> torch.Tensor:
        return (M > bound).all(dim=0) & ok

    def share(bound: torch.Tensor) -> float:
        return float(certifies(bound).double().mean())

    def scaled(i: int, factor: float) -> float:
        """The share certified with site ``i``'s remainder bound times ``factor``."""
        parts = [r * factor if j == i else r for j, r in enumerate(rest)]
        return share(least_cut(first, parts, cuts, ball))

    out = {"margin_certified": share(own), "ball_certified": share(ball_drop),
           "first_order_ceiling": share(first),
           "if_halved": [scaled(i, 0.5) for i in range(len(rest))],
           "if_removed": [scaled(i, 0.0) for i in range(len(rest))],
           "if_all_scaled": {f: share(least_cut(first, [r * f for r in rest], cuts,
                                                ball)) for f in (0.5, 0.25, 0.1)},
           "between_ball_and_ceiling": needed_scale(
               M, first, rest, certifies(first) & ~certifies(ball_drop)),
           "tightest_class_medians": {"margin": med(M), "first_order": med(first),
                                      "ball_drop": med(ball_drop),
                                      "margin_drop": med(own)},
           "site_remainders": [{"site": type(s.module).__name__, "median": med(r)}
                               for s, r in zip(mc.sites, rest, strict=True)]}
    # The stem by its chords (eq. 11.13): what margin certifies without them.
    chord, stem_rest, _ = mc.chord_terms(e)
    out["gradient_linearisation_certified"] = share(least_cut(first, rest, cuts, ball))
    out["chord_medians"] = {"first_order": med(chord),
                            "stem_remainders": [med(r) for r in stem_rest]}
    site = next((s for s in mc.sites if isinstance(s.module, ClassAttention)), None)
    if site is not None:
        i = mc.sites.index(site)
        delta = e * ball_chain(mc.chain, mc.inputs, e).L_in[-1]
        found = ascended_remainder(site.module, site.z, site.g[k, idx], delta, steps,
                                   starts)
        bound = rest[i][k, idx]
        ca, X, u = site.module, site.z, site.g[k, idx]
        ball = class_ball(X, delta, ca.a(), ca.value, mc.chain.norms[-1], ca.pos_bias,
                          ca.radius)
        second, frozen = (class_attention_remainder(
            X, delta, u[None], ca.a(), ca.value, ball.P0, P_bar, P_low, ca.radius)[0]
            for P_bar, P_low in ((ball.P_bar, ball.P_low), (ball.P0, ball.P0)))
        out["class_attention"] = {
            "input_radius": float(delta.median()), "bound": float(bound[ok].median()),
            "second_order": float(second[ok].median()),
            "attention_held": float(frozen[ok].median()),
            "hessian": float(hessian_term(ca, X, u, delta)[ok].median()),
            "ascent": float(found[ok].median()),
            "bound_over_ascent": float((bound / found.clamp_min(1e-300))[ok].median())}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, type=Path)
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--n", type=int, default=60)
    p.add_argument("--eps", type=float, nargs="+", default=[0.25, 0.5])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--starts", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    add_out(p, __file__)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_checkpoint(args.ckpt)
    model = loaded.model.double().eval()
    data = load_dataset(loaded.dataset or "fashion-mnist", args.data_dir)
    x, y = data.x_test[:args.n].double(), data.y_test[:args.n]
    results = {str(eps): measure(model, x, y, eps, args.steps, args.starts)
               for eps in args.eps}
    for eps, r in results.items():
        print(f"eps {eps}: margin {r['margin_certified']:.3f}, ball "
              f"{r['ball_certified']:.3f}, first-order ceiling "
              f"{r['first_order_ceiling']:.3f}; {r['tightest_class_medians']}")
        print("  " + ", ".join(f"{s['site']} {s['median']:.3f}"
                               for s in r["site_remainders"]))
        print("  certified were one bound halved / removed: " + ", ".join(
            f"{s['site']} {h:.3f}/{z:.3f}" for s, h, z in zip(
                r["site_remainders"], r["if_halved"], r["if_removed"], strict=True)))
        print(f"  certified were every bound scaled: {r['if_all_scaled']}")
        print("  points between ball and the first-order ceiling, the factor their "
              "remainder bounds need: " + ", ".join(
                  f"{v:.2f}" for v in r["between_ball_and_ceiling"]))
        print(f"  with the gradient's linearisation only (no chords, eq. 11.13): "
              f"{r['gradient_linearisation_certified']:.3f}; the chords' medians: "
              f"{r['chord_medians']}")
        if "class_attention" in r:
            print(f"  class attention: {r['class_attention']}")
    write_json(args.out, __file__,
               {"checkpoint": str(args.ckpt), "n": args.n, "results": results})


if __name__ == "__main__":
    main()
