"""Soundness of lipvit.certify.local: PGD and exact Jacobians never beat its bounds."""

from __future__ import annotations

import math

import pytest
import torch
from lipvit.analysis import pgd_deviation
from lipvit.analysis.jacobian import block_jacobian_sigma
from lipvit.certify.local import (
    GELU_DERIV_MAX,
    gelu_deriv_max,
    gelu_mlp_local_lipschitz,
    layer_project_is_identity,
    layer_project_local_lipschitz,
    layernorm_local_lipschitz,
    linear_norm,
)
from torch import Tensor
from torch.nn import functional as F

from lipvit.layers import layer_project

DT = torch.float64
SLACK = 1 + 1e-9  # float rounding only


def _ball_points(X: Tensor, eps: float, g: torch.Generator, k: int) -> list[Tensor]:
    """Points of the Frobenius ε-ball: random, on the sphere, and aimed at tokens.

    The aimed points spend the whole budget moving one token towards the origin
    or towards its mean (where LayerNorm and LayerProject are steepest).
    """
    B = X.shape[0]
    pts = []
    for _ in range(k):
        d = torch.randn(X.shape, generator=g, dtype=DT)
        d = d / torch.linalg.vector_norm(d.reshape(B, -1), dim=1)[:, None, None]
        r = torch.rand(B, 1, 1, generator=g, dtype=DT)
        pts += [X + eps * r * d, X + eps * d]
    for target in (X, X - X.mean(-1, keepdim=True)):
        i = torch.linalg.vector_norm(target, dim=-1).argmin(-1)  # (B,) smallest token
        d = torch.zeros_like(X)
        rows = torch.arange(B)
        d[rows, i] = -target[rows, i] / torch.linalg.vector_norm(
            target[rows, i], dim=-1, keepdim=True)
        pts.append(X + eps * (1 - 1e-12) * d)
    return pts


# ---------------------------------------------------------------- LayerNorm


def _ln_case(seed: int, B: int = 3, N: int = 4, D: int = 6):
    g = torch.Generator().manual_seed(seed)
    # Token scales from 0.05 to 3: some balls come close to the centring null space.
    scale = torch.logspace(-1.3, 0.5, N, dtype=DT)[None, :, None]
    X = scale * torch.randn(B, N, D, generator=g, dtype=DT)
    gamma = torch.randn(D, generator=g, dtype=DT)
    beta = torch.randn(D, generator=g, dtype=DT)
    return g, X, gamma, beta


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("eta", [1e-5, 1e-2])
@pytest.mark.parametrize("eps", [0.01, 0.1, 0.5])
def test_layernorm_bound_not_beaten_by_pgd(seed: int, eta: float, eps: float) -> None:
    g, X, gamma, beta = _ln_case(seed)
    L = layernorm_local_lipschitz(X, gamma, eta, eps)

    def fn(Z: Tensor) -> Tensor:
        return F.layer_norm(Z, (Z.shape[-1],), gamma, beta, eta)

    dev = pgd_deviation(fn, X, eps, steps=60, restarts=3, seed=seed)
    assert torch.all(dev <= L * eps * SLACK)
    assert torch.all(dev > 0)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("eps", [0.02, 0.3])
def test_layernorm_jacobian_in_ball_below_bound(seed: int, eps: float) -> None:
    g, X, gamma, beta = _ln_case(seed)
    eta = 1e-3
    L = layernorm_local_lipschitz(X, gamma, eta, eps)

    def fn(Z: Tensor) -> Tensor:
        return F.layer_norm(Z, (Z.shape[-1],), gamma, beta, eta)

    sigmas = torch.stack([block_jacobian_sigma(fn, P, exact=True)
                          for P in _ball_points(X, eps, g, 3)])
    assert torch.all(sigmas <= L * SLACK)
    # Per token the bound at ε = 0 is attained by the Jacobian at X when γ = c·1.
    L0 = layernorm_local_lipschitz(X, None, eta, 0.0)
    sig0 = block_jacobian_sigma(lambda Z: F.layer_norm(Z, (Z.shape[-1],), eps=eta), X,
                                exact=True)
    assert torch.allclose(sig0, L0, rtol=1e-10)


