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
    """A private float64 copy of ``model`` in eval mode (``model`` untouched),
    its parameters without gradients.

    Always a copy: the bounds built on it evaluate lazily (``delta_out(ε)``,
    ``margin_drop(ε)``), and a later change to ``model`` (more training,
    ``.cuda()``) must not reach a bound computed before it. No bound needs the
    weights' gradients; without them the weights' dense problems of a CUDA
    model run on the host (:data:`lipvit.spectral.HOST_LINALG_MAX`)."""
    return copy.deepcopy(model).double().eval().requires_grad_(False)


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


def falsi_radius(
    slack: Callable[[Tensor], Tensor],
    candidates: Tensor,
    bracket: tuple[Tensor, Tensor],
    *,
    guess: Tensor | None = None,
    rtol: float = 1e-3,
    tol: float = 0.0,
    max_iter: int = 100,
    probed: Sequence[tuple[float, Tensor]] = (),
    restrict: Callable[[Tensor], Callable[[Tensor], Tensor]] | None = None,
) -> Tensor:
    """Largest certified ε per sample from a certificate's *slack*, by a
    safeguarded secant search: fewer probes than :func:`bisect_radius` when the
    slack is smooth, never unsound.

    ``slack(ε)`` ``(B,)`` is positive exactly where the ε-ball is certified
    (e.g. ``min_j log(margin_j/drop_j(ε))``) and expected to decrease with ε.
    The lower end is probed first, the upper end is taken as uncertified and
    probed only if the search gets there; the first probe is ``guess`` (the
    geometric mean of the ends without one). Each further step probes the
    secant root of the last two probes (in ``log ε``; of the bracket's ends
    when that root leaves the bracket), moved half the tolerance past it,
    away from the end that moved last, so that an accurate estimate closes
    the bracket with the next probe; three steps in a row that do not halve
    the bracket give way to a bisection step (geometric where ``lo > 0``).

    Args:
        slack: ``ε (B,) ↦ (B,)``; NaN counts as not certified, ``+inf`` as
            certified (no secant from that point).
        candidates: ``(B,)`` bool, the samples worth searching.
        bracket: ``(lo, hi)`` ``(B,)``; the search never goes above ``hi``.
        guess: ``(B,)``, the first probe (inside the bracket).
        rtol, tol, max_iter: as in :func:`bisect_radius`.
        probed: ``(ε, slack (B,))`` pairs already computed with the same
            ``slack`` (e.g. the per-ε results): they narrow the bracket, and
            an end they decide is not probed again.
        restrict: ``index (b,) ↦`` the slack of the samples ``index`` alone
            (``ε (b,) ↦ (b,)``, the same values as ``slack``'s): given, each
            probe computes the samples still searching only (``restrict`` is
            called once each time they change); else ``slack`` runs on the
            whole batch, at ε = 0 for the others.

    Returns:
        ``(B,)`` radii: the lower end of the final bracket, a value at which the
        slack **was** positive (0 for points certified nowhere in the bracket).
    """
    if not (rtol >= 0 and tol >= 0 and (rtol > 0 or tol > 0)):
        raise ValueError("rtol, tol must be >= 0 (one > 0)")

    current: list = [None, None]  # the samples restrict last served, their slack

    def probe(e: Tensor, active: Tensor) -> Tensor:
        """Slack at ``e`` where ``active`` (probed at 0 elsewhere, or not at all
        with ``restrict``: −inf), NaN → −inf."""
        if restrict is None:
            f = slack(torch.where(active, e, torch.zeros_like(e))).detach()
            return torch.nan_to_num(f, nan=-math.inf)
        index = active.nonzero()[:, 0]
        if current[0] is None or not torch.equal(current[0], index):
            current[:] = index, restrict(index)
        f = torch.full_like(e, -math.inf)
        f[index] = torch.nan_to_num(current[1](e[index]).detach(), nan=-math.inf)
        return f

    lo = bracket[0].clamp_min(0)
    hi = torch.maximum(bracket[1].to(lo.dtype), lo)
    f_lo = f_hi = torch.full_like(lo, math.nan)  # unknown until probed
    for eps, f in probed:
        e, f = torch.full_like(lo, float(eps)), torch.nan_to_num(f, nan=-math.inf)
        ok = f > 0
        lo, f_lo = (torch.where(ok & (e >= lo) & (e <= hi), t, u)
                    for t, u in ((e, lo), (f, f_lo)))
        hi, f_hi = (torch.where(~ok & (e <= hi) & (e > lo), t, u)
                    for t, u in ((e, hi), (f, f_hi)))
    need = candidates & f_lo.isnan()
    if bool(need.any()):
        f_lo = torch.where(need, probe(lo, need), f_lo)
    lo = torch.where(f_lo > 0, lo, torch.zeros_like(lo))  # 0: certified nowhere yet
    f_lo = torch.where(f_lo > 0, f_lo, math.nan)
    x1 = x2 = lo  # the last two probes with a finite slack: the secant's points
    f1 = f2 = f_lo
    last = torch.zeros_like(lo)  # +1: lo moved last, −1: hi moved last
    stalls = torch.zeros_like(lo)
    for step in range(max_iter):
        width = torch.maximum(rtol * hi, torch.full_like(hi, tol))
        open_ = (hi - lo > width) & candidates
        if not bool(open_.any()):
            break
        w = width / 2
        x = _secant(x1, f1, x2, f2)
        x = torch.where((x > lo) & (x < hi), x, _secant(lo, f_lo, hi, f_hi))
        # Aim just past the estimate, away from the end that moved last, so
        # that an accurate estimate closes the bracket with the next probe.
        x = x + last * w / 2
        if step == 0 and guess is not None:
            x = torch.where(f_hi.isnan(), guess.to(x), x)
        x = torch.minimum(torch.maximum(x, lo + w / 2), hi - w / 2)
        mid = torch.where(lo > 0, (lo * hi).sqrt(), (lo + hi) / 2)
        x = torch.where(x.isfinite() & (stalls < 3), x, mid)
        f = probe(x, open_)
        ok, before = f > 0, hi - lo
        lo_move, hi_move = open_ & ok, open_ & ~ok
        lo, f_lo = torch.where(lo_move, x, lo), torch.where(lo_move, f, f_lo)
        hi, f_hi = torch.where(hi_move, x, hi), torch.where(hi_move, f, f_hi)
        shift = open_ & f.isfinite()
        x1, f1 = torch.where(shift, x2, x1), torch.where(shift, f2, f1)
        x2, f2 = torch.where(shift, x, x2), torch.where(shift, f, f2)
        last = torch.where(lo_move, 1.0, torch.where(hi_move, -1.0, last))
        slow = open_ & (hi - lo > before / 2)
        stalls = torch.where(slow, stalls + 1, torch.where(open_, 0, stalls))
    return torch.where(candidates, lo, torch.zeros_like(lo))


def _secant(x1: Tensor, f1: Tensor, x2: Tensor, f2: Tensor) -> Tensor:
    """Root of the line through ``(log x, f)`` at two points (``x`` itself where
    one is 0); NaN or ±inf where the points do not define one (NaN slacks,
    equal points)."""
    geometric = (x1 > 0) & (x2 > 0)
    a = torch.where(geometric, x1.log(), x1)
    b = torch.where(geometric, x2.log(), x2)
    v = a + (b - a) * f1 / (f1 - f2)
    return torch.where(geometric, v.exp(), v)

