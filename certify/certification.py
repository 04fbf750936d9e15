"""Margin certification and certified radii, LoFAST Proposition 1 (docs/math.md §1).

If ``‖F(x') − F(x)‖₂ ≤ δ`` on the ball ``‖x' − x‖₂ ≤ ε`` then every logit
difference moves by at most ``√2 δ``; a correctly classified point whose margin
``M(x) = F(x)_y − max_{j≠y} F(x)_j`` exceeds ``√2 δ(x, ε)`` keeps its label on
the whole ball.

Certificates are computed in float64 (:func:`float64_model`) and rounded in
the safe direction: ``δ`` up by the relative slack :data:`ROUNDING`, margins
down by ``ROUNDING · max|logit|`` (:func:`certified_margin`). A float64 chain
of a few hundred operations errs by ≲ 1e-13 relatively, far below the slack.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

SQRT2 = math.sqrt(2.0)
ROUNDING = 1e-9


def float64_model(model: nn.Module) -> nn.Module:
    """``model`` if its weights are float64, else a float64 copy (``model`` kept)."""
    param = next(model.parameters(), None)
    if param is None or param.dtype == torch.float64:
        return model
    return copy.deepcopy(model).double()


def margin(logits: Tensor, y: Tensor) -> Tensor:
    """``M(x) = F(x)_y − max_{j≠y} F(x)_j``, ``(B,)``; negative when misclassified."""
    true = logits.gather(1, y[:, None]).squeeze(1)
    others = logits.scatter(1, y[:, None], float("-inf"))
    return true - others.amax(dim=1)


def certified_margin(logits: Tensor, y: Tensor) -> Tensor:
    """:func:`margin` rounded down by ``ROUNDING · max_j |F(x)_j|``, ``(B,)``.

    A lower bound of the exact margin of the computed logits' real-arithmetic
    values (the float64 forward pass errs by far less than the slack).
    """
    return margin(logits, y) - ROUNDING * logits.abs().amax(dim=1)


def is_certified(margins: Tensor, delta: Tensor) -> Tensor:
    """LoFAST Prop. 1: ``M(x) > √2 δ(x, ε)`` (implies a correct prediction).

    ``δ`` is rounded up by the relative slack :data:`ROUNDING`. Returns a
    ``(B,)`` bool tensor.
    """
    return (margins > 0) & (margins > SQRT2 * delta * (1 + ROUNDING))


def certified_radius(
    margins: Tensor,
    delta_out: Callable[[Tensor], Tensor],
    *,
    rtol: float = 1e-3,
    tol: float = 0.0,
    max_radius: float = 10.0,
    max_iter: int = 100,
    certified_at: Sequence[tuple[float, Tensor]] = (),
) -> Tensor:
    """Largest ε with ``M(x) > √2 δ_out(x, ε)`` per sample (Prop. 1), by bisection.

    ``margins``: ``(B,)`` clean margins; ``delta_out``: ``ε (B,) ↦ δ_out (B,)``,
    non-decreasing in ε. See :func:`bisect_radius` for the other arguments and
    the result.
    """
    return bisect_radius(
        lambda eps: is_certified(margins, delta_out(eps)),
        margins > 0,
        dtype=margins.dtype,
        rtol=rtol,
        tol=tol,
        max_radius=max_radius,
        max_iter=max_iter,
        certified_at=certified_at,
    )


def bisect_radius(
    certified: Callable[[Tensor], Tensor],
    candidates: Tensor,
    *,
    dtype: torch.dtype = torch.float64,
    rtol: float = 1e-3,
    tol: float = 0.0,
    max_radius: float = 10.0,
    max_iter: int = 100,
    certified_at: Sequence[tuple[float, Tensor]] = (),
    bracket: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Largest certified ε per sample by bisection, for any certificate.

    Args:
        certified: ``ε (B,) ↦ (B,)`` bool, whether the ε-ball is certified
            (any sound method: Prop. 1, ``taylor``, ...); expected to be
            monotone (true below some radius, false above), which only affects
            how large the result is, never its soundness.
        candidates: ``(B,)`` bool, the samples worth searching (e.g. correctly
            classified ones); the others get radius 0.
        dtype: dtype of the radii.
        rtol: the bracket is shrunk until ``hi − lo ≤ max(rtol · hi, tol)``
            (relative by default: a radius is within ``rtol`` of the largest
            certified ε, whatever its size).
        tol: absolute tolerance (0: relative only).
        max_radius: upper end of the search (a radius at or above it is
            reported as ``max_radius`` only if certified there).
        max_iter: cap on bisection steps.
        certified_at: ``(ε, certified (B,) bool)`` pairs already decided with
            the same certificate (e.g. the per-ε results): the bisection
            starts from the largest certified ε and below the smallest
            uncertified one, so a point certified at a listed ε gets a radius
            ``≥ ε`` and one not certified there a radius ``< ε``.
        bracket: optional per-sample ``(lo, hi)`` ``(B,)`` to search between
            instead of ``[0, max_radius]``: ``lo`` is checked (0 where it is
            not certified) and the search never goes above ``hi``. Points are
            split at the geometric mean while ``lo > 0``, so probes stay near
            the radius when the bracket spans orders of magnitude (for
            certificates whose cost grows with ε).

    Returns:
        ``(B,)`` radii: the lower end of the final bracket, a value at which the
        point **is** certified (0 for points that are not certified anywhere).
        Sound: ``r > 0`` implies ``certified(r)``, i.e. certification on the
        ball of radius ``r``.
    """
    if not (rtol >= 0 and tol >= 0 and (rtol > 0 or tol > 0)) or not max_radius > 0:
        raise ValueError("rtol, tol must be >= 0 (one > 0) and max_radius > 0")
    lo = torch.zeros(candidates.shape, dtype=dtype, device=candidates.device)
    hi = torch.full_like(lo, max_radius)
    if bracket is not None:
        lo = bracket[0].to(dtype).clamp_min(0)
        ok = candidates & (lo > 0) & certified(lo)
        lo = torch.where(ok, lo, torch.zeros_like(lo))
        hi = torch.maximum(bracket[1].to(dtype), lo)
    for eps, ok in certified_at:
        e = torch.full_like(lo, float(eps))
        lo = torch.where(ok & (e > lo) & (e <= hi), e, lo)
        hi = torch.where(~ok & (e < hi) & (e > lo), e, hi)
    top = torch.zeros_like(candidates) if bracket is not None else (
        (hi == max_radius) & certified(hi) & candidates
    )
    lo = torch.where(top, hi, lo)
    for _ in range(max_iter):
        width = torch.maximum(rtol * hi, torch.full_like(hi, tol))
        open_ = (hi - lo > width) & ~top & candidates
        if not bool(open_.any()):
            break
        mid = (lo + hi) / 2
        if bracket is not None:
            mid = torch.where(lo > 0, (lo * hi).sqrt(), mid)
        # Closed samples are probed at 0 (cheap for certificates whose cost grows
        # with ε); their result is not used.
        ok = certified(torch.where(open_, mid, torch.zeros_like(mid)))
        lo = torch.where(open_ & ok, mid, lo)
        hi = torch.where(open_ & ~ok, mid, hi)
    return torch.where(candidates, lo, torch.zeros_like(lo))
