"""Structured sound certificates for ζ (LoFAST Lemma 1) and ‖M_h(X)‖ (Lemma 2).

Proofs and rounding analysis: docs/structured-certificates.md (§ numbers below
refer to it). Everything is batched over samples (and heads), matrix-free:
no ``(N·D) × (N·D)`` matrix is formed.

* :func:`kron_moments`: ``tr(G)`` and ``‖G‖_F²`` of ζ's Gram matrix
  ``G = KᵀK``, ``K = Σ_i P_i ⊗ W_vo[i]ᵀ``, exactly from the Kronecker factors
  (§2), with a bound on their rounding error.
* :func:`subspace_lambda_bound`: a guaranteed upper bound on ``λ_max(G)`` from
  any basis ``V`` (§1, §3): ``λ*`` is certified once
  ``λ* I − Θ − RᵀR/(λ* − β)`` is proven positive semidefinite by a Cholesky
  factorisation, with ``Θ = VᵀGV``, ``R = (I − VVᵀ)GV`` and ``β`` an upper
  bound of ``λ_max`` of ``G`` on the complement of ``V`` (from ``‖G‖_F²``).
* :func:`zeta_certificate`: ζ with ``V`` = the token-constant directions
  ``1 ⊗ e_j / √N`` (exactly where diffuse attention acts) plus a block of
  subspace-iteration vectors (§4).
* :func:`lemma2_structured_bound`: ``‖M_h(X)‖ ≤ √(λ_max(CᵀC + EᵀE) + 2‖C‖‖E‖)``
  (§5), ``D × D`` eigenproblems only.

Soundness never depends on the iteration budget or on ``V``; only tightness
does. All certified quantities are float64.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from lipvit.certify.attention import value_output
from lipvit.certify.lofast.operators import sensitivity_matvec, sensitivity_rmatvec
from torch import Tensor

from lipvit.spectral import eigh, eigvalsh, seeded_start

U = torch.finfo(torch.float64).eps / 2
"""Unit roundoff of float64."""
TINY = torch.finfo(torch.float64).tiny


def gamma(m: int) -> float:
    """``γ_m = m u / (1 − m u)`` (Higham, *Accuracy and Stability*, §3.1)."""
    return m * U / (1 - m * U)


def up(x: Tensor | float, rel: float = 8 * U) -> Tensor | float:
    """``x (1 + rel)`` for ``x ≥ 0``: covers the rounding of a few float ops (§0)."""
    return x * (1 + rel)


# --------------------------------------------------------------------------
# Certified positive semidefiniteness and largest eigenvalues of small matrices.
# --------------------------------------------------------------------------


def cholesky_margin(n: int, trace: Tensor) -> Tensor:
    """Shift ``c``: a completed float64 Cholesky of ``Ã − cI`` proves ``Ã ≻ 0``.

    ``c = 2γ_{n+2}/(1 − 2γ_{n+2}) · tr(Ã) + 10³·tiny`` for ``Ã`` with nonnegative
    diagonal (Demmel 1989; Higham Thm 10.5; Rump, BIT 2006; §0).
    """
    g = gamma(n + 2)
    return 2 * g / (1 - 2 * g) * trace.clamp_min(0) + 1e3 * TINY


def certified_psd(A: Tensor) -> Tensor:
    """``True`` where the symmetric ``A`` ``(..., m, m)`` is proven positive definite.

    A completed Cholesky factorisation of ``A − cI`` (:func:`cholesky_margin`)
    proves ``A ≻ 0``; ``False`` proves nothing. ``A``'s entries are taken as
    exact (they are the stored numbers).
    """
    m = A.shape[-1]
    diag = A.diagonal(dim1=-2, dim2=-1)
    c = cholesky_margin(m, diag.clamp_min(0).sum(-1))
    shifted = A - torch.diag_embed(c[..., None].expand(diag.shape))
    _, info = torch.linalg.cholesky_ex(shifted)
    return (info == 0) & (diag >= 0).all(-1)


def certified_lambda_max_small(G: Tensor, tau0: float = 1e-13) -> Tensor:
    """Upper bound on ``λ_max`` of symmetric ``G`` ``(..., m, m)`` (entries exact).

    Candidate ``μ = λ̃ + τ(|λ̃| + ‖G‖_F)`` from ``eigvalsh``, accepted where
    ``μI − G`` is :func:`certified_psd`; ``τ`` grows tenfold for the rest.
    Vectorised; the loop runs only while some entry is unproven.
    """
    lam = eigvalsh(G)[..., -1]
    scale = lam.abs() + torch.linalg.matrix_norm(G)
    diag_max = G.diagonal(dim1=-2, dim2=-1).abs().amax(-1)
    eye = torch.eye(G.shape[-1], dtype=G.dtype, device=G.device)
    out = torch.full_like(lam, math.inf)
    tau = tau0
    todo = torch.ones_like(lam, dtype=torch.bool)
    while tau < 1.0 and bool(todo.any()):
        mu = lam + tau * scale + TINY
        rho = 4 * U * (mu.abs() + diag_max)  # rounding of μ − G_ii (§0)
        ok = certified_psd((mu - rho)[..., None, None] * eye - G) & todo
        out = torch.where(ok, mu, out)
        todo = todo & ~ok
        tau *= 10
    return out


# --------------------------------------------------------------------------
# The subspace bound (§1, §3).
# --------------------------------------------------------------------------


class SubspaceBound(NamedTuple):
    """Certified ``λ_max(G)`` upper bound and the Ritz value ``λ_max(VᵀGV)``.

    ``upper`` is a guaranteed upper bound (``inf`` where unproven); ``ritz``
    is an estimate (a lower bound in exact arithmetic), ``beta`` the bound on
    the complement. All ``(B,)``.
    """

    upper: Tensor
    ritz: Tensor
    beta: Tensor


def subspace_lambda_bound(
    V: Tensor, GV: Tensor, trace: Tensor, trace_err: Tensor, fro2: Tensor,
    fro2_err: Tensor, mv_err: Tensor, g_norm: Tensor,
) -> SubspaceBound:
    """Guaranteed upper bound on ``λ_max(G)``, ``G`` symmetric PSD ``n × n`` (§3).

    Args:
        V: basis ``(B, n, k)``, float64, nearly orthonormal (any ``V`` with
            ``‖VᵀV − I‖ ≤ 1/4`` is accepted; the defect is accounted for).
        GV: computed ``G V`` ``(B, n, k)`` with
            ``‖fl(GV) − GV‖_F ≤ mv_err · ‖V‖_F``.
        trace, trace_err: computed ``tr(G)`` and a bound on its error ``(B,)``.
        fro2, fro2_err: computed ``‖G‖_F²`` and a bound on its error ``(B,)``.
        mv_err: per-column product error bound ``(B,)`` (see ``GV``).
        g_norm: an upper bound on ``‖G‖`` ``(B,)``.

    Returns:
        :class:`SubspaceBound`.
    """
    B, n, k = V.shape
    m = n - k
    # Orthonormality defect η ≥ ‖VᵀV − I‖₂ (§3.1).
    S = V.mT @ V  # (B, k, k)
    eye = torch.eye(k, dtype=V.dtype, device=V.device)
    V_fro = up(S.diagonal(dim1=-2, dim2=-1).sum(-1).sqrt(), gamma(n + k))  # ‖V‖_F
    eta = up(torch.linalg.matrix_norm(S - eye) + gamma(n) * V_fro**2)
    Y_fro = up(torch.linalg.matrix_norm(GV))  # ‖fl(GV)‖_F
    e_Y = up(mv_err * V_fro)  # ‖fl(GV) − GV‖_F
    Z = V.mT @ GV  # (B, k, k)
    Theta = (Z + Z.mT) / 2
    Theta_fro = up(torch.linalg.matrix_norm(Theta))
    # ‖Θ̂ − Θ‖ (§3.2).
    eps_X = up((1 + eta).sqrt() * e_Y + gamma(n) * V_fro * Y_fro + U * Theta_fro)
    eps_T = up(4 * eta * g_norm + eps_X)
    R = GV - V @ Theta  # (B, n, k) = (I − VVᵀ) G V, computed
    R_fro = up(torch.linalg.matrix_norm(R))
    eps_R = up(5 * eta * g_norm + e_Y + 1.12 * eps_X
               + gamma(k + 1) * (Y_fro + V_fro * Theta_fro))
    W = R.mT @ R  # (B, k, k)
    W_fro = up(torch.linalg.matrix_norm(W))
    eps_W = up(eps_R * (2 * R_fro + eps_R) + gamma(n) * R_fro**2)
    # β ≥ λ_max of G on the complement of span V (§3.3).
    tr_c = trace - Theta.diagonal(dim1=-2, dim2=-1).sum(-1)  # tr(PGP), computed
    tr_c_lo = tr_c - up(trace_err + k * eps_T
                        + gamma(k + 1) * (trace.abs() + Theta_fro * math.sqrt(k)))
    s = (tr_c / m).clamp_min(0)
    Y_lo = (torch.linalg.matrix_norm(GV) * (1 - 8 * U) - e_Y).clamp_min(0)
    Theta_hi = up(Theta_fro + math.sqrt(k) * eps_T)  # ≥ ‖Θ̂‖_F
    F_hi = fro2 + fro2_err - 2 * Y_lo**2 / (1 + eta) + Theta_hi**2
    F_hi = F_hi + gamma(8) * (fro2.abs() + fro2_err + 2 * Y_lo**2 + Theta_hi**2)
    b2 = F_hi - 2 * s * tr_c_lo + s * s * m
    b2 = b2 + gamma(4) * (F_hi.abs() + 2 * s * tr_c_lo.abs() + s * s * m)
    beta = up(s + b2.clamp_min(0).sqrt())
    # Candidate λ from the (2k × 2k) matrix [[Θ, T], [T, βI]], T = (RᵀR)^{1/2}.
    w, Q = eigh(W)
    T = (Q * w.clamp_min(0).sqrt()[..., None, :]) @ Q.mT  # (B, k, k)
    M = torch.cat([torch.cat([Theta, T], -1),
                   torch.cat([T, torch.diag_embed(beta[:, None].expand(B, k))], -1)],
                  -2)  # (B, 2k, 2k)
    lam_c = eigvalsh(M)[..., -1]
    ritz = eigvalsh(Theta)[..., -1]
    # Verification (§3.4): λ* > β and λ* I − Θ − W/(λ* − β) − (ε_Θ + ε_W/(λ*−β)) I ⪰ 0.
    upper = torch.full_like(lam_c, math.inf)
    todo = torch.ones_like(lam_c, dtype=torch.bool)
    tau = 1e-13
    scale = lam_c.abs() + g_norm
    while tau < 1e-2 and bool(todo.any()):
        lam = torch.maximum(lam_c + tau * scale, beta + tau * scale) + eps_T
        gap = lam - beta
        shift = lam - eps_T - up(eps_W) / gap
        rho = 2 * gamma(6) * (shift.abs() + Theta_fro + W_fro / gap)  # forming A
        A = (shift - rho)[:, None, None] * eye - Theta - W / gap[:, None, None]
        ok = certified_psd(A) & todo & (gap > 0) & torch.isfinite(lam)
        upper = torch.where(ok, lam, upper)
        todo = todo & ~ok
        tau *= 10
    upper = torch.where(eta <= 0.25, upper, torch.full_like(upper, math.inf))
    return SubspaceBound(upper, ritz, beta)


# --------------------------------------------------------------------------
# ζ (Lemma 1): Kronecker moments, basis, certificate (§2, §4).
# --------------------------------------------------------------------------


class KronMoments(NamedTuple):
    """``tr(G)``, ``‖G‖_F²`` of ζ's Gram matrix and bounds on their rounding (B,)."""

    trace: Tensor
    trace_err: Tensor
    fro2: Tensor
    fro2_err: Tensor


