"""Tests for lipvit.analysis.jacobian against dense Jacobians built independently."""

from __future__ import annotations

import pytest
import torch
from lipvit.analysis.jacobian import (
    block_jacobian_sigma,
    full_jacobian,
    jacobian_l1_linf_estimate,
)
from torch import Tensor, nn

from lipvit import ViT, ViTConfig

DT = torch.float64


def _attention_block(seed: int, D: int, scale: float = 1.0):
    """A residual single-head softmax attention + LayerNorm token map."""
    g = torch.Generator().manual_seed(seed)
    W_q, W_k, W_v = (scale * torch.randn(D, D, generator=g, dtype=DT) / D**0.5
                     for _ in range(3))

    def fn(X: Tensor) -> Tensor:
        Z = nn.functional.layer_norm(X, (D,))
        P = torch.softmax(Z @ W_q @ (Z @ W_k).mT / D**0.5, dim=-1)  # (B, N, N)
        return X + P @ Z @ W_v

    return fn


def _dense_loop(fn, X: Tensor) -> Tensor:
    """Per-sample Jacobians by torch.autograd.functional.jacobian: (B, n, n)."""
    n = X[0].numel()
    return torch.stack([
        torch.autograd.functional.jacobian(lambda x: fn(x[None])[0], X[b]).reshape(n, n)
        for b in range(X.shape[0])
    ])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_sigma_equals_svd_of_full_jacobian(seed: int) -> None:
    B, N, D = 3, 5, 4
    fn = _attention_block(seed, D, scale=2.0)
    g = torch.Generator().manual_seed(10 + seed)
    X = torch.randn(B, N, D, generator=g, dtype=DT)
    J = _dense_loop(fn, X)
    assert torch.allclose(full_jacobian(fn, X), J, atol=1e-12)
    ref = torch.linalg.matrix_norm(J, ord=2)
    assert torch.allclose(block_jacobian_sigma(fn, X, exact=True), ref, rtol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matrix_free_converges_from_below(seed: int) -> None:
    B, N, D = 4, 4, 3
    fn = _attention_block(seed, D)
    g = torch.Generator().manual_seed(20 + seed)
    X = torch.randn(B, N, D, generator=g, dtype=DT)
    exact = block_jacobian_sigma(fn, X, exact=True)
    prev = torch.zeros(B, dtype=DT)
    for n_iter in (1, 3, 10):
        est = block_jacobian_sigma(fn, X, n_iter=n_iter, tol=None, seed=seed)
        assert torch.all(est <= exact * (1 + 1e-12))
        assert torch.all(est >= prev * (1 - 1e-12))  # power iteration is monotone
        prev = est
    est = block_jacobian_sigma(fn, X, n_iter=500, tol=1e-14, seed=seed)
    assert torch.all(est <= exact * (1 + 1e-12))
    assert torch.allclose(est, exact, rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_l1_linf_estimate_matches_dense_and_bounds_sigma(seed: int) -> None:
    B, N, D = 3, 5, 3
    fn = _attention_block(seed, D, scale=3.0)
    X = 2 * torch.randn(B, N, D, generator=torch.Generator().manual_seed(30 + seed),
                        dtype=DT)
    J = _dense_loop(fn, X)
    ref = (torch.linalg.matrix_norm(J, ord=1)
           * torch.linalg.matrix_norm(J, ord=float("inf"))).sqrt()
    for chunk in (1, 4, 1000):  # chunking must not change the value
        est = jacobian_l1_linf_estimate(fn, X, chunk_size=chunk)
        assert torch.allclose(est, ref, rtol=1e-12)
    sigma = torch.linalg.matrix_norm(J, ord=2)
    assert torch.all(sigma <= est * (1 + 1e-12))


def _softmax_d1(a: float):
    """f(z) = softmax(a z zᵀ) z for z of N scalar tokens (Cauchy paper eq. 3)."""
    def fn(Z: Tensor) -> Tensor:  # (B, N, 1)
        return torch.softmax(a * Z @ Z.mT, dim=-1) @ Z
    return fn


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_single_head_d1_closed_form(seed: int) -> None:
    # J = a{diag(z) P diag(z) − diag(z ⊙ μ) P + diag(σ²)} + P, μ = Pz,
    # σ² = P z² − μ² (derived in docs/math.md §7). The paper's eq. 5 prints the
    # middle term as P diag(z) diag(μ); that version is checked to differ below.
    g = torch.Generator().manual_seed(seed)
    B, N, a = 3, 6, 0.8 + seed
    Z = torch.randn(B, N, 1, generator=g, dtype=DT)
    z = Z[..., 0]  # (B, N)
    P = torch.softmax(a * Z @ Z.mT, dim=-1)  # (B, N, N)
    mu = (P @ Z)[..., 0]
    s2 = (P @ Z.square())[..., 0] - mu.square()
    dg = torch.diag_embed
    J = a * (dg(z) @ P @ dg(z) - dg(z * mu) @ P + dg(s2)) + P
    fn = _softmax_d1(a)
    assert torch.allclose(full_jacobian(fn, Z), J, atol=1e-12)
    assert torch.allclose(block_jacobian_sigma(fn, Z, exact=True),
                          torch.linalg.matrix_norm(J, ord=2), rtol=1e-12)
    printed = a * (dg(z) @ P @ dg(z) - P @ dg(z) @ dg(mu) + dg(s2)) + P
    assert not torch.allclose(printed, J, atol=1e-3)


def test_exact_refuses_large_inputs() -> None:
    X = torch.zeros(1, 10, 10, dtype=DT)
    with pytest.raises(ValueError, match="max_size"):
        block_jacobian_sigma(torch.sin, X, exact=True, max_size=99)
    assert block_jacobian_sigma(torch.sin, X, exact=True, max_size=100).item() == 1.0


def test_model_block_float32_under_no_grad() -> None:
    # A real ViT block (parameters requiring grad), float32, called under no_grad.
    torch.manual_seed(0)
    model = ViT(ViTConfig(embed_dim=16, num_heads=2, depth=1)).eval()
    block = model.blocks[0]
    X = torch.randn(2, 17, 16)
    with torch.no_grad():
        exact = block_jacobian_sigma(block, X, exact=True)
        est = block_jacobian_sigma(block, X, n_iter=50, tol=None)
        upper = jacobian_l1_linf_estimate(block, X)
    assert exact.dtype == torch.float32 and exact.shape == (2,)
    # A residual block's top singular values cluster near 1: slow convergence.
    assert torch.all(est >= 0.98 * exact)
    assert torch.all(est <= exact * (1 + 1e-4))
    assert torch.all(exact <= upper * (1 + 1e-4))
