"""How far the margin's gradient can turn over the ball, one bound per kind of
nonlinear map (docs/math.md §11, ours).

Pure functions of tensors. Each bounds, for a map ``φ`` with Jacobian ``J`` at
the clean input ``z`` and a fixed row vector ``g`` (the exact gradient of one
margin with respect to the map's output at the clean point, per class), the
remainder ``|gᵀ(φ(z′) − φ(z) − J(z)(z′ − z))|`` over the ball ``‖z′ − z‖ ≤
δ``: in closed form for MaxMin (eq. 11.3), and for attention through

    |gᵀ r| ≤ δ sup_{ξ} ‖gᵀ (J(ξ) − J(z))‖                                 (11.2)

(the fundamental theorem along the segment; the maps are Lipschitz). All are
**upper bounds**; tests/test_margin_weakened.py checks them against dense
Jacobians at points of the ball and gradient ascent, in float64, and each
against weakened copies of itself.

============  ==================  ==============================================
symbol        variable            meaning
============  ==================  ==============================================
``δ``         ``delta``           radius of the map's input ball, ``(B,)``
``g``         ``g``               the margins' gradients, ``(K, B, ...)``
``η``         ``eta``             ``≥ |P′ − P|`` entrywise on the ball
``w_h``       ``w``               ``W_v[h] u_h``: class attention's values read
                                  along the margin's gradient ``u``
============  ==================  ==============================================

Shapes: ``K`` margins (classes), ``B`` batch, ``N`` tokens, ``D`` width, ``H``
heads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lipvit.layers import layer_project
from lipvit.spectral import spectral_norm

from ..ball.attention import class_envelope

# Relative float error allowed in a computed gap |a − b| (rounded towards a
# flip, so that no pair that can flip is missed).
GAP_SLACK = 1e-12


def _unit(x: Tensor, used: Tensor) -> Tensor:
    """``x`` where ``used``, 1 elsewhere: a divisor whose quotient is
    discarded where it is not used stays finite there, and so do the
    gradients (training differentiates the bounds,
    :mod:`lipvit.training.margin_loss`)."""
    return torch.where(used, x, torch.ones_like(x))


def _root(x: Tensor) -> Tensor:
    """``√x`` of ``x ≥ 0``, raised to at least ``√tiny`` of its dtype: the
    same value to within that, and a gradient that is finite at 0."""
    return x.clamp_min(torch.finfo(x.dtype).tiny).sqrt()


def pair_remainder(c: Tensor, d: Tensor, delta: Tensor) -> Tensor:
    """Eq. (11.3)'s dual bound: ``max Σ_p |c_p| (√2 t_p − |d_p|)_+`` over
    ``Σ_p t_p² ≤ δ²`` is at most, for every ``λ > 0``,

        F(λ) = λ δ² + Σ_p (c_p² / (2λ) − |c_p| |d_p|)_+

    (weak duality; the inner maximum over ``t_p`` is in closed form). ``F`` is
    convex and, between two consecutive breakpoints ``λ_p = |c_p| / (2|d_p|)``,
    of the form ``λ δ² + S₂/(2λ) − S₁``: its minimum over each piece (the
    stationary point clamped into it) is evaluated and the least taken, each
    value a valid bound. ``c`` ``(K, B, P)``, ``d`` ``(B, P)``, ``delta``
    ``(B,)``; returns ``(K, B)``."""
    c, d = c.abs(), d.abs().expand_as(c)
    lam_p = torch.where(d > 0, c / (2 * _unit(d, d > 0)), torch.inf)
    lam_p = torch.where(c > 0, lam_p, 0.0)  # c = 0: never active
    lam_p, order = lam_p.sort(dim=-1, descending=True)
    c, d = c.gather(-1, order), d.gather(-1, order)
    S2 = torch.nn.functional.pad((c**2).cumsum(dim=-1), (1, 0))  # first i active
    S1 = torch.nn.functional.pad((c * d).cumsum(dim=-1), (1, 0))
    hi = torch.nn.functional.pad(lam_p, (1, 0), value=torch.inf)  # λ_(i)
    lo = torch.nn.functional.pad(lam_p, (0, 1), value=0.0)  # λ_(i+1)
    d2 = (delta**2)[:, None]  # (B, 1)
    lam = _root(S2 / (2 * _unit(d2, d2 > 0))).clamp(min=lo, max=hi)
    used = lam > 0  # a piece with λ_(i) = 0 holds no λ > 0
    lam = _unit(lam, used)
    F = lam * d2 + S2 / (2 * lam) - S1
    F = F + 1e-12 * (lam * d2 + S2 / (2 * lam) + S1)  # the subtraction's rounding
    best = torch.where(used, F, torch.inf).amin(dim=-1)
    return torch.where(delta > 0, best, torch.zeros_like(best)).clamp_min(0.0)


def maxmin_remainder(z: Tensor, g: Tensor, delta: Tensor, dim: int) -> Tensor:
    """Eq. (11.3): a bound on ``−gᵀ r`` (what the remainder can take off the
    margin), ``r = MaxMin(z′) − MaxMin(z) − J (z′ − z)`` the remainder of
    MaxMin along ``dim`` at pre-activations ``z`` ``(B, ...)`` (``dim``
    negative) for ``z′`` on the ball of radius ``delta`` ``(B,)``, ``g``
    ``(K, B, ...)`` the margins' gradients at MaxMin's *input* (``J`` torch's:
    the swap at a tie); returns ``(K, B)``.

    A pair ``(a, b)`` read as ``g₁ max + g₂ min = (g₁ + g₂)(a + b)/2 + (g₁ −
    g₂) |a − b|/2`` (``g₁``, ``g₂`` at the outputs) leaves the remainder
    ``(g₁ − g₂)/2 · (|d′| − |d| − s (d′ − d))``, ``d = a − b``, ``s`` the
    slope ``J`` takes, a subgradient of ``|·|`` at ``d``: the bracket is never
    negative, and positive only where ``d`` changes sign, at most ``2(|Δd| −
    |d|)``. So only the pairs with ``g₁ < g₂`` can lower the margin (eq.
    11.3a), each by at most ``|g₁ − g₂| (|Δd| − |d|)_+``, with ``|Δd| ≤ √2
    t_p``, ``t_p`` the pair's move and ``Σ_p t_p² ≤ δ²`` (the pairs are
    disjoint coordinates): :func:`pair_remainder`."""
    return pair_remainder(*_pairs(z, g, dim), delta)


def pair_radius(delta: Tensor, delta_in: Tensor, V_norm: Tensor) -> Tensor:
    """Eq. (11.3b): the radius (11.3) may take for the pairs of a MaxMin that
    reads a linear map ``z = W t + b`` of an input moving by at most
    ``delta_in``: the pair differences move as ``Δd = V Δt``, ``V = W_a −
    W_b``, so ``Σ_p Δd_p² ≤ ‖V‖² δ_in²``, i.e. ``Σ_p t_p² ≤ (‖V‖ δ_in/√2)²``
    with ``|Δd_p| = √2 t_p``; and ``Σ_p t_p² ≤ δ²`` with ``delta`` the
    pre-activations' radius. The smaller of the two, ``(B,)``."""
    return torch.minimum(delta, V_norm * delta_in / 2**0.5)


