"""The weighted factorisation bound on the softmax path through the norm
(certify/taylor/softmax_norm.py, docs/taylor.md §8) against the dense Jacobian."""

from __future__ import annotations

import math

import pytest
import torch
from lipvit.certify.attention import bound_weights, value_output
from lipvit.certify.lofast.network import network_bound
from lipvit.certify.taylor.forward import forward
from lipvit.certify.taylor.remainders import softmax_path
from lipvit.certify.taylor.softmax_norm import (
    descend,
    factor_bound,
    initial_weights,
    softmax_factors,
    softmax_norm_bound,
    weighted_norm,
)
from lipvit.certify.taylor.subblock import token_jacobians, with_softmax_gains

from tests.conftest import full_jacobian, nonlinear_model

F64 = torch.float64
CASES = [("standard", {}), ("standard", {"ln_eps": 0.3}),
         ("lipschitz", {"attn_project": "token", "attn_radius": 1.0}),
         ("lipschitz", {"attn_project": "frobenius", "attn_radius": 1.0})]


def _blocks(family, kw, seed):
    """Per block: the factors, the dense ``‖S J_N‖`` per sample, and the
    softmax path's earlier bound (``max_r R_r ‖M‖ ‖J_N‖``)."""
    ln_eps = kw.pop("ln_eps", None)
    model = nonlinear_model(family, seed, **kw)
    if ln_eps is not None:
        for blk in model.blocks:
            blk.norm1.eps = ln_eps
    x = torch.rand(3, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        clean = forward(model, x)[1]
        terms = network_bound(model, x, "lofast").attention_terms
    out = []
    for k, blk in enumerate(model.blocks):
        X, Y = clean.stream[2 * k], clean.attn_in[k]
        W_q, W_k, W_v, W_o = bound_weights(blk.attn)
        A = W_q @ W_k.transpose(-1, -2) / math.sqrt(W_q.shape[-1])
        logits = torch.einsum("bnd,hde,bme->bhnm", Y, A, Y)
        assert torch.allclose(logits, terms[k].logits, rtol=1e-12, atol=1e-12)
        P = torch.softmax(logits, -1)
        V = torch.einsum("bnd,hde->bhne", Y, value_output(W_v, W_o))  # (B, H, N, D)

        def soft(v, b, blk=blk, A=A, V=V):  # the softmax path: V held clean
            Yv = blk.norm1(v[None])[0]
            P_v = torch.softmax(torch.einsum("nd,hde,me->hnm", Yv, A, Yv), -1)
            return torch.einsum("hnm,hme->ne", P_v, V[b])

        exact = torch.stack([torch.linalg.matrix_norm(full_jacobian(
            lambda v, b=b: soft(v, b), X[b]), ord=2) for b in range(len(x))])
        with torch.no_grad():
            f = softmax_factors(Y, W_q, W_k, W_v, W_o, P, token_jacobians(blk.norm1, X))
            gains = with_softmax_gains(blk, Y, terms[k])
        out.append((f, exact, softmax_path(gains)))
    return out


@pytest.mark.parametrize("family,kw", CASES)
@pytest.mark.parametrize("seed", range(3))
def test_weighted_norm_bounds_the_dense_softmax_path_for_any_weights(family, kw, seed):
    """The factorisation lemma holds for every choice of weights: random ones,
    the initial ones and the descended ones."""
    gen = torch.Generator().manual_seed(seed)
    for f, exact, _ in _blocks(family, dict(kw), seed):
        B, N, H = f.g.shape[:3]
        lw0, lv0 = initial_weights(f)
        choices = [(lw0, lv0), descend(f, lw0, lv0, 20),
                   (torch.zeros(B, N, H, N, dtype=F64), torch.zeros(B, N, dtype=F64))]
        choices += [(3 * torch.randn(B, N, H, N, dtype=F64, generator=gen),
                     3 * torch.randn(B, N, dtype=F64, generator=gen)) for _ in range(3)]
        for lw, lv in choices:
            bound = weighted_norm(f, lw, lv)
            assert torch.all(bound >= exact * (1 - 1e-12)), (bound, exact)


@pytest.mark.parametrize("family,kw", CASES[:2])
@pytest.mark.parametrize("seed", range(3))
def test_descended_weights_tighten_the_standard_softmax_path(family, kw, seed):
    """On LayerNorm blocks the descent lowers the bound below the initial
    weights' and below the rows' product bound, to within 3× the exact norm."""
    for f, exact, rows in _blocks(family, dict(kw), seed):
        lw0, lv0 = initial_weights(f)
        start = weighted_norm(f, lw0, lv0)
        bound = factor_bound(f)
        assert torch.all(bound <= start), (bound, start)
        assert torch.all(bound >= exact * (1 - 1e-12))
        assert torch.all(bound <= exact * 3), bound / exact
        J_norm = torch.linalg.matrix_norm(f.J, 2).amax(-1)
        assert torch.all(bound < rows * J_norm), (bound, rows * J_norm)


def test_softmax_norm_bound_chunks_samples_like_one_batch(monkeypatch):
    """Chunking the batch (a small memory budget) gives the same bounds."""
    model = nonlinear_model("standard", 0)
    x = torch.rand(3, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        clean = forward(model, x)[1]
        blk, X, Y = model.blocks[0], clean.stream[0], clean.attn_in[0]
        W = bound_weights(blk.attn)
        A = W[0] @ W[1].transpose(-1, -2) / math.sqrt(W[0].shape[-1])
        P = torch.softmax(torch.einsum("bnd,hde,bme->bhnm", Y, A, Y), -1)
        J = token_jacobians(blk.norm1, X)
        whole = softmax_norm_bound(Y, *W, P, J)
        monkeypatch.setattr("lipvit.certify.taylor.softmax_norm._CHUNK_BYTES", 1)
        chunked = softmax_norm_bound(Y, *W, P, J)
    assert torch.allclose(whole, chunked, rtol=1e-12)
