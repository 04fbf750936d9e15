"""1-Lipschitz layers of the lipschitz family: exact Jacobian norms and PGD searches."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import full_jacobian, pgd_lipschitz_ratio, tiny_config

from lipvit.layers import SLL, LayerProject, SpectralCap, capped_linear, layer_project
from lipvit.model import ViT
from lipvit.spectral import spectral_norm

DT = torch.float64
TOL = 1e-9


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*shape, generator=g, dtype=DT)


# ------------------------------------------------------------------ LayerProject


@pytest.mark.parametrize("mode", ["token", "frobenius"])
def test_layer_project_projects_onto_the_ball(mode: str) -> None:
    R = 1.5
    x = _randn(3, 5, 4, seed=0)
    x = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # unit tokens
    if mode == "token":
        x = x * torch.linspace(0.2, 3.0, 5, dtype=DT)[None, :, None]  # token norms
    else:
        x = (
            x * torch.tensor([0.2, 0.6, 2.0], dtype=DT)[:, None, None]
        )  # ‖X‖_F ≈ 0.4 .. 4.5
    y = LayerProject(R, mode)(x)
    dims = (-1,) if mode == "token" else (-2, -1)
    norms_in = torch.linalg.vector_norm(x, dim=dims)
    norms_out = torch.linalg.vector_norm(y, dim=dims)
    assert torch.all(norms_out <= R * (1 + 1e-12))
    inside = norms_in <= R
    # Inside the ball nothing moves; outside, the result is on the sphere.
    assert torch.allclose(norms_out[~inside], torch.full_like(norms_out[~inside], R))
    assert inside.any() and (~inside).any()
    assert torch.equal(y[inside], x[inside])
    cos = torch.nn.functional.cosine_similarity(
        x.flatten(-len(dims)), y.flatten(-len(dims)), dim=-1
    )
    assert torch.allclose(cos, torch.ones_like(cos))


@pytest.mark.parametrize("mode", ["token", "frobenius"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layer_project_is_1_lipschitz(mode: str, seed: int) -> None:
    layer = LayerProject(1.0, mode)
    x = _randn(5, 4, seed=seed, scale=0.8)  # some tokens inside the ball, some outside
    sigma = spectral_norm(full_jacobian(layer, x))
    assert sigma <= 1 + TOL
    # At a point inside the ball the projection is the identity: norm exactly 1.
    inner = spectral_norm(full_jacobian(layer, x / (10 * x.norm())))
    assert abs(inner - 1) < 1e-12
    assert pgd_lipschitz_ratio(layer, x, seed=seed) <= 1 + TOL


def test_layer_project_rejects_nothing_at_zero() -> None:
    # A zero token has norm 0 < R: it must come back unchanged (no 0/0).
    x = torch.zeros(2, 3, dtype=DT)
    assert torch.equal(layer_project(x, 1.0), x)


# ---------------------------------------------------------------- SLL


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_sll_is_1_lipschitz_exact_jacobian(seed: int) -> None:
    torch.manual_seed(seed)
    layer = SLL(6, 9).double()
    with torch.no_grad():  # random, non-trivial parameters
        layer.fc1.weight.copy_(_randn(9, 6, seed=seed + 10))
        layer.fc1.bias.copy_(_randn(9, seed=seed + 20, scale=0.5))
        layer.log_q.copy_(_randn(9, seed=seed + 30, scale=0.5))
    worst = 0.0
    for point in range(5):
        x = _randn(6, seed=100 * seed + point, scale=2.0)
        worst = max(worst, float(spectral_norm(full_jacobian(layer, x))))
    assert worst <= 1 + TOL
    assert worst > 0.5  # the check is not vacuous: SLL is close to norm 1
    x = _randn(4, 6, seed=seed + 40)
    assert pgd_lipschitz_ratio(layer, x, seed=seed) <= 1 + TOL


def test_sll_matches_its_formula() -> None:
    # y = x − 2 W T⁻¹ ReLU(Wᵀx + b), T_ii = Σ_j |WᵀW|_ij q_j / q_i (docs/math.md §5).
    layer = SLL(4, 5).double()
    with torch.no_grad():
        layer.log_q.copy_(_randn(5, seed=3))
    x = _randn(4, seed=4)
    W = layer.fc1.weight.T  # (D, m)
    q = torch.exp(layer.log_q)
    T = ((W.T @ W).abs() * q[None, :] / q[:, None]).sum(dim=1)
    expected = x - 2 * W @ (torch.relu(W.T @ x + layer.fc1.bias) / T)
    assert torch.allclose(layer(x), expected, atol=1e-12)


# ---------------------------------------------------------------- caps


@pytest.mark.parametrize("seed", [0, 1])
def test_spectral_cap_blocks(seed: int) -> None:
    H, d, D = 3, 4, 12
    W = _randn(3 * D, D, seed=seed, scale=1.0)
    W[2 * D : 2 * D + d] *= 1e-3  # head 0 of the V rows is already below the cap
    capped = SpectralCap(0.5, "rows_per_head", H, (2 * D, 3 * D))(W)
    blocks = capped[2 * D :].reshape(H, d, D)
    sig = spectral_norm(blocks)
    assert torch.all(sig <= 0.5 * (1 + 1e-12))
    assert torch.allclose(
        sig[1:], torch.full_like(sig[1:], 0.5)
    )  # big ones land on 0.5
    assert torch.equal(
        capped[2 * D : 2 * D + d], W[2 * D : 2 * D + d]
    )  # small one untouched
    assert torch.equal(capped[: 2 * D], W[: 2 * D])  # q and k rows untouched
    P = _randn(D, D, seed=seed + 5, scale=1.0)
    capped_o = SpectralCap(0.25, "cols_per_head", H)(P)
    sig_o = spectral_norm(capped_o.reshape(D, H, d).transpose(0, 1))
    assert torch.all(sig_o <= 0.25 * (1 + 1e-12))


@pytest.mark.parametrize("seed", [0, 1])
def test_capped_linear_and_head_are_1_lipschitz(seed: int) -> None:
    torch.manual_seed(seed)
    layer = capped_linear(7, 5).double()
    with torch.no_grad():
        layer.parametrizations.weight.original.mul_(100.0)
    f = layer
    x = _randn(7, seed=seed)
    sigma = spectral_norm(full_jacobian(f, x))
    assert sigma <= 1 + TOL
    assert sigma > 1 - 1e-9  # scaled far above 1, then capped: exactly 1
    assert pgd_lipschitz_ratio(f, x, seed=seed) <= 1 + TOL


@pytest.mark.parametrize("seed", [0, 1])
def test_patch_embedding_and_head_of_the_lipschitz_vit(seed: int) -> None:
    torch.manual_seed(seed)
    model = ViT(tiny_config("lipschitz")).double()
    with torch.no_grad():  # make the caps bind
        model.patch_embed.proj.parametrizations.weight.original.mul_(50.0)
        model.head.parametrizations.weight.original.mul_(50.0)
    x = _randn(1, 1, 8, 8, seed=seed)
    # Patch embedding, whole image → all patch tokens: exact norm ≤ 1.
    sigma = spectral_norm(full_jacobian(model.patch_embed, x))
    assert sigma <= 1 + TOL
    assert sigma > 1 - 1e-9
    assert pgd_lipschitz_ratio(model.patch_embed, x, seed=seed) <= 1 + TOL
    # Head on the class token.
    t = _randn(1, model.config.embed_dim, seed=seed + 1)
    assert spectral_norm(full_jacobian(model.head, t)) <= 1 + TOL
    assert pgd_lipschitz_ratio(model.head, t, seed=seed) <= 1 + TOL
    # Normalisation inside the model has Lipschitz constant 1 / min(std).
    norm_sigma = spectral_norm(full_jacobian(model.normalize, x))
    assert abs(norm_sigma - 1 / min(model.config.std)) < 1e-9


def test_final_norm_and_mlp_block_of_the_lipschitz_vit_are_1_lipschitz() -> None:
    torch.manual_seed(0)
    model = ViT(tiny_config("lipschitz")).double()
    block = model.blocks[0]
    tokens = _randn(5, model.config.embed_dim, seed=1, scale=2.0)

    def mlp_part(x: torch.Tensor) -> torch.Tensor:
        return block.mlp(block.norm2(x))

    assert spectral_norm(full_jacobian(mlp_part, tokens)) <= 1 + TOL
    assert spectral_norm(full_jacobian(model.norm, tokens)) <= 1 + TOL
    assert math.isfinite(pgd_lipschitz_ratio(mlp_part, tokens))
    assert pgd_lipschitz_ratio(mlp_part, tokens) <= 1 + TOL