def _pad_p(P: Tensor, residual: bool) -> Tensor:
    """Prepend ``P_0 = I_N`` for ``H = I``: ``(B, H', N, N)``."""
    if not residual:
        return P
    B, _, N, _ = P.shape
    eye = torch.eye(N, dtype=P.dtype, device=P.device).expand(B, 1, N, N)
    return torch.cat([eye, P], dim=1)


def _pad_w(W_vo: Tensor, residual: bool) -> Tensor:
    """Prepend ``W_vo[0] = I_D`` for ``H = I``: ``(H', D, D)``."""
    if not residual:
        return W_vo
    eye = torch.eye(W_vo.shape[-1], dtype=W_vo.dtype, device=W_vo.device)[None]
    return torch.cat([eye, W_vo], dim=0)


def kron_weight_half(W_vo: Tensor, residual: bool) -> Tensor:
    """Weight half of :func:`kron_moments`, once per layer, ``(H'² + 1, H'²)``.

    Rows ``0 … H'²−1``: ``⟨W_i W_jᵀ, W_k W_lᵀ⟩``; last row ``⟨W_i, W_j⟩``
    (pairs ``(i, j)`` flattened row-major).
    """
    W = _pad_w(W_vo, residual)
    Hp, D, _ = W.shape
    WW = torch.einsum("iae,jce->ijac", W, W).reshape(Hp * Hp, D * D)  # W_i W_jᵀ
    quad = WW @ WW.T  # (H'², H'²)
    lin = torch.einsum("iab,jab->ij", W, W).reshape(1, Hp * Hp)
    return torch.cat([quad, lin], dim=0)


