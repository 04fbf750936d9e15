"""Certified training for ``margin`` (lipvit/training/margin_loss.py): the
raised logits are the certificate's own drop bounds, their gradients are
finite, and ``--cert-margin`` is refused where it has nothing to bound."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from click.testing import CliRunner
from lipvit.certify.ball.network import ball_constant
from lipvit.certify.certification import ROUNDING
from lipvit.certify.follow.network import margin_certificate
from lipvit.certify.global_bound import proven_chain

from lipvit.cli import main
from lipvit.train import TrainConfig, train_step
from lipvit.training.margin_loss import MarginLoss


def _loss_drops(model, x, y, eps, points):
    """The drops :class:`MarginLoss` raises the wrong logits by, ``(points,
    classes)`` (0 at ``y``), and the raised logits."""
    loss = MarginLoss(model, points)
    try:
        loss.clear()
        logits = model(x)
        inputs = list(loss._inputs)
        raised = loss.raised_logits(logits, x, y, eps)
        L = ball_constant(proven_chain(model, capped=True), inputs, eps, exact=False)
    finally:
        loss.remove()
    return raised[:points] * L[:points, None] - logits[:points], raised, logits, L


@pytest.mark.parametrize("eps", [0.05, 0.2])
def test_raised_logits_are_margins_drops(trained_cait, digits, eps):
    """Float64: each wrong class of the first ``points`` images is raised by
    ``margin``'s drop bound in training's cheaper forms: never below the
    certificate's (computed without gradients), never above training's
    ``ball``; the rest of the batch by ``ball``'s."""
    model = copy.deepcopy(trained_cait)
    x, y = digits.x_test[:10].double(), digits.y_test[:10]
    drops, raised, logits, L = _loss_drops(model, x, y, eps, points=6)
    with torch.no_grad():
        own, _ = margin_certificate(model, x[:6], y[:6]).drops(
            torch.full((6,), eps, dtype=x.dtype))
    wrong = torch.ones_like(own, dtype=torch.bool).scatter(1, y[:6, None], False)
    pair = (model.head.weight[y][:, None] - model.head.weight[None]).norm(dim=-1)
    trained_ball = eps * L[:, None] * pair  # training's ball drop
    assert torch.all(drops[wrong] >= own[wrong] * (1 - 1e-9))
    assert torch.all(drops[wrong] <= trained_ball[:6][wrong] * (1 + 4 * ROUNDING))
    assert torch.all(drops[~wrong].abs() < 1e-12)
    # Where training's chain equals the certificate's, so do the drops: here
    # some margin is below ball's, so margin's own terms are read.
    assert torch.any(drops[wrong] < trained_ball[:6][wrong] * (1 - 1e-3))
    assert torch.allclose(raised[6:], logits[6:] / L[6:, None] + eps * pair[6:],
                          rtol=1e-6)


def test_margin_loss_gradients_are_finite(trained_cait, digits):
    """Float32, a model in training mode: one backward pass through the
    certificate reaches the weights with finite, nonzero gradients."""
    model = copy.deepcopy(trained_cait).float().train()
    x, y = digits.x_train[:12].float(), digits.y_train[:12]
    _, raised, _, _ = _loss_drops(model, x, y, 0.2, points=12)
    torch.nn.functional.cross_entropy(raised, y).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert math.isfinite(sum(float(g.norm()) for g in grads))
    assert sum(float(g.norm()) for g in grads) > 0


def test_cli_trains_against_margin_and_refuses_it_elsewhere(tmp_path):
    out = tmp_path / "m.pt"
    base = ["train", "--dataset", "digits", "--family", "lipschitz", "--epochs", "1",
            "--no-progress"]
    run = CliRunner().invoke(main, [*base, "--preset", "fmnist-cait", "--cert-eps",
                                    "0.1", "--cert-margin", "4", "--out", str(out)])
    assert run.exit_code == 0, run.output
    assert "cert" in run.output and "nan" not in run.output.lower()
    for extra in (["--preset", "fmnist-cait", "--cert-eps", "0"], []):
        bad = CliRunner().invoke(main, [*base, *extra, "--cert-margin", "4", "--out",
                                        str(tmp_path / "bad.pt")])
        assert bad.exit_code == 1, bad.output
        assert "--cert-margin" in bad.output.strip().splitlines()[-1]


class _NonFinite(MarginLoss):
    """A margin loss whose gradient is not finite (``√0`` of a weight's
    zero multiple): what a degenerate case of the bound's derivative does."""

    def _raise(self, logits, x, y, eps, L, chain):
        zero = (self.model.head.weight.sum() * 0.0).sqrt()
        return super()._raise(logits, x, y, eps, L, chain) + zero


def test_a_step_with_non_finite_gradients_is_skipped(trained_cait, digits):
    model = copy.deepcopy(trained_cait).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    cfg = TrainConfig(epochs=1, cert_eps=0.1, cert_margin=2, device="cpu")
    x, y = digits.x_train[:8].float(), digits.y_train[:8]
    cert, good = _NonFinite(model, 2), MarginLoss(model, 2)
    try:
        loss, _, _ = train_step(model, opt, x, y, cfg, cert=cert, cert_eps=0.1)
        assert cert.skipped == 1 and math.isfinite(float(loss))
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(),
                                                      strict=True))
        cert.remove()
        train_step(model, opt, x, y, cfg, cert=good, cert_eps=0.1)
        assert good.skipped == 0
        assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters(),
                                                          strict=True))
    finally:
        cert.remove()
        good.remove()
