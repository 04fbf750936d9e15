"""Power iteration and the MSVP penalty (SpecFormer eq. 11/14, docs/math.md §4)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from lipvit.model import ViT
from lipvit.msvp import MSVP
from lipvit.spectral import matrix_power_iteration, power_iteration, spectral_norm
from lipvit.train import TrainConfig, head_sigmas, train_step

DT = torch.float64


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_power_iteration_converges_from_below(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(4, 3, 9, 5, generator=g, dtype=DT)  # a batch of 12 matrices
    exact = torch.linalg.matrix_norm(W, ord=2)
    v0 = torch.randn(4, 3, 5, generator=g, dtype=DT)
    few = matrix_power_iteration(W, v0, n_iter=1)
    assert torch.all(few.sigma <= exact * (1 + 1e-12))  # an estimate from below
    it = matrix_power_iteration(W, v0, n_iter=500)
    assert torch.all(it.sigma <= exact * (1 + 1e-12))
    assert torch.allclose(it.sigma, exact, atol=1e-4, rtol=0)
    # u, v are unit singular vectors: W v = σ u.
    Wv = (W @ it.v.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(Wv, it.sigma[..., None] * it.u, atol=1e-4)


def test_power_iteration_matrix_free_matches_matrix() -> None:
    g = torch.Generator().manual_seed(3)
    A = torch.randn(6, 4, generator=g, dtype=DT)
    v0 = torch.randn(2, 2, generator=g, dtype=DT)  # operator on (2, 2) inputs
    it = power_iteration(
        lambda v: v.reshape(4) @ A.T,
        lambda u: (u @ A).reshape(2, 2),
        v0,
        n_iter=300,
        in_ndim=2,
        out_ndim=1,
    )
    assert abs(float(it.sigma) - float(spectral_norm(A))) < 1e-4


def _scaled_model(family: str, seed: int) -> ViT:
    torch.manual_seed(seed)
    model = ViT(tiny_config(family, embed_dim=12, num_heads=3)).double()
    with torch.no_grad():
        for attn in model.attention_layers():
            w = (
                attn.qkv.weight
                if family == "standard"
                else attn.qkv.parametrizations.weight.original
            )
            w.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("family", ["standard", "lipschitz"])
def test_msvp_persistent_vectors_converge_to_every_head(family: str) -> None:
    model = _scaled_model(family, 0)
    msvp = MSVP(model, (1.0, 1.0, 1.0), n_iter=1).double()
    for _ in range(400):  # one step per call, vectors carried over
        sigma = msvp.sigma(update=True)
    exact = head_sigmas(model)[:, :3].double()  # (L, 3, H): W_q, W_k, W_v
    assert sigma.shape == exact.shape == (2, 3, 3)
    assert torch.allclose(sigma.detach(), exact, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["standard", "lipschitz"])
def test_fused_weights_match_head_weights(family: str) -> None:
    model = _scaled_model(family, 1)
    msvp = MSVP(model, (1.0, 1.0, 1.0))
    stacked = torch.stack(
        [torch.stack(a.head_weights()[:3]) for a in model.attention_layers()]
    )  # (L, 3, H, D, d)
    assert torch.equal(msvp.weights(), stacked)
    assert torch.equal(msvp.weights_t(), stacked.mT)


def test_penalty_value_and_gradient_closed_form() -> None:
    # J = Σ λ σ², σ = uᵀ W v, so dJ/dW[h] = 2 λ σ u vᵀ for the penalised blocks.
    model = _scaled_model("standard", 2)
    lam = (0.3, 0.2, 0.1)
    msvp = MSVP(model, lam, n_iter=1).double()
    for _ in range(300):
        msvp.sigma(update=True)
    model.zero_grad()
    penalty, sigma = msvp(update=False)
    exact = head_sigmas(model)[:, :3].double()
    expected = (torch.tensor(lam, dtype=DT)[None, :, None] * exact**2).sum()
    assert abs(float(penalty.detach()) - float(expected)) < 1e-6
    penalty.backward()
    attn = model.blocks[1].attn
    grad = attn.qkv.weight.grad  # (3D, D): row blocks are W[h]ᵀ
    D, H, d = 12, 3, 4
    for kind in range(3):
        for h in range(H):
            u, v = msvp.u[1, kind, h], msvp.v[1, kind, h]  # (D,), (d,)
            block = grad[
                kind * D + h * d : kind * D + (h + 1) * d
            ]  # (d, D) = dJ/dW[h]ᵀ
            expected_grad = 2 * lam[kind] * sigma[1, kind, h] * torch.outer(v, u)
            assert torch.allclose(block, expected_grad, atol=1e-10)


def test_msvp_buffers_and_validation() -> None:
    model = ViT(tiny_config())
    msvp = MSVP(model, (1e-3, 0.0, 2e-3), n_iter=2)
    state = msvp.state_dict()
    assert set(state) == {"lambdas", "u", "v"}
    assert state["u"].shape == (2, 3, 2, 16) and state["v"].shape == (2, 3, 2, 8)
    with pytest.raises(ValueError):
        MSVP(model, (-1.0, 0.0, 0.0))
    with pytest.raises(ValueError):
        MSVP(model, (1.0, 1.0, 1.0), n_iter=0)
    with pytest.raises(ValueError):
        MSVP(torch.nn.Linear(3, 3), (1.0, 1.0, 1.0))


@pytest.mark.parametrize("family", ["standard", "lipschitz"])
def test_penalty_lowers_sigma_max_in_training(family: str, digits) -> None:
    # Same seed, data and steps; only λ differs. The penalised run must end with
    # a lower mean exact σ_max of W_q, W_k, W_v.
    x, y = digits.x_train[:512], digits.y_train[:512]
    result = {}
    for lam in (0.0, 0.05):
        torch.manual_seed(0)
        model = ViT(tiny_config(family, mean=digits.mean, std=digits.std))
        cfg = TrainConfig(
            lr=3e-3,
            weight_decay=0.0,
            msvp=(lam,) * 3,
            loss_scale=1.0 if family == "standard" else 32.0,
        )
        msvp = MSVP(model, cfg.msvp) if lam > 0 else None
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        for i in range(40):
            idx = slice((i * 64) % 512, (i * 64) % 512 + 64)
            train_step(model, opt, x[idx], y[idx], cfg, msvp)
        result[lam] = float(head_sigmas(model)[:, :3].mean())
    assert result[0.05] < 0.8 * result[0.0], result
