"""Tests for lipvit.certify.specformer (SpecFormer Theorem 4.2, eq. 9, and its repair).

Finding asserted here: eq. (9) is *not* an upper bound when
``(N+1)(‖X0‖_F + δ0)² < 1`` (e.g. ``X0 = 0``); the repaired variant is, and
eq. (9) holds whenever ``(N+1)(‖X0‖_F + δ0)² ≥ 1``. The default ``"sound"``
variant (eq. 9 where it holds, repaired elsewhere) is what the network bound
uses; a whole network with near-zero attention inputs checks it end to end.
"""

from __future__ import annotations

import math

import pytest
import torch
from lipvit.analysis.pgd import pgd_deviation
from lipvit.certify.attention import attention
from lipvit.certify.lofast.network import network_bound
from lipvit.certify.specformer import specformer_bound, specformer_terms

import lipvit

DT = torch.float64


def layer(seed: int, B=2, N=4, D=6, H=2, d=3, qk=1.0, x=1.0):
    g = torch.Generator().manual_seed(seed)
    W_q = torch.randn(H, D, d, generator=g, dtype=DT) * qk / math.sqrt(D)
    W_k = torch.randn(H, D, d, generator=g, dtype=DT) * qk / math.sqrt(D)
    W_v = torch.randn(H, D, d, generator=g, dtype=DT) / math.sqrt(D)
    W_o = torch.randn(H, d, D, generator=g, dtype=DT) / math.sqrt(d)
    X = torch.randn(B, N, D, generator=g, dtype=DT)
    X = X * (x / torch.linalg.matrix_norm(X)[:, None, None])  # ‖X‖_F = x
    return X, W_q, W_k, W_v, W_o


def _norm(W):
    return torch.linalg.matrix_norm(W, ord=2)


@pytest.mark.parametrize("residual", [True, False])
def test_formula(residual: bool) -> None:
    X, W_q, W_k, W_v, W_o = layer(0, B=3, N=5, x=1.7)
    eps = 0.03
    N = X.shape[1]
    lip = sum(_norm(W_o[h]) * N * (N + 1) * (1.7 + eps) ** 2
              * (_norm(W_v[h]) * _norm(W_q[h]) * _norm(W_k[h]) + _norm(W_v[h]))
              for h in range(2)) + float(residual)
    out = specformer_bound(X, W_q, W_k, W_v, W_o, eps, residual=residual,
                           variant="paper")
    assert out.shape == (3,)
    assert torch.allclose(out, (lip * eps).expand(3), rtol=1e-12)
    rep = specformer_bound(X, W_q, W_k, W_v, W_o, eps, residual=residual,
                           variant="repaired")
    qk = [_norm(W_q[h] @ W_k[h].T) / math.sqrt(3) for h in range(2)]  # d = 3
    lip_rep = sum(_norm(W_o[h]) * N * _norm(W_v[h])
                  * ((N + 1) * (1.7 + eps) ** 2 * qk[h] + 1)
                  for h in range(2)) + float(residual)
    assert torch.allclose(rep, (lip_rep * eps).expand(3), rtol=1e-12)
    assert torch.all(rep <= out)  # (N+1)(‖X‖+ε)² ≥ 1 here


def _jacobian_norm(X, W, residual: bool) -> torch.Tensor:
    """Exact ‖∂F/∂X‖ at each sample (full Jacobian, SVD)."""
    norms = []
    for x in X:
        J = torch.func.jacrev(lambda z: attention(z[None], *W, residual=residual)[0])(x)
        norms.append(_norm(J.reshape(x.numel(), x.numel())))
    return torch.stack(norms)


@pytest.mark.parametrize("seed", range(3))
def test_sound_when_input_norm_at_least_one(seed: int) -> None:
    # LoFAST's regime (‖X‖_F = 1 after the projection): eq. (9) holds.
    for qk, x in [(1.0, 1.0), (6.0, 1.0), (2.0, 3.0)]:
        X, *W = layer(seed, qk=qk, x=x)
        for residual in (True, False):
            def fn(Z, W=W, residual=residual):
                return attention(Z, *W, residual=residual)

            for eps in (0.01, 0.3):
                pgd = pgd_deviation(fn, X, eps, steps=60, restarts=2, seed=seed)
                paper = specformer_bound(X, *W, eps, residual=residual,
                                         variant="paper")
                sound = specformer_bound(X, *W, eps, residual=residual)
                assert torch.equal(sound, paper)  # eq. (9) holds: it is used
                rep = specformer_bound(X, *W, eps, residual=residual,
                                       variant="repaired")
                assert torch.all(pgd <= rep) and torch.all(rep <= paper)


