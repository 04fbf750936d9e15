"""Certified first-order remainders of the ViT's nonlinear maps (docs/taylor.md).

For a map ``φ`` with clean input ``u`` and Jacobian ``J = Dφ(u)`` (autograd's,
float64), the remainder is ``r(Γ) = φ(u + Γ) − φ(u) − J Γ``. Each function
here returns an **upper bound** on ``‖r(Γ)‖`` (or on a weighted sum of its
parts) over every ``Γ`` with ``‖Γ‖ ≤ β``; each is proved in docs/taylor.md
(section named in the docstring) and tested against brute force and PGD in
``tests/test_taylor.py``. Pure functions of tensors.

Token-wise maps. A map acting on every token separately (a per-token
LayerProject, LayerNorm, an MLP or SLL layer) under a Frobenius budget
``Σ_t b_t² ≤ β²`` (``b_t = ‖Γ_t‖ ≤ β``) has per-token remainders bounded in the
form ``ρ_t(b) ≤ q_t b² + l_t b`` for every ``b ≤ β``
(:class:`TokenRemainder`). Then (docs/taylor.md §2)

* ``‖r‖_F ≤ max_t q_t β² + max_t l_t β`` (:meth:`TokenRemainder.norm`);
* ``Σ_t w_t ρ_t(b_t) ≤ max_t(w_t q_t) β² + ‖(w_t l_t)_t‖₂ β`` for weights
  ``w_t ≥ 0`` (:meth:`TokenRemainder.weighted`; Cauchy–Schwarz on the linear
  part, ``Σ_t b_t² ≤ β²`` on the quadratic one).

Shapes: ``B`` batch, ``K`` classes, ``T`` vectors (tokens, or 1 for a whole
token matrix), ``m`` hidden units, ``D`` width, ``H`` heads.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from lipvit.certify.attention import query_key
from lipvit.certify.lofast.layer import LoFASTTerms, softmax_local_constant
from lipvit.certify.lofast.operators import (
    lemma2_factors,
    lemma2_matrix,
    lemma2_reduced_factors,
)
from lipvit.certify.lofast.structured import U, certified_lambda_max_small, gamma, up
from torch import Tensor

from lipvit.spectral import eigvalsh

#: ``max_x |GELU''(x)| = 2 φ(0) = √(2/π)`` (erf GELU; GELU'' = φ(x)(2 − x²)).
GELU_CURVATURE_MAX = math.sqrt(2 / math.pi)


class TokenRemainder(NamedTuple):
    """Per-vector remainder coefficients: ``ρ_t(b) ≤ quad_t b² + lin_t b``, ``b ≤ β``.

    ``quad`` and ``lin`` have shape ``(B, T)`` (non-negative); both are valid
    only up to the budget ``β`` they were computed for.
    """

    quad: Tensor
    lin: Tensor

    def norm(self, beta: Tensor) -> Tensor:
        """Bound on ``‖r‖_F`` over ``Σ_t b_t² ≤ β²``, ``(B,)`` (docs/taylor.md §2)."""
        return self.quad.amax(-1) * beta**2 + self.lin.amax(-1) * beta

    def weighted(self, w: Tensor, beta: Tensor, caps: Tensor | None = None) -> Tensor:
        """Bound on ``Σ_t w_t ‖r_t‖`` over ``Σ_t b_t² ≤ β²``, ``(B, K)``.

        Args:
            w: non-negative weights ``(B, K, T)`` (e.g. ``‖g_t‖``, the norms of a
                margin's gradient at the map's output, token by token).
            beta: ``(B,)``.
            caps: optional per-vector budgets ``b_t ≤ caps_t`` ``(B, T)`` (the
                coefficients must be valid up to them); then the bound is also
                at most ``Σ_t w_t ρ_t(caps_t)``, and the smaller one is returned.
        """
        quad = (w * self.quad[:, None]).amax(-1)  # (B, K)
        lin = torch.linalg.vector_norm(w * self.lin[:, None], dim=-1)  # (B, K)
        b = beta[:, None]
        out = quad * b**2 + lin * b
        if caps is None:
            return out
        return torch.minimum(out, (w * self.at(caps)[:, None]).sum(-1))

    def at(self, b: Tensor) -> Tensor:
        """``quad_t b_t² + lin_t b_t`` for per-vector budgets ``b`` ``(B, T)``."""
        return self.quad * b**2 + self.lin * b


def per_budget(value: Tensor, beta: Tensor) -> Tensor:
    """``value / β`` with ``0/0 = 0`` (β broadcast over trailing dims)."""
    b = beta.reshape(beta.shape + (1,) * (value.ndim - beta.ndim))
    return torch.where(b > 0, value / b.clamp_min(1e-300), torch.zeros_like(value))


# --------------------------------------------------------------------------
# LayerProject (LoFAST eq. 29): docs/taylor.md §3.
# --------------------------------------------------------------------------


def layer_project_remainder(
    norms: Tensor, radius: float, beta: Tensor
) -> TokenRemainder:
    """Remainder of ``p(x) = x R/max(‖x‖, R)`` on ``‖Γ‖ ≤ β``, docs/taylor.md §3.

    Autograd's Jacobian is ``I`` where ``‖x‖ < R`` and ``R(I − x̂x̂ᵀ)/‖x‖`` where
    ``‖x‖ ≥ R`` (``clamp_min`` passes the gradient at equality); at ``‖x‖ = R`` up
    to rounding, where the forward pass may have taken the other side, the
    bounds below (and the split's) hold with either Jacobian. Cases:

    * ``‖x‖ < R``: ``r = p(x+Γ) − (x+Γ)``, of norm ``(‖x+Γ‖ − R)₊ ≤
      (‖x‖ + b − R)₊``: zero while the ball stays inside, linear when it
      straddles the sphere.
    * ``‖x‖ ≥ R``: ``r = [q(x+Γ) − q(x) − JΓ] + [p − q](x+Γ)`` with
      ``q(y) = R y/‖y‖``; ``‖D²q(y)[u,u]‖ ≤ (2/√3) R ‖u‖²/‖y‖²`` gives the
      first part ``≤ R b²/(√3 (‖x‖ − b)²)`` (needs ``‖x‖ > β``); the second is
      ``R − ‖x+Γ‖ ≤ (b − (‖x‖ − R))₊`` where the ball crosses inside. The
      first-order-Lipschitz alternative ``(1 + R/‖x‖) b`` is used where smaller
      (a straddling ball, or one reaching the origin).

    Args:
        norms: ``‖x‖`` of each projected vector, ``(B, T)``.
        radius: ``R``.
        beta: budget of each vector's perturbation, ``(B,)`` or ``(B, T)``.

    Returns:
        :class:`TokenRemainder` with ``(B, T)`` coefficients.
    """
    b = beta[:, None] if beta.ndim == 1 else beta  # (B, 1) or (B, T)
    zero = torch.zeros_like(norms)
    inside = norms < radius
    lin_in = per_budget((norms + b - radius).clamp_min(0), beta)
    gap = norms - b  # (B, T) smallest norm on the ball
    quad_out = torch.where(
        gap > 0,
        radius / (math.sqrt(3) * gap.clamp_min(1e-300) ** 2),
        torch.full_like(norms, math.inf),
    )
    lin_out = per_budget((b - (norms - radius)).clamp_min(0), beta)
    lin_crude = 1 + radius / norms.clamp_min(radius)
    smooth = quad_out * b**2 + lin_out * b <= lin_crude * b
    quad = torch.where(inside, zero, torch.where(smooth, quad_out, zero))
    lin = torch.where(inside, lin_in, torch.where(smooth, lin_out, lin_crude))
    return TokenRemainder(quad, lin)


class RadialSplit(NamedTuple):
    """LayerProject's remainder split as ``r = −σ x̂ + r'`` with ``σ ∈ [0, s]``
    and ``‖r'‖`` bounded by ``rest`` (docs/taylor.md §3); ``s`` ``(B, T)``."""

    s: Tensor
    rest: TokenRemainder


def layer_project_split(norms: Tensor, radius: float, caps: Tensor) -> RadialSplit:
    """:func:`layer_project_remainder`'s radial part as a symbol, docs/taylor.md §3.

    With ``y = x + Γ``, ``‖Γ‖ = b ≤ β`` and ``β < ‖x‖``, the part of ``r`` that
    is linear in the crossing of the sphere is ``−σ ŷ``: ``σ = (‖y‖ − R)₊ ≤
    (‖x‖ + β − R)₊`` inside, ``σ = (R − ‖y‖)₊ ≤ (β − (‖x‖ − R))₊`` outside.
    Writing ``ŷ = x̂ + (ŷ − x̂)`` with ``‖ŷ − x̂‖ ≤ √2 b/‖x‖`` (the angle of
    ``y`` to ``x`` is at most ``arcsin(b/‖x‖) < π/2``) and ``σ ≤ (b/β) s``
    (``σ``'s bound is convex in ``b`` and 0 at 0) leaves

        ‖r'‖ ≤ (√2 s/(‖x‖ β) + [‖x‖ ≥ R] R/(√3 (‖x‖ − β)²)) b²,

    the second term the curvature of ``R y/‖y‖`` (as in
    :func:`layer_project_remainder`). Where ``β ≥ ‖x‖``, or where the plain
    bound is smaller, ``s = 0`` and ``rest`` is :func:`layer_project_remainder`.

    Args:
        norms: ``‖x‖`` of each projected vector, ``(B, T)``.
        radius: ``R``.
        caps: each vector's budget ``β`` ``(B, T)``.
    """
    plain = layer_project_remainder(norms, radius, caps)
    n = norms
    inside = n < radius
    s = torch.where(inside, n + caps - radius, caps - (n - radius)).clamp_min(0)
    gap = (n - caps).clamp_min(1e-300)
    curve = torch.where(inside, torch.zeros_like(n), radius / (math.sqrt(3) * gap**2))
    quad = math.sqrt(2) * per_budget(s, caps) / n.clamp_min(1e-300) + curve
    split = (caps < n) & (quad * caps**2 <= plain.at(caps))
    zero = torch.zeros_like(n)
    rest = TokenRemainder(torch.where(split, quad, plain.quad),
                          torch.where(split, zero, plain.lin))
    return RadialSplit(torch.where(split, s, zero), rest)


def layer_project_directional(
    norms: Tensor, radius: float, beta: Tensor, radial: Tensor
) -> RadialSplit:
    """The remainder of a projection outside its ball as ``r = −τ x̂ + c Γ_⊥``,
    given ``|x̂ᵀΓ| ≤ A``, docs/taylor.md §3 (direction-aware split).

    With ``n = ‖x‖ ≥ R``, ``‖Γ‖ ≤ β < n``, ``Γ_⊥ = Γ − (x̂ᵀΓ) x̂``,
    ``κ = β²/(2(n − β)²)``, the move of the norm ``|‖x + Γ‖ − n| ≤ Δ =
    min(β, A + β²/(2(n − β)))`` and the crossing ``(R − ‖x + Γ‖)₊ ≤ σ̄ =
    (R − n + Δ)₊``: ``τ ∈ [0, s]``, ``s = Rκ + σ̄``, and
    ``|c| ≤ l = R Δ/(n(n − β)) + σ̄/(n − β)``, so ``‖cΓ_⊥‖ ≤ l β`` and a margin
    with gradient ``g`` takes ``s (−gᵀx̂)₊ + l |g_⊥ᵀΓ|``: third order in ``β``
    when ``A`` and ``|g_⊥ᵀΓ|`` are first order. Where it does not apply
    (``n < R`` or ``β ≥ n``), ``s = 0`` and ``l = +inf``.

    Args:
        norms: ``‖x‖`` ``(B, 1)`` (one projected matrix).
        radius: ``R``.
        beta: ``β`` ``(B, 1)``.
        radial: ``A`` ``(B, 1)``.

    Returns:
        :class:`RadialSplit` with ``rest = (0, l)``.
    """
    n, b = norms, beta
    gap = (n - b).clamp_min(1e-300)
    move = torch.minimum(b, radial + b**2 / (2 * gap))  # Δ
    cross = (radius - n + move).clamp_min(0)  # σ̄
    s = radius * b**2 / (2 * gap**2) + cross
    lin = radius * move / (n * gap) + cross / gap
    valid = (n >= radius) & (b < n)
    rest = TokenRemainder(torch.zeros_like(n),
                          torch.where(valid, lin, torch.full_like(lin, math.inf)))
    return RadialSplit(torch.where(valid, s, torch.zeros_like(s)), rest)


# --------------------------------------------------------------------------
# LayerNorm: docs/taylor.md §4.
# --------------------------------------------------------------------------


def layernorm_curvature(c_norm: Tensor, kappa: float, beta: Tensor) -> Tensor:
    """``½ sup ‖D²φ‖`` of ``φ(c) = c/√(‖c‖² + κ)`` on the ball, docs/taylor.md §4.

    With ``m = r² + κ``, ``τ = r²/m`` at ``‖c‖ = r``, the bracket of §4 is at
    most ``4/(3τ)`` for ``τ ≥ 1/3`` and ``9(1 − τ)²`` below, so
    ``‖D²φ(c)[u,u]‖ ≤ ψ(r) ‖u‖²`` with ``ψ(r) = 2/(√3 m)`` for ``r² ≥ κ/2``
    and ``3 r κ/m^{5/2}`` below: increasing up to ``r = √κ/2``, decreasing
    after. Its supremum over ``r ∈ [‖c‖ − β, ‖c‖ + β]`` is at the point of that
    interval nearest ``√κ/2``, and ``‖φ(c + u) − φ(c) − Dφ(c)u‖ ≤ ½ ψ_max
    ‖u‖²`` for ``‖u‖ ≤ β`` (Taylor, integral remainder).

    Args:
        c_norm: ``‖c_t‖`` of the centred tokens, ``(B, T)``.
        kappa: ``D η`` (> 0; with ``κ = 0`` the bound is ``inf`` near ``c = 0``).
        beta: ``(B,)`` or per-vector ``(B, T)``.

    Returns:
        ``½ ψ_max``, ``(B, T)``: the quadratic coefficient of the remainder of
        ``φ`` (multiply by ``√D ‖γ ⊙ ·‖`` for LayerNorm).
    """
    b = beta[:, None] if beta.ndim == 1 else beta
    lo, hi = (c_norm - b).clamp_min(0), c_norm + b
    r = torch.minimum(torch.maximum(lo, torch.full_like(lo, math.sqrt(kappa) / 2)), hi)
    m = r**2 + kappa
    if kappa == 0:
        psi = 2 / (math.sqrt(3) * m)  # inf at r = 0
    else:
        psi = torch.where(r**2 >= kappa / 2, 2 / (math.sqrt(3) * m),
                          3 * r * kappa / m**2.5)
    return 0.5 * psi


# --------------------------------------------------------------------------
# ReLU and GELU units: docs/taylor.md §5, §6.
# --------------------------------------------------------------------------


def relu_remainder(z: Tensor, delta: Tensor, weights: Tensor | None = None) -> Tensor:
    """Per-vector ReLU remainders at the budget, docs/taylor.md §5.

    ``|relu(z + δ) − relu(z) − 1[z > 0] δ| ≤ (|δ| − |z|)₊``: zero on units whose
    pre-activation cannot change sign.

    Args:
        z: clean pre-activations ``(B, T, m)``.
        delta: bounds on ``|Δz|`` at the budget β, broadcastable to ``z``.
        weights: optional ``(B, K, T, m)`` non-negative weights.

    Returns:
        ``(B, T)``: ``‖((δ − |z|)₊)_i‖₂`` per vector, or with ``weights``
        ``(B, K, T)``: ``Σ_i w_i (δ_i − |z_i|)₊``. Both are convex in β and 0
        at β = 0, so dividing by β gives a valid ``lin`` coefficient on
        ``[0, β]``.
    """
    excess = (delta - z.abs()).clamp_min(0)  # (B, T, m)
    if weights is None:
        return torch.linalg.vector_norm(excess, dim=-1)
    return (weights * excess[:, None]).sum(-1)


def gelu_curvature(z: Tensor, delta: Tensor) -> Tensor:
    """``sup |GELU''|`` over ``[z − δ, z + δ]`` per unit, docs/taylor.md §6.

    ``GELU''(x) = φ(x)(2 − x²)`` has critical points ``0, ±2``; the supremum of
    its magnitude on an interval is at an end or one of those inside. At most
    :data:`GELU_CURVATURE_MAX`.
    """
    lo, hi = z - delta, z + delta

    def g(x: Tensor) -> Tensor:
        return (torch.exp(-(x**2) / 2) / math.sqrt(2 * math.pi) * (2 - x**2)).abs()

    out = torch.maximum(g(lo), g(hi))
    for c in (0.0, 2.0, -2.0):
        val = g(torch.tensor(c, dtype=z.dtype)).item()
        out = torch.where((lo <= c) & (hi >= c), torch.clamp_min(out, val), out)
    return out


# --------------------------------------------------------------------------
# Attention: docs/taylor.md §7.
# --------------------------------------------------------------------------


def attention_jacobian_norm(terms: LoFASTTerms) -> Tensor:
    """Upper bound on ``‖J_a‖`` of bare attention (``H = 0``), docs/taylor.md §7.

    ``J_a Γ = Σ_h P_h Γ M_h + Σ_h Ds(S_h)[(Γ A_h Xᵀ + X A_h Γᵀ)/√d] Π X M_h``,
    so ``‖J_a‖ ≤ ζ(X) + Σ_h c_h ‖M_h(X)‖ ‖Π X M_h‖/√d`` with ``c_h`` the
    softmax Jacobian's norm at the clean logits. ``(B,)``.
    """
    if terms.residual:
        raise ValueError("attention_jacobian_norm expects the bare attention (H = 0)")
    return terms.zeta + softmax_path(terms)


def softmax_path(terms: LoFASTTerms) -> Tensor:
    """A bound ``(B,)`` on the softmax path's share ``‖S‖`` of ``‖J_a‖``
    (:func:`attention_jacobian_norm`): ``Σ_h c_h ‖M_h(X)‖ ‖Π X W_vo[h]‖/√d``
    (docs/taylor.md §7) or, where ``terms.row_gain`` is set and it is smaller,
    ``max_r R_r ‖M‖/√d`` (docs/taylor.md §8, "Softmax path by rows")."""
    c0 = softmax_local_constant(terms.logits, torch.zeros_like(terms.m_norm))  # (B, H)
    heads = (c0 * terms.m_norm * terms.xm_centred).sum(-1) / math.sqrt(terms.head_dim)
    rows = _softmax_rows(terms)
    return heads if rows is None else torch.minimum(heads, rows.amax(-1))


def _softmax_rows(terms: LoFASTTerms) -> Tensor | None:
    """``R_r ‖M‖/√d`` ``(B, N)``, ``‖M‖ ≤ (Σ_h ‖M_h(X)‖²)^½`` the norm of all
    heads' logit maps stacked: a bound on the softmax path's output row ``r``
    per unit ``‖Γ‖_F``; ``None`` without ``terms.row_gain``."""
    if terms.row_gain is None:
        return None
    stacked = torch.linalg.vector_norm(terms.m_norm, dim=-1)  # (B,)
    return terms.row_gain * (stacked / math.sqrt(terms.head_dim))[:, None]


_ROW_BYTES = 2**26
"""Largest ``(B, H, rows, N, D)`` block :func:`softmax_row_gains` holds at once."""

def softmax_row_gains(P: Tensor, V: Tensor) -> Tensor:
    """``R_r ≥ ‖[V_hᵀ Ds(p_{h,r})]_h‖`` per query row ``r`` ``(B, N)``, taylor.md §8.

    Row ``r`` of the softmax path's output is ``Σ_h V_hᵀ Ds(p_{h,r}) u_{h,r}``
    (``u_{h,r}`` the row's logit change in head ``h``, ``Ds(p) = diag(p) − ppᵀ``
    the softmax Jacobian), so it is at most ``R_r ‖(u_{h,r})_h‖``. The columns
    of ``Ds(p)V`` are ``p_k (v_k − pᵀV)``; ``R_r² = λ_max`` of their Gram
    matrix (``(H·N)²`` or ``D²``, the smaller), from ``eigvalsh`` with a
    relative ``10⁻¹⁰`` (float64 rounding of a Gram of rank ≤ ``D``, far below
    it at these sizes) and an absolute ``8u √H max ‖v_k‖`` for the rounding of
    ``v_k − pᵀV``.

    Args:
        P: attention matrices ``(B, H, N, N)``, float64.
        V: ``X W_vo[h]`` ``(B, H, N, D)``, float64.
    """
    B, H, N, D = V.shape
    PV = P @ V  # (B, H, N, D): pᵀV per row
    step = max(1, _ROW_BYTES // (8 * B * H * N * D))
    out = []
    for r in range(0, N, step):
        p = P[:, :, r:r + step]  # (B, H, c, N)
        # (B, H, c, N, D): column k of Ds(p_r) V is p_k (v_k − p_rᵀV)
        W = p[..., None] * (V[:, :, None] - PV[:, :, r:r + step, None])
        W = W.permute(0, 2, 1, 3, 4).flatten(2, 3)  # (B, c, H·N, D)
        G = W @ W.mT if H * N <= D else W.mT @ W
        out.append(eigvalsh(G)[..., -1].clamp_min(0).sqrt())  # (B, c)
    v_max = torch.linalg.vector_norm(V, dim=-1).amax((-2, -1))  # (B,)
    rounding = 8 * U * math.sqrt(H) * v_max
    return torch.cat(out, dim=-1) * (1 + 1e-10) + rounding[:, None]


def _softmax_jacobians(P: Tensor) -> Tensor:
    """``Ds(p) = diag(p) − ppᵀ`` per row ``p``: ``(..., N, N) → (..., N, N, N)``."""
    return torch.diag_embed(P) - P[..., :, None] * P[..., None, :]


VARIANCE_EXACT_MAX = 1024
"""Largest reduced size ``N·r`` at which :func:`logit_variance_gain` forms the
whole weighted Gram matrix (an explicitly exact small-size mode, as
:data:`lipvit.certify.taylor.subblock.EXACT_MAX`); above it the two-part bound."""


def logit_variance_gain(X: Tensor, W_q: Tensor, W_k: Tensor, P: Tensor) -> Tensor:
    """``ν_h ≥ max_{‖Γ‖_F ≤ 1} Σ_r Var_{p_{h,r}}(M_h(X)[Γ]_r)`` ``(B, H)``, §7.

    ``Var_p(u) = uᵀDs(p)u``, so ``ν_h = λ_max(M_hᵀ Ds_h M_h)``, ``Ds_h`` the
    row-wise softmax Jacobians at ``P`` (block diagonal). In the reduced
    coordinates of :func:`~lipvit.certify.lofast.operators.lemma2_reduced_factors`
    (``M_h Γ = L(ΓQ_h)``, ``L G = G Cᵀ + E Gᵀ``, ``G`` ``N × r``) its Gram
    matrix is ``blockdiag_a(Cᵀ Ds_a C) + T + Tᵀ + Σ_i Ds_i ⊗ e_i e_iᵀ`` with
    ``T[(a,b),(c,e)] = (Cᵀ Ds_a)_{bc} E_{ae}`` and ``e_i`` the rows of ``E``.
    Up to ``N·r ≤`` :data:`VARIANCE_EXACT_MAX` its ``λ_max`` is certified
    (Cholesky, plus the rounding of the Gram matrix); above it ``ν_h ≤
    (max_a λ_max(CᵀDs_aC)^½ + c^½ ‖E‖)²`` (``Ds_i ≼ c I``, ``c`` the largest
    softmax Jacobian norm), the split ``L = L₁ + L₂`` of its two terms.

    Args:
        X: ``(B, N, D)``; W_q, W_k: ``(H, D, d)``; P: ``(B, H, N, N)``; float64.
    """
    C, E = lemma2_reduced_factors(X, W_q, W_k)  # (B, H, N, r) each
    B, H, N, r = C.shape
    Ds = _softmax_jacobians(P)  # (B, H, N, N, N)
    first = C.mT[:, :, None] @ Ds @ C[:, :, None]  # (B, H, N, r, r): Cᵀ Ds_a C
    if N * r > VARIANCE_EXACT_MAX:
        c = eigvalsh(Ds)[..., -1].amax(-1).clamp_min(0)  # (B, H)
        lam1 = certified_lambda_max_small(first).amax(-1).clamp_min(0)
        lamE = certified_lambda_max_small(E.mT @ E).clamp_min(0)
        return up(lam1.sqrt() + up(c.sqrt() * lamE.sqrt()), 1e-10) ** 2
    eye = torch.eye(N, dtype=X.dtype, device=X.device)
    # (z, h) batch and head; (a, b), (c, e) the Gram matrix's row and column
    G = torch.einsum("ac,zhabe->zhabce", eye, first)  # blockdiag_a(Cᵀ Ds_a C)
    T = torch.einsum("zhjb,zhajc,zhae->zhabce", C, Ds, E)  # (Cᵀ Ds_a)_{bc} E_{ae}
    G = G + T + T.permute(0, 1, 4, 5, 2, 3)
    G = G + torch.einsum("zhiac,zhib,zhie->zhabce", Ds, E, E)  # Σ_i Ds_i ⊗ e_i e_iᵀ
    # Rounding: every entry sums ≤ N² + 4 products, |Ds| ≤ 2 by rows and
    # ‖L‖_F² = N(‖C‖_F² + ‖E‖_F²), so the Gram matrix is off by at most
    fro2 = C.square().sum((-2, -1)) + E.square().sum((-2, -1))  # (B, H)
    err = gamma(N * N + 4) * 2 * N * fro2
    G = G.reshape(B, H, N * r, N * r)
    lam = certified_lambda_max_small(G)  # +inf for G = 0 (N = 1): its λ_max is 0
    return torch.where(G.abs().amax((-2, -1)) == 0, 0.0, lam) + up(err)


ROW_JOINT_MAX = 256
"""Largest ``H·N`` at which :func:`logit_row_variance_gains` forms the rows'
``H N × H N`` matrices over all heads together (above it, each head's alone)."""


def logit_row_variance_gains(X: Tensor, W_q: Tensor, W_k: Tensor, P: Tensor
                             ) -> tuple[Tensor, Tensor]:
    """``ν̂_h ≥ max_r max_{‖Γ‖_F ≤ 1} Var_{p_{h,r}}(M_h(X)[Γ]_r)`` ``(B, H)`` and
    ``ν̂ ≥ max_r max_{‖Γ‖_F ≤ 1} Σ_h Var_{p_{h,r}}(M_h(X)[Γ]_r)`` ``(B,)``, §7.

    Row ``r``'s logit change in head ``h``, ``u_k = Γ_r·c_k + e_r·Γ_k``
    (``c_k``, ``e_k`` the rows of ``C_h = X A_hᵀ``, ``E_h = X A_h``), has over
    ``‖Γ‖_F ≤ 1`` the Gram matrix (heads ``h``, ``g``; keys ``k``, ``l``)
    ``c^h_k·c^g_l + δ_{rl} c^h_k·e^g_r + δ_{kr} e^h_r·c^g_l + δ_{kl} e^h_r·e^g_r``,
    and ``Var_p(u) = ‖F u‖²`` with ``F = (I − qqᵀ) diag(q)``, ``q = √p``
    (``Ds(p) = FᵀF``: ``I − qqᵀ`` is a projection). So ``ν̂`` is the largest
    eigenvalue over rows of ``F_r G_r F_rᵀ`` (``H N × H N``, ``F_r`` block
    diagonal over heads) and ``ν̂_h`` that of its diagonal blocks
    (``eigvalsh``, with a relative ``10⁻¹⁰`` for rounding, as
    :func:`softmax_row_gains`); ``(B, N, H·N, H·N)`` at once up to ``H·N ≤``
    :data:`ROW_JOINT_MAX`, above it ``(B, H, N, N, N)`` and ``ν̂ ≤ Σ_h ν̂_h``.

    Args:
        X: ``(B, N, D)``; W_q, W_k: ``(H, D, d)``; P: ``(B, H, N, N)``; float64.
    """
    C, E = lemma2_factors(X, query_key(W_q, W_k))  # (B, H, N, D) each
    B, H, N, _ = C.shape
    q = P.sqrt()  # (B, H, N, N): row r is q_r
    F = torch.diag_embed(q) - q[..., :, None] * P[..., None, :]  # (B, H, r, N, N)
    FC = F @ C[:, :, None]  # (B, H, r, N, D): F_{h,r} C_h
    i = torch.arange(N, device=P.device)
    Fd = F[..., i, :, i].movedim(0, 2)  # (B, H, r, N): F_{h,r} δ_r
    if H * N > ROW_JOINT_MAX:  # each head alone; all heads: max_r Σ_h ≤ Σ_h max_r
        a = (F @ torch.einsum("bhkD,bhrD->bhrk", C, E)[..., None])[..., 0]  # F C e_r
        S = (FC @ FC.mT + a[..., :, None] * Fd[..., None, :]
             + Fd[..., :, None] * a[..., None, :]
             + E.square().sum(-1)[..., None, None] * (F @ F.mT))  # (B, H, r, N, N)
        lam_h = eigvalsh(S)[..., -1].clamp_min(0).amax(-1) * (1 + 1e-10)
        return lam_h, lam_h.sum(-1)
    CE = torch.einsum("bhkD,bgrD->bhgrk", C, E)  # c^h_k·e^g_r
    a = torch.einsum("bhrkl,bhgrl->bhgrk", F, CE)  # F_{h,r} C_h e^g_r
    S2 = torch.einsum("bhgrk,bgrl->brhkgl", a, Fd)
    EE = torch.einsum("bhrD,bgrD->brhg", E, E)  # e^h_r·e^g_r
    S = (torch.einsum("bhrkD,bgrlD->brhkgl", FC, FC) + S2 + S2.permute(0, 1, 4, 5, 2, 3)
         + EE[:, :, :, None, :, None] * torch.einsum("bhrkm,bgrlm->brhkgl", F, F))
    heads = S.diagonal(dim1=2, dim2=4).permute(0, 1, 4, 2, 3)  # (B, r, H, N, N)
    lam_h = eigvalsh(heads)[..., -1].clamp_min(0).amax(1)  # (B, H)
    lam = eigvalsh(S.reshape(B, N, H * N, H * N))[..., -1]
    return lam_h * (1 + 1e-10), lam.clamp_min(0).amax(-1) * (1 + 1e-10)


def logit_variance_gain_all(X: Tensor, W_q: Tensor, W_k: Tensor, P: Tensor
                            ) -> Tensor | None:
    """``ν ≥ max_{‖Γ‖_F ≤ 1} Σ_h Σ_r Var_{p_{h,r}}(M_h(X)[Γ]_r)`` ``(B,)``, §7:
    ``λ_max(Σ_h M_hᵀ Ds_h M_h)`` from the dense ``(N·D)²`` matrix, certified as
    in :func:`logit_variance_gain`, where ``N·D ≤`` :data:`VARIANCE_EXACT_MAX`;
    ``None`` above (then ``Σ_h ν_h`` bounds it)."""
    B, N, D = X.shape
    if N * D > VARIANCE_EXACT_MAX:
        return None
    H = W_q.shape[0]
    M = lemma2_matrix(X, query_key(W_q, W_k)).reshape(B, H, N, N, N * D)  # row r
    Ds = _softmax_jacobians(P)  # (B, H, r, N, N)
    G = torch.einsum("bhrkx,bhrky->bxy", M, Ds @ M)  # Σ_h M_hᵀ Ds_h M_h
    # Rounding: ≤ H N² + 2 products per entry, |Ds| ≤ 2 by rows
    err = gamma(H * N * N + 2) * 2 * M.square().sum((1, 2, 3, 4))
    lam = certified_lambda_max_small(G)  # +inf for G = 0: its λ_max is 0
    return torch.where(G.abs().amax((-2, -1)) == 0, 0.0, lam) + up(err)


def attention_row_norms(terms: LoFASTTerms) -> Tensor:
    """Upper bounds on ``‖(J_a Γ)_t‖/‖Γ‖_F`` per output token ``t``, ``(B, N)``,
    docs/taylor.md §8: the value path's row ``Σ_h P_h[t,:] Γ W_vo[h]`` is at
    most ``Σ_h ‖P_h[t,:]‖₂ ‖W_vo[h]‖ ‖Γ‖_F`` (Cauchy–Schwarz over tokens), the
    softmax path's at most its whole-matrix bound (as in
    :func:`attention_jacobian_norm`) and, with ``terms.row_gain``, at most
    ``R_t ‖M‖/√d``. A near-uniform attention gives about ``1/√N`` of the whole
    norm."""
    P = torch.softmax(terms.logits, dim=-1)  # (B, H, N, N)
    value = (torch.linalg.vector_norm(P, dim=-1) * terms.vo_norm[:, None]).sum(1)
    soft = softmax_path(terms)[:, None]
    rows = _softmax_rows(terms)
    return value + (soft if rows is None else torch.minimum(soft, rows))


class LogitVariance(NamedTuple):
    """Variance gains of the image → attention-logit map of one block
    (docs/taylor.md §7, *through the image*): with ``U = J_{S←x}Γ`` the
    logits' first-order change (``(H, N, N)``) and ``Var_r`` the variance of
    row ``r`` of head ``h`` under the clean ``p_{h,r}``, per unit ``‖Γ‖²``:
    ``whole`` ``(…, H)`` ``max Σ_r Var_r``, ``row`` ``(…, H)`` ``max_r max
    Var_r``, and over all heads at once ``whole_all`` ``(…)`` ``max Σ_{h,r}
    Var_{h,r}`` and ``row_all`` ``(…)`` ``max_r max Σ_h Var_{h,r}``. Exact
    (eigvalsh, rounded up); ``+inf`` where not computed."""

    whole: Tensor
    row: Tensor
    whole_all: Tensor
    row_all: Tensor

    def block(self, k: int) -> LogitVariance:
        """Block ``k``'s gains of batched ``(B, K, …)`` fields."""
        return LogitVariance(*(f[:, k] for f in self))

    @staticmethod
    def stack(parts: list[LogitVariance], dim: int = 0) -> LogitVariance:
        """The fields of ``parts`` stacked along a new axis ``dim``."""
        return LogitVariance(*(torch.stack(f, dim) for f in zip(*parts, strict=True)))


class ImagePart(NamedTuple):
    """The attention input's move ``Δ = J_{p←x}Γ + R`` (``‖Γ‖ ≤ eps``,
    ``‖R‖ ≤ rest``, both ``(B,)``), with the image → logit map's variance
    gains ``var`` (:class:`~lipvit.certify.taylor.remainders.LogitVariance`, ``(B, H)``
    and ``(B,)``) and bounds on the quadratic logits from the image → query
    and key maps: ``quad`` ``(B, H)`` ``≥ ‖ΔA_hΔᵀ‖_F`` and ``quad_row``
    ``(B, H)`` with ``‖Δ_tA_hΔᵀ‖ ≤ quad_row ‖Δ_t‖``; ``logit_row`` ``(B, H)``
    the largest image → logit-row map norm (per unit ``ε``; ``+inf`` where
    not computed); docs/taylor.md §7 (*through the image*)."""

    eps: Tensor
    rest: Tensor
    var: LogitVariance
    quad: Tensor
    quad_row: Tensor
    logit_row: Tensor


def image_times(gain: Tensor, eps: Tensor) -> Tensor:
    """``gain ε`` ``(B, H)`` for image gains ``(B, H)`` and ``ε`` ``(B,)``:
    ``+inf`` where ``gain`` is (not computed), even at ``ε = 0``."""
    return torch.where(gain.isinf(), math.inf, gain * eps[:, None])


def _fourth_root(gain: Tensor, eps: Tensor) -> Tensor:
    """``gain^¼ ε``, ``+inf`` where ``gain`` is (not computed), even at ``ε = 0``."""
    return torch.where(gain.isinf(), math.inf, gain.sqrt().sqrt() * eps)


class SoftmaxConstants(NamedTuple):
    """Per-head constants of the attention remainder at budget ``β``
    (docs/taylor.md §7), each ``(B, H)``: ``rho`` ``≥ ‖ΔS_h‖_F``; the softmax
    Jacobian's norm ``c0`` at the clean logits and ``c_loc`` on the reachable
    ones; ``quad`` what ``Ds[·]`` of the quadratic logits meets ``ΠXM_h``
    through; ``mu`` the same for the curvature; ``e_s = e^{√2ρ}``; the
    logit variance gains ``total`` (all rows) and ``row`` (the largest row) per
    unit ``‖Γ‖²``; ``qq`` ``≥ ‖ΓA_hΓᵀ‖_F`` (``‖A_h‖β²``, or through the
    image) and ``quad_b = c^½ qq``."""

    rho: Tensor
    c0: Tensor
    c_loc: Tensor
    quad: Tensor
    mu: Tensor
    e_s: Tensor
    total: Tensor
    row: Tensor
    qq: Tensor
    quad_b: Tensor


def softmax_constants(terms: LoFASTTerms, beta: Tensor,
                       logit_radius: Tensor | None, image: ImagePart | None
                       ) -> SoftmaxConstants:
    """:class:`SoftmaxConstants` of ``terms`` at budget ``beta`` ``(B,)``."""
    b = beta[:, None]  # (B, 1)
    qq = terms.qk_norm * b**2  # ≥ ‖ΓA_hΓᵀ‖_F
    if image is not None:
        qq = torch.minimum(qq, image.quad)
    rho = (b * terms.m_norm + qq) / math.sqrt(terms.head_dim)
    if logit_radius is not None:
        rho = torch.minimum(rho, logit_radius)
    c0 = softmax_local_constant(terms.logits, torch.zeros_like(rho))
    total = c0 * terms.m_norm**2  # ≥ Σ_r Var_p(u_r) per unit ‖Γ‖²: Var ≤ c ‖u‖²
    if terms.var_gain is not None:
        total = torch.minimum(total, terms.var_gain)
    row = total if terms.var_row is None else torch.minimum(total, terms.var_row)
    return SoftmaxConstants(
        rho, c0, softmax_local_constant(terms.logits, rho),
        torch.minimum(c0 * terms.xm_centred, c0.sqrt() * terms.xm_rows),
        torch.minimum(terms.xm_centred, terms.xm_rows),
        torch.exp(math.sqrt(2) * rho), total, row, qq, c0.sqrt() * qq,
    )


def linear_std(k: SoftmaxConstants, beta: Tensor, head_dim: int,
               image: ImagePart | None) -> Tensor:
    """``(B, H)`` bound on ``‖(Var_{p_r}(a_r)^½)_r‖_4`` for the linear part
    ``a = M_h(X)[Γ]/√d`` of the logit change: ``(ν̂ ν)^¼ β/√d``, or through
    the image ``(ν̂_x ν_x)^¼ ε + (ν̂ ν)^¼ rest/√d`` (docs/taylor.md §7)."""
    gain = (k.row * k.total).sqrt().sqrt() / math.sqrt(head_dim)
    std = gain * beta[:, None]
    if image is not None:
        std = torch.minimum(std, _fourth_root(image.var.row * image.var.whole,
                                              image.eps[:, None])
                            + gain * image.rest[:, None])
    return std


def row_gains(terms: LoFASTTerms, k: SoftmaxConstants, beta: Tensor,
              image: ImagePart | None) -> tuple[Tensor, Tensor]:
    """The largest row's gains ``(B, H)`` (docs/taylor.md §7, *by rows*):
    ``≥ max_r Var_{p_r}(a_r)^½`` of the linear logit part, ``ν̂^½ β/√d`` or
    through the image ``ν̂_x^½ ε + ν̂^½ rest/√d``; and ``g`` with ``‖Γ_tA_hΓᵀ‖
    ≤ g ‖Γ_t‖``, ``‖A_h‖β`` or through the image's query and key maps."""
    sqrt_d = math.sqrt(terms.head_dim)
    lin = k.row.sqrt() * beta[:, None] / sqrt_d
    quad = terms.qk_norm * beta[:, None]
    if image is not None:
        lin = torch.minimum(lin, image_times(image.var.row.sqrt(), image.eps)
                            + k.row.sqrt() * image.rest[:, None] / sqrt_d)
        quad = torch.minimum(quad, image.quad_row)
    return lin, quad


def _joint_row_gain(terms: LoFASTTerms, k: SoftmaxConstants) -> tuple[Tensor, Tensor]:
    """``(Σ_{h,r} Var, max_r Σ_h Var)`` gains of all heads at once ``(B,)``."""
    all_ = k.total.sum(-1) if terms.var_all is None else terms.var_all
    return all_, torch.minimum(terms.var_row_all, all_)


def attention_remainder(
    terms: LoFASTTerms, beta: Tensor, logit_radius: Tensor | None = None,
    image: ImagePart | None = None,
) -> Tensor:
    """Bound on ``‖a(X+Γ) − a(X) − J_a Γ‖_F`` for ``‖Γ‖_F ≤ β``, docs/taylor.md §7.

    With ``ΔS_h = (Γ A_h Xᵀ + X A_h Γᵀ + Γ A_h Γᵀ)/√d`` (``‖ΔS_h‖_F ≤ ρ_h =
    (‖M_h(X)‖ β + ‖A_h‖ β²)/√d``, LoFAST eq. 24-25):

        r = Σ_h (Ds[Γ A_h Γᵀ/√d] + r_s(ΔS_h)) Π X M_h + Σ_h (P_h' − P_h) Γ M_h

    and ``‖r‖ ≤ Σ_h (c_h‖A_h‖β²/√d + c'_h ρ_h²) ‖Π X M_h‖
    + min(c'_h ρ_h, √(2N)) ‖M_h‖ β`` with ``c_h`` the softmax Jacobian norm at
    ``S_h`` and ``c'_h`` its local constant on the reachable logits
    (:func:`lipvit.certify.lofast.layer.softmax_local_constant`), which also bounds
    the softmax's curvature: ``D²s(z)[u,u] = p ⊙ ((u − ū)² − Var_p(u))`` has ℓ1
    norm ``≤ 2 Var_p(u) = 2 uᵀDs(p)u ≤ 2 ‖Ds(p)‖ ‖u‖²``, so integrating
    ``(1 − t)`` along the segment gives ``‖r_s(u)‖₁ ≤ c' ‖u‖²``. Every row of
    ``Ds[·]`` and ``r_s`` sums to zero, so each meets ``Π X M_h`` through
    ℓ1 × its largest row (``terms.xm_rows``) where that is smaller than the
    spectral norm: ``‖Ds(p)w‖₁ ≤ Var_p(w)^½ ≤ c^½ ‖w‖``. ``(B,)``; ``terms``
    of the bare attention at its clean input (any ``H``: the residual has no
    remainder).
    ``logit_radius`` ``(B, H)``: an optional tighter bound on ``‖ΔS_h‖_F``
    (e.g. from the exact Jacobian image → logits, docs/taylor.md §7); the
    smaller of it and ``ρ_h`` is used.
    ``image``: the input's first-order part through the image; the logits'
    variances of that part then use its exact gains (the smaller bound is used).
    """
    N = terms.logits.shape[-1]
    b = beta[:, None]  # (B, 1)
    sqrt_d = math.sqrt(terms.head_dim)
    k = softmax_constants(terms, beta, logit_radius, image)
    # ‖(‖r_s(u_r)‖₁)_r‖₂ ≤ c′ρ², or e^{√2ρ} ‖(Var_p(u_r))_r‖₂ through the
    # logit variance gains (ν̂ ν)^¼ of the linear part (docs/taylor.md §7)
    std = linear_std(k, beta, terms.head_dim, image) + k.quad_b / sqrt_d
    spread = (k.total.sqrt() * b + k.quad_b) / sqrt_d  # ≥ (Σ_r Var_p(u_r))^½
    if image is not None:  # u = J_{S←x}Γ (exact gains) + M[R]/√d + quadratic
        spread = torch.minimum(spread, image_times(image.var.whole.sqrt(), image.eps)
                               + (k.total.sqrt() * image.rest[:, None] + k.quad_b)
                               / sqrt_d)
    curv = k.mu * torch.minimum(k.c_loc * k.rho**2, k.e_s * std**2)  # (B, H)
    first = (k.quad * k.qq / sqrt_d).sum(-1)
    # ‖P′_h − P_h‖_F: c′ρ, or (c′ e^s Σ_r Var_p(u_r))^½ (‖Ds(q)u‖² ≤ ‖Ds(q)‖ Var_q(u))
    cross = torch.minimum(k.c_loc * k.rho, (k.c_loc * k.e_s).sqrt() * spread)
    cross = cross.clamp_max(math.sqrt(2 * N))
    out = first + (cross * terms.vo_norm * b).sum(-1)
    if terms.var_row_all is None:
        return out + curv.sum(-1)
    # All heads at once: row r's curvature is at most max_h(e^{s_h} μ_h) Σ_h Var_{h,r}
    all_, row_all = _joint_row_gain(terms, k)
    quad_all = torch.linalg.vector_norm(k.quad_b, dim=-1)
    std_all = ((row_all * all_).sqrt().sqrt() * beta + quad_all) / sqrt_d
    if image is not None:
        std_all = torch.minimum(
            std_all, _fourth_root(image.var.row_all * image.var.whole_all, image.eps)
            + ((row_all * all_).sqrt().sqrt() * image.rest + quad_all) / sqrt_d)
    joint = (k.e_s * k.mu).amax(-1) * std_all**2
    return out + torch.minimum(curv.sum(-1), joint)


def attention_row_remainders(
    terms: LoFASTTerms, beta: Tensor, beta_tok: Tensor,
    logit_radius: Tensor | None = None, image: ImagePart | None = None,
    whole: Tensor | None = None,
) -> Tensor:
    """Bound on each output token's ``‖(a(X+Γ) − a(X) − J_a Γ)_t‖`` ``(B, N)``
    for ``‖Γ‖_F ≤ β`` with ``‖Γ_t‖ ≤ β_t`` (``beta_tok`` ``(B, N)``),
    docs/taylor.md §7 (*by rows*).

    Row ``t`` of the remainder is ``Σ_h (Ds(p_{h,t})[q] + r_s(u))ᵀ ΠXM_h +
    (p′_{h,t} − p_{h,t})ᵀ Γ M_h`` with ``u`` row ``t`` of ``ΔS_h`` and ``q =
    Γ_t A_h Γᵀ/√d`` its quadratic part, ``‖q‖ ≤ β_t ‖A_h‖ β/√d``; the
    linear part's variance is at most the largest row's gain ``ν̂_h β²/d``
    (or through the image), so ``Var_p(u)^½ ≤ (ν̂_h^½ β + c_h^½‖A_h‖β_t β)/√d``
    and ``‖r_s(u)‖₁ ≤ e^{√2ρ_h} Var_p(u)``; ``‖p′ − p‖ ≤ min(c′ρ_h,
    (c′e^{√2ρ_h} Var_p(u))^½, √2)`` and ``‖ΓM_h‖ ≤ β ‖M_h‖``. Also all heads'
    curvature at once (``max_h(e^{s_h} μ_h) Σ_h Var_{h,t}``). Never above
    :func:`attention_remainder`'s whole bound (each row is part of it;
    ``whole``: that bound, if the caller has it)."""
    if whole is None:
        whole = attention_remainder(terms, beta, logit_radius, image)
    b, bt = beta[:, None, None], beta_tok[:, None]  # (B, 1, 1), (B, 1, N)
    sqrt_d = math.sqrt(terms.head_dim)
    k = softmax_constants(terms, beta, logit_radius, image)
    h = lambda t: t[..., None]  # noqa: E731  (B, H) → (B, H, 1) against tokens
    lin, quad = (h(t) for t in row_gains(terms, k, beta, image))
    q_t = quad * bt / sqrt_d  # (B, H, N): ≥ ‖q‖
    std = lin + h(k.c0).sqrt() * q_t  # (B, H, N) ≥ Var_p(u)^½
    still = std == 0  # no logit moves: no curvature, p′ = p (even where e^s = ∞)
    curv = torch.where(still, 0.0, h(k.mu) * torch.minimum(
        h(k.c_loc * k.rho**2), h(k.e_s) * std**2))  # ‖r_s(u)‖₁ ≤ c′‖u‖² too
    first = h(k.quad) * q_t
    cross = torch.where(still, 0.0, h(k.c_loc * k.e_s).sqrt() * std)
    cross = torch.minimum(h(k.c_loc * k.rho), cross)
    cross = cross.clamp_max(math.sqrt(2))
    out = (first + cross * h(terms.vo_norm) * b).sum(1)  # (B, N)
    curv = curv.sum(1)
    if terms.var_row_all is not None:
        _, row_all = _joint_row_gain(terms, k)
        lin_all = row_all.sqrt()[:, None] * beta[:, None] / sqrt_d  # (B, 1)
        if image is not None:
            lin_all = torch.minimum(
                lin_all, image_times(image.var.row_all[:, None].sqrt(), image.eps)
                + row_all.sqrt()[:, None] * image.rest[:, None] / sqrt_d)
        quad_all = torch.linalg.vector_norm(h(k.c0).sqrt() * q_t, dim=1)  # (B, N)
        joint = (k.e_s * k.mu).amax(-1)[:, None] * (lin_all + quad_all) ** 2
        curv = torch.minimum(curv, joint)
    return torch.minimum(out + curv, whole[:, None])
