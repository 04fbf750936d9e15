"""The attention's remainder to second order through the image, docs/taylor.md §7
(*second order through the image*, ours).

For a move ``Δ = LΓ + R`` of the attention's input (``L = J_{p←x}``, ``‖Γ‖ ≤
ε``, ``‖R‖ ≤ rest``), Taylor's theorem to third order gives

    a(p+Δ) − a(p) − J_aΔ = ½D²a[LΓ, LΓ] + D²a[LΓ, R] + ½D²a[R, R] + R₃,

``R₃ = ∫₀¹ ½(1−t)² D³a(p+tΔ)[Δ,Δ,Δ] dt``. The first term is a quadratic map
of the image's ``n`` coordinates whose coefficients (one ``n × n`` Hessian per
output entry) :func:`attention_hessian_norm` computes in closed form from the
image's tangents, so ``‖½D²a[LΓ,LΓ]‖ ≤ ½‖H‖ ε²`` with ``H`` the ``n² × (N·D)``
matrix of those coefficients (``vec(ΓΓᵀ)`` has norm ``‖Γ‖²``). The middle terms
use the quadratic coefficient ``q`` of the budget-only bound
(:func:`~lipvit.certify.taylor.remainders.attention_remainder` divided by ``β²`` as
``β → 0``) and polarisation, ``‖D²a[x,y]‖ ≤ 2q‖x‖‖y‖``; :func:`third_order`
bounds ``R₃``.
"""

from __future__ import annotations

import math

import torch
from lipvit.certify.lofast.layer import LoFASTTerms
from lipvit.certify.taylor.remainders import (
    ImagePart,
    attention_remainder,
    image_times,
    linear_std,
    row_gains,
    softmax_constants,
)
from torch import Tensor

from lipvit.spectral import top_root

HESSIAN_MAX = 2**23
"""Largest ``n² · H · N²`` (entries of one ``(n, n, H, N, N)`` tensor) for which
:func:`attention_hessian_norm` runs (64 MiB in float64); above it the
image's second-order term is not computed (``+inf``)."""


def _softmax_jvp(P: Tensor, X: Tensor) -> Tensor:
    """``Ds(p)[x] = p ⊙ (x − Σ_k p_k x_k)`` row by row; ``P`` broadcasts."""
    return P * (X - (P * X).sum(-1, keepdim=True))


def attention_hessian_norm(blk, dp: Tensor) -> Tensor:
    """``σ`` ``()`` with ``‖½D²a(p)[LΓ, LΓ]‖_F ≤ σ ‖Γ‖²`` for all ``Γ``: half the
    norm of the ``n² × (N·D)`` matrix of second derivatives ``D²a[Le_i, Le_j]``.

    ``blk``: the block's clean-point data (``Linearized.blocks[k]``: ``P``,
    ``V``, ``Q_t``, ``K_t``, ``W_qkv``, ``W_o``); ``dp``
    ``(n, N, D)``: the attention input's tangents ``Le_i``. With ``S_h =
    QK_hᵀ/√d``, ``dS_i = (dQ_iKᵀ + QdK_iᵀ)/√d``, ``d²S_ij = (dQ_idK_jᵀ +
    dQ_jdK_iᵀ)/√d`` and the softmax's ``D²s(p)[a,b] = p ⊙ (a′b′ − Cov_p(a,b))``
    (``a′ = a − E_p a``):

        D²a[Le_i, Le_j] = Σ_h (D²s[dS_i, dS_j] V + Ds[d²S_ij] V + Ds[dS_i] dV_j
                               + Ds[dS_j] dV_i) W_o[h].

    ``+inf`` above :data:`HESSIAN_MAX`.
    """
    n, N, D = dp.shape
    H, d, _ = blk.Q_t.shape
    if n * n * H * N * N > HESSIAN_MAX:
        return torch.tensor(math.inf, dtype=dp.dtype, device=dp.device)
    qkv = (dp.reshape(n * N, D) @ blk.W_qkv).reshape(n, N, 3, H, d)
    dQ, dK, dV = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (n, H, N, d)
    dS = dQ @ blk.K_t + (dK @ blk.Q_t).transpose(-1, -2)  # (n, H, N, N)
    C = dS - (blk.P * dS).sum(-1, keepdim=True)  # (n, H, N, N): row-centred
    dP = _softmax_jvp(blk.P, dS)  # Ds[dS_i]
    # The pairs i ≤ j (D²a is symmetric): an off-diagonal pair's row counts twice
    # in the Gram matrix, so it enters scaled by √2.
    i, j = torch.triu_indices(n, n, device=dp.device)  # (n(n+1)/2,) each
    CC = C[i] * C[j]  # (pairs, H, N, N)
    W = blk.P * (CC - (blk.P * CC).sum(-1, keepdim=True))  # D²s[dS_i, dS_j]
    d2S = (dQ[i] @ dK[j].transpose(-1, -2) + dQ[j] @ dK[i].transpose(-1, -2))
    W = W + _softmax_jvp(blk.P, d2S / math.sqrt(d))  # + Ds[d²S_ij]
    out = W @ blk.V + dP[i] @ dV[j] + dP[j] @ dV[i]  # (pairs, H, N, d)
    out = out.transpose(1, 2).reshape(-1, N, H * d) @ blk.W_o  # (pairs, N, D)
    weight = torch.full(i.shape, math.sqrt(2), dtype=out.dtype, device=out.device)
    weight[i == j] = 1.0
    return 0.5 * top_root(_gram(out.reshape(-1, N * D) * weight[:, None]))