@pytest.mark.parametrize("residual", [True, False])
def test_eq9_fails_for_small_inputs(residual: bool) -> None:
    # Finding: at X0 = 0 the Jacobian is (11ᵀ/N) ⊗ Σ_h W_v W_o (+ I), of norm of
    # order ‖W_v W_o‖, while eq. (9) vanishes like δ0³. PGD beats eq. (9).
    _, *W = layer(1)
    X = torch.zeros(2, 4, 6, dtype=DT)
    X[1, 0, 0] = 0.02  # a tiny non-zero input as well
    eps = 0.01
    terms = specformer_terms(X, *W, residual=residual, variant="paper")
    assert not torch.any(terms.paper_holds(eps))
    paper = terms.delta(eps)
    pgd = pgd_deviation(lambda Z: attention(Z, *W, residual=residual), X, eps,
                        steps=100, restarts=4)
    assert torch.all(pgd > paper * 1.05), (pgd, paper)
    # The exact Jacobian norm at X0 already exceeds eq. (9)'s Lipschitz constant.
    assert torch.all(_jacobian_norm(X, W, residual) > terms.lipschitz(eps))
    # The repaired bound holds there.
    rep = specformer_bound(X, *W, eps, residual=residual, variant="repaired")
    assert torch.all(pgd <= rep)
    # So does the default, which falls back to it where eq. (9) fails.
    assert torch.equal(specformer_bound(X, *W, eps, residual=residual), rep)


@pytest.mark.parametrize("seed", range(3))
def test_repaired_lipschitz_bounds_jacobian_everywhere_in_ball(seed: int) -> None:
    # sup of ‖J‖ over the ball ≤ repaired Lip: check at random points of the ball,
    # for small and large inputs and sharp attention.
    g = torch.Generator().manual_seed(seed)
    cases = [(1.0, 0.0, 0.05), (1.0, 0.1, 0.02), (5.0, 1.0, 0.2), (3.0, 3.0, 0.5)]
    for qk, x, eps in cases:
        X0, *W = layer(seed + 10, B=1, N=3, D=4, H=2, d=2, qk=qk, x=max(x, 1e-300))
        if x == 0.0:
            X0 = torch.zeros_like(X0)
        rep = specformer_terms(X0, *W, residual=True, variant="repaired").lipschitz(eps)
        G = torch.randn(6, *X0.shape[1:], generator=g, dtype=DT)
        r = eps * torch.rand(6, 1, 1, generator=g, dtype=DT)
        pts = X0 + G * (r / torch.linalg.matrix_norm(G)[:, None, None])  # in the ball
        assert torch.all(_jacobian_norm(pts, W, True) <= rep)


@pytest.mark.parametrize("seed", range(3))
def test_network_bound_sound_for_near_zero_attention_inputs(seed: int) -> None:
    # Regression: the network's `specformer` bound used eq. (9) as printed and
    # was broken by PGD on a lipschitz ViT whose attention inputs are ≈ 0.
    model = lipvit.ViT(lipvit.preset("digits-tiny", family="lipschitz"))
    model = model.double().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.std.mul_(1e3)  # tokens of norm ≈ 1e-3
        model.cls_token.mul_(1e-4)
        model.pos_embed.mul_(1e-4)
        for p in model.parameters():  # a different model per seed
            p.add_(1e-3 * torch.randn(p.shape, generator=g, dtype=DT) * p.abs().mean())
    x = torch.rand(4, 1, 8, 8, generator=g, dtype=DT)  # digits-sized images
    X = model.embed(x)
    block = model.blocks[0]
    terms = specformer_terms(block.norm1(X), *block.attn.head_weights(), residual=False)
    assert not torch.any(terms.paper_holds(0.01))  # the regime where eq. (9) fails
    bound = network_bound(model, x, "specformer")
    assert bound.exact
    for eps in (0.01, 0.1):
        lower = pgd_deviation(model, x, eps, steps=60, restarts=3, seed=seed)
        assert torch.all(lower > 0)
        assert torch.all(lower <= bound.delta_out(eps)), (eps, lower)


def test_unknown_variant() -> None:
    X, *W = layer(0)
    with pytest.raises(ValueError, match="unknown SpecFormer variant"):
        specformer_terms(X, *W, variant="magic")


@pytest.mark.parametrize("eps, error", [
    (-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
    ("x", TypeError),
])
def test_bad_eps(eps, error) -> None:
    X, *W = layer(2)
    with pytest.raises(error):
        specformer_bound(X, *W, eps)
    with pytest.raises(error):
        specformer_terms(X, *W).delta(eps)
