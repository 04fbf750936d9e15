"""A structured, matrix-free bound on a lipschitz attention sub-block's Jacobian norm.

The taylor certificate's budget recursion needs ``λ ≥ ‖I + J_a J_N‖``, the
clean-point Jacobian of ``s ↦ s + attn(P₁(s))`` (docs/taylor.md §8). Its
product bound ``1 + ‖J_a‖ ‖J_N‖`` is 1.4–1.7× the exact norm on a
Fashion-MNIST model, and the exact norm needs the ``(N·D) × (N·D)``
Jacobian. Here the LayerProject's Jacobian is a scaled projection, so the
sub-block is a Kronecker-structured residual map on the complement of at most
``N`` known directions, and its norm follows from the structured ζ certificate
(:mod:`lipvit.certify.structured`) and an ``r × r`` eigenproblem
(docs/taylor.md §8, "Projected sub-blocks"; ours).

Notation: ``Γ`` an ``N × D`` token matrix, ``K Γ = Σ_h P_h Γ W_vo[h]`` the
value path, ``S`` the softmax path (``‖S‖ ≤ σ``, its product bound), ``J_N``
the projection's Jacobian: on token ``t`` (or on the whole matrix in
Frobenius mode) ``c (I − x̂x̂ᵀ)`` with ``c = R/‖x‖`` where ``‖x‖ > R``, the
identity elsewhere. Pure functions of tensors.
"""

from __future__ import annotations

import torch
from lipvit.certify.attention import value_output
from lipvit.certify.lofast import zeta_from_attention
from lipvit.certify.tangents import top_root
from torch import Tensor

_SLACK = 1e-10
"""Relative margin on the ``r × r`` part (float64 rounding of ``K'ᵀU`` and its
projection, far below ``1e-10`` at these sizes)."""


def projection_structure(X: Tensor, radius: float, mode: str) -> tuple[Tensor, Tensor]:
    """``J_N = D_c (I − U Uᵀ)`` of a LayerProject at ``X`` ``(B, N, D)``.

    Returns:
        ``c`` ``(B, N)``: each token's scale (``R/‖x‖`` where projected, else 1;
        one value for all tokens in Frobenius mode);
        ``U`` ``(B, r, N, D)``: orthonormal directions removed (``r = 1``,
        ``x̂ = X/‖X‖_F`` in Frobenius mode; ``r = N``, ``e_t ⊗ x̂_t`` in token
        mode), zero where nothing is projected.
    """
    B, N, D = X.shape
    if mode == "frobenius":
        n = torch.linalg.vector_norm(X, dim=(1, 2))  # (B,)
        proj = n > radius
        c = torch.where(proj, radius / n, torch.ones_like(n))[:, None].expand(B, N)
        U = torch.where(proj[:, None, None], X / n[:, None, None], torch.zeros_like(X))
        return c, U[:, None]  # (B, 1, N, D)
    n = torch.linalg.vector_norm(X, dim=-1)  # (B, N)
    proj = n > radius
    c = torch.where(proj, radius / n, torch.ones_like(n))
    x_hat = torch.where(proj[..., None], X / n[..., None], torch.zeros_like(X))
    U = torch.diag_embed(x_hat.transpose(1, 2)).permute(0, 2, 3, 1)  # (B, N, N, D)
    return c, U


def projected_subblock_norm(
    P: Tensor, W_v: Tensor, W_o: Tensor, c: Tensor, U: Tensor, sigma: Tensor
) -> Tensor:
    """Upper bound ``(B,)`` on ``‖I + (K + S) J_N‖``, ``J_N = D_c (I − UUᵀ)``.

    With ``K' = K D_c`` (the attention matrices' columns scaled by ``c``:
    still Kronecker) and ``A = I + K'``, ``I + K' (I − UUᵀ) = A (I − UUᵀ) +
    UUᵀ``. A unit ``w = Us + w_⊥`` maps to ``A w_⊥ + U s``, so

        ‖·w‖² = ‖A w_⊥‖² + 2 sᵀ Uᵀ A w_⊥ + ‖s‖² ≤ a² ‖w_⊥‖² + 2 b ‖s‖ ‖w_⊥‖ + ‖s‖²

    with ``a ≥ ‖A‖`` (the residual ζ certificate of ``P D_c``) and ``b =
    ‖(I − UUᵀ) K'ᵀ U‖`` (``Uᵀ A w_⊥ = ((I − UUᵀ) Aᵀ U)ᵀ w_⊥``, and ``Aᵀ U =
    U + K'ᵀ U``): at most ``λ_max([[a², b], [b, 1]])``. The softmax path adds
    at most ``σ ‖J_N‖ = σ max c``.

    Args:
        P: attention matrices ``(B, H, N, N)``, float64.
        W_v: ``(H, D, d)``; W_o: ``(H, d, D)``.
        c, U: :func:`projection_structure`.
        sigma: ``(B,)``, a bound on the softmax path's ``‖S‖``.
    """
    Pc = P * c[:, None, None, :]  # (B, H, N, N): P_h D_c
    a = zeta_from_attention(Pc, W_v, W_o, residual=True)
    W_vo = value_output(W_v, W_o)  # (H, D, D)
    V = torch.einsum("bhsn,brsd,hed->brne", Pc, U, W_vo)  # (B, r, N, D): K'ᵀ U
    coef = torch.einsum("brnd,bqnd->brq", U, V)  # (B, r, r): Uᵀ K'ᵀ U
    V_perp = V - torch.einsum("brq,brnd->bqnd", coef, U)  # (I − UUᵀ) K'ᵀ U
    flat = V_perp.flatten(2)  # (B, r, N·D)
    b = top_root(flat @ flat.transpose(1, 2)) * (1 + _SLACK)  # (B,)
    a2 = a.square()
    half = (a2 - 1) / 2
    lam2 = (a2 + 1) / 2 + torch.sqrt(half.square() + b.square())
    return lam2.sqrt() * (1 + _SLACK) + sigma * c.amax(-1)
