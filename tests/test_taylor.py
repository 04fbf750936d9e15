"""The taylor method: every remainder bound against brute force and PGD, the whole
margin-drop bound against PGD on each class margin, certified points against
torchattacks PGDL2 and APGD, both families, refusals and the CLI (float64)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torchattacks
from click.testing import CliRunner
from lipvit.analysis.pgd import pgd_deviation, pgd_margin_drop
from lipvit.certify.attention import (
    attention,
    attention_logits,
    query_key,
    value_output,
)
from lipvit.certify.certification import bisect_radius, falsi_radius
from lipvit.certify.evaluate import certify_samples
from lipvit.certify.lofast.layer import lofast_terms, softmax_local_constant
from lipvit.certify.lofast.operators import lemma2_matrix
from lipvit.certify.taylor.certificate import forward, taylor_bound
from lipvit.certify.taylor.jacobian_norms import jacobian_norms, logit_variance
from lipvit.certify.taylor.remainders import (
    GELU_CURVATURE_MAX,
    ImagePart,
    LogitVariance,
    attention_jacobian_norm,
    attention_remainder,
    attention_row_norms,
    attention_row_remainders,
    gelu_curvature,
    layer_project_directional,
    layer_project_remainder,
    layer_project_split,
    layernorm_curvature,
    logit_row_variance_gains,
    logit_variance_gain,
    logit_variance_gain_all,
    relu_remainder,
    softmax_row_gains,
)
from lipvit.certify.taylor.second_order import (
    attention_hessian_norm,
    quadratic_coefficient,
    second_order_remainder,
    third_order,
)

from lipvit.cli import main
from lipvit.errors import UnsupportedModelError
from lipvit.layers import layer_project
from lipvit.model import ViT
from tests.conftest import nonlinear_model, share_jets, tiny_config

F64 = torch.float64
SEEDS = range(2)


def _remainder_fn(phi, u0, J=None):
    """``U ↦ φ(U) − φ(u0) − J(U − u0)`` batched over U; ``J`` autograd's Jacobian
    ``Dφ(u0)`` unless given."""
    if J is None:
        J = torch.func.jacrev(phi)(u0).reshape(phi(u0).numel(), u0.numel())
    f0 = phi(u0).detach()

    def r(U):
        return torch.stack(
            [phi(u) - f0 - (J @ (u - u0).reshape(-1)).reshape(f0.shape) for u in U]
        )

    return r


def _sampled_max(r, u0, beta, n=200, seed=0):
    """Largest ``‖r‖`` over random points of the sphere and ball of radius β."""
    g = torch.Generator().manual_seed(seed)
    G = torch.randn((n, *u0.shape), generator=g, dtype=F64)
    G = G / G.flatten(1).norm(dim=1).reshape(-1, *[1] * u0.ndim)
    G[n // 2 :] *= torch.rand((n - n // 2,) + (1,) * u0.ndim, generator=g, dtype=F64)
    return r(u0 + beta * G).flatten(1).norm(dim=1).max()


# --------------------------------------------------------------------------
# Remainders against brute force.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [0.0, 0.3, 0.98, 1.0, 1.02, 1.5, 4.0])
@pytest.mark.parametrize("beta", [0.05, 0.5])
def test_layer_project_remainder_bounds_brute_force(seed, norm, beta):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, generator=g, dtype=F64)
    x = x / x.norm() * norm if norm > 0 else x * 1e-9
    R = 1.0
    phi = lambda v: layer_project(v, R)  # noqa: E731
    rem = layer_project_remainder(
        x.norm()[None, None], R, torch.tensor([beta], dtype=F64)
    )
    bound = rem.norm(torch.tensor([beta], dtype=F64))[0]
    r = _remainder_fn(phi, x)
    found = max(
        _sampled_max(r, x, beta, seed=seed),
        pgd_deviation(r, x[None], beta, steps=40, restarts=2)[0],
    )
    assert found <= bound * (1 + 1e-9) + 1e-15


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [0.3, 0.98, 1.0, 1.02, 1.5, 4.0])
@pytest.mark.parametrize("beta", [0.05, 0.5])
def test_layer_project_split_brute_force(seed, norm, beta):
    """``r = −σx̂ + r'``: ``σ ∈ [0, s]`` and ``‖r'‖ ≤ rest`` over the ball (§3)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, generator=g, dtype=F64)
    x = x / x.norm() * norm
    R, n = 1.0, x.norm()[None, None]  # the actual norm decides the side
    split = layer_project_split(n, R, torch.tensor([[beta]], dtype=F64))
    s = float(split.s)
    r = _remainder_fn(lambda v: layer_project(v, R), x)
    x_hat = x / x.norm()

    def sigma(U):
        y = U.norm(dim=-1, keepdim=True)
        return ((y - R) if float(n) < R else (R - y)).clamp_min(0)

    def rest(U):  # r + σ x̂ where the split holds (s > 0), r otherwise
        return r(U) + (sigma(U) * x_hat if s > 0 else 0)

    G = torch.randn(400, 5, generator=g, dtype=F64)
    U = x + beta * G / G.norm(dim=1, keepdim=True) * torch.rand(400, 1, generator=g,
                                                                  dtype=F64) ** 0.2
    if s > 0:
        assert float(sigma(U).max()) <= s * (1 + 1e-9)
    bound = float(split.rest.at(torch.tensor([[beta]], dtype=F64)))
    found = max(float(rest(U).norm(dim=1).max()),
                float(pgd_deviation(rest, x[None], beta, steps=40, restarts=2)[0]))
    assert found <= bound * (1 + 1e-9) + 1e-15
    if (norm, beta) in ((0.98, 0.05), (1.02, 0.05), (1.0, 0.5)):
        assert s > 0  # the ball crosses the sphere: a symbol


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [0.9, 1.0, 1.02, 1.3, 4.0])
@pytest.mark.parametrize("beta", [0.05, 0.5])
def test_layer_project_directional_brute_force(seed, norm, beta):
    """``r = −τx̂ + cΓ_⊥`` with ``τ ∈ [0, s]``, ``|c| ≤ l`` at every sampled ``Γ``
    of the ball, given that point's own ``A = |x̂ᵀΓ|`` (§3): tangential, radial
    and random directions, on the sphere and inside; so a margin's share
    ``s(−gᵀx̂)₊ + l|g_⊥ᵀΓ|`` bounds ``gᵀr``."""
    g = torch.Generator().manual_seed(seed)
    D, n_pts, R = 6, 900, 1.0
    x = torch.randn(D, generator=g, dtype=F64)
    x = x / x.norm() * norm
    w = torch.randn(D, generator=g, dtype=F64)
    x_hat = x / x.norm()
    r = _remainder_fn(lambda v: layer_project(v, R), x)
    G = torch.randn(n_pts, D, generator=g, dtype=F64)
    G[:300] -= (G[:300] @ x_hat)[:, None] * x_hat  # tangential
    G[300:400] = x_hat * torch.randn(100, 1, generator=g, dtype=F64).sign()  # radial
    G[400:500] += 3 * x_hat * torch.randn(100, 1, generator=g, dtype=F64)  # mostly
    G = G / G.norm(dim=1, keepdim=True) * beta
    G[n_pts // 2:] *= torch.rand(n_pts - n_pts // 2, 1, generator=g, dtype=F64)
    rem = r(x + G)  # (n_pts, D)
    A = (G @ x_hat).abs()
    col = lambda t: torch.full((n_pts, 1), float(t), dtype=F64)  # noqa: E731
    n = float(x.norm())  # the actual norm decides the side
    split = layer_project_directional(col(n), R, col(beta), A[:, None])
    s, lin = split.s[:, 0], split.rest.lin[:, 0]
    if n < R:  # inside: not applicable
        assert torch.all(lin.isinf()) and torch.all(s == 0)
        return
    tau = -(rem @ x_hat)
    assert torch.all(tau >= -1e-15) and torch.all(tau <= s * (1 + 1e-9) + 1e-15)
    G_perp = G - (G @ x_hat)[:, None] * x_hat
    r_perp = rem + tau[:, None] * x_hat  # = c Γ_⊥
    t = G_perp.norm(dim=1)
    assert torch.all(r_perp.norm(dim=1) <= lin * t * (1 + 1e-9) + 1e-14)
    c = (r_perp * G_perp).sum(1) / (t**2).clamp_min(1e-300)
    along = t > 1e-6 * beta  # (the radial samples have Γ_⊥ = 0 up to rounding)
    assert torch.allclose(r_perp[along], (c[:, None] * G_perp)[along], rtol=0,
                          atol=1e-12)
    g_x = w @ x_hat
    share = s * (-g_x).clamp_min(0) + lin * (G_perp @ w).abs()
    found = rem @ w
    assert torch.all(found <= share * (1 + 1e-9) + 1e-15)
    assert bool((found > 0).any())


@pytest.mark.parametrize("side", [-1, 1])
@pytest.mark.parametrize("beta", [0.05, 0.5])
def test_layer_project_bounds_hold_for_either_jacobian_at_the_radius(side, beta):
    """At ``‖x‖ = R`` up to rounding, the forward pass may have taken the other side
    than the bounds' float norm says (another reduction order): the plain bound,
    the split's ``r'`` and the direction-aware ``−τx̂ + cΓ_⊥`` must hold with
    either Jacobian, ``I`` or ``R(I − x̂x̂ᵀ)/‖x‖`` (§3)."""
    g = torch.Generator().manual_seed(7)
    D, R = 6, 1.0
    x = torch.randn(D, generator=g, dtype=F64)
    x = x / x.norm() * (R * (1 + side * 1e-15))
    x_hat = x / x.norm()
    n, b = x.norm().reshape(1, 1), torch.tensor([[beta]], dtype=F64)
    plain = float(layer_project_remainder(n, R, b[0]).at(b))
    split = layer_project_split(n, R, b)
    G = torch.randn(600, D, generator=g, dtype=F64)
    G[:100] = x_hat * torch.randn(100, 1, generator=g, dtype=F64).sign()  # radial
    G = G / G.norm(dim=1, keepdim=True) * beta
    G[300:] *= torch.rand(300, 1, generator=g, dtype=F64)
    eye = torch.eye(D, dtype=F64)
    for J in (eye, R * (eye - torch.outer(x_hat, x_hat)) / x.norm()):
        rem = _remainder_fn(lambda v: layer_project(v, R), x, J)(x + G)
        assert float(rem.norm(dim=1).max()) <= plain * (1 + 1e-9)
        sigma = (-(rem @ x_hat)).clamp(0, float(split.s))  # some σ ∈ [0, s]
        r_rest = (rem + sigma[:, None] * x_hat).norm(dim=1)
        assert torch.all(r_rest <= split.rest.at(G.norm(dim=1)[:, None])[:, 0]
                         * (1 + 1e-9) + 1e-15)
        if side < 0:
            continue  # the direction-aware split is for the outside only
        A = (G @ x_hat).abs()[:, None]
        turn = layer_project_directional(n.expand(600, 1), R, b.expand(600, 1), A)
        tau = -(rem @ x_hat)
        assert torch.all(tau >= -1e-14) and torch.all(tau <= turn.s[:, 0] * (1 + 1e-9))
        G_perp = (G - (G @ x_hat)[:, None] * x_hat).norm(dim=1)
        r_perp = (rem + tau[:, None] * x_hat).norm(dim=1)
        assert torch.all(r_perp <= turn.rest.lin[:, 0] * G_perp * (1 + 1e-9) + 1e-14)


@pytest.mark.parametrize("kw, seed", [({}, 0), ({}, 1), ({"depth": 3}, 0),
                                      ({"num_heads": 1}, 1)])
def test_stream_functionals_bound_pgd(kw, seed):
    """``|⟨v, Γ_{2k}⟩|`` of every block's input (``v = x̂``, the Frobenius
    projection's radial direction, and a random ``v``) is at most its bound."""
    model = _model("lipschitz", seed, **kw)
    x = torch.rand(2, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        y = model(x).argmax(1)
        stream = forward(model, x)[1].stream
    tb = taylor_bound(model, x, y)
    for eps in (1e-2, 0.1):
        e = torch.full((2,), eps, dtype=F64)
        for k in range(len(model.blocks)):
            X = stream[2 * k]
            for v in (X / X.flatten(1).norm(dim=1)[:, None, None], torch.randn_like(X)):
                def read(u, k=k, v=v):  # u: pgd_deviation's restarts × samples
                    vr = v.repeat(len(u) // len(v), 1, 1)
                    s = forward(model, u)[1].stream[2 * k]
                    return (s * vr).sum((1, 2))[:, None]
                found = pgd_deviation(read, x, eps, steps=30, restarts=2)
                bound = tb.functional(e, k, v)
                assert torch.all(found <= bound * (1 + 1e-9)), (eps, k, found, bound)
                assert bool((found > 0).all())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("c_scale", [1e-4, 0.1, 1.0, 5.0])
def test_layernorm_curvature_bounds_brute_force(seed, c_scale):
    g = torch.Generator().manual_seed(seed)
    D, kappa = 6, 6 * 1e-5
    c = torch.randn(D, generator=g, dtype=F64)
    c = c / c.norm() * c_scale
    phi = lambda v: v / (v.square().sum() + kappa).sqrt()  # noqa: E731
    r = _remainder_fn(phi, c)
    for beta in (1e-3, 0.05, 0.5):
        b = torch.tensor([beta], dtype=F64)
        bound = layernorm_curvature(c.norm()[None, None], kappa, b)[0, 0] * beta**2
        found = max(
            _sampled_max(r, c, beta, seed=seed),
            pgd_deviation(r, c[None], beta, steps=40, restarts=2)[0],
        )
        assert found <= bound * (1 + 1e-9)


def test_relu_and_gelu_units_brute_force():
    z = torch.linspace(-3, 3, 121, dtype=F64)
    for d in (1e-3, 0.1, 1.0, 3.0):
        delta = torch.linspace(-d, d, 201, dtype=F64)
        Z, Dl = torch.meshgrid(z, delta, indexing="ij")
        relu = (Z + Dl).relu() - Z.relu() - (Z > 0) * Dl
        bound = relu_remainder(z[None, :, None], torch.full((1, 121, 1), d, dtype=F64))
        assert torch.all(relu.abs().amax(1) <= bound[0] + 1e-15)
        gelu = F.gelu(Z + Dl) - F.gelu(Z) - _gelu_prime(Z) * Dl
        curv = gelu_curvature(z, torch.full_like(z, d))
        assert torch.all(gelu.abs().amax(1) <= 0.5 * curv * d**2 * (1 + 1e-9) + 1e-15)
        assert torch.all(curv <= GELU_CURVATURE_MAX + 1e-15)


def _gelu_prime(z):
    return 0.5 * (1 + torch.erf(z / math.sqrt(2))) + z * torch.exp(
        -(z**2) / 2
    ) / math.sqrt(2 * math.pi)


F = torch.nn.functional


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scale", [0.1, 1.0, 5.0])
def test_softmax_curvature_brute_force(seed, scale):
    """The softmax's remainder has ℓ1 norm at most ``c' ρ²``, ``c'`` its local
    Lipschitz constant (attention_remainder's curvature constant): sampled,
    and by PGD on ``‖r‖₂`` and on ``σᵀr`` for sign vectors ``σ``."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(1, 6, generator=g, dtype=F64) * scale
    r = _remainder_fn(lambda v: torch.softmax(v, -1), z)
    signs = torch.randint(0, 2, (4, 6), generator=g).to(F64) * 2 - 1
    for rho in (0.01, 0.3, 2.0):
        c2 = softmax_local_constant(z[None], torch.tensor([rho], dtype=F64))[0]
        G = torch.randn(200, 1, 6, generator=g, dtype=F64)
        G = rho * G / G.flatten(1).norm(dim=1)[:, None, None]
        found = max(
            r(z + G).abs().sum(-1).max(),
            pgd_deviation(r, z[None], rho, steps=40, restarts=2)[0],
            *(pgd_deviation(lambda U, s=s: (r(U) * s).sum(-1, keepdim=True),
                            z[None], rho, steps=40, restarts=1)[0] for s in signs),
        )
        assert found <= c2 * rho**2 * (1 + 1e-9)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("N, D, H", [(1, 4, 1), (5, 3, 2), (4, 8, 3)])  # H·N ≤ D and >
def test_softmax_row_gains_are_the_dense_row_norms(seed, N, D, H):
    """``R_r = ‖[V_hᵀ Ds(p_{h,r})]_h‖`` from the dense softmax Jacobians, to
    rounding, and never below it (the softmax path by rows against an
    attention layer's dense Jacobian: the brute-force test below)."""
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(3 * torch.randn(2, H, N, N, generator=g, dtype=F64), dim=-1)
    V = torch.randn(2, H, N, D, generator=g, dtype=F64)
    R = softmax_row_gains(P, V)
    Ds = torch.diag_embed(P) - P[..., :, None] * P[..., None, :]  # (2, H, N, N, N)
    blocks = torch.einsum("bhrkl,bhlD->brDhk", Ds, V).reshape(2, N, D, H * N)
    dense = torch.linalg.matrix_norm(blocks, ord=2)  # (2, N)
    assert torch.all(dense <= R) and torch.allclose(R, dense, rtol=1e-9, atol=1e-12)


def _weighted_logit_grams(X, W_q, W_k, P):
    """Dense ``M_hᵀ Ds_h M_h`` per row ``r`` ``(B, H, N, N·D, N·D)``."""
    B, N, D = X.shape
    H = W_q.shape[0]
    M = lemma2_matrix(X, query_key(W_q, W_k)).reshape(B, H, N, N, N * D)
    Ds = torch.diag_embed(P) - P[..., :, None] * P[..., None, :]  # (B, H, N, N, N)
    return M.mT @ Ds @ M


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("N, D, H", [(1, 4, 1), (3, 4, 1), (5, 8, 2), (6, 12, 3)])
def test_logit_variance_gains_brute_force(seed, N, D, H, monkeypatch):
    """``ν`` (all rows) and ``ν̂`` (the largest row) of the logit changes'
    variances under the softmax weights, per head and all heads summed,
    against the dense weighted Gram matrices: equal to rounding where exact,
    never below; the two-part bound of large sizes never below either."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(2, N, D, generator=g, dtype=F64)
    W_q, W_k = (torch.randn(H, D, D // H, generator=g, dtype=F64) for _ in range(2))
    P = torch.softmax(attention_logits(X, W_q, W_k), dim=-1)
    grams = _weighted_logit_grams(X, W_q, W_k, P)
    total = torch.linalg.eigvalsh(grams.sum(2))[..., -1]  # (B, H)
    row = torch.linalg.eigvalsh(grams)[..., -1].amax(-1)
    total_all = torch.linalg.eigvalsh(grams.sum((1, 2)))[..., -1]  # (B,)
    row_all = torch.linalg.eigvalsh(grams.sum(1))[..., -1].amax(-1)
    nu = logit_variance_gain(X, W_q, W_k, P)
    nu_row, nu_row_all = logit_row_variance_gains(X, W_q, W_k, P)
    nu_all = logit_variance_gain_all(X, W_q, W_k, P)
    for bound, dense in ((nu, total), (nu_row, row), (nu_all, total_all),
                         (nu_row_all, row_all)):
        assert torch.all(dense <= bound)
        assert torch.allclose(bound, dense, rtol=1e-8, atol=1e-12)
    monkeypatch.setattr("lipvit.certify.taylor.remainders.VARIANCE_EXACT_MAX", 0)
    assert torch.all(total <= logit_variance_gain(X, W_q, W_k, P) * (1 + 1e-12))
    assert logit_variance_gain_all(X, W_q, W_k, P) is None
    # heads alone
    monkeypatch.setattr("lipvit.certify.taylor.remainders.ROW_JOINT_MAX", 0)
    alone, summed = logit_row_variance_gains(X, W_q, W_k, P)
    assert torch.allclose(alone, nu_row, rtol=1e-12, atol=1e-14)
    assert torch.all(row_all <= summed)


def _layer(seed, N, D, H, qk_scale):
    g = torch.Generator().manual_seed(seed)
    d = D // H
    W_q, W_k, W_v = (
        torch.randn(H, D, d, generator=g, dtype=F64) / math.sqrt(D) for _ in range(3)
    )
    W_o = torch.randn(H, d, D, generator=g, dtype=F64) / math.sqrt(d)
    X = torch.randn(1, N, D, generator=g, dtype=F64)
    return X, (W_q * qk_scale, W_k * qk_scale, W_v, W_o)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "N, H, qk_scale", [(1, 1, 1.0), (3, 1, 1.0), (4, 2, 1.0), (4, 2, 4.0), (3, 2, 0.05)]
)
def test_attention_remainder_and_jacobian_bound_brute_force(seed, N, H, qk_scale):
    X, W = _layer(seed, N, 4, H, qk_scale)
    terms = lofast_terms(X, *W, residual=False)
    a = lambda U: attention(U[None], *W, residual=False)[0]  # noqa: E731
    J = torch.func.jacrev(a)(X[0]).reshape(N * 4, N * 4)
    assert torch.linalg.matrix_norm(J, ord=2) <= attention_jacobian_norm(terms)[0] * (
        1 + 1e-9
    )
    rows = attention_row_norms(terms)[0]  # (N,): each output token's block of rows
    exact = torch.linalg.matrix_norm(J.reshape(N, 4, N * 4), ord=2)
    assert torch.all(exact <= rows * (1 + 1e-9))
    # The softmax path by rows (docs/taylor.md §7): whole and per row; and the
    # logit variance gains of the softmax's curvature.
    P = torch.softmax(terms.logits, dim=-1)
    V = torch.einsum("bnD,hDE->bhnE", X, value_output(W[2], W[3]))
    var_row, var_row_all = logit_row_variance_gains(X, W[0], W[1], P)
    gains = replace(terms, row_gain=softmax_row_gains(P, V),
                    var_gain=logit_variance_gain(X, W[0], W[1], P), var_row=var_row,
                    var_all=logit_variance_gain_all(X, W[0], W[1], P),
                    var_row_all=var_row_all)
    assert torch.linalg.matrix_norm(J, ord=2) <= attention_jacobian_norm(gains)[0] * (
        1 + 1e-9)
    assert torch.all(exact <= attention_row_norms(gains)[0] * (1 + 1e-9))
    r = _remainder_fn(a, X[0])
    for beta in (1e-3, 0.05, 0.3):
        found = max(
            _sampled_max(r, X[0], beta, seed=seed),
            pgd_deviation(r, X, beta, steps=40, restarts=2)[0],
        )
        for t in (terms, gains):
            bound = attention_remainder(t, torch.tensor([beta], dtype=F64))[0]
            # + float rounding of the sampled remainder (N = 1: linear, bound 0)
            assert found <= bound * (1 + 1e-9) + 1e-14


def _variance_grams(T, P):
    """``(H, N, n, n)``: ``J_{h,r}ᵀ Ds(p_{h,r}) J_{h,r}`` of the logit tangents
    ``T`` ``(n, H, N, N)`` (``J_{h,r}`` row ``r``'s ``N × n`` map), dense."""
    Ds = torch.diag_embed(P) - P[..., :, None] * P[..., None, :]  # (H, N, N, N)
    J = T.permute(1, 2, 3, 0)  # (H, N, N, n)
    return J.mT @ Ds @ J


def _assert_gains(var, grams):
    """``var`` (:class:`LogitVariance`) equals the dense gains of ``grams``."""
    top = lambda G: torch.linalg.eigvalsh(G)[..., -1]  # noqa: E731
    dense = (top(grams.sum(1)), top(grams).amax(-1), top(grams.sum((0, 1))),
             top(grams.sum(0)).amax(-1))
    for bound, want in zip(var, dense, strict=True):
        assert torch.all(want <= bound)
        assert torch.allclose(bound, want, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_image_logit_variance_gains_brute_force(seed):
    """``jacobian_norms``' variance gains of the image → attention-logit maps
    against the dense Jacobian (autograd) and the dense softmax Jacobians; its
    query and key norms against the dense Jacobians."""
    model = _model("standard", seed)
    x = torch.rand(1, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(seed))
    jn = jacobian_norms(model, x)
    for k, block in enumerate(model.blocks):
        W_q, W_k = block.attn.head_weights()[:2]

        def logits(img, k=k, W_q=W_q, W_k=W_k):
            return attention_logits(forward(model, img)[1].attn_in[k], W_q, W_k)[0]

        T = torch.func.jacrev(logits)(x).flatten(3).permute(3, 0, 1, 2)  # (n, H, N, N)
        P = torch.softmax(logits(x), dim=-1)
        _assert_gains(LogitVariance(*(f[0] for f in jn.variance.block(k))),
                      _variance_grams(T, P))
        rows = torch.linalg.matrix_norm(T.permute(1, 2, 0, 3), ord=2).amax(-1)  # (H,)
        assert torch.all(rows <= jn.logit_rows[0, k])
        assert torch.allclose(jn.logit_rows[0, k], rows, rtol=1e-9, atol=1e-12)
        for W, got in ((W_q, jn.queries[0, k]), (W_k, jn.keys[0, k])):
            J = torch.func.jacrev(lambda img, k=k, W=W: torch.einsum(
                "nD,hDd->hnd", forward(model, img)[1].attn_in[k][0], W))(x)
            want = torch.linalg.matrix_norm(J.flatten(1, 2).flatten(2), ord=2)  # (H,)
            assert torch.all(want <= got)
            assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)


def _variance_terms(X, W):
    """The bare attention's terms at ``X`` with the logit variance gains, and
    its probabilities ``(B, H, N, N)``."""
    terms = lofast_terms(X, *W, residual=False)
    P = torch.softmax(terms.logits, dim=-1)
    var_row, var_row_all = logit_row_variance_gains(X, W[0], W[1], P)
    return replace(terms, var_gain=logit_variance_gain(X, W[0], W[1], P),
                   var_row=var_row, var_all=logit_variance_gain_all(X, W[0], W[1], P),
                   var_row_all=var_row_all), P


def _on_sphere(t, radius):
    """Each row of ``t`` (first axis) scaled to norm ``radius``."""
    norms = t.flatten(1).norm(dim=1).clamp_min(1e-300)
    return t * (radius / norms).reshape(-1, *[1] * (t.ndim - 1))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("N, H, qk_scale", [(3, 1, 1.0), (4, 2, 4.0), (4, 2, 1.0)])
def test_attention_remainder_through_the_image_brute_force(seed, N, H, qk_scale):
    """The remainder bound with the input's move split as ``LΓ + R`` (``L`` a
    random linear "image" map of 5 dimensions, ``‖Γ‖ ≤ ε``, ``‖R‖ ≤ rest``):
    above PGD over ``(Γ, R)`` and sampling, float64."""
    X, W = _layer(seed, N, 4, H, qk_scale)
    g = torch.Generator().manual_seed(seed + 100)
    L = torch.randn(5, N, 4, generator=g, dtype=F64) / math.sqrt(N)  # (n, N, D)
    gains, P = _variance_terms(X, W)
    T = torch.func.jvp(lambda U: attention_logits(U, W[0], W[1]),
                       (X.expand(5, -1, -1).clone(),), (L,))[1]  # (n, H, N, N)
    var = logit_variance(T, P[0])
    _assert_gains(var, _variance_grams(T, P[0]))
    row_gain = torch.linalg.matrix_norm(T.permute(1, 2, 0, 3), ord=2).amax(-1)  # (H,)
    r = _batched_remainder(X, W)
    L_norm = torch.linalg.matrix_norm(L.reshape(5, -1), ord=2)
    one = lambda v: torch.tensor([v], dtype=F64)  # noqa: E731
    # ‖ΔW_q[h]‖_F ≤ ‖L W_q[h]‖ε + ‖W_q[h]‖ rest, and the keys alike
    J_q, J_k = (torch.linalg.matrix_norm(
        torch.einsum("iND,hDd->hiNd", L, Wx).flatten(2), ord=2) for Wx in W[:2])
    w_q, w_k = (torch.linalg.matrix_norm(Wx, ord=2) for Wx in W[:2])
    sigma = attention_hessian_norm(_clean_block(X, W), L)  # ‖½D²a[Lv,Lv]‖ ≤ σ‖v‖²
    for eps, rest in ((1e-3, 0.0), (0.05, 0.01), (0.3, 0.02), (0.2, 0.2)):
        a_q, a_k = J_q * eps + w_q * rest, J_k * eps + w_k * rest
        image = ImagePart(one(eps), one(rest), LogitVariance.stack([var]),
                          (a_q * a_k)[None], (w_q * a_k)[None], row_gain[None])
        beta = one(float(L_norm) * eps + rest)
        bound = attention_remainder(gains, beta, None, image)[0]
        rows = attention_row_remainders(gains, beta, beta.expand(1, N), None, image)[0]
        assert bound <= attention_remainder(gains, beta)[0] * (1 + 1e-12)
        second = second_order_remainder(gains, beta, image, sigma[None],
                                        quadratic_coefficient(gains),
                                        one(float(L_norm) * eps), beta, None)[0]
        for t in (None, *range(N)):  # the whole remainder, then each token's
            found = _image_pgd(r, X[0], L, eps, rest, t, g)
            assert found <= (bound if t is None else rows[t]) * (1 + 1e-9) + 1e-14
            if t is None:  # to second order through the image
                assert found <= second * (1 + 1e-9) + 1e-14, (eps, rest, found, second)


def _batched_remainder(X, W):
    """``U ↦ a(U) − a(X) − J_a(U − X)`` for a batch ``U`` ``(b, N, D)`` of the
    bare attention of ``_layer``'s weights at ``X`` ``(1, N, D)``."""
    a = lambda U: attention(U, *W, residual=False)  # noqa: E731
    J = torch.func.jacrev(lambda U: a(U[None])[0])(X[0]).reshape(X[0].numel(), -1)
    f0 = a(X)

    def r(U):
        return a(U) - f0 - ((U - X).flatten(1) @ J.T).reshape(U.shape)

    return r


def _image_pgd(r, X, L, eps, rest, t, g):
    """Largest ``‖r(X + LΓ + R)‖`` (token ``t``'s row, or all) PGD finds over
    ``‖Γ‖ ≤ eps``, ``‖R‖ ≤ rest``."""
    gamma = torch.randn(64, L.shape[0], generator=g, dtype=F64)
    R = torch.randn(64, *X.shape, generator=g, dtype=F64)
    found = 0.0
    for _ in range(30):  # projected gradient ascent
        gamma = _on_sphere(gamma, eps).requires_grad_()
        R = _on_sphere(R, rest).requires_grad_()
        dev = r(X + torch.einsum("bi,iND->bND", gamma, L) + R)
        dev = (dev if t is None else dev[:, t]).flatten(1).norm(dim=1)
        found = max(found, float(dev.max()))
        dg, dR = torch.autograd.grad(dev.sum(), (gamma, R))
        gamma = (gamma + 0.2 * _on_sphere(dg, eps)).detach()
        R = (R + 0.2 * _on_sphere(dR, rest)).detach()
    return found


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("N, H, qk_scale", [(3, 1, 1.0), (4, 2, 4.0), (5, 2, 1.0)])
def test_attention_row_remainders_brute_force(seed, N, H, qk_scale):
    """Each output token's remainder bound, with per-token caps ``‖Γ_t‖ ≤ β_t``
    on the input's move, above PGD on that token's remainder over the
    feasible set, and never above the whole bound; float64 (through the image:
    the test above)."""
    X, W = _layer(seed, N, 4, H, qk_scale)
    g = torch.Generator().manual_seed(seed + 200)
    gains, _ = _variance_terms(X, W)
    r = _batched_remainder(X, W)
    one = lambda v: torch.tensor([v], dtype=F64)  # noqa: E731
    for beta in (1e-3, 0.05, 0.3):
        caps = beta * (0.2 + torch.rand(N, generator=g, dtype=F64))  # some below β
        bounds = attention_row_remainders(gains, one(beta), caps[None])[0]  # (N,)
        whole = attention_remainder(gains, one(beta))[0]
        assert torch.all(bounds <= whole * (1 + 1e-12))
        for t in range(N):
            G = torch.randn(32, N, 4, generator=g, dtype=F64)
            found = 0.0
            for _ in range(30):  # projected ascent on ‖r_t‖, feasible points only
                G = _feasible(G, caps, beta).requires_grad_()
                dev = r(X[0] + G)[:, t].norm(dim=-1)
                found = max(found, float(dev.max()))
                (dG,) = torch.autograd.grad(dev.sum(), G)
                G = (G + 0.2 * _on_sphere(dG, beta)).detach()
            assert found <= bounds[t] * (1 + 1e-9) + 1e-14, (beta, t, found, bounds)


def _feasible(G, caps, beta):
    """``G`` ``(b, N, D)`` with each token at most ``caps`` ``(N,)`` and the whole
    at most ``beta`` (scaling down keeps the token caps)."""
    tok = G.norm(dim=-1, keepdim=True)
    G = G * torch.clamp(caps[:, None] / tok.clamp_min(1e-300), max=1.0)
    return G * torch.clamp(beta / G.flatten(1).norm(dim=1).clamp_min(1e-300),
                           max=1.0)[:, None, None]


def _clean_block(X, W):
    """The clean-point data :func:`attention_hessian_norm` reads, for the bare
    attention of ``_layer``'s weights at ``X`` ``(1, N, D)``."""
    W_q, W_k, W_v, W_o = W
    H, D, d = W_q.shape
    Q, K, V = (torch.einsum("nD,hDd->hnd", X[0], Wx) for Wx in (W_q, W_k, W_v))
    return SimpleNamespace(
        P=torch.softmax(Q @ K.mT / math.sqrt(d), dim=-1), V=V,
        Q_t=(Q / math.sqrt(d)).mT, K_t=(K / math.sqrt(d)).mT,
        W_qkv=torch.cat([Wx.permute(1, 0, 2).reshape(D, H * d) for Wx in W[:3]], 1),
        W_o=W_o.reshape(H * d, D))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("N, H, qk_scale", [(3, 1, 1.0), (4, 2, 4.0)])
def test_attention_hessian_norm_brute_force(seed, N, H, qk_scale):
    """The closed-form second derivatives along a random "image" map ``L``
    against autograd's (forward over forward), and ``σ`` against the norm of
    their dense matrix and the largest ``‖½D²a[Lv,Lv]‖`` power iteration finds."""
    X, W = _layer(seed, N, 4, H, qk_scale)
    L = torch.randn(5, N, 4, generator=torch.Generator().manual_seed(seed), dtype=F64)
    a = lambda v: attention((X[0] + torch.einsum("i,iND->ND", v, L))[None], *W,  # noqa: E731
                            residual=False)[0].reshape(-1)
    Hs = torch.func.jacfwd(torch.func.jacfwd(a))(torch.zeros(5, dtype=F64))  # (ND,n,n)
    sigma = attention_hessian_norm(_clean_block(X, W), L)
    want = 0.5 * torch.linalg.matrix_norm(Hs.reshape(Hs.shape[0], -1), ord=2)
    assert want <= sigma and torch.allclose(sigma, want, rtol=1e-9)
    v = torch.randn(5, generator=torch.Generator().manual_seed(1), dtype=F64)
    for _ in range(100):  # a lower bound on max ‖½H[v,v]‖ over unit v
        w = torch.einsum("kij,j->ki", Hs, v)
        v = torch.einsum("kij,k,j->i", Hs, torch.einsum("ki,i->k", w, v), v)
        v = v / v.norm()
    assert 0.5 * torch.einsum("kij,i,j->k", Hs, v, v).norm() <= sigma


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("N, H, qk_scale", [(3, 1, 1.0), (4, 2, 4.0), (4, 2, 1.0)])
def test_third_order_remainder_brute_force(seed, N, H, qk_scale):
    """``‖a(X+Δ) − a(X) − J_aΔ − ½D²a[Δ,Δ]‖`` over ``‖Δ‖ ≤ β`` with each token
    at most ``δ``: PGD stays below :func:`third_order`, float64."""
    X, W = _layer(seed, N, 4, H, qk_scale)
    g = torch.Generator().manual_seed(seed + 300)
    gains, _ = _variance_terms(X, W)
    a = lambda U: attention(U[None], *W, residual=False)[0]  # noqa: E731

    def r3(G):  # (b, N, D) → the third-order remainder of each
        def one(Gi):
            lin = torch.func.jvp(a, (X[0],), (Gi,))[1]
            hess = torch.func.jvp(lambda U: torch.func.jvp(a, (U,), (Gi,))[1],
                                  (X[0],), (Gi,))[1]
            return a(X[0] + Gi) - a(X[0]) - lin - 0.5 * hess
        return torch.func.vmap(one)(G)

    one = lambda v: torch.tensor([v], dtype=F64)  # noqa: E731
    for beta in (0.05, 0.3, 1.0):
        caps = torch.full((N,), 0.7 * beta, dtype=F64)
        bound = third_order(gains, one(beta), one(0.7 * beta), None, None)[0]
        G = torch.randn(16, N, 4, generator=g, dtype=F64)
        found = 0.0
        for _ in range(25):
            G = _feasible(G, caps, beta).requires_grad_()
            dev = r3(G).flatten(1).norm(dim=1)
            found = max(found, float(dev.max()))
            (dG,) = torch.autograd.grad(dev.sum(), G)
            G = (G + 0.2 * _on_sphere(dG, beta)).detach()
        assert found <= bound * (1 + 1e-9) + 1e-14, (beta, found, bound)


# --------------------------------------------------------------------------
# The network.
# --------------------------------------------------------------------------


_model = nonlinear_model


@pytest.mark.parametrize("family", ["lipschitz", "standard"])
@pytest.mark.parametrize("seed", range(2))
def test_forward_is_the_model(family, seed):
    model = _model(family, seed)
    x = torch.rand(3, 1, 8, 8, dtype=F64)
    with torch.no_grad():
        assert torch.allclose(forward(model, x)[0], model(x), rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def margin_drop_shared() -> dict:
    """What the exact and the large-model (``exact: False``) cases of one model
    have in common, computed once: PGD's margin drops (pgd_margin_drop is
    deterministic: a private seeded generator) and the images' second-order
    models (:class:`~lipvit.certify.taylor.margin_jets.JetMargins`, which neither the
    exact sub-block norms nor the patch-block bounds enter)."""
    return {"pgd": {}, "jets": {}}


@pytest.mark.parametrize(
    "family, kw",
    [
        ("lipschitz", {}),
        ("lipschitz", {"attn_project": "token"}),
        ("lipschitz", {"attn_radius": 8.0, "v_cap": 1.0, "o_cap": 1.0}),  # fmnist-3x64
        ("lipschitz", {"num_heads": 1}),
        ("standard", {}),
        ("standard", {"depth": 1}),
        ("standard", {"exact": False}),
        ("lipschitz", {"exact": False}),
    ],
)
@pytest.mark.parametrize("seed", range(2))
def test_margin_drop_bound_exceeds_pgd_on_every_class(family, kw, seed, monkeypatch,
                                                      margin_drop_shared):
    kw = dict(kw)
    if not kw.pop("exact", True):  # large models: product and patch-block bounds
        monkeypatch.setattr("lipvit.certify.taylor.subblock.EXACT_MAX", 0)
        monkeypatch.setattr("lipvit.certify.taylor.jacobian_norms.EXACT_GRAM_MAX", 0)
        monkeypatch.setattr("lipvit.certify.taylor.subblock.WEIGHTED_SHARE", 0.0)
    model = _model(family, seed, **kw)
    key = (family, seed, tuple(sorted(kw.items())))  # the model, whatever exact is
    share_jets(monkeypatch, margin_drop_shared["jets"])
    x = torch.rand(3, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        y = model(x).argmax(1)
    tb = taylor_bound(model, x, y)
    for eps in (1e-3, 1e-2, 0.1):
        drop = tb.margin_drop(eps)  # (B, K)
        if (*key, eps) not in margin_drop_shared["pgd"]:
            margin_drop_shared["pgd"][(*key, eps)] = pgd_margin_drop(
                model, x, y, eps, steps=40, restarts=2)
        pgd = margin_drop_shared["pgd"][(*key, eps)]
        assert torch.all(pgd <= drop), (eps, pgd, drop)
        # The Taylor parts alone (without the √2 δ_out cap) are bounds too, each.
        e = torch.full((3,), eps, dtype=F64)
        parts = tb.remainders(e)
        assert set(parts) == ({"box", "chord"} if family == "lipschitz"
                              else {"box", "jet"})  # jets: tests/test_jets.py
        for name, part in parts.items():
            raw = tb.grad_norm * eps + part
            assert torch.all(pgd <= raw * (1 + 1e-9)), (name, eps, pgd, raw)
        assert bool((pgd > 0).any())  # the attack does find drops
        # The first-order part alone is a lower bound's limit: never above the
        # bound, save where the jets' exact quadratic term (§12) curves away.
        if "jet" not in parts:
            assert torch.all(tb.grad_norm * eps <= drop * (1 + 1e-9) + 1e-300)


@pytest.mark.parametrize("seed", range(3))
def test_chord_intervals_hold_for_sampled_perturbations(seed):
    """Every ReLU unit's move under perturbations of the ε-ball lies in its
    chord's ``[−down, up]``, and the part beyond its first-order move
    ``∇_x z_iᵀΓ`` in ``[−rest_down, rest_up]`` (docs/taylor.md §5): random
    points of the sphere and of the ball, and each unit's own steepest
    directions ``±ε ∇_x z_i/‖∇_x z_i‖`` (which reach its first-order bound),
    float64."""
    model = _model("lipschitz", seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(2, 1, 8, 8, dtype=F64, generator=gen)
    with torch.no_grad():
        y = model(x).argmax(1)
    tb = taylor_bound(model, x, y)

    def pre(v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(forward(model, v)[1].act_in)

    n = 100
    flips = 0
    for eps in (1e-2, 0.1, 0.3):
        chords = tb.chords(torch.full((2,), eps, dtype=F64))
        R = torch.randn(2 * n, 1, 8, 8, dtype=F64, generator=gen)
        R = R / R.flatten(1).norm(dim=1)[:, None, None, None] * eps  # the sphere
        R[n:] *= torch.rand(n, 1, 1, 1, dtype=F64, generator=gen)  # inside
        for b in range(2):
            J = torch.func.jacrev(lambda v: torch.cat([t.flatten() for t in pre(v)]))(
                x[b:b + 1]).reshape(-1, 1, 8, 8)  # (units, 1, 8, 8): ∇_x z_i
            G = torch.cat([R, J, -J]).detach()
            G[2 * n:] *= eps / G[2 * n:].flatten(1).norm(dim=1).clamp_min(1e-300)[
                :, None, None, None]
            X = x[b:b + 1].repeat(len(G), 1, 1, 1)
            with torch.no_grad():
                z0 = pre(x[b:b + 1])
                z1 = pre(X + G)
                _, first = torch.func.jvp(pre, (X,), (G,))
            for k, chord in enumerate(chords):
                dz = z1[k] - z0[k]  # (perturbations, N, m)
                rest = dz - first[k]
                tol = 1e-12 * (1 + dz.abs().amax())
                assert torch.all(dz <= chord.up[b] + tol), (eps, k)
                assert torch.all(-dz <= chord.down[b] + tol), (eps, k)
                assert torch.all(rest <= chord.rest_up[b] + tol), (eps, k)
                assert torch.all(-rest <= chord.rest_down[b] + tol), (eps, k)
                flips += int(((z0[k] > 0) != (z1[k] > 0)).sum())
    assert flips > 0  # some units do change sign: the intervals are exercised


def test_first_order_term_is_exact():
    model = _model("standard", 0)
    x = torch.rand(2, 1, 8, 8, dtype=F64)
    with torch.no_grad():
        y = model(x).argmax(1)
    tb = taylor_bound(model, x, y)
    j = (y + 1) % 10
    J = torch.func.jacrev(lambda v: model(v[None])[0])(x[0])  # (K, 1, 8, 8)
    grad = (J[j[0]] - J[y[0]]).norm()
    assert torch.isclose(tb.grad_norm[0, j[0]], grad, rtol=1e-10)
    full = J.reshape(10, 64)
    # The stream's Jacobian norms are exact: the logits' is ‖W_head‖-bounded, the
    # image's is 1 (first stream state = embedding, checked against jacrev).
    emb = torch.func.jacrev(lambda v: model.embed(v[None])[0])(x[0]).reshape(-1, 64)
    assert torch.isclose(
        tb.jacobians.stream[0, 0], torch.linalg.matrix_norm(emb, ord=2), rtol=1e-9
    )
    assert full.shape == (10, 64)


def test_unsupported_layers_refuse_with_one_line():
    model = ViT(tiny_config("standard", qkv_bias=True)).double()
    with torch.no_grad():
        model.blocks[0].attn.qkv.bias.fill_(0.1)
    x = torch.rand(1, 1, 8, 8, dtype=F64)
    with pytest.raises(UnsupportedModelError, match="bias-free") as err:
        taylor_bound(model, x, torch.tensor([0]))
    assert "\n" not in str(err.value)
    lip = ViT(tiny_config("lipschitz")).double()
    lip.blocks[0].norm2.mode = "frobenius"
    with pytest.raises(UnsupportedModelError, match="per token"):
        taylor_bound(lip, x, torch.tensor([0]))


def test_bisect_radius_closed_form():
    # certified iff ε < 0.3 (sample 0), never (sample 1).
    r = bisect_radius(
        lambda e: e < torch.tensor([0.3, -1.0], dtype=F64),
        torch.tensor([True, True]),
        rtol=0, tol=1e-6,
    )
    assert 0.3 - 2e-6 < r[0] < 0.3 and r[1] == 0


def _power_slacks(seed: int, B: int = 64):
    """Slacks ``log m − log min(aε + bε^p, cε)`` shaped like taylor's (a
    first-order part, a steep remainder, LoFAST's linear cap), their roots'
    bracket, and a counter of probes."""
    g = torch.Generator().manual_seed(seed)

    def u(lo, hi):
        return lo + (hi - lo) * torch.rand(B, dtype=F64, generator=g)

    a, b, p = 10 ** u(-2, 0), 10 ** u(0, 3), u(1.5, 6)
    c, m = 10 ** u(0.5, 1.5), 10 ** u(-2, 0)
    calls = [0]

    def drop(e):
        return torch.minimum(a * e + b * e**p, c * e)

    def slack(e):
        calls[0] += 1
        return m.log() - drop(e).log()

    return slack, drop, m, (m / c * 0.99, (m / a * 1.000001).clamp(max=10.0)), calls


@pytest.mark.parametrize("seed", range(3))
def test_falsi_radius_is_sound_and_within_rtol(seed):
    slack, drop, m, bracket, calls = _power_slacks(seed)
    candidates = torch.rand(64, generator=torch.Generator().manual_seed(seed)) > 0.1
    r = falsi_radius(slack, candidates, bracket, rtol=1e-3)
    assert torch.all(r[~candidates] == 0)
    assert torch.all((drop(r) < m)[candidates])  # certified where it says
    # the root: bisection of the exact slack to 1e-12
    root = bisect_radius(lambda e: drop(e) < m, candidates, rtol=1e-12,
                         bracket=bracket)
    r, root = r[candidates], root[candidates]
    assert torch.all(r <= root) and torch.all(r >= root * (1 - 1.001e-3))


def test_falsi_radius_needs_half_the_probes_of_bisection():
    falsi, bisect = 0, 0
    for seed in range(40):
        slack, drop, m, bracket, calls = _power_slacks(seed, B=1)
        one = torch.tensor([True])
        falsi_radius(slack, one, bracket)
        falsi, calls[0] = calls[0], 0
        bisect_radius(lambda e, s=slack: s(e) > 0, one, bracket=bracket)
        bisect += calls[0]
    assert falsi <= 0.6 * bisect, (falsi, bisect)


def test_falsi_radius_reuses_probed_slacks():
    """Slacks already computed at the per-ε checks narrow the bracket and are
    not probed again; the radius respects them."""
    slack, drop, m, bracket, calls = _power_slacks(3, B=8)
    one = torch.ones(8, dtype=torch.bool)
    plain = falsi_radius(slack, one, bracket)
    fresh, calls[0] = calls[0], 0
    probed = [(e, slack(torch.full((8,), e, dtype=F64))) for e in (0.01, 0.05, 0.2)]
    calls[0] = 0
    r = falsi_radius(slack, one, bracket, probed=probed)
    for e, f in probed:
        assert torch.all(r[f > 0] >= e) and torch.all(r[f <= 0] < e)
    assert torch.all((r - plain).abs() <= 2e-3 * plain)
    assert calls[0] < fresh


def test_falsi_radius_survives_nan_and_steps():
    """A slack that is NaN above 0.5 and jumps at 0.2: sound, and the jump's
    root found by the bisection fallback."""
    def slack(e):
        f = torch.where(e < 0.2, 1.0 - e, -1.0 - e)
        return torch.where(e > 0.5, torch.nan, f)
    r = falsi_radius(slack, torch.tensor([True, True]),
                     (torch.tensor([0.0, 0.01]), torch.tensor([2.0, 0.9])), rtol=1e-4)
    assert torch.all((r < 0.2) & (r > 0.2 * (1 - 2e-4))), r


# --------------------------------------------------------------------------
# A trained model: attacks and the CLI.
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(trained_ckpts):
    """The session's trained lipschitz digits model (tests/conftest.py)."""
    return trained_ckpts["lipschitz"]


def test_taylor_certified_points_survive_pgdl2_and_apgd(ckpt, digits, monkeypatch):
    from lipvit.certify import certifier

    from lipvit.checkpoint import load_checkpoint

    model = load_checkpoint(ckpt).model.double().eval()
    x, y = digits.x_test[:12].double(), digits.y_test[:12]
    tb = taylor_bound(model, x, y)
    radii = tb.radius(tol=1e-3)
    assert (radii > 0).sum() >= 3, "the model should certify some points"
    assert torch.all(tb.certified(radii)[radii > 0])
    eps = float(radii[radii > 0].median())
    # certify_samples' taylor certificates at ε come from the bound of the same
    # model, points and labels (default settings): the one above, built once.
    build, shared = certifier.taylor_bound, []

    def taylor_bound_once(m, xs, ys, **kw):
        if (torch.equal(xs, x) and torch.equal(ys, y)
                and all(v is None for v in kw.values())):
            shared.append(True)
            return tb
        return build(m, xs, ys, **kw)

    monkeypatch.setattr(certifier, "taylor_bound", taylor_bound_once)
    report = certify_samples(model, x, y, ["taylor", "lofast"], [eps])
    assert shared == [True]
    monkeypatch.undo()
    cert = report.certified[f"taylor@{eps}"]
    assert torch.all(cert >= report.certified[f"lofast@{eps}"])
    xs, ys = x[cert].float(), y[cert]
    fmodel = model.float()
    for atk in (
        torchattacks.PGDL2(
            fmodel, eps=eps, alpha=eps / 8, steps=100, random_start=True
        ),
        torchattacks.APGD(fmodel, norm="L2", eps=eps, steps=50, n_restarts=2),
    ):
        adv = atk(xs, ys)
        assert torch.all((adv - xs).flatten(1).norm(dim=1) <= eps * (1 + 1e-4))
        assert torch.all(fmodel(adv).argmax(1) == ys), type(atk).__name__
    model.double()


def test_cli_certify_taylor(ckpt, tmp_path):
    js = tmp_path / "out.json"
    result = CliRunner().invoke(
        main,
        [
            "certify",
            "--ckpt",
            str(ckpt),
            "--eps",
            "0.01,0.05",
            "--method",
            "taylor,lofast",
            "--radius",
            "--n",
            "10",
            "--json",
            str(js),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(js.read_text())
    assert "taylor" in data["quantities"]
    rows = {(r["method"], r["eps"]): r for r in data["results"]}
    for eps in (0.01, 0.05):
        assert rows[("taylor", eps)]["exact"] is True
        assert (
            rows[("taylor", eps)]["certified_accuracy"]
            >= rows[("lofast", eps)]["certified_accuracy"]
        )
    for s in data["samples"]:
        assert s["radii"]["taylor"] >= 0
        if s["radii"]["taylor"] > 0.01:
            assert s["certified"]["taylor@0.01"]


@pytest.mark.parametrize("family", ["lipschitz", "standard"])
def test_logit_jacobian_norms_are_exact(family):
    model = _model(family, 0)
    x = torch.rand(2, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(3))
    jn = jacobian_norms(model, x)
    for k, block in enumerate(model.blocks):
        W = block.attn.head_weights()

        def logits(v, k=k, W=W):  # (H, N, N) of one image
            p = forward(model, v[None])[1].attn_in[k][0]
            S = torch.einsum("nd,hde,hme,km->hnk", p, W.W_q, W.W_k, p)
            return S / math.sqrt(W.W_q.shape[-1])

        for b in range(2):
            J = torch.func.jacrev(logits)(x[b])  # (H, N, N, 1, 8, 8)
            exact = torch.linalg.matrix_norm(J.flatten(1, 2).flatten(2), ord=2)  # (H,)
            assert torch.allclose(jn.logits[b, k], exact, rtol=1e-9)


@pytest.mark.parametrize("family,project,push", [
    ("lipschitz", "frobenius", None), ("lipschitz", "token", 2**17),
    ("standard", None, None), ("standard", None, 2**20),
])
def test_subblock_norms_are_exact(family, project, push, monkeypatch):
    """Against dense Jacobians: the attention sub-block's norm formed whole
    (Frobenius projection) and from the bare attention's Jacobian (token-wise
    norms), with the basis tangents pushed all at once and a few at a time."""
    from lipvit.certify.taylor import subblock
    from lipvit.certify.taylor.subblock import subblock_norms

    if push is not None:
        monkeypatch.setattr(subblock, "PUSH_BYTES", push)
    model = _model(family, 1, **({"attn_project": project} if project else {}))
    x = torch.rand(2, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        clean = forward(model, x)[1]
    sub = subblock_norms(model, clean)

    def norm(fn, v):  # ‖Dfn(v)‖ of one token matrix (or token) from the dense Jacobian
        J = torch.func.jacrev(fn)(v)
        return torch.linalg.matrix_norm(J.reshape(fn(v).numel(), v.numel()), ord=2)

    for k, blk in enumerate(model.blocks):
        X, X_mid = clean.stream[2 * k], clean.stream[2 * k + 1]
        for b in range(2):
            attn = norm(lambda v, blk=blk: v + blk.attn(blk.norm1(v[None]))[0], X[b])
            bare = norm(lambda v, blk=blk: blk.attn(v[None])[0], clean.attn_in[k][b])
            # upper bounds (a Cholesky certificate above the estimate), tight
            for bound, exact in ((sub.attn[b, k], attn), (sub.bare[b, k], bare)):
                assert exact * (1 - 1e-12) <= bound <= exact * (1 + 1e-6)
            for t in (0, 5):
                def ff(v, blk=blk):
                    out = blk.mlp(blk.norm2(v[None, None]))[0, 0]
                    return out if family == "lipschitz" else v + out
                exact = norm(ff, X_mid[b, t])
                assert torch.allclose(sub.mlp[b, k, t], exact, rtol=1e-9)
                J_z = torch.func.jacrev(lambda v, blk=blk: blk.mlp.fc1(blk.norm2(v)))(
                    X_mid[b, t][None])[0, :, 0]  # (m, D)
                assert torch.allclose(sub.unit[k][b, t], J_z.norm(dim=1), rtol=1e-9)
                q = blk.norm2(X_mid[b, t][None])[0]
                ffn = norm(lambda v, blk=blk: blk.mlp(v[None])[0], q)
                assert torch.allclose(sub.ffn[k][b, t], ffn, rtol=1e-9)
                if k + 1 == len(model.blocks):
                    continue
                if family == "lipschitz":
                    assert torch.isinf(sub.into[k][b, t])
                    continue
                nxt = model.blocks[k + 1].norm1
                into = norm(lambda v, f=ff, n=nxt: n(f(v)[None])[0], X_mid[b, t])
                assert torch.allclose(sub.into[k][b, t], into, rtol=1e-9)
    assert len(sub.into) == len(model.blocks) - 1
    large = subblock_norms(model, clean, max_size=10)  # token-wise maps only
    assert torch.all(large.attn.isinf()) and torch.all(large.bare.isinf())
    for f in ("mlp", "unit", "ffn", "into"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(large, f),
                                                      getattr(sub, f), strict=True))


@pytest.fixture(scope="module")
def token_pgd() -> dict:
    """PGD's deviations by (family, seed, ε, stream state, token): the attacks do
    not depend on ``exact`` (the same model, points and ε, and pgd_deviation's
    private seeded generator), so the exact and the large-model budgets are
    checked against the same attacks, run once."""
    return {}


@pytest.mark.parametrize("family, exact", [("standard", True), ("standard", False),
                                           ("lipschitz", True), ("lipschitz", False)])
@pytest.mark.parametrize("seed", range(2))
def test_token_budgets_bound_pgd(family, exact, seed, monkeypatch, token_pgd):
    """Every stream state's whole and per-token budgets (``acc_token``, the exact
    sub-block norms, the attention's row bounds, the Lipschitz recursion) exceed
    what PGD finds; a lipschitz block's 1-Lipschitz ``SLL∘P₂`` never lets a
    budget grow."""
    if not exact:  # large models: product and patch-block bounds
        monkeypatch.setattr("lipvit.certify.taylor.subblock.EXACT_MAX", 0)
        monkeypatch.setattr("lipvit.certify.taylor.jacobian_norms.EXACT_GRAM_MAX", 0)
        monkeypatch.setattr("lipvit.certify.taylor.subblock.WEIGHTED_SHARE", 0.0)
    model = _model(family, seed)
    x = torch.rand(2, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        y = model(x).argmax(1)
    tb = taylor_bound(model, x, y)

    def attack(eps, m, t, fn):
        key = (family, seed, eps, m, t)
        if key not in token_pgd:
            token_pgd[key] = pgd_deviation(fn, x, eps, steps=30, restarts=2)
        return token_pgd[key]

    for eps in (1e-3, 3e-2):
        _, budgets, _ = tb.walk(torch.full((2,), eps, dtype=F64))
        for m, budget in enumerate(budgets):
            for t in (0, 7):
                def token(v, m=m, t=t):
                    return forward(model, v)[1].stream[m][:, t]
                found = attack(eps, m, t, token)
                assert torch.all(found <= budget.token[:, t] * (1 + 1e-9)), (eps, m, t)
                assert torch.all(budget.token[:, t] <= budget.all * (1 + 1e-12))
            if eps == 3e-2:  # the whole matrix, at the larger ε
                def whole(v, m=m):
                    return forward(model, v)[1].stream[m].flatten(1)
                found = attack(eps, m, "all", whole)
                assert torch.all(found <= budget.all * (1 + 1e-9)), (eps, m)
        if family == "lipschitz":
            for mid, out in zip(budgets[1::2], budgets[2::2], strict=True):
                assert torch.all(out.all <= mid.all)
                assert torch.all(out.token <= mid.token)


def _radii(path) -> dict[int, float]:
    """``taylor``'s radius per test-set index in a ``certify --json`` file."""
    return {s["index"]: s["radii"]["taylor"]
            for s in json.loads(path.read_text())["samples"]}


@pytest.fixture(scope="module")
def default_radii(ckpt, tmp_path_factory) -> dict[int, float]:
    """``lipvit certify --method taylor --radius`` with the default settings on
    the model's six test points (``--n 6``), run once: what the ``--max-memory``
    and ``--max-symbols`` runs are compared with, by test-set index."""
    js = tmp_path_factory.mktemp("taylor_default") / "default.json"
    result = CliRunner().invoke(main, ["certify", "--ckpt", str(ckpt), "--eps", "0.05",
                                       "--method", "taylor", "--n", "6", "--radius",
                                       "--json", str(js)])
    assert result.exit_code == 0, result.output
    return _radii(js)


def test_cli_max_memory(ckpt, tmp_path, default_radii):
    """``--max-memory``: a budget below one patch of tangents is refused in one
    line before any work (nothing written); a small one that still fits runs a
    sample at a time with the patch-block norms (bounds of the exact ones:
    radii no larger than the default's, up to the bisection's tolerance)."""
    def run(*extra):
        return CliRunner().invoke(main, ["certify", "--ckpt", str(ckpt), "--eps",
                                         "0.05", "--method", "taylor", "--n", "4",
                                         *extra])

    js = tmp_path / "out.json"
    refused = run("--max-memory", "1K", "--json", str(js))
    assert refused.exit_code != 0
    assert "--max-memory" in refused.output and "Traceback" not in refused.output
    assert len(refused.output.strip().splitlines()) == 1 and not js.exists()
    assert run("--max-memory", "lots").exit_code != 0
    a = tmp_path / "a.json"
    assert run("--max-memory", "6M", "--radius", "--json", str(a)).exit_code == 0
    small = _radii(a)
    assert len(small) == 4 and set(small) <= set(default_radii)  # --n 4 of --n 6
    assert all(r <= default_radii[i] * (1 + 2e-3) for i, r in small.items())


def test_cli_max_symbols(ckpt, tmp_path, default_radii):
    """``--max-symbols``: negative is refused in one line; 0 (every flippable unit
    bounded in norm) certifies radii no larger than the default's, and smaller
    on some point (the symbols carry the flips exactly); ``taylor_bound``
    refuses a negative count too."""
    def run(*extra):
        return CliRunner().invoke(main, ["certify", "--ckpt", str(ckpt), "--eps",
                                         "0.05", "--method", "taylor", "--n", "6",
                                         *extra])

    refused = run("--max-symbols", "-1")
    assert refused.exit_code != 0 and "Traceback" not in refused.output
    assert "--max-symbols" in refused.output
    a = tmp_path / "a.json"
    assert run("--max-symbols", "0", "--radius", "--json", str(a)).exit_code == 0
    none = _radii(a)
    assert set(none) == set(default_radii)
    assert all(r <= default_radii[i] * (1 + 2e-3) for i, r in none.items())
    assert any(r < default_radii[i] * (1 - 2e-3) for i, r in none.items())
    from lipvit.checkpoint import load_checkpoint

    model = load_checkpoint(ckpt).model.double().eval()
    with pytest.raises(ValueError, match="max_symbols"):
        taylor_bound(model, torch.zeros(1, 1, 8, 8, dtype=F64), torch.zeros(1).long(),
                     max_symbols=-1)