def _gram(M: Tensor) -> Tensor:
    """The smaller Gram matrix of ``M`` (the same nonzero eigenvalues)."""
    return M @ M.T if M.shape[0] <= M.shape[1] else M.T @ M


def quadratic_coefficient(terms: LoFASTTerms) -> Tensor:
    """``q`` ``(B,)`` with ``‖½D²a(p)[x,x]‖ ≤ q‖x‖²`` for every ``x``: the
    budget-only bound over ``β²`` at ``β = 10⁻⁸/(1 + max_h‖M_h(X)‖)``.
    ``r(tx)/t² → ½D²a[x,x]`` as ``t → 0`` and each of the bound's terms over
    ``β²`` is nondecreasing in ``β`` except the probabilities' cap ``√(2N)``,
    which needs ``c′ρ_h ≥ √(2N)`` and so is inactive at that ``β`` (``c′ ≤ ½``,
    ``ρ_h ≤ β(‖M_h‖ + β‖A_h‖)/√d``): the ratio there is at least the limit."""
    beta = 1e-8 / (1 + terms.m_norm.amax(-1))  # (B,)
    return attention_remainder(terms, beta) / beta**2


def third_order(terms: LoFASTTerms, beta: Tensor, delta_max: Tensor,
                logit_radius: Tensor | None, image: ImagePart | None) -> Tensor:
    """Bound on ``‖R₃‖ ≤ ⅙ sup_t ‖D³a(p+tΔ)[Δ,Δ,Δ]‖_F`` ``(B,)`` for ``‖Δ‖ ≤ β``,
    every token's ``‖Δ_k‖ ≤ delta_max`` (docs/taylor.md §7).

    Per head, along ``p_t = p + tΔ``: ``S′ = U(t) = U₀ + 2tQ`` (``Q = ΔA_hΔᵀ/√d``),
    ``S″ = 2Q``; ``V(t) = p_tW_vo``, ``V′ = E = ΔW_vo``; so with the softmax's
    ``D³s[u,u,u] = p ⊙ (u′³ − 3Var(u)u′ − E u′³)``,

        out‴ = (D³s[U,U,U] + 6D²s[U,Q]) V + 3(D²s[U,U] + 2Ds[Q]) E.

    Row by row at the probabilities ``q = p(t)`` (within ``p e^{±s}``, ``s =
    √2ρ_h``, so ``Var_q ≤ e^s Var_p``): ``‖D³s[u,u,u]‖₁ ≤ 2E|u′|³ +
    3Var_q(u)^{3/2} ≤ (2M + 3 min(M, e^{s/2}σ_max)) e^s σ_r²`` (``σ_r`` and
    its largest ``σ_max`` below; ``M ≥
    max_k|u′_k|``, ``≤ √2‖u_r‖ ≤ √2(‖a_r‖ + 2‖q_r‖)``, at most ``2√2ρ_h`` and
    ``√2(max_r‖a_r‖ + 2‖A_h‖δβ/√d)`` with the image's largest logit-row gain
    in ``max_r‖a_r‖``), ``‖D²s[a,b]‖₁ ≤ 2(Var a Var b)^½``,
    ``‖Ds[a]‖₁ ≤ Var^½``; a zero-sum row meets ``V(t)`` through its half
    diameter ``≤ m_h + ‖W_vo‖δ`` and ``E`` through ``‖W_vo‖δ`` (``δ`` =
    ``delta_max``); ``Var_p(u_r(t))^½ ≤ σ_r = Var_p(a_r)^½ + 2c^½‖q_r‖`` (``a`` the
    linear part) with ``‖σ‖₄ ≤ std₃ = linear_std + 2c^½‖Q‖_F`` and ``‖Q‖_F ≤
    qq/√d``. Frobenius over rows (Cauchy–Schwarz in ℓ4), then over heads."""
    k = softmax_constants(terms, beta, logit_radius, image)
    sqrt_d = math.sqrt(terms.head_dim)
    q_f = k.qq / sqrt_d  # (B, H) ≥ ‖Q‖_F
    c = k.c0.sqrt()
    std3 = linear_std(k, beta, terms.head_dim, image) + 2 * c * q_f
    lin_max, q_row = row_gains(terms, k, beta, image)  # (B, H) each
    q_max = q_row * delta_max[:, None] / sqrt_d  # ≥ max_r ‖q_r‖
    # max_k |u′_k| ≤ √2 ‖u_r‖ ≤ √2 (‖a_r‖ + 2‖q_r‖) for every row, ≤ 2√2ρ_h
    a_row = terms.m_norm * beta[:, None] / sqrt_d
    if image is not None:
        a_row = torch.minimum(a_row, image_times(image.logit_row, image.eps)
                              + terms.m_norm * image.rest[:, None] / sqrt_d)
    M = math.sqrt(2) * torch.minimum(2 * k.rho, a_row + 2 * q_max)
    # ‖D³s[u,u,u]‖₁ ≤ (2M + 3 min(M, e^{s/2} σ_max)) e^s σ_r², σ_max ≥ max_r σ_r
    sigma_max = lin_max + 2 * c * q_max
    third = 2 * M + torch.minimum(3 * M, 3 * k.e_s.sqrt() * sigma_max)
    e_max = terms.vo_norm * delta_max[:, None]  # (B, H)
    m_t = terms.xm_rows + e_max
    curv = (third * m_t + 6 * e_max) * std3**2 + 12 * m_t * c * std3 * q_f
    per_head = k.e_s * curv + 6 * k.e_s.sqrt() * c * e_max * q_f
    return per_head.sum(-1) / 6


def second_order_remainder(
    terms: LoFASTTerms, beta: Tensor, image: ImagePart, hessian: Tensor, q: Tensor,
    first: Tensor, delta_max: Tensor, logit_radius: Tensor | None,
) -> Tensor:
    """The module docstring's bound ``(B,)``: ``hessian ε² + 2q·first·rest +
    q·rest² + R₃``, ``hessian`` ``(B,)`` from :func:`attention_hessian_norm`
    (``+inf`` where not computed), ``q`` ``(B,)`` from
    :func:`quadratic_coefficient` (both clean-point constants), ``first``
    ``(B,)`` ``≥ ‖LΓ‖``."""
    e, rest = image.eps, image.rest
    second = torch.where(hessian.isinf(), math.inf, hessian * e**2)
    cross = q * rest * (2 * first + rest)
    return second + cross + third_order(terms, beta, delta_max, logit_radius, image)
