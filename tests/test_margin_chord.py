"""``margin``'s chord linearisation of the stem's MaxMin pairs (docs/math.md
eq. 11.13): :func:`chord_remainder` against brute force and against weakened
copies of itself, in float64 over seeds; :func:`chord_max_min`'s values and
slopes; and on a trained CaiT, that the chord's cut lowers some margins'
bounds, and that ``drops`` (which skips the chords where they
cannot change a verdict) decides every point as the least of both cuts.
The network-level soundness of the drop bounds that read it:
tests/test_margin.py (PGD on every margin).

Weakened copies (each text asserted to occur once):

- ``side``: the half-line on which the pair does not cross its kink dropped
  (as if the remainder were one-sided, eq. 11.3a's reading, which holds for
  the gradient's slope only). Bites where ``d > 0``, the slope strictly
  between 0 and 1 and ``κ < 0``: moving ``d`` up lowers the margin by ``|κ| (1
  − s) t`` without any crossing.
- ``kink``: the remainder's value at the kink, ``s d − ReLU(d)``, taken as 0.
  Bites where ``κ > 0`` and ``d > 0``: the chord lies above ``ReLU`` at the
  kink, and the pair reaching it lowers the margin by ``κ (1 − s) d``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import weakened_copy
from lipvit.certify.certification import ROUNDING
from lipvit.certify.follow import variation
from lipvit.certify.follow.network import least_cut, margin_certificate
from lipvit.certify.follow.variation import (
    CHORD_REACHES,
    chord_max_min,
    chord_remainder,
    chord_slopes,
)

from lipvit.layers import max_min

SEEDS = (0, 1, 2, 3, 4)
F64 = torch.float64
WEAKENINGS = {
    "side": [("for slope, above in ((1 - s, True), (-s, False)):",
              "for slope, above in ((-s, False),):")],
    "kink": [("kink = s * d - d.clamp_min(0.0)", "kink = torch.zeros_like(d)")],
}


def brute(kappa: torch.Tensor, d: torch.Tensor, s: torch.Tensor, R: float,
          seed: int, n: int = 200_000) -> float:
    """The largest ``Σ_p −κ_p ρ_p(t_p)`` over random points of the ball ``Σ t_p²
    ≤ R²`` (on its sphere and inside) and the points that put one pair at
    ``±R`` or at its kink: a lower bound of the maximum. ``kappa, d, s``
    ``(P,)``."""
    gen = torch.Generator().manual_seed(seed)
    P = kappa.shape[0]
    t = torch.randn(n, P, generator=gen, dtype=F64)
    t = t / t.norm(dim=1, keepdim=True) * R
    t[n // 2:] *= torch.rand(n - n // 2, 1, generator=gen, dtype=F64)
    eye = torch.eye(P, dtype=F64)
    kinks = -d.abs().clamp(max=R)[:, None] * d.sign()[:, None] * eye
    t = torch.cat([t, R * eye, -R * eye, kinks])
    rho = torch.relu(d + t) - torch.relu(d) - s * t
    return float((-kappa * rho).sum(dim=1).max())


def case(name: str, seed: int) -> tuple[torch.Tensor, ...]:
    """``κ, d, s`` ``(P,)`` and ``R``: random pairs (``random``), or the
    configuration where weakening ``name`` bites (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    P = 2 + seed % 3
    d = 0.5 * torch.randn(P, generator=gen, dtype=F64)
    kappa = torch.randn(P, generator=gen, dtype=F64)
    R = 0.2 + 0.8 * float(torch.rand(1, generator=gen, dtype=F64))
    if name == "side":
        d, kappa, R = 0.2 + 0.2 * d.abs(), -kappa.abs(), 0.5
    elif name == "kink":
        d, kappa = 0.2 + 0.2 * d.abs(), kappa.abs()
    s = chord_slopes(d, torch.full_like(d, 0.6 if name != "random" else R))
    return kappa, d, s, R


def bound(fn, kappa, d, s, R) -> float:
    return float(fn(kappa[None, None], d[None, None], s[None, None],
                    torch.tensor([R], dtype=F64))[0, 0])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["random", "side", "kink"])
