"""The ``ball`` certificate (docs/math.md §9.4, §10) against brute force.

Every local constant is checked in float64 over several seeds against the
largest Jacobian norm found by gradient ascent inside its ball (dense
Jacobians at tiny sizes); the network's ``L(x, ε)`` against PGD on the
features' move over the ε-ball; every certified point against targeted
PGD-ℓ2 on each wrong class's margin.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from conftest import assert_survive_targeted_pgd
from lipvit.certify.ball.attention import (
    class_attention_local,
    class_head_local,
    self_attention_local,
)
from lipvit.certify.ball.network import BallCertificate, ball_bound
from lipvit.certify.evaluate import certify_samples
from lipvit.certify.global_bound import global_constant, global_radius, proven_chain
from torch.func import grad_and_value, jacrev, vmap

import lipvit
from lipvit.cait import LipschitzCaiT
from lipvit.cli import main
from lipvit.config import ViTConfig
from lipvit.layers import max_min
from lipvit.lipschitz_blocks import ClassAttention, GatedAttention

SEEDS = (0, 1, 2)


def cait_config(image_size: int = 8, **overrides) -> ViTConfig:
    """A tiny CaiT: ``(image_size / 4)²`` tokens of width 8."""
    base = dict(image_size=image_size, in_chans=1, num_classes=10, patch_size=4,
                embed_dim=8, depth=2, num_heads=2, mlp_ratio=2.0, family="lipschitz",
                arch="cait", stem_width=4, head_hidden=8, attn_radius=1.5,
                cls_heads=3, cls_key_dim=2, cls_value_dim=4)
    return ViTConfig(**{**base, **overrides})


def sharpened(model: LipschitzCaiT, seed: int, scale: float) -> LipschitzCaiT:
    """``model`` in float64 with sharp, visibly nonlinear attention: queries and
    keys ``scale`` times larger, random positional biases, open gates."""
    torch.manual_seed(seed)
    model = model.double().eval()
    with torch.no_grad():
        for block in model.blocks:
            D = block.attn.qkv.weight.shape[1]
            block.attn.qkv.weight[: 2 * D].normal_(0, scale / math.sqrt(D))
            block.attn.pos_bias.normal_(0, 1.0)
            block.attn.gate_logit.fill_(1.0)
            block.mlp.gate_logit.fill_(0.5)
        model.cls_attn.query.normal_(0, scale)
        model.cls_attn.key.weight.normal_(0, scale / math.sqrt(D))
        model.cls_attn.pos_bias.normal_(0, 1.0)
        model.pos_embed.normal_(0, 0.5)
    return model


def in_ball(x0: Tensor, delta: float, gen: torch.Generator, n: int) -> Tensor:
    """``n`` points of the Frobenius ball of radius ``delta`` around ``x0``,
    half of them on its sphere."""
    G = torch.randn((n, *x0.shape), generator=gen, dtype=x0.dtype)
    r = torch.rand(n, generator=gen, dtype=x0.dtype)
    r[: n // 2] = 1.0
    scale = delta * r / G.flatten(1).norm(dim=1)
    return x0 + G * scale.reshape(-1, *([1] * x0.ndim))


def max_jacobian_in_ball(fn, x0: Tensor, delta: float, seed: int, n: int = 8,
                         steps: int = 12) -> float:
    """Largest ``‖J_fn(x)‖₂`` over sampled points of the ball and projected
    gradient ascent from them (a lower bound of the supremum the local
    constant must bound); the ``n`` ascents run side by side (``vmap``)."""
    def sigma(x):
        return torch.linalg.matrix_norm(jacrev(fn)(x).reshape(-1, x.numel()), ord=2)

    def per_point(t: Tensor) -> Tensor:  # (n,) → broadcast over a point's axes
        return t.reshape(-1, *([1] * x0.ndim))

    gen = torch.Generator().manual_seed(seed)
    x = in_ball(x0, delta, gen, n)  # (n, *x0.shape)
    best = 0.0
    for _ in range(steps):
        g, s = vmap(grad_and_value(sigma))(x)
        best = max(best, float(s.max()))
        x = x + 0.1 * delta * g / per_point(g.flatten(1).norm(dim=1).clamp_min(1e-30))
        d = x - x0
        x = x0 + d * per_point((delta / d.flatten(1).norm(dim=1)).clamp(max=1.0))
    return max(best, float(vmap(sigma)(x).max()))


Tensor = torch.Tensor


# ---------------------------------------------------------------- one map


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0])
@pytest.mark.parametrize("delta", [0.05, 0.5])
def test_self_attention_local_bounds_the_jacobian_on_the_ball(seed, scale, delta):
    block = sharpened(LipschitzCaiT(cait_config(12)), seed, scale).blocks[0].attn
    gen = torch.Generator().manual_seed(seed)
    N, D = 9, 8
    x0 = torch.randn(N, D, generator=gen, dtype=torch.float64) * 0.6
    W_q, W_k, W_v, _ = block.weights()
    L = self_attention_local(x0[None], torch.tensor([delta], dtype=torch.float64),
                             W_q, W_k, W_v, block.norms(), block.pos_bias,
                             block.radius)
    found = max_jacobian_in_ball(lambda x: block.attend(x[None])[0], x0, delta, seed)
    assert found <= float(L), (found, float(L))
    # Training's cheaper form is never smaller.
    L_train = self_attention_local(x0[None], torch.tensor([delta], dtype=torch.float64),
                                   W_q, W_k, W_v, block.norms(), block.pos_bias,
                                   block.radius, exact=False)
    assert float(L_train) >= float(L)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0])
@pytest.mark.parametrize("delta", [0.05, 0.5])
def test_class_attention_local_bounds_the_jacobian_on_the_ball(seed, scale, delta):
    ca = sharpened(LipschitzCaiT(cait_config(12)), seed, scale).cls_attn
    gen = torch.Generator().manual_seed(seed + 10)
    x0 = torch.randn(9, 8, generator=gen, dtype=torch.float64) * 0.6
    d = torch.tensor([delta], dtype=torch.float64)
    L = class_attention_local(x0[None], d, ca.a(), ca.value, ca.norms(),
                              ca.pos_bias, ca.radius)
    found = max_jacobian_in_ball(lambda x: ca(x[None])[0], x0, delta, seed)
    assert found <= float(L), (found, float(L))
    L_train = class_attention_local(x0[None], d, ca.a(), ca.value, ca.norms(),
                                    ca.pos_bias, ca.radius, exact=False)
    assert float(L_train) >= float(L)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scale", [0.0, 1.0, 3.0])
@pytest.mark.parametrize("delta", [0.05, 0.5])
def test_class_head_local_bounds_the_jacobian_on_the_ball(seed, scale, delta):
    """Class attention through the head's hidden layer (eq. 10.6): exact at
    the clean point where the content logits are off (``scale`` 0)."""
    model = sharpened(LipschitzCaiT(cait_config(12)), seed, scale)
    ca, W = model.cls_attn, model.head_hidden
    chain = proven_chain(model)
    gen = torch.Generator().manual_seed(seed + 20)
    x0 = torch.randn(9, 8, generator=gen, dtype=torch.float64) * 0.3  # inside R
    d = torch.tensor([delta], dtype=torch.float64)
    L = class_head_local(x0[None], d, ca.a(), ca.value, ca.norms(), ca.pos_bias,
                         ca.radius, chain.class_head, chain.class_head_norm,
                         chain.head)
    def fn(x):
        return W(ca(x[None]))[0]

    found = max_jacobian_in_ball(fn, x0, delta, seed)
    assert found <= float(L), (found, float(L))
    if scale == 0:  # no content: the attention is fixed, the bound its exact norm
        J = jacrev(fn)(x0).reshape(-1, x0.numel())
        assert float(L) <= float(torch.linalg.matrix_norm(J, ord=2)) * (1 + 1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_class_attention_global_constant_bounds_ascended_jacobians(seed):
    ca = sharpened(LipschitzCaiT(cait_config(12)), seed, 1.0).cls_attn
    gen = torch.Generator().manual_seed(seed)
    L = float(ca.lipschitz())
    for scale in (0.3, 3.0):  # tokens inside and outside the projection ball
        x0 = torch.randn(9, 8, generator=gen, dtype=torch.float64) * scale
        assert max_jacobian_in_ball(lambda x: ca(x[None])[0], x0, 2.0, seed) <= L


def test_class_attention_value_path_alone_is_the_pooling_norm():
    """With no content logits (``a = 0``) and one head of orthogonal values,
    (9.4) is ``‖W_v‖ min((max_j P⁰[j])^{1/2}, ‖P⁰‖₂)`` and the Jacobian's norm
    is ``‖W_v‖ ‖P⁰‖₂``: equal where the attention is one-hot."""
    cfg = cait_config(12, cls_heads=1, cls_value_dim=8)
    ca = LipschitzCaiT(cfg).double().cls_attn
    with torch.no_grad():
        ca.query.zero_()
        ca.pos_bias.copy_(torch.tensor([[8.0] + [-30.0] * 8]))
    x0 = torch.randn(9, 8, dtype=torch.float64) * 0.3
    J = jacrev(lambda x: ca(x[None])[0])(x0).reshape(8, -1)
    exact = torch.linalg.matrix_norm(J, ord=2)
    assert torch.isclose(ca.lipschitz(), exact, rtol=1e-6)  # float32 orthogonal init


# ---------------------------------------------------------------- the network


def features(model: LipschitzCaiT):
    """The map the last layer reads, for images ``(B, C, S, S)``."""
    def g(x):
        return max_min(model.head_hidden(model.cls_attn(model.forward_features(x))))
    return g


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("eps", [0.05, 0.5])
def test_ball_constant_bounds_the_features_move(seed, eps, digits):
    """PGD on ``‖g(x′) − g(x)‖`` over the ε-ball never exceeds ``ε L(x, ε)``,
    and ``L(x, ε)`` is at most the global constant."""
    model = sharpened(LipschitzCaiT(cait_config()), seed, 1.0)
    x = digits.x_test[seed * 4:(seed + 1) * 4].double()
    g = features(model)
    with torch.no_grad():
        L = ball_bound(model, x, eps).L
        assert torch.all(L <= global_constant(model).L * (1 + 1e-12))
    gen = torch.Generator().manual_seed(seed)
    delta = 1e-3 * torch.randn(x.shape, generator=gen, dtype=x.dtype)
    for _ in range(60):
        delta = delta.detach().requires_grad_(True)
        move = (g(x + delta) - g(x)).norm(dim=1)
        (grad,) = torch.autograd.grad(move.sum(), delta)
        with torch.no_grad():
            delta = delta + 0.1 * eps * grad / grad.flatten(1).norm(dim=1).clamp_min(
                1e-30)[:, None, None, None]
            delta = delta * (eps / delta.flatten(1).norm(dim=1)).clamp(max=1.0)[
                :, None, None, None]
    with torch.no_grad():
        move = (g(x + delta) - g(x)).norm(dim=1)
    assert torch.all(move <= eps * L), (move, eps * L)


# ---------------------------------------------------------------- trained model


@pytest.fixture(scope="module")
def trained(trained_cait):
    return trained_cait


def test_ball_is_never_weaker_than_global(trained, digits):
    x, y = digits.x_test[:120].double(), digits.y_test[:120]
    with torch.no_grad():
        r_global = global_radius(trained(x), y, global_constant(trained))
        r_ball = BallCertificate(proven_chain(trained), trained, x, y).radius()
    assert torch.all(r_ball >= r_global * (1 - 2e-3))
    assert (r_ball > 0.05).float().mean() > 0.3, "the trained model should certify"


def test_radius_agrees_with_the_per_eps_certificate(trained, digits):
    x, y = digits.x_test[:60].double(), digits.y_test[:60]
    report = certify_samples(trained, x, y, ["ball"], [0.05, 0.1], radius=True)
    r = report.radii["ball"]
    for eps in (0.05, 0.1):
        assert torch.equal(report.certified[f"ball@{eps}"], r >= eps)


def test_certified_points_survive_targeted_pgd(trained, digits):
    """At each certified point and every wrong class ``j``, PGD-ℓ2 on
    ``F_j − F_y`` inside the ball of the point's certified radius leaves the
    margin positive."""
    x, y = digits.x_test[:80].double(), digits.y_test[:80]
    with torch.no_grad():
        r = BallCertificate(proven_chain(trained), trained, x, y).radius()
    keep = r > 0
    assert keep.sum() >= 10
    assert_survive_targeted_pgd(trained, x[keep], y[keep], r[keep])


# ---------------------------------------------------------------- ablation, commands


def test_ablate_attention_removes_every_attention_term(trained, digits):
    x = digits.x_test[:8].double()
    ablated = lipvit.ablate_attention(trained)
    assert ablated is not trained
    assert not any(m.ablated for m in trained.modules()
                   if isinstance(m, GatedAttention | ClassAttention))
    with torch.no_grad():
        t = trained.tokens(x)
        for block in ablated.blocks:
            assert torch.equal(block.attn(t), t)
        # No attention: the class token is its constant start, the same logits
        # for every image.
        logits = ablated(x)
    assert torch.allclose(logits, logits[:1].expand_as(logits))
    # Only the self-attention: the blocks pass their input on, class attention
    # still reads the tokens.
    kept = lipvit.ablate_attention(trained, "self")
    assert not kept.cls_attn.ablated and all(b.attn.ablated for b in kept.blocks)
    with torch.no_grad():
        assert torch.equal(kept.blocks[0].attn(t), t)
        logits = kept(x)
    assert not torch.allclose(logits, logits[:1].expand_as(logits))
    with pytest.raises(ValueError, match="which must be one of"):
        lipvit.ablate_attention(trained, "class")
    with pytest.raises(ValueError, match="hybrid ViT or CaiT"):
        from tests.conftest import nonlinear_model

        lipvit.ablate_attention(nonlinear_model("lipschitz", 0))


def test_cli_trains_and_certifies_cait(tmp_path):
    out = tmp_path / "c.pt"
    run = CliRunner().invoke(main, [
        "train", "--dataset", "digits", "--family", "lipschitz", "--preset",
        "fmnist-cait", "--epochs", "1", "--no-progress", "--out", str(out)])
    assert run.exit_code == 0, run.output
    assert "content" in run.output and "without attention" in run.output
    js, js2 = tmp_path / "cert.json", tmp_path / "radii.json"
    cert = CliRunner().invoke(main, ["certify", "--ckpt", str(out), "--eps", "0.05",
                                     "--n", "20", "--json", str(js)])
    assert cert.exit_code == 0, cert.output
    assert any(line.startswith("margin") for line in cert.output.splitlines())
    # margin's radius search (its costly part) runs only with --radius.
    assert all(s["radius"] is None for s in json.loads(js.read_text())["samples"])
    cert = CliRunner().invoke(main, ["certify", "--ckpt", str(out), "--eps", "0.05",
                                     "--n", "2", "--radius", "--json", str(js2)])
    assert cert.exit_code == 0, cert.output
    assert all(s["radius"] is not None for s in json.loads(js2.read_text())["samples"])
    info = CliRunner().invoke(main, ["info", "--ckpt", str(out)])
    assert info.exit_code == 0 and "without attention" in info.output
    for flag in ("--msvp", "--relu-stability"):
        bad = CliRunner().invoke(main, [
            "train", "--dataset", "digits", "--family", "lipschitz", "--preset",
            "fmnist-cait", "--epochs", "1", flag, "0.1", "--no-progress",
            "--out", str(tmp_path / "bad.pt")])
        assert bad.exit_code == 1 and flag in bad.output.strip().splitlines()[-1]


def test_cait_mixes_tokens_only_in_attention():
    """With every attention term removed, each token's path through the
    blocks reads that token alone (a block-diagonal Jacobian), and no linear
    map reads the tokens flattened together."""
    cfg = cait_config(12)
    model = sharpened(LipschitzCaiT(cfg), 0, 1.0)
    N, D = cfg.num_patches, cfg.embed_dim
    assert not any(isinstance(m, torch.nn.Linear) and m.in_features == N * D
                   for m in model.modules())
    ablated = lipvit.ablate_attention(model)
    t0 = torch.randn(N, D, dtype=torch.float64)

    def blocks(t):
        for block in ablated.blocks:
            t = block(t[None])[0]
        return t

    J = jacrev(blocks)(t0)  # (N, D, N, D)
    across = (1 - torch.eye(N, dtype=J.dtype))[:, None, :, None]  # token i ≠ j
    assert (J * across).abs().max() == 0
    J_full = jacrev(lambda t: model.blocks[0](t[None])[0])(t0)
    assert (J_full * across).abs().max() > 0


def test_cait_config_is_checked():
    with pytest.raises(ValueError, match="lipschitz family only"):
        cait_config(family="standard")
    with pytest.raises(ValueError, match="even MLP width"):
        cait_config(mlp_ratio=1.125)
    with pytest.raises(ValueError, match="cls_key_dim"):
        cait_config(cls_key_dim=0)
