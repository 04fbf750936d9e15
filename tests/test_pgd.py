"""Tests for lipvit.analysis.pgd: closed forms (linear maps), feasibility, checks."""

from __future__ import annotations

import math

import pytest
import torch
from lipvit.analysis import pgd_deviation

DT = torch.float64


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_linear_map_attains_eps_times_norm(seed: int) -> None:
    # auto_LiRPA-style closed form: max ‖A Γ‖ over ‖Γ‖ ≤ ε is ε‖A‖.
    g = torch.Generator().manual_seed(seed)
    B, N, D = 3, 4, 5
    A = torch.randn(N * D, N * D, generator=g, dtype=DT)
    X = torch.randn(B, N, D, generator=g, dtype=DT)
    b = torch.randn(N * D, generator=g, dtype=DT)

    def fn(Z: torch.Tensor) -> torch.Tensor:
        return (Z.reshape(Z.shape[0], -1) @ A.T + b).reshape(Z.shape)  # (B, N, D)

    eps = 0.3
    dev = pgd_deviation(fn, X, eps)
    exact = eps * torch.linalg.matrix_norm(A, ord=2)
    assert torch.all(dev <= exact * (1 + 1e-10))
    assert torch.allclose(dev, exact.expand(B), rtol=1e-4)


@pytest.mark.parametrize("seed", [0, 1])
def test_per_sample_linear_maps(seed: int) -> None:
    # Different matrix per sample: each sample reaches its own ε‖W_b‖.
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(4, 9, 6, generator=g, dtype=DT)
    X = torch.randn(4, 6, generator=g, dtype=DT)
    eps = torch.tensor([0.1, 0.5, 1.0, 2.0], dtype=DT)
    dev = pgd_deviation(lambda Z: torch.einsum("bij,bj->bi", W, Z), X, eps,
                        batch_restarts=False)  # the map holds each sample's W_b
    exact = eps * torch.linalg.matrix_norm(W, ord=2)
    assert torch.allclose(dev, exact, rtol=1e-4)
    assert torch.all(dev <= exact * (1 + 1e-10))


def test_every_evaluated_point_is_feasible_and_bound_is_below_lipschitz() -> None:
    g = torch.Generator().manual_seed(3)
    X = torch.randn(5, 3, 4, generator=g, dtype=DT)
    eps = 0.7
    seen: list[torch.Tensor] = []

    def fn(Z: torch.Tensor) -> torch.Tensor:
        seen.append(Z.detach().clone())
        return torch.tanh(3 * Z) / 3  # 1-Lipschitz, elementwise

    dev = pgd_deviation(fn, X, eps, steps=30, restarts=2)
    # The clean point, then the two restarts as one batch (rows r·5 + b).
    radii = torch.cat([torch.linalg.vector_norm((Z - X.repeat(len(Z) // 5, 1, 1))
                                                .reshape(len(Z), -1), dim=1)
                       for Z in seen])
    assert bool((radii <= eps * (1 + 1e-12)).all())
    assert bool((dev <= eps * (1 + 1e-12)).all())
    assert bool((dev > 0).all())


@pytest.mark.parametrize("seed", range(3))
def test_batched_restarts_are_the_restarts_one_at_a_time(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(5, 4, generator=g, dtype=DT)
    X = torch.randn(3, 2, 4, generator=g, dtype=DT)

    def fn(Z):
        return torch.tanh(Z @ W.T)

    eps = torch.tensor([0.1, 0.5, 2.0], dtype=DT)
    batched = pgd_deviation(fn, X, eps, steps=20, restarts=3, seed=seed)
    alone = pgd_deviation(fn, X, eps, steps=20, restarts=3, seed=seed,
                          batch_restarts=False)
    assert torch.allclose(batched, alone, rtol=1e-12, atol=0)


def test_deterministic_global_rng_untouched_and_works_under_no_grad() -> None:
    g = torch.Generator().manual_seed(4)
    X = torch.randn(2, 3, 3, generator=g, dtype=DT)
    fn = torch.sin
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = pgd_deviation(fn, X, 0.2, steps=10, restarts=2, seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    with torch.no_grad():
        b = pgd_deviation(fn, X, 0.2, steps=10, restarts=2, seed=5)
    assert torch.equal(a, b)
    assert a.shape == (2,) and a.dtype == DT and not a.requires_grad


def test_zero_eps_gives_zero_and_float32_works() -> None:
    X = torch.randn(3, 4, 2)
    assert torch.equal(pgd_deviation(torch.exp, X, 0.0, steps=5), torch.zeros(3))
    dev = pgd_deviation(lambda Z: 2 * Z, X, 0.5, steps=5, restarts=1)
    assert dev.dtype == torch.float32
    assert torch.allclose(dev, torch.full((3,), 1.0), rtol=1e-4)


@pytest.mark.parametrize("eps", [-0.1, math.nan, math.inf])
def test_invalid_eps_raises(eps: float) -> None:
    with pytest.raises(ValueError):
        pgd_deviation(torch.sin, torch.zeros(2, 3), eps)


@pytest.mark.parametrize("kwargs", [{"steps": -1}, {"restarts": 0}, {"step_size": 0.0}])
def test_invalid_options_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        pgd_deviation(torch.sin, torch.zeros(2, 3), 0.1, **kwargs)
