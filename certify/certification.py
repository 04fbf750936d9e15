"""Margin certification and certified radii, LoFAST Proposition 1 (MATH.md §1).

If ``‖F(x') − F(x)‖₂ ≤ δ`` on the ball ``‖x' − x‖₂ ≤ ε`` then every logit
difference moves by at most ``√2 δ``; a correctly classified point whose margin
``M(x) = F(x)_y − max_{j≠y} F(x)_j`` exceeds ``√2 δ(x, ε)`` keeps its label on
the whole ball.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

SQRT2 = math.sqrt(2.0)


def margin(logits: Tensor, y: Tensor) -> Tensor:
    """``M(x) = F(x)_y − max_{j≠y} F(x)_j``, ``(B,)``; negative when misclassified."""
    true = logits.gather(1, y[:, None]).squeeze(1)
    others = logits.scatter(1, y[:, None], float("-inf"))
    return true - others.amax(dim=1)


def is_certified(margins: Tensor, delta: Tensor) -> Tensor:
    """LoFAST Prop. 1: ``M(x) > √2 δ(x, ε)`` (implies a correct prediction).

    Returns a ``(B,)`` bool tensor.
    """
    return (margins > 0) & (margins > SQRT2 * delta)


def certified_radius(
    margins: Tensor,
    delta_out: Callable[[Tensor], Tensor],
    *,
    tol: float = 1e-4,
    max_radius: float = 10.0,
    max_iter: int = 60,
) -> Tensor:
    """Largest ε with ``M(x) > √2 δ_out(x, ε)`` per sample (Prop. 1), by bisection.

    ``delta_out``: ``ε (B,) ↦ δ_out (B,)``, non-decreasing in ε. See
    :func:`bisect_radius` for the other arguments and the result.
    """
    return bisect_radius(
        lambda eps: is_certified(margins, delta_out(eps)),
        margins > 0,
        dtype=margins.dtype,
        tol=tol,
        max_radius=max_radius,
        max_iter=max_iter,
    )


def bisect_radius(
    certified: Callable[[Tensor], Tensor],
    candidates: Tensor,
    *,
    dtype: torch.dtype = torch.float64,
    tol: float = 1e-4,
    max_radius: float = 10.0,
    max_iter: int = 60,
) -> Tensor:
    """Largest certified ε per sample by bisection, for any certificate.

    Args:
        certified: ``ε (B,) ↦ (B,)`` bool, whether the ε-ball is certified
            (any sound method: Prop. 1, ``taylor``, ...); expected to be
            monotone (true below some radius, false above), which only affects
            how large the result is, never its soundness.
        candidates: ``(B,)`` bool, the samples worth searching (e.g. correctly
            classified ones); the others get radius 0.
        tol: the bracket is shrunk until ``hi − lo ≤ tol`` (absolute).
        max_radius: upper end of the search (a radius at or above it is
            reported as ``max_radius`` only if certified there).
        max_iter: cap on bisection steps.
        dtype: dtype of the radii (every tried ε is exactly representable).

    Returns:
        ``(B,)`` radii: the lower end of the final bracket, a value at which the
        point **is** certified (0 for points that are not certified anywhere).
        Sound: ``r > 0`` implies ``certified(r)``, i.e. certification on the
        ball of radius ``r``.
    """
    if not tol > 0 or not max_radius > 0:
        raise ValueError("tol and max_radius must be > 0")
    lo = torch.zeros(candidates.shape, dtype=dtype, device=candidates.device)
    hi = torch.full_like(lo, max_radius)
    top = certified(hi) & candidates
    lo = torch.where(top, hi, lo)
    for _ in range(max_iter):
        open_ = (hi - lo > tol) & ~top & candidates
        if not bool(open_.any()):
            break
        mid = (lo + hi) / 2
        ok = certified(mid)
        lo = torch.where(open_ & ok, mid, lo)
        hi = torch.where(open_ & ~ok, mid, hi)
    return torch.where(candidates, lo, torch.zeros_like(lo))
