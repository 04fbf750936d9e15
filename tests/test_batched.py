"""Certificates of a batch are those of its samples alone (issue: ``taylor`` and
``lofast`` batched across samples): every bound of a sample is the same, to
1e-9, whether it is computed alone or beside others, whatever the tangent
pushes' sizes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from lipvit.certify.certification import falsi_radius
from lipvit.certify.lofast.network import network_bound
from lipvit.certify.taylor.certificate import taylor_bound

from lipvit.spectral import matrix_power_iteration
from tests.conftest import nonlinear_model, share_jets

F64 = torch.float64
EPS = (0.005, 0.02, 0.1)


def _batch(family: str, seed: int, n: int = 3, **kw):
    """``n`` images of a nonlinear model with 4×4 patches (5 tokens: a sample's
    bounds do not depend on its batch whatever the size, and every stage runs)."""
    model = nonlinear_model(family, seed, patch_size=4, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.rand(n, 1, 8, 8, dtype=F64, generator=g)
    with torch.no_grad():
        y = model(x).argmax(1)
    return model, x, y


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to a relative 1e-9 (the same infinities)."""
    same_inf = torch.equal(torch.isinf(a), torch.isinf(b))
    fin = torch.isfinite(a)
    return same_inf and torch.allclose(a[fin], b[fin], rtol=1e-9, atol=1e-300)


@pytest.fixture(scope="module")
def jets_cache() -> dict:
    """The standard model's second-order models, built once for this module
    (:func:`tests.conftest.share_jets`): each is one sample's, built from that
    sample alone whatever its batch, and depends on neither the Jacobian
    norms' mode nor the push size."""
    return {}


# Each architecture with each value of ``exact`` and of ``push``, and every
# (exact, push) pair somewhere: pairwise, not the whole product.
@pytest.mark.parametrize(("family", "kw", "exact", "push"), [
    ("lipschitz", {}, True, None), ("lipschitz", {}, False, 3),
    ("lipschitz", {"attn_project": "token"}, True, 3),
    ("lipschitz", {"attn_project": "token"}, False, None),
    ("standard", {}, True, 3), ("standard", {}, False, None),
])
def test_taylor_of_a_batch_is_each_samples_alone(family, kw, exact, push,
                                                 monkeypatch, jets_cache):
    """Margin drops at several ε, every remainder part and the radii of three
    images together equal each image's alone; ``exact``: the whole-matrix
    Jacobian norms from Gram matrices, else the patch-block bound; ``push``:
    tangents per sample and push (a few: many pushes; ``None``: the default)."""
    share_jets(monkeypatch, jets_cache)
    if not exact:
        monkeypatch.setattr("lipvit.certify.taylor.jacobian_norms.EXACT_GRAM_MAX", 0)
    if push is not None:
        monkeypatch.setattr("lipvit.certify.taylor.symbols.push_size", lambda lin: push)
    model, x, y = _batch(family, 3, **kw)
    together = taylor_bound(model, x, y)
    alone = [taylor_bound(model, x[i:i + 1], y[i:i + 1]) for i in range(len(x))]
    for eps in EPS:
        assert _close(together.margin_drop(eps),
                      torch.cat([t.margin_drop(eps) for t in alone])), eps
        parts = together.remainders(torch.full((len(x),), eps, dtype=F64))
        for name, value in parts.items():
            each = [t.remainders(torch.full((1,), eps, dtype=F64))[name] for t in alone]
            assert _close(value, torch.cat(each)), (eps, name)
    assert _close(together.radius(), torch.cat([t.radius() for t in alone]))


@pytest.mark.parametrize("family", ["lipschitz", "standard"])
def test_radius_search_probes_only_the_samples_still_searching(family, monkeypatch):
    """The radius search that computes only the samples still searching gives
    the radii of the one that probes the whole batch every time (the others at
    ε = 0), to 1e-9, on a batch whose samples converge at different probes:
    each probe after the first few serves fewer samples. (Without the
    second-order models, which are built per sample: the test above restricts
    them in its radius search.)"""
    monkeypatch.setattr("lipvit.certify.taylor.margin_jets.supports", lambda m: False)
    model, x, y = _batch(family, 3, n=4)
    tb = taylor_bound(model, x, y)
    served = []

    def take(index):
        served.append(len(index))
        return tb.take(index)

    restricted = replace(tb, take=take).radius()
    monkeypatch.setattr(
        "lipvit.certify.taylor.certificate.falsi_radius",
        lambda slack, *args, restrict=None, **kw: falsi_radius(slack, *args, **kw))
    assert _close(restricted, tb.radius())
    assert served == sorted(served, reverse=True) and len(set(served)) >= 2, served
    assert bool((restricted > 0).all())


def test_lofast_of_a_batch_is_each_samples_alone():
    """LoFAST's δ_out of a batch equals each sample's alone (the power
    iterations start every sample from the same vector and stop each where it
    would alone)."""
    model, x, _ = _batch("standard", 5, n=4)
    eps = torch.full((len(x),), 0.05, dtype=F64)
    together = network_bound(model, x, "lofast").delta_out(eps)
    alone = torch.cat([network_bound(model, x[i:i + 1], "lofast").delta_out(eps[:1])
                       for i in range(len(x))])
    assert _close(together, alone)


def test_power_iteration_stops_each_entry_as_if_alone():
    """Matrices that converge at different speeds: each entry's σ and ``v``
    are those of its own run, however long the slowest one takes."""
    g = torch.Generator().manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(3, 6, 6, dtype=F64, generator=g))
    gaps = torch.tensor([[5.0, 1.0], [1.1, 1.0], [1.01, 1.0]], dtype=F64)
    s = torch.cat([gaps, torch.full((3, 4), 0.5, dtype=F64)], dim=1)
    W = U @ torch.diag_embed(s) @ U.mT  # (3, 6, 6)
    v0 = torch.randn(1, 6, dtype=F64, generator=g).expand(3, 6)
    together = matrix_power_iteration(W, v0, 500, tol=1e-10)
    for i in range(3):
        alone = matrix_power_iteration(W[i:i + 1], v0[i:i + 1], 500, tol=1e-10)
        assert torch.equal(together.sigma[i:i + 1], alone.sigma)
        assert torch.equal(together.v[i:i + 1], alone.v)
