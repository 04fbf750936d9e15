"""LoFAST: local sensitivity bounds of one attention layer (Havens et al., Theorem 1).

``‖F(X') − F(X)‖_F ≤ ζ(X) ε + δ2(X, ε)`` for every ``‖X' − X‖_F ≤ ε``, with
``F(X) = H X + Σ_h P_h(X) X W_v[h] W_o[h]``
(:func:`lipvit.certify.attention.attention`).

Symbols (docs/math.md §2; shapes: ``B`` batch, ``N`` tokens, ``D`` width, ``H``
heads, ``d`` head width):

===================  =================  =========================================
paper                code               meaning, equation
===================  =================  =========================================
``Γ = X' − X``       ``Gamma``          input perturbation, ``(B, N, D)``
``M_l = W^V W^O``    ``W_vo``           ``(H, D, D)``
``A_l = W^Q W^Kᵀ``   ``W_qk``           ``(H, D, D)`` (``1/√d`` kept outside)
``ζ(X)``             ``zeta``           key sensitivity metric, eq. (15), Lemma 1
``ζ_cls(X)``         ``zeta_cls``       ζ's class-token row (extension, math.md §5.2)
``δ1^(naive)``       ``delta_1_naive``  eq. (12)
``M_l(X)``           ``lemma2_*``       ``Γ ↦ Γ A_l Xᵀ + X A_l Γᵀ``, eq. (25)
``ξ_l(X)``           ``xi``             ``‖A_l Xᵀ‖ + ‖X A_l‖``, eq. (26)
``δ2^(1)``           ``delta_2_tight``  eq. (27)
``δ2^(2)``           ``delta_2_fast``   eq. (28)
===================  =================  =========================================

Vectorisation: the paper's ``vec(Γᵀ)`` is the row-major flattening of ``Γ``
(``Γ.reshape(N*D)``); every dense matrix here acts on that vector.

Extensions beyond the paper (docs/math.md §2, proved in the docstrings and tested
against PGD):

* ``delta_2_half``: row-wise softmax has the symmetric PSD Jacobian
  ``diag(p) − ppᵀ`` whose eigenvalues are at most ``max_i 2p_i(1 − p_i) ≤ ½``
  (Gershgorin), so softmax is ½-Lipschitz and δ2^(1) halves.
* ``delta_2_local`` (:func:`softmax_local_constant`): the same Jacobian is
  also ``≼ diag(p)``, so its norm is at most ``max_i p_i``; along the segment
  from the clean to the perturbed logits every probability stays within a
  factor ``e^{±s}`` of its clean value, ``s`` a bound on the spread of the logit
  change. This gives a local softmax constant ``c_h ≤ ½``, often ``≈ 1/N`` for
  diffuse attention. In addition ``(P' − P) 1 = 0``, so ``X'`` may be replaced
  by its token-centred version ``Π X'`` (``Π = I − 11ᵀ/N``), and each row of
  ``P' − P`` has norm at most ``√2``.

Exact versus estimated norms. ζ is the largest singular value of an
``(N·D) × (N·D)`` matrix and ``‖M_l(X)‖`` that of an ``N² × (N·D)`` matrix.
``exact=True`` returns guaranteed upper bounds for the float64 attention
matrices and factors (the rounding of forming and solving the Gram matrices is
covered by a margin, docs/math.md "Rounding"):

* Gram size ``n ≤ EIGVALSH_MAX_N`` (256): dense Gram matrix, ``eigvalsh``
  plus the rounding margin (:func:`lipvit.spectral.eigvalsh_upper`).
* larger: the structured certificates of :mod:`lipvit.certify.lofast.structured`
  (docs/structured-certificates.md), batched and matrix-free. ζ: a subspace
  bound (token-constant directions plus a block of subspace-iteration
  vectors; ``tr G`` and ``‖G‖_F²`` exact from the Kronecker structure;
  verified by a small Cholesky, every rounding error added), and, only for
  samples where it is more than ``STRUCTURED_RTOL`` above its Ritz value and
  ``n ≤ ZETA_CHOLESKY_MAX_N`` (4096), the dense certificate ``λ_max(G) ≤ μ``
  proved by a Cholesky factorisation of ``μ I − G`` with a Rump-type
  rounding margin (:func:`certified_lambda_max`, Gram formed by
  :func:`sensitivity_gram`, one sample at a time).
  ``‖M_l(X)‖``: up to ``LEMMA2_CHOLESKY_MAX_N``, a power-iteration estimate
  certified by the Cholesky of ``μ I − G`` (as for ζ), one head's reduced
  Gram matrix at a time; above, ``√(λ_max(CᵀC + EᵀE) + 2‖C‖‖E‖)`` (``D × D``
  eigenproblems, never above ξ). The dense routes of ``‖M_l(X)‖`` use a
  reduced operator: ``Γ`` enters only through ``Γ [W_q W_k]``, so with ``Q``
  an orthonormal basis of the columns of ``[W_q[h], W_k[h]]`` the Gram size is
  ``N · min(2d, D)`` instead of ``N·D`` (:func:`lemma2_reduced_factors`).

``exact=False`` never forms a matrix larger than ``(N, N)`` or ``(D, D)``: ζ
and ``‖M_l(X)‖`` come from :func:`lipvit.spectral.power_iteration` on the
operators below (estimates from below, labelled so). The small norms
(``‖X W_vo‖``, ``‖W_vo‖``, ``‖W_qk‖``, ``‖P_h‖``, ξ) are exact dense SVDs in both
modes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch
from lipvit.certify.attention import (
    attention_logits,
    check_layer,
    query_key,
    value_output,
)
from lipvit.certify.eps import eps_per_sample
from lipvit.certify.lofast.operators import (
    lemma2_gram,
    lemma2_op,
    lemma2_op_adjoint,
    lemma2_reduced_factors,
    sensitivity_gram,
    sensitivity_matvec,
    sensitivity_rmatvec,
)
from lipvit.certify.lofast.structured import lemma2_structured_bound, zeta_certificate
from torch import Tensor

from lipvit.spectral import (
    eigvalsh_upper,
    gamma,
    power_iteration,
    seeded_start,
    spectral_norm,
)

Op = Callable[[Tensor], Tensor]

EIGVALSH_MAX_N = 256
"""Largest Gram size solved by ``eigvalsh``; above it, the structured certificates."""
LEMMA2_CHOLESKY_MAX_N = 1024
"""Largest reduced Gram size of ``‖M_h(X)‖`` certified densely (power iteration
plus Cholesky, within 1e-7 of exact; ``n³/3`` flops per head); above it the
structured bound (1.1–1.4× exact, docs/structured-certificates.md §5)."""
CHECK_EVERY = 10
"""Power iterations between convergence tests (each one a host sync on a GPU)."""
STRUCTURED_RTOL = 1e-4
"""ζ's structured certificate is kept where it is within this relative distance of
its Ritz value (a lower estimate of ζ); elsewhere the Cholesky certificate runs
(up to :data:`ZETA_CHOLESKY_MAX_N`)."""
ZETA_CHOLESKY_MAX_N = 4096
"""Largest Gram size of ζ's dense Cholesky fallback (``8 n²`` bytes, 128 MiB,
and ``n³/3`` flops per sample); above it the structured certificate stands
alone. At the 6×384 preset (``n = 24 960``: a 5 GB Gram matrix, hours of one
core; random weights) it is at most 2e-4 above ζ: a subspace four times
larger has Ritz values (≤ ζ) within that of it (``bench/studies/zeta_gap.py``)."""


@dataclass(frozen=True)
class LoFASTBound:
    """LoFAST Theorem 1 for a batch of inputs; every tensor has shape ``(B,)``.

    With ``exact=True`` each number is a guaranteed upper bound of what it names
    (float rounding aside); with ``exact=False`` ζ and ``‖M_h(X)‖`` are
    power-iteration estimates from below and so are every quantity built on
    them.

    Attributes:
        zeta: ζ(X), eq. (15).
        delta_1: ``ζ ε``, the exact maximum of Δ1 (Lemma 1).
        delta_1_naive: eq. (12), ``(‖H‖ + Σ_h ‖W_vo[h]‖ ‖P_h(X)‖) ε`` (≥ ζε).
        delta_2_tight: δ2^(1), eq. (27), with ``‖M_h(X)‖`` of Lemma 2.
        delta_2_fast: δ2^(2), eq. (28), with ξ_h of eq. (26).
        delta_2_half: ``delta_2_tight / 2`` (softmax is ½-Lipschitz; extension).
        delta_2_local: local softmax constant, centred tokens (extension).
        total: ``ζ ε + delta_2_tight`` (Theorem 1).
        total_fast: ``ζ ε + delta_2_fast``.
        total_half: ``ζ ε + delta_2_half``.
        total_local: ``ζ ε + delta_2_local`` (extension; the tightest bound here).
        eps: the radius ε of each sample.
        method: how ζ and ``‖M_h(X)‖`` were obtained.
        exact: whether every number is a guaranteed upper bound.
    """

    zeta: Tensor
    delta_1: Tensor
    delta_1_naive: Tensor
    delta_2_tight: Tensor
    delta_2_fast: Tensor
    delta_2_half: Tensor
    delta_2_local: Tensor
    total: Tensor
    total_fast: Tensor
    total_half: Tensor
    total_local: Tensor
    eps: Tensor
    method: str
    exact: bool


@dataclass(frozen=True)
class NormBound:
    """A spectral norm and how it was obtained (``method``, ``exact``)."""

    value: Tensor
    method: str
    exact: bool


# --------------------------------------------------------------------------
# Estimates and certified largest eigenvalues.
# --------------------------------------------------------------------------


def certified_lambda_max(G: Tensor, lower: float, tau0: float = 1e-7, *,
                         scale: float = 0.0, inner: int = 0,
                         tau_max: float = 0.1) -> float:
    """Guaranteed upper bound of ``λ_max(G)`` for a symmetric PSD ``G``, ``(n, n)``.

    For ``μ = lower · (1 + τ)``, ``τ = τ0, 10 τ0, …, ≤ tau_max``: if a floating-point
    Cholesky factorisation of ``μ I − G − c I`` runs to completion, then
    ``μ I − G`` is positive definite and ``λ_max(G) < μ``: a completed
    Cholesky factor ``R`` of ``Ã`` satisfies ``RᵀR = Ã + ΔA`` with
    ``|ΔA| ≤ γ_{n+1} |Rᵀ||R|`` (Demmel 1989; Higham, *Accuracy and Stability of
    Numerical Algorithms*, Thm. 10.5; Rump, BIT 2006), hence
    ``‖ΔA‖ ≤ γ_{n+1}/(1 − γ_{n+1}) · tr(Ã)``, and ``Ã + ΔA ≻ 0``; the margin
    ``c = 2 γ_{n+2}/(1 − 2γ_{n+2}) · tr(μ I − G)`` (``γ_k = k u/(1 − k u)``)
    exceeds ``‖ΔA‖`` with a factor 2 to spare (covering the rounding of the
    shifted diagonal). If every ``τ`` fails, falls back to
    :func:`lipvit.spectral.eigvalsh_upper`. ``G`` is negated in place during
    the call and restored exactly. The rounding of forming ``G`` itself,
    ``≤ γ_inner · scale`` in norm, is added to the result.

    Args:
        G: symmetric PSD matrix, float64.
        lower: an estimate of ``λ_max(G)`` (ideally from below; any value is
            sound, a poor one only costs time).
        tau0: first relative increment tried; ``tau_max`` the last.
        scale, inner: bound of ``‖K̃‖_F²`` and the dot-product length with
            which ``G`` was formed (:func:`lipvit.spectral.eigvalsh_upper`).

    Returns:
        A float ``≥ λ_max`` of the exact Gram matrix that ``G`` rounds.
    """
    assert G.dtype == torch.float64 and G.ndim == 2
    n = G.shape[0]
    u = torch.finfo(torch.float64).eps / 2
    g = (n + 2) * u / (1 - (n + 2) * u)
    tiny = torch.finfo(torch.float64).tiny
    formed = gamma(inner + 2) * float(scale)  # rounding of forming G
    largest = max(float(G.diagonal().max()), tiny)  # the shift's scale
    lower = max(float(lower), 0.0)
    tau = max(float(tau0), 1e-12)
    G.neg_()  # exact; undone in `finally`
    diag = G.diagonal().clone()  # −G_ii
    try:
        while tau <= tau_max * (1 + 1e-9):
            mu = lower * (1 + tau) + tau * 1e-12 * largest
            trace_A = float((diag + mu).clamp_min(0).sum())  # tr(μI − G)
            margin = 2 * g / (1 - 2 * g) * trace_A + 1e3 * tiny
            G.diagonal().copy_(diag + (mu - margin))  # μI − G − cI, rounded once
            _, info = torch.linalg.cholesky_ex(G)
            if int(info) == 0:
                return mu + formed
            tau *= 10
    finally:
        G.diagonal().copy_(diag)
        G.neg_()
    return float(eigvalsh_upper(G, max(float(scale), largest), inner))


class _Estimate(NamedTuple):
    """Power-iteration estimate σ (from below) and the relative Gram residual."""

    sigma: Tensor
    residual: Tensor


def _estimate(
    matvec: Op, rmatvec: Op, start: Tensor, n_iter: int, tol: float
) -> _Estimate:
    """σ_max estimate by :func:`lipvit.spectral.power_iteration` on 2-d operands.

    ``residual = ‖AᵀA v − σ² v‖ / σ²`` at the final unit ``v`` with ``σ = ‖A v‖``:
    when ``v`` has converged to the top singular vector, ``λ_max(AᵀA) − σ²``
    is at most ``residual · σ²`` — a heuristic start for the certificate's ``τ``.
    """
    est = power_iteration(matvec, rmatvec, start, n_iter, in_ndim=2, out_ndim=2,
                          tol=tol, check_every=CHECK_EVERY)
    Av = matvec(est.v)
    lam = Av.pow(2).sum(dim=(-2, -1))  # Rayleigh quotient of AᵀA
    res = (rmatvec(Av) - lam[..., None, None] * est.v).pow(2).sum(dim=(-2, -1)).sqrt()
    sigma = torch.maximum(est.sigma, lam.sqrt())
    return _Estimate(sigma, res / lam.clamp_min(torch.finfo(lam.dtype).tiny))


class _Rounding(NamedTuple):
    """How Gram matrices were formed: ``scale ≥ ‖K̃‖_F²`` ``(k,)``, dot length."""

    scale: Tensor
    inner: int


def _certified_sigma(grams: Tensor, est: _Estimate, rnd: _Rounding) -> Tensor:
    """σ_max upper bounds from Gram matrices ``(k, n, n)`` and estimates ``(k,)``."""
    values = [certified_lambda_max(grams[i], float(est.sigma[i]) ** 2,
                                   max(1e-7, 2 * float(est.residual[i])),
                                   scale=float(rnd.scale[i]), inner=rnd.inner)
              for i in range(grams.shape[0])]
    return torch.tensor(values, dtype=torch.float64, device=grams.device).sqrt()


def _dense_sigma(grams: Tensor, rnd: _Rounding) -> Tensor:
    """σ_max upper bounds from Gram matrices: ``eigvalsh`` plus the rounding margin."""
    return eigvalsh_upper(grams, rnd.scale, rnd.inner).sqrt()


def _sensitivity_rounding(P: Tensor, W_vo: Tensor, residual: bool) -> _Rounding:
    """:func:`sensitivity_gram`'s rounding: ``K̃ = Σ_h |P_h| ⊗ |W_vo[h]|ᵀ`` (plus
    ``I`` for the residual) has ``‖K̃‖_F ≤ Σ_h ‖P_h‖_F ‖W_vo[h]‖_F (+ √(N·D))``;
    the products run over ``N`` (PᵀP), ``D`` (W Wᵀ) and the head pairs."""
    B, H, N, _ = P.shape
    D = W_vo.shape[-1]
    frob = (torch.linalg.matrix_norm(P) * torch.linalg.matrix_norm(W_vo)).sum(-1)
    frob = frob + (math.sqrt(N * D) if residual else 0.0)  # (B,)
    return _Rounding(frob.square(), N + D + (H + 1) ** 2)


def _lemma2_rounding(C: Tensor, E: Tensor) -> _Rounding:
    """:func:`lemma2_gram`'s rounding: ``‖K̃‖_F ≤ ‖C‖_F + ‖E‖_F``, dot length ``N``."""
    scale = (torch.linalg.matrix_norm(C) + torch.linalg.matrix_norm(E)).square()
    return _Rounding(scale, C.shape[-2])