def test_layernorm_pgd_beats_the_constant_taken_at_the_centre() -> None:
    # The test can fail: L_LN(x, 0) (ignoring the ball) is beaten by PGD when the
    # ball nearly reaches the token's mean, while L_LN(x, ε) holds.
    g = torch.Generator().manual_seed(7)
    D, eta = 5, 1e-6
    X = torch.randn(2, 1, D, generator=g, dtype=DT)
    c_norm = torch.linalg.vector_norm(X - X.mean(-1, keepdim=True), dim=-1)[:, 0]
    eps = 0.9 * c_norm  # (B,)
    fn = lambda Z: F.layer_norm(Z, (D,), eps=eta)  # noqa: E731
    dev = pgd_deviation(fn, X, eps, steps=100, restarts=4)
    assert torch.all(dev > layernorm_local_lipschitz(X, None, eta, 0.0) * eps * 1.05)
    assert torch.all(dev <= layernorm_local_lipschitz(X, None, eta, eps) * eps)


def test_layernorm_validation_and_float32() -> None:
    X = torch.randn(2, 3, 4)
    L = layernorm_local_lipschitz(X, torch.ones(4), 1e-5, 0.1)
    assert L.shape == (2,) and L.dtype == torch.float32
    with pytest.raises(ValueError):
        layernorm_local_lipschitz(X, None, 1e-5, -1.0)
    with pytest.raises(ValueError):
        layernorm_local_lipschitz(X, None, -1e-5, 0.1)
    with pytest.raises(ValueError):
        layernorm_local_lipschitz(X[0], None, 1e-5, 0.1)
    # η = 0 and a ball containing the centring null space: no finite constant.
    L = layernorm_local_lipschitz(torch.ones(1, 2, 4), None, 0.0, 0.1)
    assert torch.isinf(L).all()


# ---------------------------------------------------------------- LayerProject


def _lp_case(seed: int, mode: str, B: int = 4, N: int = 3, D: int = 4):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(B, N, D, generator=g, dtype=DT)
    if mode == "token":
        # Token norms between 0.3 and 3 with R = 1: inside, near and outside.
        norms = torch.linspace(0.3, 3.0, B * N, dtype=DT).reshape(B, N, 1)
        X = X / torch.linalg.vector_norm(X, dim=-1, keepdim=True) * norms
    else:
        norms = torch.linspace(0.3, 3.0, B, dtype=DT).reshape(B, 1, 1)
        X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) * norms
    return g, X


def _lp_fn(mode: str, radius: float):
    dims = (-1,) if mode == "token" else (-2, -1)
    return lambda Z: layer_project(Z, radius, dims)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", ["token", "frobenius"])
@pytest.mark.parametrize("eps", [0.05, 0.5, 2.0])
def test_layer_project_bound_not_beaten(seed: int, mode: str, eps: float) -> None:
    g, X = _lp_case(seed, mode)
    R = 1.0
    L = layer_project_local_lipschitz(X, R, eps, mode)
    assert torch.all((L > 0) & (L <= 1))
    fn = _lp_fn(mode, R)
    dev = pgd_deviation(fn, X, eps, steps=60, restarts=3, seed=seed)
    assert torch.all(dev <= L * eps * SLACK)
    sigmas = torch.stack([block_jacobian_sigma(fn, P, exact=True)
                          for P in _ball_points(X, eps, g, 2)])
    assert torch.all(sigmas <= L * SLACK)


def test_layer_project_bound_is_tight_outside_the_ball() -> None:
    # Whole ball outside radius R and ε ≪ ‖X‖: PGD reaches ≈ R ε/‖X‖, the bound is
    # R ε/(‖X‖ − ε); not vacuous.
    g = torch.Generator().manual_seed(3)
    X = torch.randn(3, 4, 5, generator=g, dtype=DT)
    X = 4 * X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    eps, R = 0.04, 1.0
    L = layer_project_local_lipschitz(X, R, eps, "frobenius")
    assert torch.allclose(L, torch.full_like(L, R / (4 - eps)))
    dev = pgd_deviation(_lp_fn("frobenius", R), X, eps)
    assert torch.all(dev <= L * eps * SLACK)
    assert torch.all(dev >= 0.98 * L * eps)


