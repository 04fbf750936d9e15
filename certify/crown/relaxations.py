"""Sound linear relaxations of the standard family's GELU and LayerNorm (ours).

auto_LiRPA 0.3 has no bound for ``erf`` and an unsound one for ``Sqrt``
(:mod:`lipvit.certify.crown.bounds`), so the standard family's two nonlinear
operators are written as operators of our own
(:class:`lipvit.certify.crown.verifiable.GELU`,
:class:`~lipvit.certify.crown.verifiable.RSqrt`) with the relaxations below
(docs/certificates.md, "`crown` and the cascades").

**GELU** ``g(x) = ½x(1 + erf(x/√2)) = xΦ(x)`` on ``[l, u]``: both lines have the
chord's slope ``k`` and the intercepts ``min`` and ``max`` of ``h(x) = g(x) − kx``
over ``[l, u]`` (:func:`gelu_relaxation`), so they bound ``g`` there whatever
``k`` is. ``h′ = g′ − k`` with ``g′(x) = Φ(x) + xφ(x)`` and ``g″(x) = φ(x)(2 − x²)``:
``g′`` is monotone on each of ``(−∞, −√2]``, ``[−√2, √2]``, ``[√2, ∞)``, so ``h``
has at most one stationary point per piece, found by bisection on ``h′``'s sign
change; ``h``'s extremes are among the piece ends and those points. A bisection
bracket ``[a, b]`` of width ``w`` holds the stationary point, and ``h`` there is
within ``max(|h′(a)|, |h′(b)|) w`` of ``h(a)`` (``h′`` is monotone on the
bracket), which is subtracted (added) too.

**LayerNorm's** ``1/√(v + η)`` on the variance ``v ∈ [l, u]``
(:func:`rsqrt_relaxation`): ``v ≥ 0`` always, so ``[max(l, 0), u]``; the
function is convex and decreasing there: the chord above, the tangent at the
midpoint below. LayerNorm is then ``(x − μ) · rsqrt(var) · γ + β``, the same
product structure as LayerProject's ``x · ψ_R(‖x‖²)``.

Every intercept is widened by :data:`SLACK` relative to the values involved
(float rounding of ``erf``, ``sqrt`` and the products).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: Relative widening of every intercept (rounding of the evaluated functions).
SLACK = 1e-12
#: Bisection steps on ``h′`` (float64: the bracket reaches rounding well before).
BISECTION_STEPS = 80
_SQRT2 = math.sqrt(2.0)
_PIECES = ((-math.inf, -_SQRT2), (-_SQRT2, _SQRT2), (_SQRT2, math.inf))


def gelu(x: Tensor) -> Tensor:
    """The exact GELU ``½x(1 + erf(x/√2))``."""
    return 0.5 * x * (1.0 + torch.erf(x / _SQRT2))


def gelu_grad(x: Tensor) -> Tensor:
    """``g′(x) = Φ(x) + xφ(x)``."""
    Phi = 0.5 * (1.0 + torch.erf(x / _SQRT2))
    phi = torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return Phi + x * phi


def _stationary(lo: Tensor, hi: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Bracket ``[a, b]`` of ``h′ = g′ − k``'s sign change on ``[lo, hi]`` where
    ``h′`` is monotone; ``(a, b, found)`` (``found`` false: no sign change, and
    then ``a = b = lo``)."""
    d_lo, d_hi = gelu_grad(lo) - k, gelu_grad(hi) - k
    found = (d_lo * d_hi) < 0
    a, b = lo.clone(), torch.where(found, hi, lo)
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (a + b)
        same = (gelu_grad(mid) - k) * d_lo > 0  # mid on lo's side of the root
        a = torch.where(found & same, mid, a)
        b = torch.where(found & ~same, mid, b)
    return a, b, found