def kron_moments(P: Tensor, W_vo: Tensor, residual: bool,
                 weight_half: Tensor | None = None) -> KronMoments:
    """``tr(G)`` and ``‖G‖_F²`` of ``G = KᵀK``, ``K = Σ_i P_i ⊗ W_vo[i]ᵀ`` (§2).

    ``G = Σ_{ij} P_iᵀP_j ⊗ W_i W_jᵀ``, so ``tr G = Σ ⟨P_i,P_j⟩⟨W_i,W_j⟩`` and
    ``‖G‖_F² = Σ ⟨P_iᵀP_j, P_kᵀP_l⟩⟨W_iW_jᵀ, W_kW_lᵀ⟩`` (exact identities);
    the errors bound the float64 evaluation (§2.1).

    Args:
        P: ``(B, H, N, N)``; W_vo: ``(H, D, D)``; residual: add ``I ⊗ I``.
        weight_half: :func:`kron_weight_half` of the same weights (reused).
    """
    B, H, N, _ = P.shape
    D = W_vo.shape[-1]
    if weight_half is None:
        weight_half = kron_weight_half(W_vo, residual)
    Pp, Wp = _pad_p(P, residual), _pad_w(W_vo, residual)
    Hp = Pp.shape[1]
    PP = torch.einsum("bian,bjam->bijnm", Pp, Pp).reshape(B, Hp * Hp, N * N)
    quad_p = PP @ PP.mT  # (B, H'², H'²)
    lin_p = torch.einsum("bian,bjan->bij", Pp, Pp).reshape(B, Hp * Hp)
    fro2 = (quad_p * weight_half[:-1]).sum((-2, -1))
    trace = (lin_p * weight_half[-1]).sum(-1)
    nu = up((torch.linalg.vector_norm(Pp, dim=(-2, -1))
             * torch.linalg.vector_norm(Wp, dim=(-2, -1))).sum(-1), gamma(4 * Hp))
    L1 = N * N + D * D + Hp * Hp + 2
    L2 = 2 * N + N * N + 2 * D + D * D + Hp**4 + 3
    return KronMoments(trace, up(gamma(L1) * nu**2), fro2, up(gamma(L2) * nu**4))


