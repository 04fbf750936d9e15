"""``lipvit.Certifier``: built once per model, tensors out; the same answers as
``certify_samples`` for every kind of method."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from lipvit.certify.evaluate import certify_samples
from lipvit.certify.smoothing import SmoothingConfig

import lipvit
from lipvit.errors import UnsupportedModelError

EPS = [0.05, 0.1]


@pytest.mark.parametrize("method", ["global", "ball", "margin"])
def test_proven_methods_match_certify_samples(trained_cait, digits, method):
    x, y = digits.x_test[:24], digits.y_test[:24]
    cert = lipvit.Certifier(trained_cait, method=method)
    out = cert.certify(x, y, EPS)
    report = certify_samples(trained_cait, x, y, [method], EPS, radius=True)
    assert torch.equal(out.prediction, report.predictions)
    for e, eps in enumerate(EPS):
        assert torch.equal(out.certified[:, e], report.certified[f"{method}@{eps}"])
    assert torch.allclose(out.radius, report.radii[method], rtol=2e-3)
    assert torch.equal(out.certified, out.radius[:, None] >= out.eps)
    # A second call on other points reuses the model's constants.
    again = cert.certify(digits.x_test[24:30], digits.y_test[24:30], 0.05)
    assert again.certified.shape == (6, 1)


def test_default_method_and_refusals(trained_cait):
    assert lipvit.Certifier(trained_cait).method == "margin"
    with pytest.raises(ValueError, match="unknown method"):
        lipvit.Certifier(trained_cait, method="magic")
    with pytest.raises(UnsupportedModelError):
        lipvit.Certifier(lipvit.ViT(tiny_config("lipschitz")), method="ball")
    with pytest.raises(ValueError):
        lipvit.Certifier(trained_cait, method="ball").certify(
            torch.zeros(1, 1, 8, 8), torch.zeros(1, dtype=torch.long), -0.1)


def test_smoothing_returns_counts_and_lower_bounds(digits):
    torch.manual_seed(0)
    model = lipvit.ViT(tiny_config("standard")).eval()
    x, y = digits.x_test[:4], digits.y_test[:4]
    config = SmoothingConfig(sigma=0.25, n0=10, n_noise=200, batch_size=200)
    out = lipvit.Certifier(model, method="smoothing", smoothing=config).certify(
        x, y, [0.1], index=range(4))  # indices seed the noise: same draws below
    report = certify_samples(model, x, y, ["smoothing"], [0.1], radius=True,
                             smoothing=config, index=range(4))
    assert out.counts.shape == (4, 10) and torch.all(out.counts.sum(1) == 200)
    assert torch.equal(out.prediction, report.smoothing.prediction)
    assert torch.equal(out.p_lower, report.smoothing.p_lower)
    assert torch.equal(out.certified[:, 0], report.certified["smoothing@0.1"])
