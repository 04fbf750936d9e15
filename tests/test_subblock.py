"""The structured bound on a lipschitz attention sub-block's Jacobian norm
(certify/subblock.py, docs/taylor.md §8) against the dense Jacobian."""

from __future__ import annotations

import pytest
import torch
from lipvit.certify.attention import bound_weights
from lipvit.certify.network import network_bound
from lipvit.certify.remainders import softmax_path
from lipvit.certify.sites import forward
from lipvit.certify.subblock import projected_subblock_norm, projection_structure
from lipvit.certify.taylor import taylor_bound

from tests.conftest import full_jacobian, nonlinear_model

F64 = torch.float64


def _bound_and_exact(model, x):
    """The structured bound and the dense Jacobian norm of every block's
    ``s ↦ s + attn(P₁(s))`` at the clean point, ``(B, K)`` each."""
    with torch.no_grad():
        clean = forward(model, x)[1]
        terms = network_bound(model, x, "lofast").attention_terms
    bounds, exact = [], []
    for k, blk in enumerate(model.blocks):
        X = clean.stream[2 * k]
        c, U = projection_structure(X, blk.norm1.radius, blk.norm1.mode)
        W_v, W_o = bound_weights(blk.attn)[2:]
        bounds.append(projected_subblock_norm(
            torch.softmax(terms[k].logits, -1), W_v, W_o, c, U, softmax_path(terms[k])))
        exact.append(torch.stack([
            torch.linalg.matrix_norm(full_jacobian(
                lambda v, blk=blk: v + blk.attn(blk.norm1(v[None]))[0], X[b]), ord=2)
            for b in range(len(x))]))
    return torch.stack(bounds, 1), torch.stack(exact, 1)


@pytest.mark.parametrize("mode", ["frobenius", "token"])
@pytest.mark.parametrize("radius", [0.3, 3.0, 100.0])  # all, some, no tokens projected
@pytest.mark.parametrize("seed", range(4))
def test_structured_subblock_norm_bounds_the_dense_jacobian(mode, radius, seed):
    model = nonlinear_model("lipschitz", seed, attn_project=mode, attn_radius=radius)
    x = torch.rand(3, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(seed))
    bound, exact = _bound_and_exact(model, x)
    assert torch.all(bound >= exact * (1 - 1e-12)), (bound, exact)


@pytest.mark.parametrize("mode", ["frobenius", "token"])
@pytest.mark.parametrize("seed", range(3))
def test_structured_subblock_norm_is_tight_for_uniform_attention(mode, seed):
    """With ``W_q = 0`` (uniform attention, as MSVP leaves a lipschitz model)
    the softmax path vanishes and the bound is close to the exact norm, far
    below the product ``1 + ‖J_a‖‖J_N‖``."""
    model = nonlinear_model("lipschitz", seed, attn_project=mode, attn_radius=1.0)
    with torch.no_grad():
        for blk in model.blocks:
            D = blk.attn.qkv.weight.shape[1]
            blk.attn.qkv.parametrizations.weight.original[:D].zero_()  # W_q
    x = torch.rand(3, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(seed))
    assert torch.all(model.blocks[0].attn.head_weights().W_q == 0)
    bound, exact = _bound_and_exact(model, x)
    assert torch.all(bound >= exact * (1 - 1e-12))
    assert torch.all(bound <= exact * 1.1), bound / exact


def test_structured_bound_never_lowers_the_radius(monkeypatch):
    """Without the exact sub-block norms (a large model) the structured bound
    only tightens the budgets: every radius is at least the product bound's."""
    monkeypatch.setattr("lipvit.certify.sites.EXACT_MAX", 0)
    model = nonlinear_model("lipschitz", 0, attn_radius=3.0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 / 3)
    x = torch.rand(4, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = model(x).argmax(1)
    with_it = taylor_bound(model, x, y).radius()
    monkeypatch.setattr("lipvit.certify.taylor.projected_subblock_norm",
                        lambda *a: torch.full((len(x),), torch.inf, dtype=F64))
    without = taylor_bound(model, x, y).radius()
    assert torch.all(with_it >= without) and torch.any(with_it > 0)