def value_kappa(P: Tensor, W_v: Tensor, W_o: Tensor, residual: bool) -> Tensor:
    """``κ = [H = I] + Σ_h ‖P_h‖_F ‖W_v[h]‖_F ‖W_o[h]‖_F ≥ ‖|A|‖`` ``(B,)`` (§2.2)."""
    w = torch.linalg.vector_norm(W_v, dim=(-2, -1)) * torch.linalg.vector_norm(
        W_o, dim=(-2, -1))  # (H,)
    k = (torch.linalg.vector_norm(P, dim=(-2, -1)) * w).sum(-1) + float(residual)
    return up(k, gamma(4 * P.shape[1] + 4))


def gram_apply(Gamma: Tensor, P: Tensor, W_v: Tensor, W_o: Tensor,
               residual: bool) -> Tensor:
    """``G Γ = A*(A(Γ))`` for a block ``Γ`` ``(B, K, N, D)``, ``P`` ``(B, H, N, N)``."""

    Pb = P[:, None]  # (B, 1, H, N, N)
    return sensitivity_rmatvec(sensitivity_matvec(Gamma, Pb, W_v, W_o, residual),
                               Pb, W_v, W_o, residual)


def _orthonormal(Z: Tensor) -> Tensor:
    """Orthonormal basis of the columns ``(B, K, N, D)`` (batched Householder QR)."""
    B, K, N, D = Z.shape
    Q = torch.linalg.qr(Z.reshape(B, K, N * D).mT).Q  # (B, N·D, K)
    return Q.mT.reshape(B, K, N, D)