CHORD_REACHES = (0.3, 0.1)
"""The shares ``θ`` of each stem pair's own reach on which
:func:`chord_slopes` draws its chords, each tried (any slope is sound; on
the content-2 CaiT at ε = 0.5, 0.3 certified most of 0.1, 0.2, 0.3, 0.5
and 1 on its first 50 test points, and 0.1 one point more than 0.3 on
``lipvit certify``'s seeded 300; docs/math.md eq. 11.13)."""

CHORD_MULTIPLIERS = 25
"""Multipliers ``λ`` tried in :func:`chord_remainder`'s dual, ``λ₀ 2^{k/2}``,
``|k| ≤ 12``."""


def chord_slopes(d: Tensor, reach: Tensor) -> Tensor:
    """Eq. (11.13): the slope of the chord of ``ReLU`` over ``[d − ρ, d + ρ]``
    per MaxMin pair, ``d`` its difference ``a − b`` and ``ρ`` (``reach``,
    broadcast to ``d``) how far it is taken to move: 1 where the interval
    stays above 0, 0 where below, ``(d + ρ)/(2ρ)`` where it straddles the kink
    (DeepZ's slope). A choice, not a bound: any slope is sound."""
    lo, hi = d - reach, d + reach
    straddle = (lo < 0) & (hi > 0)
    slope = hi / _unit(hi - lo, straddle)
    return torch.where(straddle, slope, (lo >= 0).to(d.dtype))