def _round_up(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Cast ``x`` to ``dtype``, moving values that rounded down up by one ulp."""
    y = x.to(dtype)
    if dtype == x.dtype:
        return y
    above = torch.nextafter(y, torch.full_like(y, math.inf))
    return torch.where(y.to(x.dtype) < x, above, y)


def _method(n: int, exact: bool) -> str:
    if not exact:
        return "power iteration (estimate)"
    if n <= EIGVALSH_MAX_N:
        return f"dense eigvalsh (Gram size {n})"
    return f"structured certificate (Gram size {n})"


# --------------------------------------------------------------------------
# ζ (Lemma 1) and ‖M_h(X)‖ (Lemma 2).
# --------------------------------------------------------------------------


def _key_sensitivity(
    P: Tensor, W_v: Tensor, W_o: Tensor, residual: bool, exact: bool,
    n_iter: int, tol: float,
) -> NormBound:
    """ζ, ``(B,)``, from attention matrices ``P (B, H, N, N)`` (dtype of ``P``)."""
    B, H, N, _ = P.shape
    D = W_v.shape[1]
    n = N * D
    method = _method(n, exact)
    if exact and n <= EIGVALSH_MAX_N:
        W_vo = value_output(W_v, W_o)  # (H, D, D)
        gram = sensitivity_gram(P, W_vo, residual)  # (B, n, n)
        rnd = _sensitivity_rounding(P, W_vo, residual)
        return NormBound(_dense_sigma(gram, rnd), method, True)
    if exact:
        return _certified_zeta(P, W_v, W_o, residual)
    est = _estimate(lambda G: sensitivity_matvec(G, P, W_v, W_o, residual),
                    lambda Y: sensitivity_rmatvec(Y, P, W_v, W_o, residual),
                    seeded_start((B, N, D), P.dtype, P.device), n_iter, tol)
    return NormBound(est.sigma, method, False)


def zeta_from_attention(P: Tensor, W_v: Tensor, W_o: Tensor, residual: bool) -> Tensor:
    """Guaranteed upper bound on ζ, eq. (15), ``(B,)``, from attention matrices
    ``P`` ``(B, H, N, N)`` (float64, taken as exact data; any nonnegative
    entries, e.g. columns scaled by a LayerProject's Jacobian): the dense
    certificate up to :data:`EIGVALSH_MAX_N`, the structured one above."""
    return _key_sensitivity(P, W_v, W_o, residual, True, 0, 0.0).value


def zeta_cls(P: Tensor, W_vo: Tensor) -> Tensor:
    """ζ_cls(X): exact norm of ``Γ ↦ Σ_h P_h[0, :] Γ W_vo[h]`` (the class row of Δ1).

    The class token's row of LoFAST's first-order term (eq. 10, ``H = 0``) is
    ``Σ_n (Σ_h P_h[0, n] W_vo[h]ᵀ) Γ[n]ᵀ``: the ``D × N·D`` matrix
    ``K = [K_1 … K_N]``, ``K_n = Σ_h P_h[0, n] W_vo[h]ᵀ``, whose norm is
    ``√λ_max(Σ_n K_n K_nᵀ)`` (dense ``D × D`` eigvalsh plus the rounding
    margin of :func:`lipvit.spectral.eigvalsh_upper` with
    ``‖K̃‖_F ≤ Σ_h ‖P_h[0, :]‖ ‖W_vo[h]‖_F``: an upper bound). Under diffuse
    attention it is about ``‖W_vo‖/√N``, while the
    whole-matrix ζ is about ``‖W_vo‖`` (extension; tested against brute force).

    Args:
        P: attention ``(B, H, N, N)``.
        W_vo: ``W_v[h] W_o[h]``, ``(H, D, D)``.

    Returns:
        ``(B,)``.
    """
    K = torch.einsum("bhn,hED->bnDE", P[:, :, 0], W_vo)  # (B, N, D, D): K_n
    gram = torch.einsum("bnij,bnkj->bik", K, K)  # (B, D, D): Σ_n K_n K_nᵀ
    row = torch.linalg.vector_norm(P[:, :, 0], dim=-1)  # (B, H): ‖P_h[0, :]‖
    scale = (row * torch.linalg.matrix_norm(W_vo)).sum(-1).square()  # (B,)
    N, D, H = P.shape[-1], W_vo.shape[-1], W_vo.shape[0]
    return eigvalsh_upper(gram, scale, inner=N * D + H).sqrt()


def _certified_zeta(P: Tensor, W_v: Tensor, W_o: Tensor, residual: bool) -> NormBound:
    """ζ upper bound ``(B,)``: the structured certificate, Cholesky where it is loose.

    :func:`lipvit.certify.lofast.structured.zeta_certificate`
    (docs/structured-certificates.md §4) for every sample; samples whose certificate
    exceeds its Ritz value (≤ ζ) by more than :data:`STRUCTURED_RTOL` get the dense
    Cholesky certificate too (:func:`certified_lambda_max`), and keep the smaller, when
    the Gram size is at most :data:`ZETA_CHOLESKY_MAX_N`. """
    B, H, N, _ = P.shape
    n = N * W_v.shape[1]
    cert = zeta_certificate(P, W_v, W_o, residual)
    method = f"structured subspace certificate (Gram size {n})"
    if n > ZETA_CHOLESKY_MAX_N:  # the dense Gram matrix would not fit
        return NormBound(cert.upper, f"{method}, no Cholesky fallback above "
                         f"{ZETA_CHOLESKY_MAX_N}", True)
    loose = (cert.upper > cert.ritz * (1 + STRUCTURED_RTOL)).nonzero().flatten()
    value = cert.upper.clone()
    W_vo = value_output(W_v, W_o)  # (H, D, D)
    rnd = _sensitivity_rounding(P, W_vo, residual)
    if len(loose):
        Pl = P[loose]  # (L, H, N, N)
        z0 = seeded_start((len(loose), N, W_v.shape[1]), P.dtype, P.device)
        est = _estimate(lambda G: sensitivity_matvec(G, Pl, W_v, W_o, residual),
                        lambda Y: sensitivity_rmatvec(Y, Pl, W_v, W_o, residual),
                        z0, 1000, 1e-10)
    for i, b in enumerate(loose.tolist()):  # one (N·D)² Gram matrix at a time
        gram = sensitivity_gram(P[b:b + 1], W_vo, residual)  # (1, n, n)
        start = _Estimate(torch.maximum(est.sigma[i:i + 1], cert.ritz[b:b + 1]),
                          est.residual[i:i + 1])
        rounding = _Rounding(rnd.scale[b:b + 1], rnd.inner)
        value[b] = torch.minimum(value[b], _certified_sigma(gram, start, rounding)[0])
    return NormBound(value, f"{method}, Cholesky fallback on {len(loose)} of {B}",
                     True)


def key_sensitivity(
    X: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    W_v: Tensor,
    W_o: Tensor,
    residual: bool = True,
    exact: bool = True,
    n_iter: int = 1000,
    tol: float = 1e-9,
) -> NormBound:
    """Key sensitivity metric ζ(X), LoFAST Lemma 1, eq. (15).

    ``ζ(X) = ‖H ⊗ I + Σ_h P_h(X) ⊗ (W_v[h] W_o[h])ᵀ‖ = max_{‖Γ‖_F ≤ 1} ‖A(Γ)‖_F``
    (:func:`sensitivity_matvec`); ``ζ ε`` is the exact maximum of Δ1 over the
    ε-ball.

    Args:
        X: ``(B, N, D)``; W_q, W_k, W_v: ``(H, D, d)``; W_o: ``(H, d, D)``.
        residual: ``H = I`` if true, else ``H = 0``.
        exact: guaranteed upper bound (float64 internally; see the module
            docstring) if true; matrix-free power-iteration estimate from below
            (in ``X.dtype``) if false.
        n_iter, tol: power-iteration budget and relative tolerance.

    Returns:
        :class:`NormBound` with ``value`` of shape ``(B,)`` in ``X.dtype``.
    """
    check_layer(X, W_q, W_k, W_v, W_o)
    work = torch.float64 if exact else X.dtype
    Xw, Wq, Wk, Wv, Wo = (t.to(work) for t in (X, W_q, W_k, W_v, W_o))
    P = torch.softmax(attention_logits(Xw, Wq, Wk), dim=-1)  # (B, H, N, N)
    out = _key_sensitivity(P, Wv, Wo, residual, exact, n_iter, tol)
    return NormBound(_round_up(out.value, X.dtype), out.method, out.exact)


def _lemma2_norm(
    X: Tensor, W_q: Tensor, W_k: Tensor, exact: bool, n_iter: int, tol: float
) -> NormBound:
    """‖M_h(X)‖ for every head, ``(B, H)``, in the dtype of ``X``."""
    B, N, D = X.shape
    C, E = lemma2_reduced_factors(X, W_q, W_k)  # (B, H, N, r) each
    n = N * C.shape[-1]
    method = _method(n, exact)
    if exact and n <= EIGVALSH_MAX_N:
        return NormBound(_dense_sigma(lemma2_gram(C, E), _lemma2_rounding(C, E)),
                         method, True)
    if exact and n > LEMMA2_CHOLESKY_MAX_N:  # docs/structured-certificates.md §5
        return NormBound(lemma2_structured_bound(X, W_q, W_k),
                         f"structured bound √(λ_max(CᵀC+EᵀE)+2‖C‖‖E‖) (Gram size {n})",
                         True)
    est = _estimate(lambda G: lemma2_op(G, C, E), lambda Y: lemma2_op_adjoint(Y, C, E),
                    seeded_start(C.shape, X.dtype, X.device), n_iter, tol)
    if not exact:
        return NormBound(est.sigma, method, False)
    rnd = _lemma2_rounding(C, E)  # scale (B, H)
    values = [_certified_sigma(lemma2_gram(C[b], E[b]),  # (H, n, n)
                               _Estimate(est.sigma[b], est.residual[b]),
                               _Rounding(rnd.scale[b], rnd.inner))
              for b in range(B)]
    return NormBound(torch.stack(values),
                     f"power iteration + Cholesky certificate (Gram size {n})", True)


def lemma2_norm(
    X: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    exact: bool = True,
    n_iter: int = 1000,
    tol: float = 1e-9,
) -> NormBound:
    """``‖M_h(X)‖`` of LoFAST Lemma 2 (eq. 25) for every head.

    ``max_{‖Γ‖_F ≤ ε} ‖Γ A_h Xᵀ + X A_h Γᵀ‖_F = ‖M_h(X)‖ ε`` (``A_h = W_q W_kᵀ``,
    without the ``1/√d``).

    Args:
        X: ``(B, N, D)``; W_q, W_k: ``(H, D, d)``.
        exact: guaranteed upper bound if true (reduced Gram matrix, see
            :func:`lemma2_reduced_factors`), else a power-iteration estimate
            from below on the same reduced operator.
        n_iter, tol: power-iteration budget and relative tolerance.

    Returns:
        :class:`NormBound` with ``value`` of shape ``(B, H)`` in ``X.dtype``.
    """
    if (X.ndim != 3 or W_q.ndim != 3 or W_k.shape != W_q.shape
            or X.shape[-1] != W_q.shape[1]):
        raise ValueError("expected X (B, N, D) and W_q, W_k (H, D, d)")
    work = torch.float64 if exact else X.dtype
    out = _lemma2_norm(X.to(work), W_q.to(work), W_k.to(work), exact, n_iter, tol)
    return NormBound(_round_up(out.value, X.dtype), out.method, out.exact)


# --------------------------------------------------------------------------
# Softmax: local Lipschitz constant (extension).
# --------------------------------------------------------------------------


def softmax_local_constant(logits: Tensor, logit_radius: Tensor) -> Tensor:
    """Local Lipschitz constant of row-wise softmax over reachable logits (extension).

    For a row with logits ``z`` and any change ``Δ`` with ``‖Δ‖_2 ≤ ρ``,
    ``‖softmax(z + Δ) − softmax(z)‖ ≤ c ‖Δ‖`` with ``c`` returned here. Proof:
    on the segment ``z + tΔ`` the Jacobian ``J = diag(p) − ppᵀ`` is symmetric
    PSD, ``J ≼ diag(p)`` gives ``‖J‖ ≤ max_k p_k``, and Gershgorin gives
    ``‖J‖ ≤ max_k 2 p_k(1 − p_k) ≤ ½``. Along the segment
    ``p_k(t) ∈ [p_k e^{−s}, p_k e^{s}]`` with ``s ≥ max Δ − min Δ``, and
    ``max Δ − min Δ ≤ √2 ‖Δ‖_2``. Both eigenvalue bounds are maximised over
    these intervals; the mean value theorem finishes the proof.

    Args:
        logits: clean scaled logits ``(..., N, N)`` (softmax over the last dim).
        logit_radius: ``ρ``, shape ``logits.shape[:-2]``: a bound on the norm
            of every row's logit change (e.g. the Frobenius bound of all rows).

    Returns:
        ``c``, shape ``logits.shape[:-2]``, with ``c ≤ ½``: the largest
        constant over all rows.
    """
    s = (math.sqrt(2) * logit_radius)[..., None, None]  # (..., 1, 1) spread bound
    logp = torch.log_softmax(logits, dim=-1)  # (..., N, N)
    hi = torch.exp((logp + s).clamp(max=0))  # upper bound of p_k(t), ≤ 1
    lo = torch.exp(logp - s)  # lower bound of p_k(t)
    gersh = torch.maximum(2 * lo * (1 - lo), 2 * hi * (1 - hi))
    gersh = torch.where((lo <= 0.5) & (hi >= 0.5), torch.full_like(gersh, 0.5), gersh)
    row = torch.minimum(hi.amax(dim=-1), gersh.amax(dim=-1))  # (..., N)
    return row.amax(dim=-1).clamp(max=0.5)


# --------------------------------------------------------------------------
# Theorem 1.
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class LoFASTTerms:
    """The ε-independent parts of LoFAST at a clean input ``X`` (batch ``B``).

    Computed once by :func:`lofast_terms`; :meth:`bound` and :meth:`delta`
    evaluate Theorem 1 for any ε at negligible cost (certified radii by
    bisection, layer-by-layer composition). Shapes: ``(B,)`` or ``(B, H)``; in
    float64 when ``exact``.

    Attributes:
        zeta: ζ(X), eq. (15).
        m_norm: ``‖M_h(X)‖``, Lemma 2.
        xi: ξ_h(X), eq. (26) (exact SVDs).
        xm_norm: ``‖X W_vo[h]‖``; xm_centred: ``‖Π X W_vo[h]‖``, ``Π = I − 11ᵀ/N``;
            xm_rows: half the largest distance between two rows of ``X W_vo[h]``
            (at most ``Π X W_vo[h]``'s largest row norm, ``≤ xm_centred``): a
            row ``w`` summing to zero has ``‖wᵀ X W_vo[h]‖ ≤ ‖w‖₁ xm_rows``.
        vo_norm: ``‖W_vo[h]‖`` ``(H,)``; qk_norm: ``‖W_qk[h]‖`` ``(H,)``.
        p_norm: ``‖P_h(X)‖``.
        logits: scaled logits ``(B, H, N, N)`` (for the local softmax constant).
        head_dim: ``d``.
        residual: ``H = I`` or ``0``.
        exact: whether ζ and ``‖M_h(X)‖`` are guaranteed upper bounds.
        method: how ζ and ``‖M_h(X)‖`` were obtained.
        out_dtype: dtype of the returned bounds (that of ``X``).
        row_gain: optional ``(B, N)``, per query row ``r`` an upper bound on
            ``‖[(X W_vo[h])ᵀ Ds(p_{h,r})]_h‖``, the softmax path's gain from the
            row's logit changes (all heads) to its output
            (:func:`lipvit.certify.taylor.remainders.softmax_row_gains`; taylor sets
            it).
        var_gain, var_row: optional ``(B, H)``, bounds on ``Σ_r Var_{p_{h,r}}``
            and on ``max_r Var_{p_{h,r}}`` of the logit changes ``M_h(X)[Γ]``
            per unit ``‖Γ‖_F²``
            (:func:`lipvit.certify.taylor.remainders.logit_variance_gain`,
            :func:`~lipvit.certify.taylor.remainders.logit_row_variance_gains`; taylor
            sets them).
        var_all, var_row_all: optional ``(B,)``, the same for all heads'
            variances summed (``remainders.logit_variance_gain_all``, ``None``
            above its size, and ``logit_row_variance_gains``).
    """

    zeta: Tensor
    m_norm: Tensor
    xi: Tensor
    xm_norm: Tensor
    xm_centred: Tensor
    xm_rows: Tensor
    vo_norm: Tensor
    qk_norm: Tensor
    p_norm: Tensor
    logits: Tensor
    head_dim: int
    residual: bool
    exact: bool
    method: str
    out_dtype: torch.dtype
    row_gain: Tensor | None = None
    var_gain: Tensor | None = None
    var_row: Tensor | None = None
    var_all: Tensor | None = None
    var_row_all: Tensor | None = None

    def take(self, index: Tensor) -> LoFASTTerms:
        """The terms of the samples ``index`` ``(b,)`` of the batch (the weights'
        ``vo_norm``, ``qk_norm`` are every sample's)."""
        rows = {f.name: t[index] for f in fields(self)
                if isinstance(t := getattr(self, f.name), Tensor)
                and f.name not in ("vo_norm", "qk_norm")}
        return replace(self, **rows)

    def bound(self, eps: float | Tensor) -> LoFASTBound:
        """All LoFAST bounds at radius ``eps`` (a float or a ``(B,)`` tensor)."""
        B, H, N, _ = self.logits.shape
        e = eps_per_sample(eps, B, self.zeta.dtype, self.zeta.device)  # (B,)
        eh = e[:, None]  # (B, 1)
        out_term = self.xm_norm + eh * self.vo_norm  # (B, H), eq. (18)
        centred = self.xm_centred + eh * self.vo_norm  # (B, H)
        scale = eh / math.sqrt(self.head_dim)
        rho_tight = scale * (self.m_norm + eh * self.qk_norm)  # (B, H), logit change
        rho_fast = scale * (self.xi + eh * self.qk_norm)  # (B, H)
        delta_2_tight = (rho_tight * out_term).sum(dim=1)  # eq. (27)
        delta_2_fast = (rho_fast * out_term).sum(dim=1)  # eq. (28)
        c_local = softmax_local_constant(self.logits, rho_tight)  # (B, H)
        softmax_change = torch.minimum(c_local * rho_tight,
                                       torch.full_like(rho_tight, math.sqrt(2 * N)))
        delta_2_local = (softmax_change * centred).sum(dim=1)
        delta_1 = self.zeta * e
        naive = float(self.residual) + (self.vo_norm * self.p_norm).sum(dim=1)  # (B,)
        delta_1_naive = naive * e  # eq. (12)

        def up(t: Tensor) -> Tensor:
            return _round_up(t, self.out_dtype) if self.exact else t.to(self.out_dtype)

        return LoFASTBound(
            zeta=up(self.zeta),
            delta_1=up(delta_1),
            delta_1_naive=up(delta_1_naive),
            delta_2_tight=up(delta_2_tight),
            delta_2_fast=up(delta_2_fast),
            delta_2_half=up(delta_2_tight / 2),
            delta_2_local=up(delta_2_local),
            total=up(delta_1 + delta_2_tight),
            total_fast=up(delta_1 + delta_2_fast),
            total_half=up(delta_1 + delta_2_tight / 2),
            total_local=up(delta_1 + delta_2_local),
            eps=e.to(self.out_dtype),
            method=self.method,
            exact=self.exact,
        )

    def delta(self, eps: float | Tensor, variant: str = "tight") -> Tensor:
        """One variant of ``δ(X, ε)``, ``(B,)``; usable as a ``ε ↦ δ`` callable.

        Args:
            eps: radius, a float or a ``(B,)`` tensor.
            variant: ``"tight"`` (Theorem 1, eq. 27; the default), ``"fast"``
                (eq. 28), ``"half"`` or ``"local"`` (extensions, sound and
                tighter; ``"local"`` is the tightest).
        """
        fields = {"tight": "total", "fast": "total_fast", "half": "total_half",
                  "local": "total_local"}
        if variant not in fields:
            raise ValueError(
                f"variant must be one of {sorted(fields)}, got {variant!r}"
            )
        return getattr(self.bound(eps), fields[variant])


def lofast_terms(
    X: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    W_v: Tensor,
    W_o: Tensor,
    residual: bool = True,
    exact: bool = True,
    n_iter: int = 1000,
    tol: float = 1e-9,
) -> LoFASTTerms:
    """The ε-independent parts of LoFAST at clean ``X`` (see :class:`LoFASTTerms`).

    ``lofast_terms(...).bound(eps) == lofast_bound(..., eps)``; the expensive
    part (ζ, ``‖M_h(X)‖``) is done here once. Arguments as for
    :func:`lofast_bound`, without ``eps``.
    """
    check_layer(X, W_q, W_k, W_v, W_o)
    work = torch.float64 if exact else X.dtype
    Xw, Wq, Wk, Wv, Wo = (t.to(work) for t in (X, W_q, W_k, W_v, W_o))
    W_vo = value_output(Wv, Wo)  # (H, D, D)
    W_qk = query_key(Wq, Wk)  # (H, D, D)
    logits = attention_logits(Xw, Wq, Wk)  # (B, H, N, N)
    P = torch.softmax(logits, dim=-1)  # (B, H, N, N)
    zeta = _key_sensitivity(P, Wv, Wo, residual, exact, n_iter, tol)  # (B,)
    m_norm = _lemma2_norm(Xw, Wq, Wk, exact, n_iter, tol)  # (B, H)
    XM = torch.einsum("bnD,hDE->bhnE", Xw, W_vo)  # (B, H, N, D)
    XM_c = XM - XM.mean(dim=-2, keepdim=True)  # Π X W_vo[h]
    xi = (spectral_norm(torch.einsum("bnD,hED->bhnE", Xw, W_qk))  # ‖A Xᵀ‖ = ‖X Aᵀ‖
          + spectral_norm(torch.einsum("bnD,hDE->bhnE", Xw, W_qk)))  # + ‖X A‖, eq. (26)
    return LoFASTTerms(
        zeta=zeta.value,
        m_norm=m_norm.value,
        xi=xi,
        xm_norm=spectral_norm(XM),
        xm_centred=spectral_norm(XM_c),
        xm_rows=torch.cdist(XM, XM, compute_mode="donot_use_mm_for_euclid_dist"
                            ).amax((-2, -1)) * ((1 + 1e-12) / 2),
        vo_norm=spectral_norm(W_vo),
        qk_norm=spectral_norm(W_qk),
        p_norm=spectral_norm(P),
        logits=logits,
        head_dim=W_q.shape[-1],
        residual=residual,
        exact=exact,
        method=f"zeta: {zeta.method}; ||M_h(X)||: {m_norm.method}",
        out_dtype=X.dtype,
    )


def lofast_bound(
    X: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    W_v: Tensor,
    W_o: Tensor,
    eps: float | Tensor,
    residual: bool = True,
    exact: bool = True,
    n_iter: int = 1000,
    tol: float = 1e-9,
) -> LoFASTBound:
    """LoFAST bounds on ``max_{‖X'−X‖_F ≤ ε} ‖F(X') − F(X)‖_F``, Theorem 1.

    ``total = ζ ε + δ2^(1)`` (eq. 15, 27), ``total_fast = ζ ε + δ2^(2)``
    (eq. 28), ``total_half`` and ``total_local`` the extensions of the module
    docstring. Ordering: ``total_local ≤ total_half ≤ total ≤ total_fast``.

    The δ2 terms bound ``Δ2 ≤ Σ_h ‖P_h(X') − P_h(X)‖_F ‖X' W_vo[h]‖`` (eq. 17)
    with ``‖X' W_vo‖ ≤ ‖X W_vo‖ + ε‖W_vo‖`` (eq. 18) and the logit change
    ``‖Δ_h‖_F ≤ ρ_h = (ε/√d)(‖M_h(X)‖ + ε‖A_h‖)`` (eq. 21-25); softmax is
    1-Lipschitz (paper), ½-Lipschitz (``half``) or locally
    :func:`softmax_local_constant`-Lipschitz (``local``, which also uses
    ``‖P' − P‖_F ≤ √(2N)`` — each row is a difference of two probability
    vectors — and ``(P' − P) X' = (P' − P) Π X'`` since ``(P' − P) 1 = 0``).

    Args:
        X: ``(B, N, D)``; W_q, W_k, W_v: ``(H, D, d)``; W_o: ``(H, d, D)``;
            any float dtype, CPU or CUDA.
        eps: radius ε ≥ 0 of the Frobenius ball (a float, or a ``(B,)`` tensor).
        residual: ``H = I`` (the model's ``x + attn(x)``) or ``H = 0``.
        exact: guaranteed upper bounds (float64 internally) if true; power
            iteration estimates (in ``X.dtype``) if false.
        n_iter, tol: power-iteration budget and relative tolerance.

    Returns:
        :class:`LoFASTBound` of ``(B,)`` tensors in ``X.dtype``.

    Raises:
        ValueError: negative, NaN or infinite ``eps``; shape mismatches.
        TypeError: non-float or mixed dtypes / devices.
    """
    eps_per_sample(eps, X.shape[0] if X.ndim == 3 else 1, torch.float64,
                   torch.device("cpu"))  # validate before the expensive part
    terms = lofast_terms(X, W_q, W_k, W_v, W_o, residual, exact, n_iter, tol)
    return terms.bound(eps)