def _centre(Z: Tensor) -> Tensor:
    """Remove the token mean (project off the directions ``1 ⊗ e_j``)."""
    return Z - Z.mean(dim=-2, keepdim=True)


class ZetaCertificate(NamedTuple):
    """ζ upper bound (``inf`` where unproven) and the Ritz estimate ``√λ_max(VᵀGV)``."""

    upper: Tensor
    ritz: Tensor


CPU_CHUNK_BYTES = 1 << 30
"""Working memory of one chunk of samples on the CPU (CUDA: a quarter of free)."""


def samples_per_chunk(bytes_per_sample: int, device: torch.device) -> int:
    """Memory-aware batch size: how many samples fit the working-memory budget."""
    budget = CPU_CHUNK_BYTES
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free // 4
    return max(1, budget // max(1, bytes_per_sample))


def zeta_certificate(
    P: Tensor, W_v: Tensor, W_o: Tensor, residual: bool, k: int = 16,
    n_iter: int = 12,
) -> ZetaCertificate:
    """Guaranteed upper bound on ζ(X), LoFAST eq. (15), batched over samples (§4).

    ``V`` = the ``D`` token-constant directions ``1 ⊗ e_j/√N`` (``A`` maps
    them to token-constant outputs, and diffuse attention acts almost only on
    them) plus ``k`` token-centred vectors from ``n_iter`` steps of subspace
    iteration on ``G`` (float32: they only need to be good, not exact). The
    certificate (:func:`subspace_lambda_bound`, :func:`kron_moments`) is
    float64 and sound for every ``V``. Samples are processed in chunks sized
    by :func:`samples_per_chunk`; the weight half of the moments is computed
    once.

    Args:
        P: attention ``(B, H, N, N)``, float64 (taken as exact data).
        W_v: ``(H, D, d)``; W_o: ``(H, d, D)``, float64.
        residual: ``H = I`` if true, else ``H = 0``.
        k, n_iter: subspace size and iterations (tightness and time only).

    Returns:
        :class:`ZetaCertificate`, ``(B,)`` each, float64.
    """

    B, H, N, _ = P.shape
    D = W_v.shape[1]
    W_vo = value_output(W_v, W_o)  # (H, D, D), rounded: accounted for in §2.2
    weight_half = kron_weight_half(W_vo, residual)
    # V, G V, R and the (K, N, H·d) intermediates, float64: ≈ 6 (D + k) N D words.
    chunk = samples_per_chunk(48 * (D + k) * N * max(D, W_v.shape[2] * H), P.device)
    parts = [_zeta_chunk(P[i:i + chunk], W_v, W_o, W_vo, weight_half, residual, k,
                         n_iter) for i in range(0, B, chunk)]
    return ZetaCertificate(*(torch.cat(t) for t in zip(*parts, strict=True)))


def _zeta_chunk(
    P: Tensor, W_v: Tensor, W_o: Tensor, W_vo: Tensor, weight_half: Tensor,
    residual: bool, k: int, n_iter: int,
) -> ZetaCertificate:
    """:func:`zeta_certificate` for one chunk of samples."""
    B, H, N, _ = P.shape
    D, d = W_v.shape[1], W_v.shape[2]
    moments = kron_moments(P, W_vo, residual, weight_half)
    kappa = value_kappa(P, W_v, W_o, residual)  # (B,)
    mv_err = up(3 * (gamma(D + N + H * d + 2) + gamma(d)) * kappa**2)
    g_norm = torch.minimum(up(kappa**2 * (1 + gamma(d)) ** 2),
                           up((moments.fro2 + moments.fro2_err).clamp_min(0).sqrt()))
    # Token-constant directions (exact up to the rounding of 1/√N).
    const = torch.eye(D, dtype=P.dtype, device=P.device)[:, None, :].expand(D, N, D)
    const = (const / math.sqrt(N)).expand(B, D, N, D)
    vecs = []
    if k > 0:
        P32, Wv32, Wo32 = P.float(), W_v.float(), W_o.float()
        Z = seeded_start((B, k, N, D), torch.float32, P.device)
        for _ in range(n_iter):
            Z = _centre(gram_apply(_orthonormal(_centre(Z)), P32, Wv32, Wo32, residual))
        vecs = [_orthonormal(_centre(Z.double()))]
    V = torch.cat([const, *vecs], dim=1)  # (B, D + k, N, D)
    GV = gram_apply(V, P, W_v, W_o, residual)  # (B, D + k, N, D)
    sb = subspace_lambda_bound(V.reshape(B, -1, N * D).mT, GV.reshape(B, -1, N * D).mT,
                               moments.trace, moments.trace_err, moments.fro2,
                               moments.fro2_err, mv_err, g_norm)
    upper = up(sb.upper.sqrt()) + up(gamma(d) * kappa)  # ‖K_op − K_kron‖ ≤ γ_d κ
    return ZetaCertificate(upper, sb.ritz.clamp_min(0).sqrt())


# --------------------------------------------------------------------------
# ‖M_h(X)‖ (Lemma 2), §5.
# --------------------------------------------------------------------------


def lemma2_structured_bound(X: Tensor, W_q: Tensor, W_k: Tensor) -> Tensor:
    """Guaranteed upper bound on ``‖M_h(X)‖`` (LoFAST eq. 25) for every head (§5).

    ``‖M_h(X)‖² ≤ λ_max(CᵀC + EᵀE) + 2‖C‖‖E‖`` with ``C = X A_hᵀ``,
    ``E = X A_h`` (``A_h = W_q W_kᵀ``): the Gram matrix of ``Γ ↦ ΓCᵀ + EΓᵀ``
    is ``I ⊗ (CᵀC + EᵀE) + T + Tᵀ`` with ``T Γ = E Γᵀ C``, ``‖T‖ ≤ ‖C‖‖E‖``.
    Never above ξ = ‖C‖ + ‖E‖ (eq. 26). ``D × D`` eigenproblems, certified by
    Cholesky; rounding of ``C``, ``E`` and the products is added.

    Args:
        X: ``(B, N, D)``; W_q, W_k: ``(H, D, d)``; float64.

    Returns:
        ``(B, H)`` float64.
    """
    B, N, D = X.shape
    d = W_q.shape[-1]
    Xh = X[:, None]  # (B, 1, N, D)
    C = (Xh @ W_k) @ W_q.mT  # (B, H, N, D) = X W_k W_qᵀ = X Aᵀ
    E = (Xh @ W_q) @ W_k.mT  # (B, H, N, D) = X A
    e_C = up(gamma(D + d) * torch.linalg.vector_norm(X, dim=(-2, -1))[:, None]
             * (torch.linalg.vector_norm(W_q, dim=(-2, -1))
                * torch.linalg.vector_norm(W_k, dim=(-2, -1))))  # (B, H)
    CC, EE = C.mT @ C, E.mT @ E  # (B, H, D, D)
    c_fro2 = torch.linalg.vector_norm(C, dim=(-2, -1)) ** 2
    e_fro2 = torch.linalg.vector_norm(E, dim=(-2, -1)) ** 2
    lam = torch.stack([certified_lambda_max_small(CC + EE),
                       certified_lambda_max_small(CC),
                       certified_lambda_max_small(EE)])  # (3, B, H)
    err = up(gamma(2 * N + 1) * (c_fro2 + e_fro2))
    lam_S = lam[0] + err
    c_norm = (lam[1] + err).clamp_min(0).sqrt()  # ≥ ‖C‖
    e_norm = (lam[2] + err).clamp_min(0).sqrt()  # ≥ ‖E‖
    return up(up(lam_S + 2 * up(c_norm * e_norm)).clamp_min(0).sqrt() + 2 * e_C)