def chord_remainder(kappa: Tensor, d: Tensor, s: Tensor, R: Tensor) -> Tensor:
    """Eq. (11.13): a bound on ``−Σ_p κ_p ρ_p(t_p)`` over ``Σ_p t_p² ≤ R²``,
    where ``ρ_p(t) = ReLU(d_p + t) − ReLU(d_p) − s_p t`` is what a MaxMin
    pair linearised with slope ``s_p`` leaves when its difference ``d_p``
    moves by ``t``, and ``κ_p = g₁ − g₂`` the gradients at its outputs: for
    every ``λ > 0``

        max Σ_p −κ_p ρ_p(t_p) ≤ λ R² + Σ_p max_{|t| ≤ R} (−κ_p ρ_p(t) − λ t²)

    (weak duality; every ``|t_p| ≤ R`` on the ball). ``ρ_p`` is linear on each
    side of ``t = −d_p`` (slopes ``1 − s_p`` and ``−s_p``), so each inner
    maximum is a concave quadratic's on two intervals, at its stationary
    point clamped into each (an empty one skipped); two-sided
    (``s_p`` strictly between 0 and 1 leaves a remainder either way). The
    least over :data:`CHORD_MULTIPLIERS` values of ``λ``. ``kappa, d, s``
    ``(K, B, P)``, ``R`` ``(B,)``; returns ``(K, B)``."""
    R2, Rp = R**2, R[:, None]  # (B,), (B, 1)
    kink = s * d - d.clamp_min(0.0)  # ρ_p(−d_p)
    lam0 = _root((kappa**2).sum(dim=-1) / (4 * _unit(R2, R2 > 0)))  # (K, B)
    best = torch.full_like(lam0, torch.inf)
    for k in range(-(CHORD_MULTIPLIERS // 2), CHORD_MULTIPLIERS // 2 + 1):
        lam = (lam0 * 2 ** (k / 2))[..., None]  # (K, B, 1)
        inner = torch.zeros_like(kappa)
        for slope, above in ((1 - s, True), (-s, False)):  # t ≥ −d_p, t ≤ −d_p
            lo = torch.maximum(-d, -Rp) if above else -Rp.expand_as(d)
            hi = Rp.expand_as(d) if above else torch.minimum(-d, Rp)
            t = torch.minimum(torch.maximum(-kappa * slope / (2 * lam), lo), hi)
            moved = kink + slope * (t + d)  # ρ_p(t)
            value = -kappa * moved - lam * t**2
            value = value + 1e-12 * (kappa.abs() * (kink.abs() + moved.abs())
                                     + lam * t**2)  # its rounding
            inner = torch.where(lo <= hi, torch.maximum(inner, value), inner)
        best = torch.minimum(best, lam[..., 0] * R2 * (1 + 1e-12) + inner.sum(dim=-1))
    zero = (kappa == 0).all(dim=-1) | (R2 == 0)
    return torch.where(zero, torch.zeros_like(best), best)


def chord_max_min(z: Tensor, s: Tensor) -> Tensor:
    """MaxMin over channels (``dim=1``) of ``z`` ``(B, 2c, ...)``, the same
    values as :func:`lipvit.layers.max_min`, differentiated as if each pair's
    ``ReLU(a − b)`` had slope ``s`` ``(B, c, ...)`` (eq. 11.13)."""
    a, b = z.chunk(2, dim=1)
    d = a - b
    r = torch.relu(d).detach() + s * (d - d.detach())
    return torch.cat([b + r, a - r], dim=1)


def lowered_gap(a: Tensor, b: Tensor) -> Tensor:
    """MaxMin pairs' gaps ``|a − b|`` lowered by their float error (towards a
    flip, so that no pair that can flip is missed), at least 0: a pair whose
    lowered gap is 0 may have either sign."""
    return ((a - b).abs() - GAP_SLACK * (a.abs() + b.abs())).clamp_min(0.0)


def _pairs(z: Tensor, g: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """MaxMin's pairs along ``dim`` (negative): ``c = g_a − g_b`` ``(K, B, P)``
    (gradients at the input), set to 0 for the pairs that cannot lower the
    margin, and the gaps ``|a − b|`` ``(B, P)``, lowered by their float error
    (towards a flip, so that no pair that can flip is missed).

    At the input ``g_a − g_b = (g₁ − g₂) sign(a − b)`` (torch's swap at a
    tie), so ``c (a − b) > 0`` is ``g₁ > g₂``: that pair's remainder only
    raises the margin (eq. 11.3a). Pairs whose lowered gap is 0 keep their
    ``c`` whatever its sign."""
    assert dim < 0, "dim counts from the end (z and g differ in leading axes)"
    a, b = z.chunk(2, dim=dim)
    ga, gb = g.chunk(2, dim=dim)
    gap = lowered_gap(a, b)
    c = ga - gb
    raises = (c * (a - b) > 0) & (gap > 0)
    return torch.where(raises, 0.0, c).flatten(2), gap.flatten(1)


def capped_maxmin_remainder(z: Tensor, g: Tensor, moves: Tensor, dim: int) -> Tensor:
    """Eq. (11.11): MaxMin's bound as in :func:`maxmin_remainder` (on ``−gᵀ r``,
    ``g`` at the input), each pair's difference ``a − b`` known to move by at
    most ``moves`` ``(B, P)`` on the ball: a pair that can lower the margin
    takes off at most ``|g_a − g_b| (b_p − |a − b|)_+``. Returns ``(K, B)``."""
    c, gap = _pairs(z, g, dim)
    over = (moves - gap).clamp_min(0.0)  # (B, P)
    return (c.abs() * over).sum(dim=-1) * (1 + 1e-12)


def coupled_maxmin_remainder(z: Tensor, g: Tensor, gram: Tensor, grad_norm: Tensor,
                             rest: Tensor, delta: Tensor, dim: int) -> Tensor:
    """Eq. (11.12): MaxMin's bound on ``−gᵀ r`` (``g`` at the input, as in
    :func:`maxmin_remainder`) where each pair's difference moves as ``Δd_p =
    ∇_p · ΔX + ρ_p``, ``|ρ_p| ≤ rest_p``, for one move ``‖ΔX‖ ≤ δ`` shared by
    every pair: ``gram`` ``(B, P, P)`` the Gram matrix ``∇_p · ∇_q`` and
    ``grad_norm`` ``(B, P)`` its diagonal's square roots (rounded up),
    ``rest`` ``(B, P)``, ``delta`` ``(B,)``. Returns ``(K, B)``.

    A pair that can lower the margin takes off at most ``φ_p(∇_p · ΔX)``,
    ``φ_p(s) = |c_p| (|s| − e_p)_+`` with ``e_p = |d_p| − rest_p``, and for
    every ``α_p > 0``, ``φ_p(s) ≤ α_p s² + (c_p²/(4α_p) − |c_p| e_p)_+``
    (``|c||s| ≤ α s² + c²/(4α)``), so the loss is at most

        δ² λ_max(diag(√α) gram diag(√α)) + Σ_p (c_p²/(4α_p) − |c_p| e_p)_+

    (the first sum is the quadratic form ``Σ_p α_p (∇_p · ΔX)²``). Each
    ``λ`` of a grid gives ``α_p = λ/‖∇_p‖²`` (the choice that is optimal when the
    gradients are orthogonal), lowered to ``|c_p|/(4e_p)`` where that costs
    nothing; pairs out of reach (``δ‖∇_p‖ ≤ e_p``) and those that can only
    raise the margin drop out; the least bound is kept (a ``λ`` whose matrix
    leaves the dtype's range is skipped). ``λ_max`` by ``eigvalsh`` in
    float64, raised by ``10⁻¹⁰`` of the trace (its rounding)."""
    c, gap = _pairs(z, g, dim)
    e = gap - rest  # (B, P): the gap left once the remainder has moved the pair
    grad_norm = grad_norm.expand_as(e)
    lose = (c != 0) & (delta[:, None] * grad_norm > e)  # (K, B, P)
    c = torch.where(lose, c.abs(), 0.0)
    moving = grad_norm > 0
    fixed = (c * (-e).clamp_min(0.0)).where(~moving, 0.0).sum(dim=-1)  # ∇_p = 0
    g2 = _unit(grad_norm.square(), moving)
    lam0 = _root((c.square() * g2).sum(dim=-1)) / _unit(
        2 * delta, delta > 0)  # (K, B): the orthogonal case's optimum
    best = torch.full_like(lam0, torch.inf)
    for k in range(-6, 7):
        lam = lam0 * 2 ** (k / 2)
        alpha = lam[..., None] / g2  # (K, B, P)
        alpha = torch.where(e > 0, torch.minimum(alpha, c / (4 * _unit(e, e > 0))),
                            alpha)
        alpha = torch.where(lose & moving, alpha, 0.0)
        on = alpha > 0
        quad = c.square() / (4 * _unit(alpha, on))
        lin = quad - c * e + 1e-12 * (quad + c * e.abs())  # the subtraction's rounding
        lin = torch.where(on, lin.clamp_min(0.0), 0.0).sum(dim=-1)
        root = _root(alpha)
        M = root[..., :, None] * gram[None] * root[..., None, :]  # (K, B, P, P)
        finite = torch.isfinite(M).all(dim=-1).all(dim=-1)  # (K, B): float32's range
        M = torch.where(finite[..., None, None], M, 0.0)
        top = torch.linalg.eigvalsh(M.double())[..., -1].to(M.dtype)
        top = top + 1e-10 * M.diagonal(dim1=-2, dim2=-1).sum(dim=-1)
        bound = delta**2 * top.clamp_min(0.0) + lin
        best = torch.minimum(best, torch.where((lam > 0) & finite, bound, torch.inf))
    none = ~(lose & moving).any(dim=-1)  # no moving pair in reach
    return torch.where(none, 0.0, best) + fixed


def projection_moves(X: Tensor, delta: Tensor, radius: float) -> Tensor:
    """``(B, N)`` bool: the tokens of ``X`` ``(B, N, D)`` whose projection's
    Jacobian may differ anywhere on the ball of radius ``delta`` ``(B,)`` from
    its value at ``X`` (``‖x_j‖ + δ ≥ R``; elsewhere it is the identity on the
    whole ball). Where it may, the two Jacobians differ by at most 1 (both are
    symmetric with eigenvalues in ``[0, 1]``)."""
    return X.norm(dim=-1) + delta[:, None] >= radius * (1 - GAP_SLACK)


def projection_turn(X: Tensor, delta: Tensor, radius: float) -> tuple[Tensor, Tensor]:
    """How far the projection's Jacobian ``J(x) = (R/‖x‖)(I − x xᵀ/‖x‖²)``
    (outside the radius; ``I`` inside) can change on each token's ball,
    eq. (11.6): ``cross`` ``(B, N)`` bool, the tokens that may cross the
    radius (change at most 1), and ``kappa`` ``(B, N)``, for the tokens that
    stay outside, ``‖J(x′) − J(x)‖ ≤ κ_j ‖x′ − x‖`` with ``κ_j = (R/‖x_j‖)
    (1/(‖x_j‖ − δ) + 1/‖x_j‖)`` (0 for the tokens that stay inside)."""
    norm = X.norm(dim=-1)  # (B, N)
    dl = delta[:, None]
    R_lo, R_hi = radius * (1 - GAP_SLACK), radius * (1 + GAP_SLACK)
    cross = (norm + dl >= R_lo) & (norm - dl <= R_hi)
    _, kappa = projection_reach(X, delta, radius)  # κ_j of every token outside
    return cross, torch.where(norm - dl > R_hi, kappa, torch.zeros_like(kappa))


def self_attention_variation(P0: Tensor, P_bar: Tensor, P_low: Tensor,
                             soft: Tensor, soft0: Tensor, moves: Tensor,
                             value: Tensor, out: Tensor) -> Tensor:
    """Eq. (11.4): ``‖J_Attn(X′) − J_Attn(X)‖`` on the ball for self-attention
    (``g`` enters by its norm). The value path changes by the attention's
    change ``η ≥ |P′ − P|`` and by the projection's Jacobian on the tokens
    that may cross the radius (``moves``), the softmax path is bounded at
    ``X′`` and at ``X`` (``soft``, ``soft0``: eq. 10.2's term on the ball and
    at the point)::

        ‖W_o‖ ‖W_v‖ max_h (‖η_h‖ + ‖P_h[:, T]‖) + S(δ) + S(0)

    ``P0, P_bar, P_low`` ``(B, H, N, N)`` (:func:`lipvit.certify.ball.attention.
    self_ball`), ``soft, soft0`` ``(B,)``, ``moves`` ``(B, N)``, ``value =
    ‖W_v‖``, ``out = ‖W_o‖``; returns ``(B,)``."""
    eta = torch.maximum(P_bar - P0, P0 - P_low)  # (B, H, N, N)
    P_T = P0 * moves[:, None, None, :].to(P0.dtype)  # the columns of T
    paths = (spectral_norm(eta) + spectral_norm(P_T)) * (1 + 1e-12)  # (B, H)
    return out * value * paths.amax(dim=-1) + soft + soft0


def _read_along(X: Tensor, u: Tensor, W_v: Tensor, P0: Tensor, radius: float
                ) -> tuple[Tensor, Tensor, Tensor]:
    """Class attention read along ``u`` ``(K, B, H·d_v)``: ``w_h = W_v[h] u_h``
    ``(K, B, H, D)``, the values ``f_hj = w_h · x̂_j`` ``(K, B, H, N)`` of the
    projected tokens of ``X`` ``(B, N, D)`` and their pooled ``φ_h = Σ_j
    P_h[j] f_hj`` ``(K, B, H, 1)``."""
    K, B = u.shape[:2]
    H, _, d_v = W_v.shape
    x_hat = layer_project(X, radius)  # (B, N, D)
    w = torch.einsum("kbhv,hDv->kbhD", u.reshape(K, B, H, d_v), W_v)
    f = torch.einsum("bnD,kbhD->kbhn", x_hat, w)
    return w, f, (P0 * f).sum(dim=-1, keepdim=True)


def _token_gradient(P0: Tensor, w: Tensor, f: Tensor, phi: Tensor, a: Tensor
                    ) -> Tensor:
    """``G_j = ∂(uᵀc)/∂x̂_j = Σ_h P_h[j] (w_h + (f_hj − φ_h) a_h)`` ``(K, B, N,
    D)`` at the clean point (:func:`_read_along`'s ``w, f, φ``)."""
    return torch.einsum("bhn,kbhD->kbnD", P0, w) + torch.einsum(
        "bhn,kbhn,hD->kbnD", P0, f - phi, a)


def class_attention_variation(X: Tensor, delta: Tensor, u: Tensor, a: Tensor,
                              W_v: Tensor, P0: Tensor, P_bar: Tensor,
                              P_low: Tensor, radius: float) -> Tensor:
    """Eq. (11.5): (11.2) for class attention ``c(X) = [(Σ_j P_h[j] x̂_j)
    W_v[h]]_h``, ``P_h = softmax(B_h + X̂ a_h)``, along ``u`` ``(K, B, H·d_v)``
    (the margins' gradients at ``c``). With ``w_h = W_v[h] u_h``, ``f_hj = w_h ·
    x̂_j`` and ``φ_h = Σ_j P_h[j] f_hj``, ``uᵀc = Σ_h φ_h`` and its gradient in
    ``x̂_j`` is ``G_j = Σ_h P_h[j] (w_h + (f_hj − φ_h) a_h)``. On the ball each
    projected token moves by ``γ_j``, ``Σ_j γ_j² ≤ δ²``, and

        G′_j − G_j = Σ_h (ΔP_hj w_h + ΔQ_hj a_h),   Q_hj = P_h[j] (f_hj − φ_h),

    each term bounded by a part proportional to ``γ_j`` and a part shared by
    the tokens; the ℓ2 norm over tokens of ``Σ_h (α_hj γ_j + β_hj)`` is at most
    ``δ max_j Σ_h α_hj + ‖Σ_h β_hj‖_j``. The attention's change (eq. 11.5a):
    ``|ΔP_hj| ≤ η̄_hj = max(P̄_hj − P_hj, P_hj − P̲_hj)`` (eq. 10.1b, no
    split) and ``≤ ζ_h ψ_h P_h[j] (γ_j + ‖P_h‖₂ δ)`` with ``ψ_h = (e^{‖a_h‖δ}
    − 1)/δ`` (the chord of the exponential) and ``ζ_h = e^{‖a_h‖ ‖P_h‖₂ δ}``
    (Jensen on the softmax's denominator); the
    pooled value's change ``Δφ_h ≤ ‖w_h‖ ‖P̄_h‖₂ δ + Σ_j |ΔP_hj| |f_hj − φ_h|``;
    ``|ΔQ_hj| ≤ |ΔP_hj| (|f_hj − φ_h| + ‖w_h‖ γ_j + Δφ_h) + P_h[j] (‖w_h‖ γ_j +
    Δφ_h)``. Both forms of each sum are computed and the smaller kept. The
    projection adds ``(J′ − J)ᵀ G`` (eq. 11.6, :func:`projection_turn`).

    ``X`` ``(B, N, D)``, ``delta`` ``(B,)``, ``a`` ``(H, D)``, ``W_v`` ``(H, D,
    d_v)``; ``P0, P_bar, P_low`` ``(B, H, N)`` from
    :func:`lipvit.certify.ball.attention.class_ball`; returns ``(K, B)``."""
    w, f, phi = _read_along(X, u, W_v, P0, radius)
    dev = (f - phi).abs()
    w_norm = w.norm(dim=-1)[..., None]  # (K, B, H, 1)
    a_norm = a.norm(dim=-1)[:, None]  # (H, 1)
    dl = delta[:, None, None]  # (B, 1, 1)
    # |ΔP| ≤ η̄ (eq. 10.1b) and ≤ α γ_j + β (eq. 11.5a).
    eta = torch.maximum(P_bar - P0, P0 - P_low)
    P2 = P0.norm(dim=-1, keepdim=True)  # (B, H, 1) ‖P_h‖₂
    ad = a_norm * dl  # (B, H, 1)
    psi = torch.where(dl > 0, torch.expm1(ad) / _unit(dl, dl > 0), a_norm)
    alpha = (ad * P2).exp() * psi * P0  # (B, H, N)
    beta = alpha * P2 * dl

    def tokens(local: Tensor, shared: Tensor) -> Tensor:
        """``δ max_j Σ_h local + ‖Σ_h shared‖_j``: ``(K, B)``."""
        return (delta * local.sum(dim=-2).amax(dim=-1)
                + shared.sum(dim=-2).norm(dim=-1))

    values = torch.minimum((eta * w_norm).sum(dim=-2).norm(dim=-1),
                           tokens(alpha * w_norm, beta * w_norm))
    P_bar2 = torch.minimum(P_bar.norm(dim=-1, keepdim=True),
                           _root(P_bar.amax(dim=-1, keepdim=True))).clamp(max=1.0)
    d_phi = w_norm * dl * P_bar2 + torch.minimum(
        (eta * dev).sum(dim=-1, keepdim=True),
        dl * (alpha * dev).norm(dim=-1, keepdim=True)
        + (beta * dev).sum(dim=-1, keepdim=True))  # (K, B, H, 1)
    whole = tokens(a_norm * P0 * w_norm,
                   a_norm * (eta * (dev + w_norm * dl + d_phi) + P0 * d_phi))
    split = tokens(a_norm * (alpha * (dev + d_phi) + (eta + P0) * w_norm),
                   a_norm * (beta * (dev + d_phi) + P0 * d_phi))
    soft = torch.minimum(whole, split)
    G = _token_gradient(P0, w, f, phi, a)  # (K, B, N, D)
    G_norm = G.norm(dim=-1)  # (K, B, N)
    cross, kappa = projection_turn(X, delta, radius)
    project = (_root((G_norm**2 * cross.to(G.dtype)).sum(dim=-1))
               + delta * (kappa * G_norm).amax(dim=-1))
    return values + soft + project


def projection_reach(X: Tensor, delta: Tensor, radius: float) -> tuple[Tensor, Tensor]:
    """Each token's distance to the projection's radius and how fast its
    Jacobian turns outside it (eq. 11.10): ``gap`` ``(B, N)``, ``d_j = |‖x_j‖ −
    R|`` lowered by its float error, and ``kappa`` ``(B, N)``, ``κ_j =
    (R/‖x_j‖)(1/max(‖x_j‖ − δ, R) + 1/‖x_j‖)`` for the tokens outside (eq.
    11.6), 0 inside; ``X`` ``(B, N, D)``, ``delta`` ``(B,)``."""
    norm = X.norm(dim=-1)  # (B, N)
    gap = lowered_gap(norm, torch.full_like(norm, radius))
    outside = norm > radius * (1 + GAP_SLACK)
    low = torch.maximum(norm - delta[:, None], torch.full_like(norm, radius))
    kappa = radius / norm.clamp_min(radius) * (1 / low + 1 / norm.clamp_min(radius))
    return gap, torch.where(outside, kappa, torch.zeros_like(kappa)) * (1 + 1e-12)


def projection_remainder(G_norm: Tensor, gap: Tensor, kappa: Tensor,
                         delta: Tensor) -> Tensor:
    """Eq. (11.10): ``Σ_j ‖G_j‖ ‖r_j‖`` over the ball, ``r_j = x̂′_j − x̂_j −
    J_j (x′_j − x_j)`` the projection's remainder on token ``j`` and ``G_j``
    ``(K, B, N)`` by its norm the gradient it is read with. A token moved by
    ``γ_j`` (``Σ γ_j² ≤ δ²``) at distance ``d_j`` (``gap``) from the radius has
    ``‖r_j‖ ≤ (γ_j − d_j)_+ + κ_j γ_j² / 2`` (:func:`projection_reach`):
    where the segment crosses the radius its Jacobian differs from ``J_j`` by
    at most 1, and only after the token has moved by ``d_j``; outside, ``J``
    turns at rate ``κ_j``. The first sum is :func:`pair_remainder`'s problem
    with ``t_j = γ_j/√2``; returns ``(K, B)``."""
    cross = pair_remainder(G_norm, gap, delta / 2**0.5)
    return cross + delta**2 / 2 * (G_norm * kappa).amax(dim=-1)


def crossing_gradient(X: Tensor, delta: Tensor, G: Tensor, radius: float,
                      both: Tensor) -> Tensor:
    """What the projection's remainder on token ``j`` takes off ``uᵀc`` per
    unit of ``(γ_j − d_j)_+`` (eq. 11.10b): ``‖G_j‖`` for a token outside the
    radius, and for one inside (``J = I``: ``r_j = −(1 − R/‖x′_j‖)_+ x′_j``)
    ``((G_j · x_j)_+ + ‖G_j‖ δ)/(‖x_j‖ + δ)`` (``|G_j · x_j|`` where ``both``).
    ``X`` ``(B, N, D)``, ``G`` ``(K, B, N, D)`` the clean gradient in the
    projected tokens; returns ``(K, B, N)``."""
    norm, G_norm = X.norm(dim=-1), G.norm(dim=-1)  # (B, N), (K, B, N)
    radial = (G * X).sum(dim=-1)  # G_j · x_j
    radial = torch.where(both[..., None], radial.abs(), radial.clamp_min(0.0))
    dl = delta[:, None]
    inside = (norm < radius * (1 - GAP_SLACK)) & (dl > 0)
    reduced = (radial + G_norm * dl) / _unit(norm + dl, inside) * (1 + 1e-12)
    return torch.where(inside, torch.minimum(reduced, G_norm), G_norm)


SHARES = 41
"""Multipliers ``λ`` tried in :func:`shared_remainder`'s dual, ``λ₀ 2^{−k/4}``."""


def shared_remainder(q: Tensor, G_norm: Tensor, gap: Tensor, kappa: Tensor,
                     delta: Tensor) -> Tensor:
    """Eq. (11.10a): class attention's curvature and the projection's
    remainder on one budget. Token ``j`` moved by ``γ_j`` (``Σ_j γ_j² ≤ δ²``,
    ``γ_j ≤ δ``) costs at most ``h_j(γ_j) = Q_j γ_j² + ‖G_j‖ (γ_j − d_j)_+``
    with ``Q_j = q_j + κ_j ‖G_j‖/2``, ``q_j`` ``(K, B, N)`` its curvature
    coefficient along the segment (eq. 11.9c token by token), ``d_j, κ_j``
    from :func:`projection_reach`. For every ``λ ≥ 0`` (weak duality)

        max Σ_j h_j(γ_j) ≤ λ δ² + Σ_j max_{0 ≤ γ ≤ δ} (h_j(γ) − λ γ²),

    each inner maximum attained at ``0``, ``min(d_j, δ)``, ``δ`` or the
    stationary point ``‖G_j‖/(2(λ − Q_j))`` clamped into ``[min(d_j, δ), δ]``
    (where ``λ > Q_j``): all four are evaluated. The least over :data:`SHARES`
    multipliers ``λ₀ 2^{−k/4}``, ``λ₀ = max_j Q_j + max_j ‖G_j‖/δ``; returns
    ``(K, B)``."""
    Q = q + kappa * G_norm / 2  # (K, B, N)
    dl = delta[:, None].expand_as(gap)  # (B, N)
    near = torch.minimum(gap, dl)
    lam0 = Q.amax(dim=-1) + G_norm.amax(dim=-1) / _unit(delta, delta > 0)  # (K, B)
    best = torch.full_like(lam0, torch.inf)
    for k in range(SHARES):
        lam = (lam0 * 2 ** (-k / 4))[..., None]  # (K, B, 1)
        over = lam - Q
        stationary = G_norm / (2 * _unit(over, over > 0))
        stationary = torch.where(over > 0, torch.minimum(stationary, dl), dl)
        inner = torch.stack([  # each value plus its rounding
            -over * g**2 + G_norm * (g - gap).clamp_min(0.0)
            + 1e-12 * (over.abs() * g**2 + G_norm * (g + gap))
            for g in (near, dl, torch.maximum(stationary, near))]).amax(dim=0)
        inner = inner.clamp_min(0.0)  # γ = 0 gives 0
        best = torch.minimum(best, lam[..., 0] * delta**2 * (1 + 1e-12)
                             + inner.sum(dim=-1))
    return torch.where(delta > 0, best, torch.zeros_like(best))


def _schur(C: Tensor, p: Tensor) -> Tensor:
    """``λ_max(Σ_h p_hj c_h c_hᵀ)`` ≤ ``max_h Σ_h′ |c_h · c_h′| p_h′j`` per token
    ``j`` (Schur's test on the heads' Gram matrix ``√(p_h p_h′) c_h · c_h′``
    with the vector ``√p_h``): ``C`` ``(..., H, H)`` the Gram ``c_h · c_h′``,
    ``p`` ``(..., H, N)`` nonnegative weights; returns ``(..., N)``."""
    return (C.abs() @ p).amax(dim=-2) * (1 + 1e-12)


PIECES = 8
"""Pieces of the segment on which (11.9) bounds class attention's curvature
by its value at the piece's far end (eq. 11.9c)."""

SPLITS = tuple(2 ** (k / 2) for k in range(-4, 5))
"""The factors of ``τ₀`` tried in the split ``2|Cov| ≤ τ_h Σ P ν² + Σ P λ²/τ_h``
(eq. 11.9d); ``1`` makes the bound never weaker than (11.9)."""


def _cov_split(tau: Tensor) -> tuple[Tensor, Tensor]:
    """The weights of ``2|Cov_P(ν, λ)| ≤ 2 √(Σ P ν²) √(Σ P λ²) ≤ τ Σ P ν² + Σ P
    λ²/τ`` (any ``τ > 0``): ``(τ, 1/τ)``."""
    return tau, 1 / tau


def _split_curvature(alpha: Tensor, beta: Tensor, third: Tensor,
                     squares: tuple[Tensor, ...], tau0: Tensor, best: Tensor) -> Tensor:
    """Eq. (11.9d) token by token: of ``best`` ``(K, B, N)`` and the splits
    ``τ_h = τ r_h`` over ``τ = τ₀ f`` (``f`` in :data:`SPLITS`), each a bound
    on ``λ_max(M_j)`` for every token ``j``, the one whose largest over the
    tokens is least, where

        M_j = Σ_h (τ α_hj w_h w_hᵀ + (β_hj/τ + third_hj) a_h a_hᵀ)

    (from ``2|Cov_P(ν, λ)| ≤ τ_h Σ_j P_j ν_j² + Σ_j P_j λ_j²/τ_h`` head by
    head, ``α = r p``, ``β = p / r`` for per-head ratios ``r > 0``, and the
    third moment's weights ``third``). ``M_j = Σ_i q_i c_i c_iᵀ`` over the
    ``2H`` vectors ``c = (w_h, a_h)`` with weights ``q ≥ 0``, so ``λ_max(M_j)``
    is at most its Frobenius norm ``(qᵀ (Γ ∘ Γ) q)^{1/2}``, ``Γ`` the
    vectors' Gram matrix: a polynomial in ``τ`` and ``1/τ`` whose
    coefficients are computed once; ``squares`` are the blocks ``(w_h ·
    w_h′)²``, ``(w_h · a_h′)²``, ``(a_h · a_h′)²`` of ``Γ ∘ Γ``, ``(K, B, H,
    H)``, ``(K, B, H, H)``, ``(H, H)``. ``alpha, beta, third`` ``(…, H, N)``
    (broadcast to ``(K, B, H, N)``), ``tau0`` ``(K, B, 1)``. One ``τ`` serves
    every token (the split is of sums over the tokens)."""
    G_ww, G_wa, G_aa = squares
    aa_beta = G_aa @ beta
    A = (alpha * (G_ww @ alpha)).sum(dim=-2)  # (K, B, N): coefficients of ‖M_j‖_F²
    B1, B2 = (alpha * (G_wa @ beta)).sum(dim=-2), (alpha * (G_wa @ third)).sum(dim=-2)
    C1 = (beta * aa_beta).sum(dim=-2)
    C2, C3 = (third * aa_beta).sum(dim=-2), (third * (G_aa @ third)).sum(dim=-2)
    for f in SPLITS:
        tau = tau0 * f  # (K, B, 1)
        nu_coef, lam_coef = _cov_split(tau)
        frobenius = (nu_coef**2 * A + 2 * nu_coef * (lam_coef * B1 + B2)
                     + lam_coef**2 * C1 + 2 * lam_coef * C2 + C3)
        frobenius = _root(frobenius) * (1 + 1e-12)
        better = frobenius.amax(dim=-1) < best.amax(dim=-1)  # (K, B)
        best = torch.where(better[..., None], frobenius, best)
    return best


def _covariance_parts(w: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. (11.9g): the vectors ``b⁻_h``, ``b⁺_h`` with ``(−S_h)⁺ = b⁻_h b⁻_hᵀ`` and
    ``S_h⁺ = b⁺_h b⁺_hᵀ``, the positive parts of ``S_h = w_h a_hᵀ + a_h w_hᵀ``
    (eigenvalues ``w_h · a_h ± ‖w_h‖ ‖a_h‖`` along ``ŵ_h ± â_h``):
    ``b^∓_h = √(‖w_h‖ ‖a_h‖ / 2) (ŵ_h ∓ â_h)``. ``w`` ``(K, B, H, D)``, ``a``
    ``(H, D)``; returns two ``(K, B, H, D)``."""
    w_norm, a_norm = w.norm(dim=-1), a.norm(dim=-1)  # (K, B, H), (H,)
    w_hat = w / _unit(w_norm, w_norm > 0)[..., None]
    a_hat = a / _unit(a_norm, a_norm > 0)[..., None]
    scale = _root(w_norm * a_norm / 2)[..., None]  # (K, B, H, 1)
    return scale * (w_hat - a_hat), scale * (w_hat + a_hat)


def _parts_frobenius(p: Tensor, third: Tensor, squares: tuple[Tensor, ...]) -> Tensor:
    """``‖Σ_h (p_hj b_h b_hᵀ + third_hj a_h a_hᵀ)‖_F`` per token ``j`` (an upper
    bound on its ``λ_max``), from the blocks ``(b_h · b_h′)²``, ``(b_h · a_h′)²``
    ``(K, B, H, H)`` and ``(a_h · a_h′)²`` ``(H, H)`` of the vectors' squared
    Gram matrix; ``p, third`` ``(…, H, N)``; returns ``(K, B, N)``."""
    G_bb, G_ba, G_aa = squares
    square = ((p * (G_bb @ p)).sum(dim=-2) + 2 * (p * (G_ba @ third)).sum(dim=-2)
              + (third * (G_aa @ third)).sum(dim=-2))
    return _root(square) * (1 + 1e-12)


EXCESS = ((0.5, 1.0), (0.25, 1.0), (0.0, 1.0))
"""The splits ``(E_S / max_j e_j, t)`` tried in the third moment's bound (eq.
11.9f); ``(1, ·)`` is eq. (11.9e)'s."""


def _third_moment(e: Tensor, P_bar: Tensor) -> Tensor:
    """Eq. (11.9f): weights ``θ_hj`` with ``−E_{P′}[(f − f̄)(λ − λ̄)²] ≤ Σ_j
    θ_hj λ_j²`` per head, ``e`` ``(K, B, H, N)`` the bound of each token's
    value below the mean on the ball, ``(f̄′ − f′_j)_+ ≤ e_j``, ``P_bar``
    ``(B, H, N)``. For any level ``E_S`` and ``t > 0``, ``e_j ≤ E_S + (e_j −
    E_S)_+`` and ``(λ_j − λ̄)² ≤ (1 + t) λ_j² + (1 + 1/t) λ̄²``, ``λ̄² ≤ Σ_k
    P̄_k λ_k²`` (Jensen), so

        θ_j = P̄_j (E_S + (1 + t)(e_j − E_S)_+ + (1 + 1/t) Σ_k P̄_k (e_k − E_S)_+)

    (``E_S = max_j e_j`` is eq. 11.9e's ``E⁻ P̄_j``). Of :data:`EXCESS`,
    each head keeps the split whose largest ``θ_hj`` is least (chosen
    without a graph; any is sound)."""
    top = e.amax(dim=-1, keepdim=True)  # (K, B, H, 1)
    levels = torch.tensor([1.0] + [lv for lv, _ in EXCESS], dtype=e.dtype,
                          device=e.device)
    ts = torch.tensor([1.0] + [t for _, t in EXCESS], dtype=e.dtype, device=e.device)

    def theta(level: Tensor, t: Tensor) -> Tensor:
        E_S = top * level
        excess = P_bar * (e - E_S).clamp_min(0.0)  # P̄_j (e_j − E_S)_+
        W = excess.sum(dim=-1, keepdim=True)
        return P_bar * (E_S + (1 + 1 / t) * W) + (1 + t) * excess

    with torch.no_grad():
        best = theta(levels[0], ts[0]).amax(dim=-1, keepdim=True)
        choice = torch.zeros_like(best, dtype=torch.long)  # (K, B, H, 1)
        for i in range(1, len(levels)):
            largest = theta(levels[i], ts[i]).amax(dim=-1, keepdim=True)
            choice = torch.where(largest < best, i, choice)
            best = torch.minimum(largest, best)
    return theta(levels[choice], ts[choice])


def _curvature(f: Tensor, phi: Tensor, w: Tensor, a: Tensor, P0: Tensor,
               P_ball: Tensor, P_floor: Tensor, radius: float, both: Tensor
               ) -> Callable[[Tensor], Tensor]:
    """``s ↦ c`` ``(K, B, N)`` with ``−F″(t) ≤ Σ_j c_j ‖Δ_j‖²`` (``|F″(t)|``
    where ``both`` ``(K, B)``) at every point of the segment within ``s``
    ``(B,)`` of its start, ``Δ_j`` the projected tokens' moves (eq. 11.9b,
    11.9d): ``c_j ≥ λ_max(M_j)``, ``P̄`` the smaller of ``P_ball`` (on the
    whole ball) and eq. (10.1b)'s bound within ``s`` (likewise ``P̲`` the larger
    of ``P_floor`` and eq. 10.1b's), ``E_h ≥
    max_j (f̄_h − f_hj)_+`` (``|f̄_h − f_hj|`` where ``both``) within ``s``,
    token by token (:func:`_third_moment`, eq. 11.9f);
    Schur's test (11.9) token by token, ``2 √(Σ P̄ ν²) √(Σ P̄ λ²) ≤ τ₀ Σ P̄ ν²
    + Σ P̄ λ²/τ₀``, and the covariance split with one ``τ`` for every head and
    with each head's own balance ``τ_h = τ ‖a_h‖/‖w_h‖``
    (:func:`_split_curvature`), and the covariance by its positive part
    head by head (eq. 11.9g, :func:`_covariance_parts`), each token's bound
    the family's whose largest over the tokens is least. ``f, phi, w`` from
    :func:`_read_along`;
    ``P0, P_ball, P_floor`` ``(B, H, N)``. What does not depend on ``s`` is
    computed once."""
    w_norm = w.norm(dim=-1)  # (K, B, H)
    a_norm = a.norm(dim=-1)  # (H,)
    dev = (f - phi).abs()  # (K, B, H, N)
    # Only −F″ lowers the margin: the third moment reads the values below f̄.
    low = torch.where(both[..., None, None], dev, (phi - f).clamp_min(0.0))
    C_a, C_w = a @ a.T, w @ w.mT  # (H, H), (K, B, H, H)
    squares = (C_w.square(), (w @ a.T).square(), C_a.square())  # Γ ∘ Γ (11.9d)
    # Per-head splits τ_h = τ ‖a_h‖/‖w_h‖ (each head's own balance).
    small = torch.finfo(w_norm.dtype).eps  # any τ_h > 0 is sound; τ_h² stays finite
    ratio = (a_norm / _unit(w_norm, w_norm > 0)).clamp(small, 1 / small)[..., None]
    # −2 Cov_P(ν, λ) ≤ Σ_j P_j (b⁻_h · Δ_j)², and 2 Cov_P ≤ with b⁺ (eq. 11.9g)
    parts = [((b @ b.mT).square(), (b @ a.T).square(), squares[2])
             for b in _covariance_parts(w, a)[:1 + bool(both.any())]]

    def at(s: Tensor) -> Tensor:
        P_bar, P_low = class_envelope(P0, a_norm, s, radius)  # (B, H, N)
        P_bar = torch.minimum(P_ball, P_bar)
        eta = torch.maximum(P_bar - P0, P0 - torch.maximum(P_floor, P_low))
        P_bar2 = torch.minimum(P_bar.norm(dim=-1),
                               _root(P_bar.amax(dim=-1))).clamp(max=1.0)  # (B, H)
        d_phi = (w_norm * s[:, None] * P_bar2
                 + (eta * dev).sum(dim=-1))  # (K, B, H) ≥ |f̄ − φ_h|
        e = torch.minimum(low + (w_norm * s[:, None] + d_phi)[..., None],
                          2 * radius * w_norm[..., None])  # (K, B, H, N)
        third = _third_moment(e, P_bar)  # (K, B, H, N)
        nu, lam = _schur(C_w, P_bar), _schur(C_a, P_bar)  # (K, B, N), (B, N)
        mu_nu, mu_lam = nu.amax(dim=-1), lam.amax(dim=-1)  # (K, B), (B,)
        tau0 = _root(mu_lam / _unit(mu_nu, mu_nu > 0)).clamp(small, 1 / small)
        tau0 = tau0[..., None]  # (K, B, 1)
        nu_coef, lam_coef = _cov_split(tau0)  # (11.9): 2√(μ_ν μ_λ) ≥ the largest
        best = (nu_coef * nu + lam_coef * lam + _schur(C_a, third)) * (1 + 1e-12)
        best = _split_curvature(P_bar, P_bar, third, squares, tau0, best)  # one τ
        best = _split_curvature(ratio * P_bar, P_bar / ratio, third, squares,
                                torch.ones_like(tau0), best)
        part = _parts_frobenius(P_bar, third, parts[0])  # (K, B, N)
        if len(parts) > 1:  # |F″| ≤ the larger of the two sides' bounds
            part = torch.where(both[..., None], torch.maximum(
                part, _parts_frobenius(P_bar, third, parts[1])), part)
        better = part.amax(dim=-1) < best.amax(dim=-1)  # (K, B)
        return torch.where(better[..., None], part, best)

    return at


def class_attention_remainder(X: Tensor, delta: Tensor, u: Tensor, a: Tensor,
                              W_v: Tensor, P0: Tensor, P_bar: Tensor,
                              P_low: Tensor, radius: float, both: Tensor | None = None
                              ) -> Tensor:
    """Eq. (11.9)–(11.10): a bound on ``−uᵀ r`` (what class
    attention's remainder ``r`` can take off ``uᵀc``; on ``|uᵀ r|`` where
    ``both`` ``(K, B)``) over the ball, from its second derivative along the
    segment. Per head, with logits moving at ``λ_j = a_h · Δ_j`` and values
    ``f_hj = w_h · x̂_j`` at ``ν_j = w_h · Δ_j`` (``w_h = W_v[h] u_h``), the
    pooled value ``φ_h = Σ_j P_h[j] f_hj`` has

        φ_h″ = 2 Cov_P(ν, λ) + E_P[(f − f̄)(λ − λ̄)²]

    at every point of the segment (the softmax an exponential family), so ``−φ_h″ ≤
    2 √(Σ_j P̄_hj ν_j²) √(Σ_j P̄_hj λ_j²) + E_h Σ_j P̄_hj λ_j²`` with ``E_h ≥ max_j
    (f̄_h − f_hj)_+`` on the ball (eq. 11.9e; token by token, eq. 11.9f).
    Summed over the heads (Cauchy–Schwarz), each sum is a quadratic form
    ``Σ_j Δ_jᵀ M_j Δ_j ≤ μ δ²``
    (``μ`` by :func:`_schur`): ``−F″(t) ≤ δ² (2 √(μ_ν μ_λ) + μ_S)``, or ``δ² max_j
    λ_max(M_j)`` with the covariance split into one quadratic form (eq. 11.9d,
    :func:`_split_curvature`, the least kept), with ``P̄`` and the values' spread
    those of the points within ``tδ`` of the start (:func:`_curvature`). ``−r_F =
    −∫₀¹ (1 − t) F″(t) dt`` is then at most the sum over :data:`PIECES` equal pieces
    of the segment of each piece's weight ``∫ (1 − t) dt`` times the bound at its
    far end (eq. 11.9c), token by token: ``−r_F ≤ Σ_j q_j γ_j²``. The
    projection's own remainder read by the clean gradient ``G`` is
    :func:`projection_remainder`; the least of the two bounded apart (``δ²
    max_j q_j`` plus it) and on one budget (:func:`shared_remainder`, eq.
    11.10a) is returned.

    ``X`` ``(B, N, D)``, ``delta`` ``(B,)``, ``u`` ``(K, B, H·d_v)``, ``a``
    ``(H, D)``, ``W_v`` ``(H, D, d_v)``, ``P0, P_bar, P_low`` ``(B, H, N)`` from
    :func:`~lipvit.certify.ball.attention.class_ball` on the whole ball;
    returns ``(K, B)``."""
    w, f, phi = _read_along(X, u, W_v, P0, radius)
    if both is None:
        both = torch.zeros(u.shape[:2], dtype=torch.bool, device=u.device)
    curvature = _curvature(f, phi, w, a, P0, P_bar, P_low, radius, both)
    q = 0.0  # −r_F ≤ Σ_j q_j γ_j²
    for k in range(PIECES):
        near, far = k / PIECES, (k + 1) / PIECES
        weight = ((1 - near) ** 2 - (1 - far) ** 2) / 2  # ∫_near^far (1 − t) dt
        q = q + weight * curvature(far * delta)
    q = q * (1 + 1e-12)  # (K, B, N)
    G = _token_gradient(P0, w, f, phi, a)  # (K, B, N, D)
    G = crossing_gradient(X, delta, G, radius, both)  # (K, B, N)
    gap, kappa = projection_reach(X, delta, radius)
    apart = delta**2 * q.amax(dim=-1) + projection_remainder(G, gap, kappa, delta)
    return torch.minimum(apart, shared_remainder(q, G, gap, kappa, delta))
