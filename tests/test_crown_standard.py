"""CROWN on the standard family: lipvit's relaxations of the exact GELU and of
LayerNorm's ``1/√(v + η)`` (lipvit.certify.crown.relaxations), and whole-network
bounds of trained LayerNorm/GELU ViTs against sampling and PGD (float64,
several seeds); certified points survive attacks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lipvit.certify.crown import bounds as crown
from lipvit.certify.crown.relaxations import (
    gelu,
    gelu_range,
    gelu_relaxation,
    rsqrt,
    rsqrt_relaxation,
)
from lipvit.certify.crown.verifiable import GELU, RSqrt, to_verifiable
from lipvit.certify.evaluate import certify_samples

from lipvit.config import ViTConfig
from tests.test_crown import (
    DT,
    TINY,
    assert_logit_bounds_hold,
    assert_survive_attacks,
    needs_lirpa,
    pgd_margins,
    train_tiny,
)

GRID = 401
TOL = 1e-9  # float64 rounding in auto_LiRPA's sums


def _intervals(seed: int, n: int = 3000, scale: float = 3.0) -> tuple:
    """``n`` intervals: centres ``N(0, scale²)``, widths from 0 to about 20
    (log-uniform, some exactly 0)."""
    g = torch.Generator().manual_seed(seed)
    centre = scale * torch.randn(n, generator=g, dtype=DT)
    width = 10.0 ** (-9 + 10.3 * torch.rand(n, generator=g, dtype=DT))
    width[:30] = 0.0
    return centre - width / 2, centre + width / 2


def _grid(lo: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return lo[:, None] + (up - lo)[:, None] * torch.linspace(0, 1, GRID, dtype=DT)


@pytest.mark.parametrize("seed", range(3))
def test_gelu_relaxation_brackets_and_touches_the_function(seed):
    lo, up = _intervals(seed)
    k_l, b_l, k_u, b_u = gelu_relaxation(lo, up)
    x = _grid(lo, up)
    g = gelu(x)
    below = g - (k_l[:, None] * x + b_l[:, None])
    above = (k_u[:, None] * x + b_u[:, None]) - g
    assert torch.all(below >= 0) and torch.all(above >= 0)
    # Each line touches g (h's extremes are exact): the gap at the nearest grid
    # point is at most ½ max|g″| h² (max|g″| = 2φ(0) < 0.8), h the grid step.
    step = (up - lo) / (GRID - 1)
    slack = 0.4 * step**2 + 1e-9
    assert torch.all(below.amin(1) <= slack) and torch.all(above.amin(1) <= slack)


@pytest.mark.parametrize("seed", range(2))
def test_gelu_range_is_the_functions_range(seed):
    lo, up = _intervals(seed + 10)
    low, high = gelu_range(lo, up)
    g = gelu(_grid(lo, up))
    assert torch.all(low <= g.amin(1)) and torch.all(high >= g.amax(1))
    step = (up - lo) / (GRID - 1)
    assert torch.all(g.amin(1) - low <= 0.4 * step**2 + 1e-9)
    assert torch.all(high - g.amax(1) <= 0.4 * step**2 + 1e-9)
    # GELU's minimum, −0.17 near x = −0.75, is found inside a wide interval.
    low, _ = gelu_range(torch.tensor([-5.0], dtype=DT), torch.tensor([5.0], dtype=DT))
    assert -0.1701 < float(low) < -0.1699


@pytest.mark.parametrize("eta", [1e-5, 1e-6, 0.5])
def test_rsqrt_relaxation_brackets_the_function(eta):
    lo, up = _intervals(int(eta * 1e6), scale=2.0)  # lower bounds below 0 too
    k_l, b_l, k_u, b_u = rsqrt_relaxation(lo, up, eta)
    v = _grid(lo.clamp_min(0), up)  # variances are never negative
    f = rsqrt(v, eta)
    assert torch.all(k_l[:, None] * v + b_l[:, None] <= f)
    assert torch.all(k_u[:, None] * v + b_u[:, None] >= f)
    # The chord is exact at both ends of an interval that is not degenerate.
    wide = (up - lo.clamp_min(0)) > 1e-9
    assert wide.sum() > 1000 and (lo < 0).sum() > 500
    ends = v[wide][:, [0, -1]]
    chord = k_u[wide, None] * ends + b_u[wide, None]
    f_ends = rsqrt(ends, eta)  # the widening is relative to the larger, f(l)
    assert torch.all((chord - f_ends).abs() <= 1e-9 * f_ends[:, :1])


def test_custom_operators_compute_the_model_functions_and_gradients():
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(200, generator=g, dtype=DT)).requires_grad_(True)
    assert torch.allclose(GELU.apply(x, None), F.gelu(x), rtol=0, atol=1e-14)
    (ours,) = torch.autograd.grad(GELU.apply(x, None).sum(), x)
    (ref,) = torch.autograd.grad(F.gelu(x).sum(), x)
    assert torch.allclose(ours, ref, rtol=0, atol=1e-13)
    v = (torch.rand(200, generator=g, dtype=DT) * 4).requires_grad_(True)
    (ours,) = torch.autograd.grad(RSqrt.apply(v, 1e-5).sum(), v)
    (ref,) = torch.autograd.grad((1 / torch.sqrt(v + 1e-5)).sum(), v)
    assert torch.allclose(ours, ref, rtol=1e-12, atol=0)


# --- whole networks (auto_LiRPA) ---------------------------------------------------

@pytest.fixture(scope="module", params=(0, 1))
def standard(request, digits):
    """A tiny standard (LayerNorm, GELU) ViT trained briefly with seed
    ``request.param``, and 4 correctly classified test points."""
    cfg = ViTConfig(**{**TINY, "family": "standard"}, mean=digits.mean, std=digits.std)
    model = train_tiny(cfg, digits, seed=request.param, steps=300, lr=1e-2)
    x, y = digits.x_test[:40].to(DT), digits.y_test[:40]
    with torch.no_grad():
        right = (model(x).argmax(1) == y).nonzero()[:4, 0]
    return model, x[right], y[right]


@pytest.mark.crown
@needs_lirpa
def test_standard_logit_bounds_contain_sampled_and_attacked_points(standard):
    model, x, y = standard
    eps = 0.01
    lb, ub = crown.crown_logit_bounds(model, x, eps, chunk_size=None)  # 4 in one
    assert torch.all(torch.isfinite(lb)) and torch.all(torch.isfinite(ub))
    assert torch.all((ub - lb).amax(1) < 2.0)  # not vacuous (logits span ~15)
    assert_logit_bounds_hold(model, x, y, eps, lb, ub, tol=TOL)


@pytest.mark.crown
@needs_lirpa
def test_standard_certified_points_survive_attacks(standard, monkeypatch):
    model, x, y = standard
    prepared = crown.crown_model(model)
    bounded_ops = None
    # crown_certify's CROWN margin bounds are the ones checked against PGD here
    # (the same model, points, labels, ε, chunk (all four points) and prepared
    # model; CROWN has nothing to stop early): computed once, crown_certify
    # decides from them.
    bounds, computed = crown.crown_margin_bounds, {}

    def margin_bounds_once(model_, x_, y_, eps_, **kw):
        kw.pop("stop_when_positive", None)
        if (model_ is model and x_ is x and y_ is y and eps_ in computed
                and kw.get("method", "CROWN") == "CROWN"
                and kw.get("prepared") is prepared
                and kw.get("chunk_size", 2) is None):
            return computed[eps_]
        return bounds(model_, x_, y_, eps_, **kw)

    monkeypatch.setattr(crown, "crown_margin_bounds", margin_bounds_once)
    for eps in (0.002, 0.02):
        mlb = computed[eps] = bounds(model, x, y, eps, prepared=prepared,
                                     chunk_size=None)
        assert torch.all(pgd_margins(model, x, y, eps, steps=30) >= mlb - TOL)
        cert = crown.crown_certify(model, x, y, eps, prepared=prepared,
                                   chunk_size=None)
        if eps == 0.002:
            assert cert.any(), "a trained tiny model certifies at a small radius"
        if cert.any():
            assert_survive_attacks(model, x[cert], y[cert], eps, steps=30, restarts=1)
        bounded_ops = {type(n).__name__ for b in prepared.cache.values()
                       for n in b.modules() if getattr(n, "perturbed", False)}
    # lipvit's GELU and LayerNorm operators are what bounds the model.
    assert {"BoundGELU", "BoundRSqrt"} <= bounded_ops
    twin = to_verifiable(model)
    with torch.no_grad():
        assert torch.allclose(twin(x.flatten(1)), model(x), rtol=0, atol=1e-10)


@pytest.mark.crown
@needs_lirpa
def test_standard_family_runs_through_certify_samples(standard):
    model, x, y = standard
    report = certify_samples(model, x[:2], y[:2], ["crown", "cascade-taylor"], [0.002])
    by_method = {r["method"]: r for r in report.to_records()}
    assert set(by_method) == {"crown", "cascade-taylor"}
    # The cascade certifies whatever CROWN alone does.
    assert (by_method["cascade-taylor"]["certified_accuracy"]
            >= by_method["crown"]["certified_accuracy"])
