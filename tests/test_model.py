"""ViT shapes, configs, and the head_weights() reconstruction of attention."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_config

from lipvit.config import PRESETS, ViTConfig, preset
from lipvit.model import ViT
from lipvit.spectral import spectral_norm

DT = torch.float64


@pytest.mark.parametrize(
    "family,attn_project",
    [("standard", "frobenius"), ("lipschitz", "frobenius"), ("lipschitz", "token")],
)
def test_shapes_and_finite_outputs(family: str, attn_project: str) -> None:
    torch.manual_seed(0)
    cfg = tiny_config(family, attn_project=attn_project, num_classes=7)
    model = ViT(cfg)
    x = torch.rand(5, 1, 8, 8)
    assert model.embed(x).shape == (5, cfg.num_patches + 1, cfg.embed_dim)
    feats = model.forward_features(x)
    assert feats.shape == (5, 17, cfg.embed_dim)
    logits = model(x)
    assert logits.shape == (5, 7)
    assert torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(
        p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters()
    )


def test_presets_build() -> None:
    for name in PRESETS:
        cfg = preset(name)
        assert cfg.image_size % cfg.patch_size == 0
    torch.manual_seed(0)
    model = ViT(
        preset(
            "cifar-lofast-3x128", family="lipschitz", mean=(0.5,) * 3, std=(0.25,) * 3
        )
    )
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize(
    "bad",
    [
        dict(patch_size=3),
        dict(num_heads=3),
        dict(depth=0),
        dict(family="other"),
        dict(v_cap=1.5),
        dict(std=(0.0,)),
        dict(mean=(0.1, 0.2)),
        dict(family="lipschitz", qkv_bias=True),
    ],
)
def test_config_validation(bad: dict) -> None:
    with pytest.raises(ValueError):
        tiny_config(**bad)


def test_config_round_trip() -> None:
    cfg = tiny_config("lipschitz", mean=(0.3,), std=(0.4,))
    assert ViTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError):
        ViTConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def _attention_from_head_weights(attn, X: torch.Tensor) -> torch.Tensor:
    """``Σ_h softmax((X W_q + b_q)(X W_k + b_k)ᵀ/√d) (X W_v + b_v) W_o + b_o``."""
    W_q, W_k, W_v, W_o = attn.head_weights()
    b_q, b_k, b_v, b_o = attn.head_biases()
    H, D, d = W_q.shape
    out = torch.zeros_like(X)
    for h in range(H):
        q, k, v = X @ W_q[h], X @ W_k[h], X @ W_v[h]  # (B, N, d)
        if b_q is not None:
            q, k, v = q + b_q[h], k + b_k[h], v + b_v[h]
        P = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)  # (B, N, N)
        out = out + P @ v @ W_o[h]
    return out + (0 if b_o is None else b_o)


@pytest.mark.parametrize(
    "family,qkv_bias", [("standard", False), ("standard", True), ("lipschitz", False)]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_head_weights_reconstruct_attention(
    family: str, qkv_bias: bool, seed: int
) -> None:
    torch.manual_seed(seed)
    model = ViT(
        tiny_config(family, qkv_bias=qkv_bias, embed_dim=12, num_heads=3)
    ).double()
    with torch.no_grad():  # weights large enough that attention is far from uniform
        for p in model.parameters():
            p.normal_(0, 0.5)
    attn = model.blocks[0].attn
    W_q, W_k, W_v, W_o = attn.head_weights()
    assert W_q.shape == W_k.shape == W_v.shape == (3, 12, 4)
    assert W_o.shape == (3, 4, 12)
    X = torch.randn(2, 6, 12, dtype=DT) * 2
    assert torch.allclose(
        attn(X), _attention_from_head_weights(attn, X), atol=1e-6, rtol=0
    )
    # Not trivially true: attention differs from its uniform-average version.
    P_uniform = attn(X).sub(_attention_from_head_weights(attn, X * 1e-4)).abs().max()
    assert P_uniform > 1e-3


def test_head_weights_carry_gradients_and_caps() -> None:
    torch.manual_seed(0)
    cfg = tiny_config("lipschitz", v_cap=0.3, o_cap=0.7)
    model = ViT(cfg)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.parametrizations.weight.original.mul_(30.0)
            block.attn.proj.parametrizations.weight.original.mul_(30.0)
    for attn in model.attention_layers():
        W_q, W_k, W_v, W_o = attn.head_weights()
        assert torch.all(spectral_norm(W_v.double()) <= 0.3 * (1 + 1e-6))
        assert torch.all(spectral_norm(W_o.double()) <= 0.7 * (1 + 1e-6))
        assert spectral_norm(W_q.double()).max() > 1  # q and k are not capped
        (W_q.sum() + W_v.sum()).backward()
        assert attn.qkv.parametrizations.weight.original.grad is not None
