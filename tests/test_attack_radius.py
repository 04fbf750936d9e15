"""Tests for lipvit.analysis.attack_radius: verified attack radii, per-sample ε,
soundness of certified radii against them (float64, tiny models)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_config
from lipvit.analysis import attack_radius as AR
from lipvit.analysis.gap import Gap, violations
from lipvit.certify.evaluate import certify_samples
from torch import nn

import lipvit

pytest.importorskip("torchattacks")

FAST = AR.RadiusSettings(steps=10, restarts=1, targets=2, cw_steps=30, rtol=0.02)


def _vit(family: str = "lipschitz", seed: int = 0) -> lipvit.ViT:
    torch.manual_seed(seed)
    return lipvit.ViT(tiny_config(family)).double().eval()


def _labelled(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Labels = the model's predictions: every sample is correctly classified.
    with torch.no_grad():
        return model(x).argmax(1)


def _linear(seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """An affine classifier and interior images (pixels in [0.4, 0.6]): its
    smallest adversarial radius is the first-order limit (the box never binds)."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(64, 10).double()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(10, 64, generator=g, dtype=torch.float64))
        lin.bias.zero_()
    model = nn.Sequential(nn.Flatten(), lin).eval()
    x = 0.5 + 0.1 * (torch.rand(6, 1, 8, 8, generator=g, dtype=torch.float64) - 0.5)
    return model, x, _labelled(model, x)


@pytest.mark.parametrize("seed", [0, 1])
def test_first_order_limit_is_the_affine_boundary_distance(seed):
    model, x, y = _linear(seed)
    W = model[1].weight.detach()  # (K, 64)
    logits = model(x).detach()
    expected = []
    for b in range(x.shape[0]):
        d = [(logits[b, y[b]] - logits[b, j]) / torch.linalg.norm(W[y[b]] - W[j])
             for j in range(10) if j != y[b]]
        expected.append(float(min(d)))
    got = AR.first_order_limit(model, x, y)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10)
    wrong = (y + 1) % 10
    assert torch.all(AR.first_order_limit(model, x, wrong) == 0)  # misclassified


@pytest.mark.parametrize(("attack", "steps"),
                         [("pgd-l2", 30), ("apgd", 30), ("apgd-t", 15), ("cw", 1)])
def test_affine_model_radius_is_the_boundary_distance(attack, steps):
    model, x, y = _linear(0)
    s = AR.RadiusSettings(attacks=(attack,), steps=steps, restarts=1, targets=9,
                          cw_steps=200, rtol=0.01)
    r = AR.attack_radius(model, x, y, s)
    exact = AR.first_order_limit(model, x, y).numpy()  # exact here: the box is far
    assert np.all(r.verified) and set(r.attack) == {attack}
    assert np.all(r.radius >= exact * (1 - 1e-9)), "closer than the boundary"
    if attack == "cw":  # a minimum-norm attack run once: close, not bisected
        assert np.all(r.radius <= 1.3 * exact)
    else:
        assert np.all(r.radius <= (1 + 3 * s.rtol) * exact), (r.radius / exact)


@pytest.mark.parametrize("attack", ["pgd-l2", "apgd", "apgd-t"])
def test_per_sample_eps_points_are_admissible(attack, digits):
    model = _vit()
    x = digits.x_test[:8].double()  # digits have many pixels at exactly 0
    y = _labelled(model, x)
    eps = torch.linspace(0.05, 0.8, 8, dtype=torch.float64)
    x_adv = AR.perturb_per_sample(model, x, y, eps, attack, FAST)
    dist = (x_adv - x).flatten(1).norm(dim=1)
    assert torch.all(dist <= eps * (1 + 1e-12))
    assert float(x_adv.min()) >= 0 and float(x_adv.max()) <= 1
    assert dist.max() > 0.5 * eps.max()  # the large radii are used


def test_radius_is_a_verified_adversarial_distance(digits):
    model = _vit()
    x = digits.x_test[:10].double()
    y = _labelled(model, x)
    y[:2] = (y[:2] + 1) % 10  # two misclassified samples
    r = AR.attack_radius(model, x, y, FAST)
    assert r.n == 10 and np.all(r.verified)
    assert list(r.radius[:2]) == [0, 0] and r.attack[:2] == [AR.CLEAN] * 2
    ok = r.correct
    assert ok.sum() == 8 and np.all(np.isfinite(r.radius[ok]))
    with torch.no_grad():
        pred = model(r.x_adv).argmax(1)
    assert torch.all(pred[torch.from_numpy(ok)] != y[torch.from_numpy(ok)])
    dist = (r.x_adv - x).flatten(1).norm(dim=1).numpy()
    np.testing.assert_array_equal(dist, r.radius)
    assert float(r.x_adv.min()) >= 0 and float(r.x_adv.max()) <= 1
    assert np.all(r.bracket_low <= r.radius)
    gap = r.radius[ok] - r.bracket_low[ok]
    assert np.all(gap <= FAST.rtol * r.radius[ok] + 1e-12)  # bisection converged
    # Worst case over attacks: never farther than CW alone (which runs first,
    # deterministically, and seeds the upper end).
    cw = AR.attack_radius(model, x, y, AR.RadiusSettings(
        attacks=("cw",), cw_steps=FAST.cw_steps))
    assert np.all(r.radius <= cw.radius)


@pytest.mark.parametrize("seed", [0, 1])
def test_lofast_certified_radius_is_below_the_attack_radius(seed, digits):
    """Soundness: certified ≤ true radius ≤ attack radius on every sample."""
    model = _vit("lipschitz", seed)
    x = digits.x_test[seed * 12:(seed + 1) * 12].double()
    y = _labelled(model, x)
    report = certify_samples(model, x, y, ["lofast"], [0.01], radius=True,
                             radius_tol=1e-4)
    cert = report.radii["lofast"].numpy()
    assert (cert > 0).sum() >= 6, "the check would be vacuous"
    r = AR.attack_radius(model, x, y, FAST)
    assert np.all(r.verified)
    gap = Gap(index=np.arange(12), attack=r.radius, first_order=r.first_order,
              certified={"lofast": cert}, estimates=frozenset())
    assert violations(gap) == {"lofast": 0}
    assert np.all(cert <= r.radius)


def test_violations_flag_radii_above_the_attack_radius():
    attack = np.array([0.0, 0.2, 0.3, np.inf])
    gap = Gap(index=np.arange(4), attack=attack, first_order=attack,
              certified={"a": np.array([0, 0.1, 0.31, 5.0]),
                         "b": np.array([0, 0.25, 0.0, 0.0]),
                         "est": np.array([0, 1.0, 1.0, 0.0])},
              estimates=frozenset({"est"}))
    assert violations(gap) == {"a": 1, "b": 1}


@pytest.mark.parametrize("kwargs", [
    {"attacks": ()}, {"attacks": ("pgd",)}, {"attacks": ("cw", "cw")},
    {"steps": 0}, {"rtol": 0.0}, {"rtol": float("nan")}, {"max_radius": -1.0},
    {"max_radius": float("nan")}, {"cw_c": (0.0,)},
])
def test_settings_reject_bad_values(kwargs):
    with pytest.raises(ValueError):
        AR.RadiusSettings(**kwargs)


def test_bad_images_are_refused():
    model, x, y = _linear(0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        AR.attack_radius(model, x + 1, y, FAST)
    with pytest.raises(ValueError, match="expected images"):
        AR.attack_radius(model, x, y[:3], FAST)
    with pytest.raises(ValueError, match="no samples"):
        AR.attack_radius(model, x[:0], y[:0], FAST)
