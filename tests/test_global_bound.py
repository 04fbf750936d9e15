"""The hybrid ViT's proven constants (docs/math.md §9) against brute force.

Every bound is checked in float64 over several seeds: the convolution bound
against the dense matrix of the convolution, the attention's constant and the
whole network's against the largest Jacobian norm found by ascent from random
and test points, and the certificate against PGD-ℓ2 and APGD.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from lipvit.certify.certification import margin
from lipvit.certify.evaluate import certify_samples
from lipvit.certify.global_bound import (
    global_constant,
    global_radius,
    pair_constants,
)
from torch.func import jacrev, vmap

from lipvit.cli import main
from lipvit.config import ViTConfig, preset
from lipvit.errors import UnsupportedModelError
from lipvit.hybrid import HybridViT
from lipvit.layers import max_min
from lipvit.lipschitz_blocks import attention_lipschitz, attention_norms
from lipvit.spectral import conv_operator_norm
from lipvit.train import train, train_config_for

SEEDS = (0, 1, 2)


def hybrid_config(image_size: int = 8, **overrides) -> ViTConfig:
    """A tiny hybrid ViT: ``(image_size / 4)²`` tokens of width 8."""
    base = dict(image_size=image_size, in_chans=1, num_classes=10, patch_size=4,
                embed_dim=8, depth=1, num_heads=2, family="lipschitz", arch="hybrid",
                stem_width=4, head_hidden=8)
    return ViTConfig(**{**base, **overrides})


def sharpened(model: HybridViT, seed: int, scale: float = 3.0) -> HybridViT:
    """``model`` in float64 with sharp, visibly nonlinear attention: queries and
    keys ``scale`` times larger, a random positional bias, an open gate."""
    torch.manual_seed(seed)
    model = model.double().eval()
    with torch.no_grad():
        for block in model.blocks:
            D = block.qkv.weight.shape[1]
            block.qkv.weight[: 2 * D].normal_(0, scale / math.sqrt(D))
            block.pos_bias.normal_(0, 2.0)
            block.gate_logit.fill_(1.0)
        model.pos_embed.normal_(0, 0.5)
    return model


def spectral(J):
    return torch.linalg.matrix_norm(J, ord=2)


def ascend(fn, x0, steps: int = 60, lr: float = 0.05):
    """Largest ``‖J_fn(x)‖₂`` met by gradient ascent from each start ``x0[b]``
    (a lower bound of ``fn``'s Lipschitz constant): ``(B,)``."""
    def sigma(x):
        J = jacrev(fn)(x)  # (*out, *in)
        return spectral(J.reshape(-1, x.numel()))

    x = x0.clone()
    best = vmap(sigma)(x)
    for _ in range(steps):
        g = vmap(torch.func.grad(sigma))(x)
        x = x + lr * g / g.flatten(1).norm(dim=1).clamp_min(1e-30).reshape(
            (-1,) + (1,) * (x.ndim - 1))
        best = torch.maximum(best, vmap(sigma)(x))
    return best


# ---------------------------------------------------------------- convolutions


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("size", [5, 8])
def test_conv_bound_is_above_the_dense_convolution(seed: int, size: int) -> None:
    torch.manual_seed(seed)
    K = torch.randn(6, 3, 3, 3, dtype=torch.float64)
    basis = torch.eye(3 * size * size, dtype=torch.float64).reshape(-1, 3, size, size)
    dense = F.conv2d(basis, K, padding=1).reshape(3 * size * size, -1)  # rows: inputs
    exact = spectral(dense)
    bound = conv_operator_norm(K, size)
    assert exact <= bound * (1 + 1e-12)
    # The bound is the exact norm of the circular convolution on the G × G grid.
    G = size + 2
    basis = torch.eye(3 * G * G, dtype=torch.float64).reshape(-1, 3, G, G)
    circ = F.conv2d(F.pad(basis, (1, 1, 1, 1), mode="circular"), K)
    assert torch.isclose(spectral(circ.reshape(3 * G * G, -1)), bound, rtol=1e-10)


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scale", [0.1, 0.3, 1.0, 3.0])
def test_attention_constant_bounds_ascended_jacobians(seed: int, scale: float) -> None:
    cfg = hybrid_config(image_size=12, attn_radius=1.5)  # 9 tokens of width 8
    block = sharpened(HybridViT(cfg), seed, scale).blocks[0]
    L_A = block.lipschitz()
    N, D = cfg.num_patches, cfg.embed_dim

    def attn(x):  # one token matrix (N, D)
        return block.attend(x[None])[0]

    gen = torch.Generator().manual_seed(seed)
    # Tokens inside and outside the projection ball (radius 1.5).
    x0 = torch.randn(12, N, D, generator=gen, dtype=torch.float64)
    x0 = x0 * torch.linspace(0.1, 1.0, 12, dtype=torch.float64)[:, None, None]
    found = ascend(attn, x0, steps=25)
    assert found.max() <= L_A, (float(found.max()), float(L_A))
    if scale <= 0.3:  # gentle attention: the bound is near the ascended norm
        assert found.max() >= 0.3 * L_A


def test_attention_constant_is_each_path_on_its_own_case() -> None:
    """Zero query/key weights leave the value path alone: ``L_A`` is then
    ``‖W_o‖ ‖softmax(B)‖ ‖W_v‖``, and a uniform bias makes it the exact norm
    of the token average times ``‖W_v W_o‖``-like factors."""
    torch.manual_seed(0)
    H, D, d, N = 2, 6, 3, 5
    W_q = torch.zeros(H, D, d, dtype=torch.float64)
    W_v = torch.randn(H, D, d, dtype=torch.float64)
    W_o = torch.randn(H, d, D, dtype=torch.float64)
    B = torch.randn(H, N, N, dtype=torch.float64)
    L = attention_lipschitz(attention_norms(W_q, W_q, W_v, W_o), B, 1.0)
    value = (spectral(B.softmax(-1)).amax() * spectral(W_v.permute(1, 0, 2)
             .reshape(D, H * d)) * spectral(W_o.reshape(H * d, D)))
    assert torch.isclose(L, value, rtol=1e-12)


# ---------------------------------------------------------------- the network


def features(model: HybridViT):
    """The map the last layer reads, for one image ``(C, S, S)``."""
    def g(x):
        z = model.forward_features(x[None]).flatten(1)
        return max_min(model.head_hidden(z))[0]
    return g


@pytest.mark.parametrize("seed", SEEDS)
def test_global_constant_bounds_ascended_jacobians(seed: int, digits) -> None:
    model = sharpened(HybridViT(hybrid_config()), seed)
    gc = global_constant(model)
    gen = torch.Generator().manual_seed(seed)
    random = torch.rand(12, 1, 8, 8, generator=gen, dtype=torch.float64)
    test = digits.x_test[:12].double()
    found = ascend(features(model), torch.cat([random, test]), steps=30)
    assert found.max() <= gc.L, (float(found.max()), float(gc.L))
    # Per pair: ‖∇(F_y − F_j)‖ ≤ L ‖w_y − w_j‖ at every start.
    x, y = test, digits.y_test[:12]
    J = vmap(jacrev(lambda v: model(v[None])[0]))(x).flatten(2)  # (B, classes, pixels)
    grad_margin = J.gather(1, y[:, None, None].expand(-1, 1, J.shape[2])) - J
    assert torch.all(grad_margin.norm(dim=2) <= pair_constants(gc.W, gc.L, y) + 1e-12)


def test_the_model_is_one_lipschitz_by_construction() -> None:
    model = HybridViT(hybrid_config()).double()
    with torch.no_grad():  # weights far beyond their caps: the caps rescale them
        for p in model.parameters():
            p.mul_(7.0)
    # Each capped map's norm is 1 up to float rounding (1e-16); the product is
    # then raised by the certificate's slack ROUNDING = 1e-9.
    assert global_constant(model).L <= (1 + 1e-9) * (1 + 1e-12)


# ---------------------------------------------------------------- certificates


@pytest.fixture(scope="module")
def trained(digits, tmp_path_factory):
    """A hybrid ViT trained on digits for 15 epochs (seconds)."""
    out = tmp_path_factory.mktemp("hybrid") / "h.pt"
    cfg = preset("fmnist-hybrid", family="lipschitz", image_size=8, embed_dim=16,
                 stem_width=8, head_hidden=32)
    tc = train_config_for("lipschitz", "digits", arch="hybrid", epochs=15,
                          batch_size=64, device="cpu", seed=0)
    train(cfg, tc, digits, out)
    from lipvit.checkpoint import load_checkpoint

    return load_checkpoint(out).model.double().eval()


def test_trained_constant_is_sound_and_not_vacuous(trained, digits) -> None:
    gc = global_constant(trained)
    found = ascend(features(trained), digits.x_test[:16].double(), steps=30)
    assert found.max() <= gc.L, (float(found.max()), float(gc.L))
    assert found.max() >= 0.2 * gc.L, (float(found.max()), float(gc.L))


def test_radius_is_at_least_prop1_and_certifies_what_it_says(trained, digits) -> None:
    x, y = digits.x_test[:200].double(), digits.y_test[:200]
    gc = global_constant(trained)
    with torch.no_grad():
        logits = trained(x)
    r = global_radius(logits, y, gc)
    # LoFAST Prop. 1 with the network constant L‖W‖: never more than per pair.
    prop1 = margin(logits, y) / (math.sqrt(2) * gc.L * spectral(gc.W))
    assert torch.all(r >= prop1.clamp_min(0) * (1 - 1e-6))
    assert (r > 0.05).float().mean() > 0.3, "the trained model should certify"
    report = certify_samples(trained, x, y, ["global"], [0.05, 0.1])
    for eps in (0.05, 0.1):
        assert torch.equal(report.certified[f"global@{eps}"], r >= eps)
    assert torch.equal(report.radii["global"], r)


@pytest.mark.parametrize("attack", ["pgd-l2", "apgd"])
def test_certified_points_survive_attacks(trained, digits, attack: str) -> None:
    from lipvit.analysis.attacks import admissible, perturb

    x, y = digits.x_test[:200].double(), digits.y_test[:200]
    with torch.no_grad():
        r = global_radius(trained(x), y, global_constant(trained))
    eps = float(r[r > 0].median())
    cert = r >= eps
    assert cert.sum() >= 10
    model = trained.float()
    try:
        adv = perturb(model, x[cert].float(), y[cert], attack, eps, norm="l2",
                      steps=40)
        assert torch.all(admissible(x[cert].float(), adv, eps, "l2"))
        with torch.no_grad():
            assert torch.all(model(adv).argmax(1) == y[cert]), "a certified point broke"
    finally:
        trained.double()


# ---------------------------------------------------------------- commands


def test_cli_trains_and_certifies_the_hybrid(tmp_path) -> None:
    out = tmp_path / "h.pt"
    run = CliRunner().invoke(main, [
        "train", "--dataset", "digits", "--family", "lipschitz", "--preset",
        "fmnist-hybrid", "--epochs", "1", "--no-progress", "--out", str(out)])
    assert run.exit_code == 0, run.output
    assert "global constant" in run.output and "attention logit spread" in run.output
    cert = CliRunner().invoke(main, ["certify", "--ckpt", str(out), "--eps", "0.05",
                                     "--n", "20"])
    assert cert.exit_code == 0, cert.output
    # The default is ball, the local constants, never weaker than global.
    assert any(line.startswith("ball") for line in cert.output.splitlines())
    for method in ("taylor", "lofast", "crown", "specformer"):
        bad = CliRunner().invoke(main, ["certify", "--ckpt", str(out), "--eps",
                                        "0.05", "--n", "4", "--method", method])
        assert bad.exit_code == 1 and "Traceback" not in bad.output, bad.output
        assert "ball or global" in bad.output.strip().splitlines()[-1]
    for command in (["spectrum", "--ckpt", str(out), "--out", str(tmp_path / "s")],
                    ["tightness", "--ckpt", str(out), "--layer", "0",
                     "--out", str(tmp_path / "t")],
                    ["features", "--ckpt", str(out), "--out", str(tmp_path / "f")]):
        bad = CliRunner().invoke(main, command)
        assert bad.exit_code == 1 and "Traceback" not in bad.output, bad.output
        assert "hybrid ViT" in bad.output.strip().splitlines()[-1]
    info = CliRunner().invoke(main, ["info", "--ckpt", str(out)])
    assert info.exit_code == 0 and "global constant 1.0000" in info.output
    for flag in ("--msvp", "--cert-eps", "--relu-stability"):
        bad = CliRunner().invoke(main, [
            "train", "--dataset", "digits", "--family", "lipschitz", "--preset",
            "fmnist-hybrid", "--epochs", "1", flag, "0.1", "--no-progress",
            "--out", str(tmp_path / "bad.pt")])
        assert bad.exit_code == 1 and flag in bad.output.strip().splitlines()[-1]


def test_global_refuses_a_vit(digits) -> None:
    from tests.conftest import nonlinear_model

    model = nonlinear_model("lipschitz", 0)
    with pytest.raises(UnsupportedModelError, match="proven Lipschitz constant"):
        certify_samples(model, digits.x_test[:2], digits.y_test[:2], ["global"], [0.1])


def test_hybrid_config_is_checked() -> None:
    with pytest.raises(ValueError, match="lipschitz family only"):
        hybrid_config(family="standard")
    with pytest.raises(ValueError, match="patch_size must be 4"):
        hybrid_config(patch_size=2)
    with pytest.raises(ValueError, match="stem_width"):
        hybrid_config(stem_width=3)
