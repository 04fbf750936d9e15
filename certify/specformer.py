"""SpecFormer's local Lipschitz bound of self-attention (Hu et al., Theorem 4.2, eq. 9).

Symbols (docs/math.md §3; shapes: ``B`` batch, ``N`` tokens, ``D`` width, ``H``
heads, ``d`` head width):

=================  ===========  ================================================
paper              code         meaning
=================  ===========  ================================================
``X0``             ``X``        clean token matrix ``(B, N, D)``
``δ0``             ``eps``      radius of the Frobenius ball (``δ0 = ε``)
``B``              ``x_bound``  ``‖X0‖_F + δ0 ≥ ‖X‖_F`` on the ball
``W^Q,W^K,W^V``    ``W_q...``   per-head weights ``(H, D, d)``
``Lip_local``      ``lip``      bound on the Jacobian norm on the ball, eq. (9)
=================  ===========  ================================================

Theorem 4.2 (single head, no output projection):
``Lip_local(Att, X0) ≤ N(N+1) (‖X0‖_F + δ0)² [‖W^V‖‖W^Q‖‖W^K‖ + ‖W^V‖]``.
The deviation bound is ``Lip_local · ε`` (mean value theorem on the convex
ball). Extension to the layer of :func:`lipvit.certify.attention.attention`
(docs/math.md §3): the Jacobian of ``Σ_h f_h(X) W_o[h]`` has norm at most
``Σ_h ‖W_o[h]‖ ‖J_{f_h}‖``, so the per-head bounds are multiplied by
``‖W_o[h]‖`` and summed; the residual adds ``‖H‖ = 1``.

**Finding: the theorem as stated is not an upper bound for small inputs.**
Its proof (Appendix B) bounds the ``(i, j)`` Jacobian block by
``‖W^V‖(‖X‖²‖P^(i)‖(1 + δ_ij)‖W^Q‖‖W^K‖ + P_ij)`` and then absorbs the
``P_ij ‖W^V‖`` term into ``(B + δ0)² ‖W^V‖``, which needs ``B + δ0 ≥ 1``. At
``X0 = 0`` the Jacobian is ``(11ᵀ/N) ⊗ W^V`` with norm ``‖W^V‖`` while eq. (9)
tends to 0 with δ0; PGD exceeds eq. (9) there (``tests/test_specformer.py``).
Redoing the proof with ``Σ_j P_ij = 1`` gives the sound variant
(``variant="repaired"``)::

    Lip_local ≤ N ‖W^V‖ [ (N+1) (‖X0‖_F + δ0)² ‖W^Q W^Kᵀ‖/√d + 1 ]

(the row block ``i`` has norm ``≤ Σ_j ‖J_ij‖``; the block norms use
``‖P^(i)‖ ≤ 1``, ``‖x_i‖ ≤ ‖X‖ ≤ ‖X‖_F``, ``‖E_ij‖ = 1``; the full Jacobian
has norm ``≤ Σ_i`` of its row-block norms). Eq. (9) is at least this whenever
``(N+1)(‖X0‖_F + δ0)² ≥ 1``: the difference is
``N‖W^V‖[(N+1)r²(‖W^Q‖‖W^K‖ − ‖W^Q W^Kᵀ‖/√d) + (N+1)r² − 1]`` with
``r = ‖X0‖_F + δ0``, and ``‖W^Q W^Kᵀ‖ ≤ ‖W^Q‖‖W^K‖``, ``√d ≥ 1``. So in that
regime — e.g. LoFAST's inputs with ``‖X0‖_F = 1`` — the paper's value is an
upper bound too.

Variants (``variant=``): ``"paper"``, eq. (9) as printed (*not* a certificate);
``"repaired"``, the proven bound above; ``"sound"`` (the default), eq. (9) per
sample where ``(N+1)(‖X0‖_F + δ0)² ≥ 1`` and the repaired bound elsewhere — the
paper's number wherever it is an upper bound, and an upper bound everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from lipvit.certify.attention import check_layer, query_key
from lipvit.certify.eps import eps_per_sample
from torch import Tensor

from lipvit.spectral import spectral_norm

Variant = Literal["paper", "repaired", "sound"]
VARIANTS: tuple[str, ...] = ("paper", "repaired", "sound")


@dataclass(frozen=True)
class SpecFormerTerms:
    """ε-independent parts of the SpecFormer bound at clean ``X`` (batch ``B``).

    Attributes:
        x_norm: ``‖X0‖_F`` ``(B,)``.
        qk_paper: per-head ``‖W_q‖‖W_k‖`` (eq. 9), ``(H,)``.
        qk_repaired: per-head ``‖W_q W_kᵀ‖/√d`` (repaired bound), ``(H,)``.
        v_norm: ``‖W_v[h]‖`` ``(H,)``; o_norm: ``‖W_o[h]‖`` ``(H,)``.
        N: tokens.
        residual: adds ``‖H‖ = 1``.
        variant: ``"paper"``, ``"repaired"`` or ``"sound"`` (module docstring).
    """

    x_norm: Tensor
    qk_paper: Tensor
    qk_repaired: Tensor
    v_norm: Tensor
    o_norm: Tensor
    N: int
    residual: bool
    variant: Variant

    def _eps(self, eps: float | Tensor) -> Tensor:
        x = self.x_norm
        return eps_per_sample(eps, x.shape[0], x.dtype, x.device)  # (B,)

    def paper_holds(self, eps: float | Tensor) -> Tensor:
        """Whether eq. (9) is an upper bound: ``(N+1)(‖X0‖_F + δ0)² ≥ 1``, ``(B,)``."""
        e = self._eps(eps)
        return (self.N + 1) * (self.x_norm + e) ** 2 >= 1

    def lipschitz(self, eps: float | Tensor) -> Tensor:
        """``Lip_local`` on the ball of radius ``eps`` (δ0 = ε), ``(B,)``."""
        e = self._eps(eps)
        radius2 = ((self.x_norm + e) ** 2)[:, None]  # (B, 1): (‖X0‖_F + δ0)²
        N, v = self.N, self.v_norm
        paper = N * (N + 1) * radius2 * (v * self.qk_paper + v)  # (B, H): eq. (9)
        repaired = N * v * ((N + 1) * radius2 * self.qk_repaired + 1)  # (B, H)
        if self.variant == "paper":
            per_head = paper
        elif self.variant == "repaired":
            per_head = repaired
        else:
            per_head = torch.where(self.paper_holds(e)[:, None], paper, repaired)
        return (per_head * self.o_norm).sum(dim=1) + float(self.residual)

    def delta(self, eps: float | Tensor) -> Tensor:
        """Deviation bound ``Lip_local · ε``, ``(B,)``."""
        e = self._eps(eps)
        return self.lipschitz(e) * e


def specformer_terms(
    X: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    W_v: Tensor,
    W_o: Tensor,
    residual: bool = True,
    variant: Variant = "sound",
) -> SpecFormerTerms:
    """The parts of :func:`specformer_bound` that do not depend on ε.

    Raises:
        ValueError: an unknown ``variant``; shape mismatches.
    """
    if variant not in VARIANTS:
        raise ValueError(
            f"unknown SpecFormer variant {variant!r}; choose from {', '.join(VARIANTS)}"
        )
    check_layer(X, W_q, W_k, W_v, W_o)
    return SpecFormerTerms(
        x_norm=torch.linalg.matrix_norm(X),  # Frobenius, (B,)
        qk_paper=spectral_norm(W_q) * spectral_norm(W_k),
        qk_repaired=spectral_norm(query_key(W_q, W_k)) / math.sqrt(W_q.shape[-1]),
        v_norm=spectral_norm(W_v),
        o_norm=spectral_norm(W_o),
        N=X.shape[1],
        residual=residual,
        variant=variant,
    )


def specformer_bound(
    X: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    W_v: Tensor,
    W_o: Tensor,
    eps: float | Tensor,
    residual: bool = True,
    variant: Variant = "sound",
) -> Tensor:
    """SpecFormer Theorem 4.2 deviation bound ``Lip_local · ε``, ``δ0 = ε``, ``(B,)``.

    ``variant="paper"``: eq. (9),
    ``Σ_h ‖W_o[h]‖ · N(N+1)(‖X‖_F + ε)² (‖W_v[h]‖‖W_q[h]‖‖W_k[h]‖ + ‖W_v[h]‖) · ε``,
    plus ``ε`` for the residual — only *claimed* as an upper bound: it fails
    when ``(N+1)(‖X‖_F + ε)² < 1`` (module docstring). ``"repaired"``: the
    proven variant. ``"sound"`` (default): eq. (9) where it holds, the repaired
    bound elsewhere — an upper bound. Exact spectral norms (dense SVD).

    Args:
        X: ``(B, N, D)``; W_q, W_k, W_v: ``(H, D, d)``; W_o: ``(H, d, D)``.
        eps: radius ε ≥ 0 (float or ``(B,)`` tensor).
        residual: ``H = I`` (adds ``‖H‖ ε = ε``) or ``H = 0``.
        variant: ``"paper"``, ``"repaired"`` or ``"sound"``.

    Raises:
        ValueError: negative, NaN or infinite ``eps``; an unknown variant;
            shape mismatches.
    """
    B = X.shape[0] if X.ndim == 3 else 1
    eps_per_sample(eps, B, torch.float64, torch.device("cpu"))  # validate first
    return specformer_terms(X, W_q, W_k, W_v, W_o, residual, variant).delta(eps)
