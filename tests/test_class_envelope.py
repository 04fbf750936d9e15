"""Class attention's bounds on the ball (docs/math.md eq. 10.1b) against brute force.

:func:`~lipvit.certify.ball.attention.class_envelope` bounds every entry of
``P_h = softmax_j(B_h[j] + a_h · x̂_j)`` over the tokens' Frobenius ball
``‖X′ − X‖_F ≤ δ``, ``x̂`` the projection onto the radius-``R`` ball. Here,
in float64 and over seeds, each entry is pushed up and down by projected
gradient ascent on the tokens themselves (the real projection and softmax),
from random starts and from the move the proof says is worst; the bounds must
contain everything found. Two weakened copies must not: ``jensen`` drops
what the other tokens' logits falling adds (``r_j = 1``), ``lower`` charges
the entry's fall for one token's move only (``√2`` dropped). On two tokens
well inside the radius both bounds are exact (the worst move splits the
budget evenly between them), so both copies fall below the ascent.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import weakened_copy
from lipvit.certify.ball import attention as ball_attention
from lipvit.certify.ball.attention import class_envelope
from torch import Tensor

from lipvit.layers import layer_project

F64 = torch.float64
SEEDS = (0, 1, 2, 3, 4)

WEAKENINGS = {
    "jensen": ("r = (1 + (others / rest.square()).clamp(max=1.0)).sqrt()",
               "r = torch.ones_like(p)"),
    "lower": ("move * math.sqrt(2)", "move"),
}


def attention(X: Tensor, a: Tensor, B: Tensor, R: float) -> Tensor:
    """``P`` ``(..., H, N)`` of tokens ``X`` ``(..., N, D)``."""
    return (layer_project(X, R) @ a.T).mT.add(B).softmax(dim=-1)


def extremes(X: Tensor, a: Tensor, B: Tensor, R: float, delta: float,
             steps: int = 150, starts: int = 4, seed: int = 0) -> tuple[Tensor, Tensor]:
    """The largest and least ``P_h[j]`` ``(H, N)`` found on the ball: projected
    gradient ascent on the tokens for each entry and side, from random points
    of the ball and from the move of the proof (token ``j`` along ``±a_h``,
    the others along ``∓a_h`` in proportion to their weights)."""
    gen = torch.Generator().manual_seed(seed)
    H, N = B.shape
    P0 = attention(X, a, B, R)
    h, j = torch.meshgrid(torch.arange(H), torch.arange(N), indexing="ij")
    h, j = h.flatten(), j.flatten()  # (E,)
    best = []
    for sign in (1.0, -1.0):
        weight = -P0[h] / (1 - P0[h, j])[:, None]  # (E, N): the others' π_k
        weight[torch.arange(len(j)), j] = 1.0
        witness = sign * weight[..., None] * a[h][:, None, :]  # (E, N, D)
        inits = [witness] + [torch.randn(len(j), N, X.shape[-1], generator=gen,
                                         dtype=F64) for _ in range(starts)]
        found = torch.full((len(j),), -math.inf, dtype=F64)
        for init in inits:
            D = init / init.flatten(1).norm(dim=-1)[:, None, None] * delta
            D.requires_grad_()
            opt = torch.optim.Adam([D], lr=delta / 20)
            for _ in range(steps):
                P = attention(X + D, a, B, R)[torch.arange(len(j)), h, j]
                found = torch.maximum(found, sign * P.detach())
                opt.zero_grad()
                (-sign * P).sum().backward()
                opt.step()
                with torch.no_grad():
                    norm = D.flatten(1).norm(dim=-1).clamp_min(delta)
                    D.mul_(delta / norm[:, None, None])
            P = attention(X + D.detach(), a, B, R)[torch.arange(len(j)), h, j]
            found = torch.maximum(found, sign * P)
        best.append(sign * found.reshape(H, N))
    return best[0], best[1]


def case(seed: int, N: int, H: int, norm: float, R: float, bias: float,
         content: float) -> tuple[Tensor, Tensor, Tensor]:
    """Tokens ``X`` ``(N, 4)`` of norms up to ``norm``, content vectors ``a``
    ``(H, 4)`` of norm ``content``, positional biases ``B`` ``(H, N)`` of
    scale ``bias``."""
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(N, 4, generator=gen, dtype=F64)
    X = X / X.norm(dim=-1, keepdim=True) * norm * torch.rand(N, 1, generator=gen,
                                                              dtype=F64).sqrt()
    a = torch.randn(H, 4, generator=gen, dtype=F64)
    a = a / a.norm(dim=-1, keepdim=True) * content
    return X, a, bias * torch.randn(H, N, generator=gen, dtype=F64)


def bounds(fn, X: Tensor, a: Tensor, B: Tensor, R: float, delta: float
           ) -> tuple[Tensor, Tensor]:
    P0 = attention(X, a, B, R)[None]
    P_bar, P_low = fn(P0, a.norm(dim=-1), torch.tensor([delta], dtype=F64), R)
    return P_bar[0], P_low[0]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("delta", "norm", "bias", "content"), [
    (0.05, 1.4, 1.0, 2.0),  # small ball
    (0.4, 1.4, 3.0, 3.0),  # sharp rows, several-fold growth
    (0.4, 2.5, 0.5, 1.0),  # tokens outside the radius
    (4.0, 1.4, 1.0, 1.0),  # δ beyond the diameter 2R: the cap binds
])
def test_class_envelope_contains_the_attention_on_the_ball(seed, delta, norm, bias,
                                                           content):
    X, a, B = case(seed, N=6, H=3, norm=norm, R=1.5, bias=bias, content=content)
    hi, lo = extremes(X, a, B, 1.5, delta, seed=seed)
    P_bar, P_low = bounds(class_envelope, X, a, B, 1.5, delta)
    assert (hi <= P_bar).all(), (hi - P_bar).max()
    assert (lo >= P_low).all(), (P_low - lo).max()
    P0 = attention(X, a, B, 1.5)
    assert (P_low <= P0).all() and (P0 <= P_bar).all()


def two_tokens(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Two tokens of norm 0.3 (the radius 1.5 far away), one head with
    ``‖a‖ = 2`` and a bias that sets ``P = (0.27, 0.73)`` up to the seed's
    content logits."""
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(2, 4, generator=gen, dtype=F64)
    X = 0.3 * X / X.norm(dim=-1, keepdim=True)
    a = torch.randn(1, 4, generator=gen, dtype=F64)
    return X, 2 * a / a.norm(), torch.tensor([[0.0, 1.0]], dtype=F64)


