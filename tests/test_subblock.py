"""The structured bound on an attention sub-block's Jacobian norm
(certify/taylor/subblock.py, docs/taylor.md §8) against the dense Jacobian, for
LayerProject (lipschitz) and LayerNorm (standard) blocks."""

from __future__ import annotations

import pytest
import torch
from lipvit.certify.attention import bound_weights
from lipvit.certify.local import layernorm_local_lipschitz
from lipvit.certify.lofast.network import network_bound
from lipvit.certify.taylor.certificate import taylor_bound
from lipvit.certify.taylor.forward import forward
from lipvit.certify.taylor.remainders import attention_jacobian_norm
from lipvit.certify.taylor.subblock import (
    subblock_bound,
    subblock_parts,
    with_softmax_gains,
)

from tests.conftest import full_jacobian, nonlinear_model, share_jets

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
        with torch.no_grad():
            gains = with_softmax_gains(blk, clean.attn_in[k], terms[k])
            bounds.append(subblock_bound(blk, X, gains))
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


@pytest.mark.parametrize("ln_eps", [1e-6, 0.3])  # 0.3: LayerNorm keeps part of û_t
@pytest.mark.parametrize("seed", range(4))
def test_layernorm_subblock_norm_bounds_the_dense_jacobian(ln_eps, seed):
    model = nonlinear_model("standard", seed)
    for blk in model.blocks:
        blk.norm1.eps = ln_eps
    x = torch.rand(3, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(seed))
    bound, exact = _bound_and_exact(model, x)
    assert torch.all(bound >= exact * (1 - 1e-12)), (bound, exact)


def test_layernorm_subblock_norm_is_far_below_the_product_bound():
    """On a standard model the structured bound (value path by ζ of ``P D_c``,
    softmax path by rows) is within 4× the exact norm and well below the
    product ``1 + ‖J_a‖ ‖J_N‖`` (5–6× the exact norm on this model; 15–140×
    on trained ones, bench/studies/subblock_norms.py)."""
    model = nonlinear_model("standard", 0)
    x = torch.rand(3, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(0))
    bound, exact = _bound_and_exact(model, x)
    with torch.no_grad():
        clean = forward(model, x)[1]
        terms = network_bound(model, x, "lofast").attention_terms
    for k, blk in enumerate(model.blocks):
        X = clean.stream[2 * k]
        L_N = layernorm_local_lipschitz(X, blk.norm1.weight, blk.norm1.eps,
                                        torch.zeros(3, dtype=F64))
        product = 1 + attention_jacobian_norm(terms[k]) * L_N
        assert torch.all(bound[:, k] < product * 0.6), (bound[:, k], product)
    assert torch.all(bound <= exact * 4), bound / exact


def _dense_paths(blk, X: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """Exact ``‖I + K J_N‖`` and ``‖S J_N‖`` of ``blk``'s attention sub-block
    at one sample's input ``X`` ``(N, D)``, ``P`` ``(H, N, N)`` its attention:
    the value path from the Jacobian with ``P`` held fixed, the softmax path
    the rest of the whole sub-block's."""
    W_v, W_o = bound_weights(blk.attn)[2:]

    def value(v):
        heads = torch.einsum("hrk,kd,hde->hre", P, blk.norm1(v[None])[0], W_v)
        return v + torch.einsum("hre,hef->rf", heads, W_o)

    J_value = full_jacobian(value, X)
    J_sub = full_jacobian(lambda v: v + blk.attn(blk.norm1(v[None]))[0], X)
    return torch.linalg.matrix_norm(torch.stack([J_value, J_sub - J_value]), ord=2)


@pytest.mark.parametrize("family,kw", [("standard", {}),
                                       ("lipschitz", {"attn_project": "token"})])
@pytest.mark.parametrize("seed", range(3))
def test_each_part_bounds_its_own_path(family, kw, seed):
    """:func:`subblock_parts`: the value part bounds ``‖I + K J_N‖`` (the
    attention matrices held at the clean point; 1.00–1.11× it here) and the
    softmax part the rest of the attention's Jacobian, ``‖S J_N‖`` (1.2–2.2×),
    each against its dense Jacobian (what ``bench/studies/subblock_norms.py --paths``
    compares)."""
    model = nonlinear_model(family, seed, **kw)
    x = torch.rand(2, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        clean = forward(model, x)[1]
        terms = network_bound(model, x, "lofast").attention_terms
    for k, blk in enumerate(model.blocks):
        X = clean.stream[2 * k]
        with torch.no_grad():
            gains = with_softmax_gains(blk, clean.attn_in[k], terms[k])
            parts = torch.stack(subblock_parts(blk, X, gains), 1)  # (B, 2)
        P = torch.softmax(terms[k].logits, -1)
        exact = torch.stack([_dense_paths(blk, X[b], P[b]) for b in range(len(x))])
        assert torch.all(parts >= exact * (1 - 1e-12)), (parts, exact)


@pytest.mark.parametrize("family", ["lipschitz", "standard"])
def test_structured_bound_never_lowers_the_radius(family, monkeypatch):
    """Without the exact sub-block norms (a large model) the structured bound
    only tightens the budgets: every radius is at least the product bound's."""
    monkeypatch.setattr("lipvit.certify.taylor.subblock.EXACT_MAX", 0)
    kw = {"attn_radius": 3.0} if family == "lipschitz" else {}
    model = nonlinear_model(family, 0, patch_size=4, **kw)  # 5 tokens: any size
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 / 3)
    x = torch.rand(4, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = model(x).argmax(1)
    # Both bounds take the same second-order models of the images (the standard
    # family's jets; the sub-block bound does not enter them): built once.
    share_jets(monkeypatch, {})
    with_it = taylor_bound(model, x, y).radius()
    monkeypatch.setattr("lipvit.certify.taylor.certificate.subblock_bound",
                        lambda *a, **kw: torch.full((len(x),), torch.inf, dtype=F64))
    without = taylor_bound(model, x, y).radius()
    assert torch.all(with_it >= without) and torch.any(with_it > 0)