def _h_range(lo: Tensor, up: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """``(min, max)`` of ``h(x) = g(x) − kx`` over ``[lo, up]``, rounded outwards."""
    def h(x: Tensor) -> Tensor:
        return gelu(x) - k * x

    lo_all, hi_all = torch.minimum(h(lo), h(up)), torch.maximum(h(lo), h(up))
    for left, right in _PIECES:
        p_lo = lo.clamp(min=left, max=right)
        p_hi = up.clamp(min=left, max=right)
        inside = (p_lo <= p_hi) & (lo <= right) & (up >= left)
        p_lo = torch.where(inside, p_lo, lo)
        p_hi = torch.where(inside, p_hi, lo)
        a, b, found = _stationary(p_lo, p_hi, k)
        slope = torch.maximum((gelu_grad(a) - k).abs(), (gelu_grad(b) - k).abs())
        spread = slope * (b - a)
        for point in (p_lo, p_hi):
            value = h(point)
            lo_all = torch.where(inside, torch.minimum(lo_all, value), lo_all)
            hi_all = torch.where(inside, torch.maximum(hi_all, value), hi_all)
        value, use = h(a), found & inside  # the stationary point, to within spread
        lo_all = torch.where(use, torch.minimum(lo_all, value - spread), lo_all)
        hi_all = torch.where(use, torch.maximum(hi_all, value + spread), hi_all)
    pad = SLACK * (1.0 + lo.abs() + up.abs()) * (1.0 + k.abs())
    return lo_all - pad, hi_all + pad


def gelu_relaxation(
    lower: Tensor, upper: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Linear bounds ``k x + b_l ≤ g(x) ≤ k x + b_u`` on ``x ∈ [lower, upper]``
    (module docstring); ``(k_l, b_l, k_u, b_u)`` with ``k_l = k_u = k`` the chord's
    slope (``g′`` at the midpoint for an interval of width ≤ 1e-9)."""
    lo, up = lower, torch.maximum(upper, lower)
    width = up - lo
    narrow = width <= 1e-9
    chord = (gelu(up) - gelu(lo)) / width.clamp_min(1e-300)
    k = torch.where(narrow, gelu_grad(0.5 * (lo + up)), chord)
    b_l, b_u = _h_range(lo, up, k)
    return k, b_l, k, b_u


def gelu_range(lower: Tensor, upper: Tensor) -> tuple[Tensor, Tensor]:
    """``[min g, max g]`` over ``[lower, upper]`` (interval bounds), rounded
    outwards."""
    lo, up = lower, torch.maximum(upper, lower)
    return _h_range(lo, up, torch.zeros_like(lo))


def rsqrt(v: Tensor, eta: float) -> Tensor:
    """``1/√(max(v, 0) + η)``: LayerNorm's scale at variance ``v``."""
    return torch.rsqrt(v.clamp_min(0) + eta)


def rsqrt_relaxation(
    lower: Tensor, upper: Tensor, eta: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Linear bounds ``k_l v + b_l ≤ 1/√(v + η) ≤ k_u v + b_u`` for the variances
    ``v ∈ [max(lower, 0), upper]`` (module docstring): the chord above, the
    tangent at the midpoint below; constants ``f(up) ≤ f ≤ f(lo)`` on an interval
    of width ≤ 1e-12 (relative)."""
    lo = lower.clamp_min(0)
    up = torch.maximum(upper, lo)
    f_l, f_u = rsqrt(lo, eta), rsqrt(up, eta)
    degenerate = (up - lo) <= 1e-12 * (1.0 + up)
    chord = (f_u - f_l) / (up - lo).clamp_min(1e-300)
    k_u = torch.where(degenerate, torch.zeros_like(lo), chord)
    b_u = torch.where(degenerate, f_l, f_l - chord * lo)
    mid = 0.5 * (lo + up)
    f_mid = rsqrt(mid, eta)
    k_mid = -0.5 * f_mid**3  # f′(mid)
    k_l = torch.where(degenerate, torch.zeros_like(lo), k_mid)
    b_l = torch.where(degenerate, f_u, f_mid - k_mid * mid)
    pad = SLACK * (f_l + (k_u.abs() + k_l.abs()) * up)
    return k_l, b_l - pad, k_u, b_u + pad
