"""The ``margin`` certificate (docs/math.md §11) against attacks, ``ball`` and
brute force, in float64 over several seeds.

Each margin's drop bound is checked against PGD on that margin inside the
ε-ball (the network-level soundness of eq. 11.1 with every remainder), is never
above ``ball``'s (its last cut), and every certified point of a trained CaiT
survives targeted PGD at its certified radius. The per-map bounds and their
weakened copies: tests/test_margin_weakened.py.
"""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from conftest import assert_survive_targeted_pgd
from lipvit.certify.ball.network import BallCertificate
from lipvit.certify.evaluate import certify_samples
from lipvit.certify.follow.network import MarginCertificate, margin_certificate
from lipvit.certify.global_bound import proven_chain
from test_ball import cait_config, sharpened

import lipvit
from lipvit.cait import LipschitzCaiT
from lipvit.checkpoint import save_checkpoint
from lipvit.cli import main
from lipvit.errors import UnsupportedModelError
from lipvit.hybrid import HybridViT

SEEDS = (0, 1, 2)
SHAPE = (-1, 1, 1, 1)


@pytest.fixture(scope="module")
def trained(trained_cait):
    return trained_cait


def tiny(arch: str, seed: int, scale: float):
    """A float64 tiny CaiT or hybrid ViT whose attention looks at the image
    (content logits ``scale`` times their initial size), gates open."""
    if arch == "cait":
        return sharpened(LipschitzCaiT(cait_config()), seed, scale)
    torch.manual_seed(seed)
    model = HybridViT(cait_config(arch="hybrid", depth=1)).double().eval()
    with torch.no_grad():
        D = model.blocks[0].qkv.weight.shape[1]
        model.blocks[0].qkv.weight[: 2 * D].normal_(0, scale / D**0.5)
        model.blocks[0].pos_bias.normal_(0, 1.0)
        model.blocks[0].gate_logit.fill_(1.0)
        model.pos_embed.normal_(0, 0.5)
    return model


def largest_drops(model, x: torch.Tensor, y: torch.Tensor, eps: float,
                  steps: int = 40, seed: int = 0) -> torch.Tensor:
    """``(B, K)``: the largest drop of each margin ``F_y − F_j`` that
    normalised-gradient PGD-ℓ2 finds inside the ε-ball (every class at once)."""
    B, K = x.shape[0], 10
    gen = torch.Generator().manual_seed(seed)
    xs = x.repeat_interleave(K, 0)  # (B·K, C, S, S): sample b, class j at b·K + j
    ys, js = y.repeat_interleave(K), torch.arange(K).repeat(B)
    with torch.no_grad():
        z = model(xs)
        m0 = z.gather(1, ys[:, None])[:, 0] - z.gather(1, js[:, None])[:, 0]
    delta = 1e-3 * torch.randn(xs.shape, generator=gen, dtype=xs.dtype)
    best = torch.zeros_like(m0)
    for i in range(steps):
        delta = delta.detach().requires_grad_(True)
        z = model(xs + delta)
        m = z.gather(1, ys[:, None])[:, 0] - z.gather(1, js[:, None])[:, 0]
        best = torch.maximum(best, (m0 - m).detach())
        (grad,) = torch.autograd.grad(m.sum(), delta)
        with torch.no_grad():
            step = 0.25 * eps * 0.95**i
            delta = delta - step * grad / grad.flatten(1).norm(dim=1).clamp_min(
                1e-30).reshape(SHAPE)
            delta = delta * (eps / delta.flatten(1).norm(dim=1)).clamp(
                max=1.0).reshape(SHAPE)
    with torch.no_grad():
        z = model(xs + delta)
        m = z.gather(1, ys[:, None])[:, 0] - z.gather(1, js[:, None])[:, 0]
    return torch.maximum(best, m0 - m).reshape(B, K)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("arch, scale", [("cait", 0.3), ("cait", 2.0),
                                         ("hybrid", 2.0)])
@pytest.mark.parametrize("eps", [0.05, 0.3])
def test_drop_bounds_exceed_pgd_and_never_exceed_balls(seed, arch, scale, eps, digits):
    model = tiny(arch, seed, scale)
    x = digits.x_test[seed * 3:(seed + 1) * 3].double()
    y = digits.y_test[seed * 3:(seed + 1) * 3]
    cert = margin_certificate(model, x, y)
    own, ball = cert.drops(torch.full((3,), eps, dtype=x.dtype))
    found = largest_drops(model, x, y, eps, seed=seed)
    wrong = torch.isfinite(cert.margins)
    assert torch.all(found[wrong] <= own[wrong]), (found / own)[wrong].max()
    assert torch.all(own[wrong] <= ball[wrong])


def test_radius_agrees_with_the_per_eps_certificate_and_beats_balls(trained, digits):
    x, y = digits.x_test[:60].double(), digits.y_test[:60]
    report = certify_samples(trained, x, y, ["ball", "margin"], [0.05, 0.1],
                             radius=True)
    r, r_ball = report.radii["margin"], report.radii["ball"]
    for eps in (0.05, 0.1):
        assert torch.equal(report.certified[f"margin@{eps}"], r >= eps)
        assert torch.all(report.certified[f"margin@{eps}"]
                         >= report.certified[f"ball@{eps}"])
    assert torch.all(r >= r_ball * (1 - 2e-3))
    assert (r > r_ball * 1.01).any(), "margin should reach past ball somewhere"


def test_certified_points_survive_targeted_pgd(trained, digits):
    """At each certified point and every wrong class, PGD-ℓ2 on ``F_j − F_y``
    inside the ball of the point's certified radius leaves the margin
    positive."""
    x, y = digits.x_test[:80].double(), digits.y_test[:80]
    r = MarginCertificate(proven_chain(trained), trained, x, y).radius()
    keep = r > 0
    assert keep.sum() >= 10
    assert_survive_targeted_pgd(trained, x[keep], y[keep], r[keep])


def test_cli_certifies_with_margin_and_refuses_a_vit(trained, tmp_path):
    ckpt = save_checkpoint(tmp_path / "c.pt", trained.float(), dataset="digits")
    trained.double()
    run = CliRunner().invoke(main, ["certify", "--ckpt", str(ckpt), "--eps",
                                    "0.05", "--method", "ball,margin", "--n", "8"])
    assert run.exit_code == 0, run.output
    assert "margin" in run.output
    from conftest import tiny_config

    from lipvit.model import ViT

    vit = save_checkpoint(tmp_path / "v.pt", ViT(tiny_config("lipschitz")),
                          dataset="digits")
    run = CliRunner().invoke(main, ["certify", "--ckpt", str(vit), "--eps", "0.05",
                                    "--method", "margin"])
    assert run.exit_code != 0 and "Traceback" not in run.output
    assert "proven" in run.output


@pytest.mark.parametrize("method", ["global", "ball", "margin"])
def test_an_ablated_model_is_refused(trained, digits, method):
    """Its blocks are identities, which the chain would still charge below 1."""
    x, y = digits.x_test[:4].double(), digits.y_test[:4]
    ablated = lipvit.ablate_attention(trained, "self")
    with pytest.raises(UnsupportedModelError, match="ablated"):
        certify_samples(ablated, x, y, [method], [0.05])
    with pytest.raises(UnsupportedModelError, match="ablated"):
        BallCertificate(proven_chain(ablated), ablated, x, y)
