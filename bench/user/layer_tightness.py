"""Tightness of the attention-layer bounds against PGD (LoFAST's Table 3).

One residual 8-head attention layer, ``N = 65`` tokens, ``D = 128`` (the size of
LoFAST's 3-layer CIFAR model), random weights scaled like a trained LoFAST
layer (seeded):

* ``W_v[h]``, ``W_o[h]``: Gaussian, each head rescaled to spectral norm 0.5 —
  the per-head caps ``v_cap = o_cap = 0.5`` of lipvit's lipschitz family
  (LoFAST §5.2 constrains them "to a fraction of 1").
* ``W_q[h]``, ``W_k[h]``: Gaussian, each head rescaled to spectral norm
  ``--qk-norm`` (default 1; unconstrained in LoFAST, of order one after
  training).

Three settings (docs/math.md §5):

1. ``frobenius``: the input token matrix is projected onto the Frobenius ball
   of radius 1 (what LoFAST's architecture does before each attention).
2. ``token``: every token projected onto the unit sphere (per-token norm 1,
   ``‖X‖_F = √N``).
3. ``qk x4``: as 1 with 4× larger ``W_q`` and ``W_k``.

For every ε the table shows the PGD lower bound (the best of
``lipvit.analysis.pgd_deviation`` on the layer and the two feasible points
``X ± ε v``, ``v`` the top right singular vector of ζ's operator: PGD from
random starts converges like power iteration, slowly on this clustered
spectrum), ``ζ ε`` (exact maximum of the linear term Δ1), LoFAST's
``total`` (eq. 27) and ``total_fast`` (eq. 28), the extensions ``total_half``
(softmax is ½-Lipschitz) and ``total_local`` (local softmax constant, centred
tokens), SpecFormer's Theorem 4.2 (eq. 9, δ0 = ε), and ratios to PGD (means
over samples). All LoFAST numbers are exact-mode certificates
(``lofast_bound(..., exact=True)``). The last two columns are the shares of
the gap ``total − PGD`` that ``total_half`` and ``total_local`` close.

The tables also go, as numbers, to ``--out``/layer_tightness.json.

Usage::

    python bench/user/layer_tightness.py                # CPU, a few minutes
    python bench/user/layer_tightness.py --n-samples 4 --device cuda
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from lipvit.analysis.pgd import pgd_deviation
from lipvit.certify.attention import attention, attention_probs
from lipvit.certify.lofast.layer import lofast_terms
from lipvit.certify.lofast.operators import sensitivity_matvec, sensitivity_rmatvec
from lipvit.certify.specformer import specformer_terms
from torch import Tensor

from lipvit.layers import layer_project
from lipvit.spectral import power_iteration

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402

N, D, H = 65, 128, 8
EPS = (0.01, 0.03, 0.05, 0.07, 0.09, 0.1)


def _heads(shape: tuple[int, ...], norm: float, g: torch.Generator, dtype) -> Tensor:
    """Gaussian per-head matrices, each rescaled to spectral norm ``norm``."""
    W = torch.randn(*shape, generator=g, dtype=torch.float64)
    return (W * (norm / torch.linalg.matrix_norm(W, ord=2))[:, None, None]).to(dtype)


def make_layer(qk_norm: float, vo_norm: float, seed: int, dtype) -> list[Tensor]:
    """``W_q, W_k, W_v (H, D, d)`` and ``W_o (H, d, D)``."""
    g = torch.Generator().manual_seed(seed)
    d = D // H
    W_q = _heads((H, D, d), qk_norm, g, dtype)
    W_k = _heads((H, D, d), qk_norm, g, dtype)
    W_v = _heads((H, D, d), vo_norm, g, dtype)
    W_o = _heads((H, d, D), vo_norm, g, dtype)
    return [W_q, W_k, W_v, W_o]


def make_inputs(n: int, mode: str, seed: int, dtype) -> Tensor:
    """Gaussian token matrices projected per ``mode`` ("frobenius" or "token")."""
    g = torch.Generator().manual_seed(seed + 1)
    X = torch.randn(n, N, D, generator=g, dtype=torch.float64)
    dims = (-2, -1) if mode == "frobenius" else (-1,)
    return layer_project(X, 1.0, dims).to(dtype)


def zeta_direction(X: Tensor, W: list[Tensor]) -> Tensor:
    """Unit ``Γ`` per sample maximising the linear term ``‖A(Γ)‖_F`` (power iter.)."""
    P = attention_probs(X, W[0], W[1])  # (B, H, N, N)
    g = torch.Generator(device=X.device).manual_seed(0)
    start = torch.randn(X.shape, generator=g, dtype=X.dtype, device=X.device)
    return power_iteration(lambda G: sensitivity_matvec(G, P, W[2], W[3], True),
                           lambda Y: sensitivity_rmatvec(Y, P, W[2], W[3], True),
                           start, 1500, in_ndim=2, out_ndim=2, tol=1e-11).v


def lower_bound(fn, X: Tensor, v: Tensor, eps: float, steps: int,
                restarts: int) -> Tensor:
    """Largest deviation found: PGD, and the two points ``X ± ε v`` (all feasible)."""
    pgd = pgd_deviation(fn, X, eps, steps=steps, restarts=restarts, seed=0)
    radius = eps * (1 - 1e-12)  # keeps ‖ε v‖ ≤ ε through rounding
    with torch.no_grad():
        Y = fn(X)
        for sign in (1.0, -1.0):
            out = fn(X + sign * radius * v) - Y  # (B, N, D)
            pgd = torch.maximum(pgd, torch.linalg.vector_norm(out.flatten(1), dim=1))
    return pgd


def table(X: Tensor, W: list[Tensor], eps_list, steps: int, restarts: int,
          record: dict | None = None) -> list[str]:
    """Markdown rows of one setting (their numbers into ``record`` if given)."""
    terms = lofast_terms(X, *W, residual=True, exact=True)
    spec = specformer_terms(X, *W, residual=True)
    v = zeta_direction(X, W)  # (B, N, D)

    def fn(Z: Tensor) -> Tensor:
        return attention(Z, *W, residual=True)

    rows = [
        f"ζ = {terms.zeta.mean():.4f} (mean), method: {terms.method}",
        "",
        "| ε | PGD | ζε | total | total_fast | total_half | total_local | SpecFormer "
        "| ζε/PGD | total/PGD | fast/PGD | half/PGD | local/PGD | SpecFormer/PGD "
        "| gap closed: half | local |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for eps in eps_list:
        b = terms.bound(eps)
        sf = spec.delta(eps)
        pgd = lower_bound(fn, X, v, eps, steps, restarts)
        assert bool((pgd <= b.total_local * (1 + 1e-9)).all()), "PGD beat total_local"

        def m(t: Tensor) -> float:
            return float(t.double().mean())

        gap = (b.total - pgd).clamp_min(1e-300)
        closed_half = m((b.total - b.total_half) / gap)
        closed_local = m((b.total - b.total_local) / gap)
        rows.append(
            f"| {eps:g} | {m(pgd):.5f} | {m(b.delta_1):.5f} | {m(b.total):.5f} "
            f"| {m(b.total_fast):.5f} | {m(b.total_half):.5f} | {m(b.total_local):.5f} "
            f"| {m(sf):.4g} | {m(b.delta_1 / pgd):.4f} | {m(b.total / pgd):.4f} "
            f"| {m(b.total_fast / pgd):.4f} | {m(b.total_half / pgd):.4f} "
            f"| {m(b.total_local / pgd):.4f} | {m(sf / pgd):.4g} "
            f"| {100 * closed_half:.0f} % | {100 * closed_local:.0f} % |"
        )
        if record is not None:
            record.setdefault("rows", []).append({
                "eps": eps, "pgd": m(pgd), "zeta_eps": m(b.delta_1),
                "total": m(b.total), "total_fast": m(b.total_fast),
                "total_half": m(b.total_half), "total_local": m(b.total_local),
                "specformer": m(sf), "zeta_eps_over_pgd": m(b.delta_1 / pgd),
                "total_over_pgd": m(b.total / pgd),
                "fast_over_pgd": m(b.total_fast / pgd),
                "half_over_pgd": m(b.total_half / pgd),
                "local_over_pgd": m(b.total_local / pgd),
                "specformer_over_pgd": m(sf / pgd),
                "gap_closed_half": closed_half, "gap_closed_local": closed_local})
    if record is not None:
        record.update(zeta_mean=float(terms.zeta.mean()), method=terms.method)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-samples", type=int, default=2)
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--qk-norm", type=float, default=1.0)
    parser.add_argument("--vo-norm", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=50, help="PGD steps per restart")
    parser.add_argument("--restarts", type=int, default=2, help="PGD restarts")
    parser.add_argument("--eps", type=float, nargs="+", default=list(EPS))
    add_out(parser, __file__)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)

    settings = [
        ("frobenius: ‖X‖_F = 1", "frobenius", 1.0),
        ("token: every token of norm 1", "token", 1.0),
        ("qk x4: ‖X‖_F = 1, 4× larger W_q, W_k", "frobenius", 4.0),
    ]
    print(f"# Attention-layer tightness: N={N}, D={D}, H={H}, residual, "
          f"‖W_q[h]‖=‖W_k[h]‖={args.qk_norm:g}, ‖W_v[h]‖=‖W_o[h]‖={args.vo_norm:g}, "
          f"{args.n_samples} samples, seed {args.seed}, {args.dtype}, {device}; "
          f"PGD {args.steps} steps x {args.restarts} restarts\n")
    record = {"N": N, "D": D, "H": H, "args": vars(args), "settings": []}
    for title, mode, qk_scale in settings:
        t0 = time.perf_counter()
        W = [w.to(device) for w in make_layer(args.qk_norm * qk_scale, args.vo_norm,
                                               args.seed, dtype)]
        X = make_inputs(args.n_samples, mode, args.seed, dtype).to(device)
        setting = {"setting": title, "mode": mode, "qk_scale": qk_scale}
        rows = table(X, W, args.eps, args.steps, args.restarts, setting)
        print(f"## {title}\n")
        print("\n".join(rows))
        setting["seconds"] = time.perf_counter() - t0
        print(f"\n({setting['seconds']:.0f} s)\n")
        record["settings"].append(setting)
    write_json(args.out, __file__, record)


if __name__ == "__main__":
    main()