def test_chord_remainder_bounds_the_brute_force(seed, name):
    kappa, d, s, R = case(name, seed)
    found = brute(kappa, d, s, R, seed)
    real = bound(chord_remainder, kappa, d, s, R)
    assert found <= real
    assert real <= 1.5 * found  # and the dual is not loose here


@pytest.mark.parametrize("name", list(WEAKENINGS))
def test_weakened_chord_remainder_falls_below_brute_force(name):
    weak_fn = weakened_copy(variation, "chord_remainder", WEAKENINGS[name])
    seen = []
    for seed in SEEDS:
        kappa, d, s, R = case(name, seed)
        seen.append((seed, brute(kappa, d, s, R, seed),
                     bound(weak_fn, kappa, d, s, R)))
    assert all(weak < found for _, found, weak in seen), seen


@pytest.mark.parametrize("name", list(WEAKENINGS))
def test_copies_with_nothing_replaced_are_the_real_bound(name):
    same = weakened_copy(variation, "chord_remainder",
                         [(old, old) for old, _ in WEAKENINGS[name]])
    kappa, d, s, R = case(name, 0)
    assert bound(same, kappa, d, s, R) == bound(chord_remainder, kappa, d, s, R)


def test_chord_slopes_and_max_min():
    d = torch.tensor([-2.0, -0.5, 0.0, 0.5, 2.0], dtype=F64)
    s = chord_slopes(d, torch.ones_like(d))
    assert torch.equal(s, torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=F64))
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(3, 4, 5, 5, generator=gen, dtype=F64, requires_grad=True)
    slope = torch.rand(3, 2, 5, 5, generator=gen, dtype=F64)
    out = chord_max_min(z, slope)
    assert torch.equal(out, max_min(z, dim=1))
    g = torch.randn(out.shape, generator=gen, dtype=F64)
    (grad,) = torch.autograd.grad(out, z, g)
    g1, g2 = g.chunk(2, dim=1)
    # max = b + r, min = a − r, r differentiated as s (a − b)
    expected = torch.cat([g2 + slope * (g1 - g2), g1 - slope * (g1 - g2)], dim=1)
    torch.testing.assert_close(grad, expected)


def test_the_chord_cut_lowers_margins_bounds_and_drops_keeps_verdicts(trained_cait,
                                                                      digits):
    """On this small CaiT the chords lower some margins' bounds at every ε but
    certify no point more (they do on Fashion-MNIST's stems, docs/math.md
    eq. 11.13)."""
    x, y = digits.x_test[:60].double(), digits.y_test[:60]
    cert = margin_certificate(trained_cait, x, y)
    for value in (0.05, 0.1, 0.2, 0.3):
        eps = torch.full((60,), value, dtype=F64)
        first, rest, cuts, ball = cert.terms(eps)
        plain = least_cut(first, rest, cuts, ball)
        other = plain
        for theta in CHORD_REACHES:
            chord, stem_rest, stem_cuts = cert.chord_terms(eps, theta=theta)
            n = len(stem_rest)
            other = torch.minimum(other, least_cut(
                chord, [*stem_rest, *rest[n:]], [*stem_cuts, *cuts[n:]], ball))
        wrong = torch.isfinite(cert.margins.mT)
        assert (other < plain)[wrong].any()
        # drops computes the chords' remainders only where they can change a
        # verdict: never below the least of both, never above the gradient's,
        # and the same verdicts as the least of both.
        full = other * (1 + ROUNDING)
        own, _ = cert.drops(eps)
        assert torch.all(own.mT >= full) and torch.all(own.mT <= plain * (1 + ROUNDING))
        verdict = (cert.margins.mT > full).all(dim=0) & cert.correct
        assert torch.equal(cert.certified(eps), verdict)
