"""The ReLU-stability penalty (lipvit/stability.py): its value, the κ-stability it
rewards, its effect in training, and its refusals."""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner
from lipvit.certify.taylor.forward import forward

from lipvit.checkpoint import load_checkpoint
from lipvit.cli import main
from lipvit.data import load_dataset
from lipvit.model import ViT
from lipvit.stability import ReLUStability
from lipvit.train import TrainConfig, train
from tests.conftest import tiny_config

F64 = torch.float64


def _model(seed: int = 0) -> ViT:
    torch.manual_seed(seed)
    return ViT(tiny_config("lipschitz")).double().eval()


def _hinges(model: ViT, x: torch.Tensor, kappa: float) -> list[torch.Tensor]:
    """``(1 − |z|/(κ‖w‖))₊`` per block, from the certificate's own forward pass."""
    with torch.no_grad():
        _, rec = forward(model, x)
    return [
        (1 - z.abs() / (kappa * block.mlp.fc1.weight.norm(dim=1))).clamp_min(0)
        for z, block in zip(rec.act_in, model.blocks, strict=True)
    ]


@pytest.mark.parametrize("seed", range(3))
def test_penalty_is_the_mean_hinge_and_tallies_unstable_units(seed):
    model = _model(seed)
    x = torch.rand(5, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(seed))
    lam, kappa = 0.7, 0.3
    stability = ReLUStability(model, lam, kappa)
    stability.clear()
    model(x)
    penalty = stability()
    hinges = _hinges(model, x, kappa)
    expected = lam * torch.stack([h.mean() for h in hinges]).mean()
    assert penalty.requires_grad
    assert float(penalty) == pytest.approx(float(expected), rel=1e-6)
    unstable = torch.stack([(h > 0).double().mean() for h in hinges]).mean()
    assert stability.take_unstable() == pytest.approx(float(unstable), rel=1e-6)
    assert stability.take_unstable() is None  # reset
    with torch.no_grad():  # evaluation passes do not count
        model(x)
    assert float(stability()) == 0.0
    stability.remove()
    model(x)
    assert float(stability()) == 0.0


@pytest.mark.parametrize("seed", range(3))
def test_kappa_stable_units_keep_their_sign_under_kappa_moves(seed):
    """The lemma behind the penalty: a unit with ``|z_i| ≥ κ‖w_i‖`` keeps its sign
    when a token at the SLL block's input (before P₂, 1-Lipschitz per token) moves
    by at most κ; such units have a zero hinge."""
    model, kappa = _model(seed), 0.4
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(3, 1, 8, 8, dtype=F64, generator=g)
    with torch.no_grad():
        for block in model.blocks:  # biases of the order of κ‖w_i‖: both kinds
            fc1 = block.mlp.fc1
            fc1.bias.copy_(2 * kappa * fc1.weight.norm(dim=1)
                           * torch.randn(fc1.bias.shape, dtype=F64, generator=g))
        _, rec = forward(model, x)
        for k, block in enumerate(model.blocks):
            W = block.mlp.fc1.weight
            z = rec.act_in[k]  # (B, N, m)
            stable = z.abs() >= kappa * W.norm(dim=1)
            assert stable.any() and not stable.all()  # both kinds present
            assert torch.all(_hinges(model, x, kappa)[k][stable] == 0)
            X_mid = rec.stream[2 * k + 1]  # (B, N, D): P₂'s input
            for _ in range(50):
                move = torch.randn(X_mid.shape, dtype=F64, generator=g)
                move = kappa * move / move.norm(dim=-1, keepdim=True)  # per token
                z2 = block.mlp.fc1(block.norm2(X_mid + move))
                assert torch.all((torch.sign(z2) == torch.sign(z))[stable])


def test_training_with_the_penalty_stabilises_units(tmp_path):
    """Three epochs with λ = 1 leave under half as many units that a κ move could
    flip (on test images) as the same run without the penalty; the epoch log
    carries the tally only when the penalty is on."""
    data = load_dataset("digits")
    cfg = tiny_config("lipschitz", mean=data.mean, std=data.std)
    x = data.x_test[:200].double()
    unstable = {}
    for lam in (0.0, 1.0):
        train_cfg = TrainConfig(epochs=3, batch_size=64, lr=5e-3, loss_scale=128.0,
                                relu_stability=lam, device="cpu")
        out = tmp_path / f"m{lam}.pt"
        summary = train(cfg, train_cfg, data, out, progress=False)
        tallies = [h["relu_unstable"] for h in summary["history"]]
        assert all((t is not None) == (lam > 0) for t in tallies)
        model = load_checkpoint(out).model.double()
        hinges = _hinges(model, x, train_cfg.stability_radius)
        unstable[lam] = float(torch.cat([(h > 0).flatten() for h in hinges]).double()
                              .mean())
    assert unstable[1.0] < 0.5 * unstable[0.0]


def test_refusals():
    with pytest.raises(ValueError, match="needs ReLU units"):
        ReLUStability(ViT(tiny_config("standard")), 0.1, 0.25)
    for lam, kappa in ((0.0, 0.25), (math.nan, 0.25), (0.1, -1.0), (0.1, math.inf)):
        with pytest.raises(ValueError, match="finite number > 0"):
            ReLUStability(_model(), lam, kappa)
    with pytest.raises(ValueError, match="relu_stability"):
        TrainConfig(relu_stability=-0.1)
    with pytest.raises(ValueError, match="stability_radius"):
        TrainConfig(stability_radius=0.0)


def test_cli_refuses_the_standard_family_in_one_line(tmp_path):
    result = CliRunner().invoke(main, [
        "train", "--family", "standard", "--preset", "digits-tiny", "--epochs", "1",
        "--relu-stability", "0.1", "--no-progress", "--out", str(tmp_path / "m.pt"),
    ])
    assert result.exit_code != 0
    assert "needs ReLU units" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "m.pt").exists()
