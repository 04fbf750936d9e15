"""LoFAST on one attention layer versus a PGD lower bound (LoFAST Theorem 1).

A random 4-head residual attention layer ``F(X) = X + Σ_h P_h(X) X W_v[h] W_o[h]``
at an input with ‖X‖_F = 1 (what LoFAST's projection enforces). For each ε the
script prints ζ(X)ε, the LoFAST bound (eq. 27), its ξ relaxation (eq. 28), the
½-Lipschitz-softmax variant and the deviation PGD finds: PGD ≤ true max ≤ bound.

    python examples/bound_layer.py --tokens 9 --dim 16 --heads 4
"""

from __future__ import annotations

import argparse
import os

import torch
from lipvit.analysis.pgd import pgd_deviation
from lipvit.certify.attention import attention
from lipvit.certify.lofast.layer import lofast_bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens", type=int, default=int(os.environ.get("LIPVIT_EXAMPLE_TOKENS", "9"))
    )
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest
    D, H = args.dim, args.heads
    d = D // H
    g = torch.Generator().manual_seed(args.seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    W_q, W_k, W_v = (rand(H, D, d, scale=D**-0.5) for _ in range(3))  # (H, D, d)
    W_o = rand(H, d, D, scale=d**-0.5)  # (H, d, D)
    X = rand(args.samples, args.tokens, D, scale=1.0)  # (B, N, D)
    X = X / torch.linalg.matrix_norm(X)[:, None, None]  # ‖X‖_F = 1

    def F(Z: torch.Tensor) -> torch.Tensor:
        return attention(Z, W_q, W_k, W_v, W_o, residual=True)

    print(
        f"{'eps':>6}  {'zeta*eps':>9}  {'LoFAST':>9}  {'xi (28)':>9}  "
        f"{'half':>9}  {'PGD':>9}  {'LoFAST/PGD':>10}"
    )
    for eps in (0.01, 0.05, 0.1):
        b = lofast_bound(X, W_q, W_k, W_v, W_o, eps, residual=True)
        pgd = pgd_deviation(F, X, eps, steps=50, restarts=2, seed=args.seed)
        assert bool((b.total >= pgd).all()), "a bound below PGD would be a bug"
        print(
            f"{eps:6.2f}  {b.delta_1.mean():9.5f}  {b.total.mean():9.5f}  "
            f"{b.total_fast.mean():9.5f}  {b.total_half.mean():9.5f}  "
            f"{pgd.mean():9.5f}  {(b.total / pgd).mean():10.4f}"
        )


if __name__ == "__main__":
    main()