@pytest.mark.parametrize("mode", ["token", "frobenius"])
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.7])
def test_layer_project_is_identity_exactly_characterised(mode: str, eps: float) -> None:
    g, X = _lp_case(5, mode, B=8)
    R = 2.0
    ident = layer_project_is_identity(X, R, eps, mode)
    assert ident.any() and not ident.all()
    fn = _lp_fn(mode, R)
    for P in _ball_points(X, eps, g, 4):
        same = (fn(P) == P).reshape(P.shape[0], -1).all(-1)
        assert torch.all(same[ident])
    # Where it is not the identity, pushing the largest vector outwards by ε
    # reaches a point that is projected.
    if mode == "token":
        norms = torch.linalg.vector_norm(X, dim=-1)  # (B, N)
        i = norms.argmax(-1)
        d = torch.zeros_like(X)
        rows = torch.arange(X.shape[0])
        d[rows, i] = X[rows, i] / norms[rows, i, None]
    else:
        d = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    P = X + eps * d
    moved = (fn(P) != P).reshape(P.shape[0], -1).any(-1)
    assert torch.equal(moved, ~ident)


def test_layer_project_validation() -> None:
    X = torch.randn(2, 3, 4)
    with pytest.raises(ValueError):
        layer_project_local_lipschitz(X, 1.0, 0.1, "rows")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        layer_project_local_lipschitz(X, 0.0, 0.1)
    with pytest.raises(ValueError):
        layer_project_is_identity(X, 1.0, math.nan)


# ---------------------------------------------------------------- linear, GELU MLP


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_linear_bound_is_eps_norm_and_attained(seed: int) -> None:
    # auto_LiRPA's closed form: ‖W x' + b − (W x + b)‖ ≤ ε‖W‖, attained.
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(7, 5, generator=g, dtype=DT)
    b = torch.randn(7, generator=g, dtype=DT)
    X = torch.randn(3, 4, 5, generator=g, dtype=DT)
    norm = linear_norm(W)
    assert torch.allclose(norm, torch.linalg.svdvals(W)[0], rtol=1e-12)
    eps = 0.25
    dev = pgd_deviation(lambda Z: F.linear(Z, W, b), X, eps)
    assert torch.all(dev <= eps * norm * SLACK)
    assert torch.allclose(dev, eps * norm.expand(3), rtol=1e-4)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_derivative_max_against_dense_grid(approximate: str) -> None:
    x = torch.linspace(-12, 12, 2_400_001, dtype=DT, requires_grad=True)
    (d,) = torch.autograd.grad(F.gelu(x, approximate=approximate).sum(), x)
    grid_max = d.abs().max().item()
    const = gelu_deriv_max(approximate)  # type: ignore[arg-type]
    assert grid_max <= const
    assert const - grid_max <= 1e-8
    if approximate == "none":
        assert abs(GELU_DERIV_MAX - 1.1289) < 1e-4
        i = d.abs().argmax()
        assert abs(x[i].item() - math.sqrt(2)) < 1e-4  # GELU'' = φ(x)(2 − x²)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gelu_mlp_bound_not_beaten(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    D, Hd = 4, 8
    W1 = torch.randn(Hd, D, generator=g, dtype=DT)
    W2 = torch.randn(D, Hd, generator=g, dtype=DT)
    b1 = torch.randn(Hd, generator=g, dtype=DT)
    X = torch.randn(3, 5, D, generator=g, dtype=DT)
    L = gelu_mlp_local_lipschitz(W1, W2)
    for eps in (0.05, 1.0):
        dev = pgd_deviation(lambda Z: F.linear(F.gelu(F.linear(Z, W1, b1)), W2), X, eps,
                            steps=60, restarts=3)
        assert torch.all(dev <= L * eps * SLACK)


def test_gelu_mlp_bound_is_attained_at_the_gelu_maximum() -> None:
    # W1 = s I, W2 = t I, pre-activations all at √2: the Jacobian is
    # s t GELU'(√2) I, and GELU''(√2) = 0 makes the deviation ≈ L ε.
    D, s, t = 4, 2.0, 0.5
    X = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(0), dtype=DT)
    W1, W2 = s * torch.eye(D, dtype=DT), t * torch.eye(D, dtype=DT)
    b1 = math.sqrt(2) - s * X  # per-sample bias: fold it into the map
    L = gelu_mlp_local_lipschitz(W1, W2)
    assert math.isclose(L.item(), s * t * GELU_DERIV_MAX, rel_tol=1e-8)
    eps = 1e-3
    dev = pgd_deviation(lambda Z: F.gelu(Z @ W1.T + b1) @ W2.T, X, eps,
                        batch_restarts=False)  # b1 holds each sample's bias
    assert torch.all(dev <= L * eps * SLACK)
    assert torch.all(dev >= L * eps * (1 - 1e-5))