@pytest.mark.parametrize("seed", SEEDS)
def test_class_envelope_is_exact_on_two_tokens(seed):
    """Both bounds are reached: the ascent comes within 10⁻⁶ of each."""
    X, a, B = two_tokens(seed)
    hi, lo = extremes(X, a, B, 1.5, 0.3, seed=seed)
    P_bar, P_low = bounds(class_envelope, X, a, B, 1.5, 0.3)
    assert torch.allclose(hi, P_bar, rtol=1e-6) and (hi <= P_bar).all()
    assert torch.allclose(lo, P_low, rtol=1e-6) and (lo >= P_low).all()


@pytest.mark.parametrize("kind", sorted(WEAKENINGS))
def test_weakened_class_envelope_falls_below_the_ascent(kind):
    fn = weakened_copy(ball_attention, "class_envelope", [WEAKENINGS[kind]])
    for seed in SEEDS:
        X, a, B = two_tokens(seed)
        hi, lo = extremes(X, a, B, 1.5, 0.3, seed=seed)
        P_bar, P_low = bounds(fn, X, a, B, 1.5, 0.3)
        if kind == "jensen":
            assert (P_bar < hi * (1 - 1e-3)).all(), (seed, P_bar, hi)
        else:
            assert (P_low > lo * (1 + 1e-3)).all(), (seed, P_low, lo)


@pytest.mark.parametrize("kind", sorted(WEAKENINGS))
def test_class_envelope_copies_with_nothing_replaced_are_the_real_bound(kind):
    old = WEAKENINGS[kind][0]
    fn = weakened_copy(ball_attention, "class_envelope", [(old, old)])
    X, a, B = two_tokens(0)
    for got, want in zip(bounds(fn, X, a, B, 1.5, 0.3),
                         bounds(class_envelope, X, a, B, 1.5, 0.3), strict=True):
        assert torch.equal(got, want)
