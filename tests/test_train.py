"""The trainer: configs, schedule, PGD, train(), checkpoints per epoch and resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from lipvit.checkpoint import load_checkpoint
from lipvit.errors import LipvitError
from lipvit.model import ViT
from lipvit.spectral import spectral_norm
from lipvit.train import (
    TrainConfig,
    head_sigmas,
    lr_at,
    pgd_attack,
    summary_path,
    train,
    train_config_for,
    train_step,
)


def _cfg(ds, family: str = "standard", **kw):
    return tiny_config(family, mean=ds.mean, std=ds.std, **kw)


def _tc(**kw) -> TrainConfig:
    base = dict(epochs=1, batch_size=100, lr=3e-3, msvp=(1e-3, 1e-3, 1e-3), warmup=0.5)
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize(
    "bad",
    [
        dict(epochs=0),
        dict(batch_size=-1),
        dict(lr=0.0),
        dict(optimizer="adam"),
        dict(weight_decay=-1.0),
        dict(label_smoothing=1.0),
        dict(msvp=(1.0, -1.0, 0.0)),
        dict(msvp=(1.0, 1.0)),
        dict(adv_train="fgsm"),
        dict(adv_train="pgd-linf"),
        dict(device="tpu"),
        dict(loss_scale=0.0),
        dict(seed=-1),
        dict(threads=-2),
        dict(noise_sd=-0.25),
        dict(noise_sd=math.inf),
    ],
)
def test_train_config_validation(bad: dict) -> None:
    with pytest.raises(ValueError):
        TrainConfig(**bad)


def test_train_config_round_trip_and_family_defaults() -> None:
    tc = TrainConfig(msvp=(1e-3, 0.0, 2e-3), adv_train="pgd-l2", adv_eps=0.5)
    assert TrainConfig.from_dict(json.loads(json.dumps(tc.to_dict()))) == tc
    with pytest.raises(ValueError):
        TrainConfig.from_dict({"nope": 1})
    lip = train_config_for("lipschitz", epochs=None, lr=0.1)
    assert lip.lr == 0.1 and lip.loss_scale > 1  # None means "family default"


def test_lr_schedule() -> None:
    total, warm, lr = 100, 10, 0.5
    values = [lr_at(s, total, warm, lr) for s in range(total)]
    assert values[0] == pytest.approx(lr / warm)
    assert values[warm - 1] == pytest.approx(lr)
    assert values[warm] == pytest.approx(lr)
    assert all(a >= b for a, b in zip(values[warm:], values[warm + 1 :], strict=False))
    assert values[-1] < 1e-3 * lr
    assert lr_at(total, total, warm, lr) == pytest.approx(0.0, abs=1e-15)
    assert lr_at(5, 50, 0, lr) == pytest.approx(
        lr * 0.5 * (1 + math.cos(math.pi * 0.1))
    )


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_pgd_attack_stays_in_the_ball_and_raises_the_loss(norm: str, digits) -> None:
    torch.manual_seed(0)
    model = ViT(_cfg(digits))
    x, y = digits.x_test[:32], digits.y_test[:32]
    eps = 0.1 if norm == "linf" else 1.0
    g = torch.Generator().manual_seed(0)
    x_adv = pgd_attack(model, x, y, norm=norm, eps=eps, steps=5, generator=g)
    delta = (x_adv - x).flatten(1)
    size = delta.abs().max(dim=1).values if norm == "linf" else delta.norm(dim=1)
    assert torch.all(size <= eps * (1 + 1e-5))
    assert float(x_adv.min()) >= 0 and float(x_adv.max()) <= 1
    ce = torch.nn.functional.cross_entropy
    with torch.no_grad():
        assert ce(model(x_adv), y) > ce(model(x), y)
    assert all(p.grad is None for p in model.parameters())  # parameters untouched


def test_train_writes_checkpoint_and_summary(small_digits, tmp_path: Path) -> None:
    out = tmp_path / "run" / "m.pt"
    lines: list[str] = []
    summary = train(
        _cfg(small_digits),
        _tc(epochs=2),
        small_digits,
        out,
        progress=False,
        log=lines.append,
    )
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"]
    assert "test" in lines[0] and "sigma_max" in lines[0] and "msvp" in lines[0]
    on_disk = json.loads(summary_path(out).read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert len(summary["history"]) == 2
    assert 0 <= summary["test_acc"] <= 1
    assert summary["dataset"]["name"] == "digits"
    sig = summary["sigma_max"]
    assert sig["mean"] == pytest.approx(
        float(head_sigmas(load_checkpoint(out).model)[:, :3].mean()), rel=1e-6
    )
    ckpt = load_checkpoint(out)
    assert ckpt.summary["test_acc"] == summary["test_acc"]
    assert ckpt.raw["extra"]["epoch"] == 2
    assert ckpt.msvp is not None and ckpt.dataset == "digits"


def test_train_refuses_to_overwrite(small_digits, tmp_path: Path) -> None:
    out = tmp_path / "m.pt"
    out.write_bytes(b"precious")
    with pytest.raises(LipvitError, match="--force"):
        train(_cfg(small_digits), _tc(), small_digits, out, progress=False)
    assert out.read_bytes() == b"precious"
    summary_path(out).write_text("{}")
    out.unlink()
    with pytest.raises(LipvitError, match="exists"):  # the summary is protected too
        train(_cfg(small_digits), _tc(), small_digits, out, progress=False)
    train(_cfg(small_digits), _tc(), small_digits, out, progress=False, force=True)
    assert load_checkpoint(out).summary is not None
    with pytest.raises(ValueError, match="json"):
        train(
            _cfg(small_digits), _tc(), small_digits, tmp_path / "m.json", progress=False
        )


def test_model_must_fit_dataset(small_digits, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="classes"):
        train(_cfg(small_digits, num_classes=3), _tc(), small_digits, tmp_path / "m.pt")


class _Stop(Exception):
    pass


def test_resume_replays_an_interrupted_run_exactly(
    small_digits, tmp_path: Path
) -> None:
    cfg, tc = _cfg(small_digits), _tc(epochs=3)
    straight = tmp_path / "straight.pt"
    train(cfg, tc, small_digits, straight, progress=False)

    def stop_after_first(line: str) -> None:
        if line.startswith("epoch   1/3"):
            raise _Stop

    broken = tmp_path / "broken.pt"
    with pytest.raises(_Stop):
        train(cfg, tc, small_digits, broken, progress=False, log=stop_after_first)
    assert load_checkpoint(broken).raw["extra"]["epoch"] == 1  # saved before the crash
    assert load_checkpoint(broken).summary is None
    lines: list[str] = []
    summary = train(
        cfg, tc, small_digits, broken, resume=True, progress=False, log=lines.append
    )
    assert lines[0].startswith("resuming")
    assert len(summary["history"]) == 3
    a, b = load_checkpoint(straight), load_checkpoint(broken)
    for key, value in a.raw["state_dict"].items():
        assert torch.equal(value, b.raw["state_dict"][key]), key
    assert torch.equal(a.msvp["u"], b.msvp["u"])
    # Different settings cannot resume.
    with pytest.raises(LipvitError, match="lr"):
        train(
            cfg,
            _tc(epochs=3, lr=1e-2),
            small_digits,
            broken,
            resume=True,
            progress=False,
        )


def test_caps_hold_exactly_after_training(small_digits, tmp_path: Path) -> None:
    cfg = _cfg(small_digits, "lipschitz", v_cap=0.2, o_cap=0.3)
    out = tmp_path / "lip.pt"
    # A large learning rate drives the raw weights far beyond the caps.
    train(
        cfg, _tc(epochs=2, lr=5e-2, loss_scale=64.0), small_digits, out, progress=False
    )
    model = load_checkpoint(out).model
    sig = head_sigmas(model).double()  # (L, 4, H) exact
    assert torch.all(sig[:, 2] <= 0.2 * (1 + 1e-6)) and torch.all(
        sig[:, 3] <= 0.3 * (1 + 1e-6)
    )
    assert float(sig[:, 3].max()) > 0.29  # the cap binds: the check is not vacuous
    for layer in (model.patch_embed.proj, model.head):
        assert float(spectral_norm(layer.weight.detach().double())) <= 1 + 1e-6


def test_adversarial_training_runs(small_digits, tmp_path: Path) -> None:
    summary = train(
        _cfg(small_digits),
        _tc(adv_train="pgd-linf", adv_eps=0.05, adv_steps=2, msvp=(0.0, 0.0, 0.0)),
        small_digits,
        tmp_path / "adv.pt",
        progress=False,
    )
    assert math.isfinite(summary["loss"])
    assert summary["msvp_penalty"] == 0.0


class _Recorder(torch.nn.Module):
    """A linear classifier that keeps the last batch it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(16, 3)
        self.seen: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x.detach().clone()
        return self.head(x.flatten(1))


@pytest.mark.parametrize("noise_sd", [0.0, 0.25])
def test_train_step_adds_seeded_gaussian_noise(noise_sd: float) -> None:
    # Cohen et al. 2019 train the base classifier on x + N(0, sigma^2 I): the
    # batch the model sees is the image plus sigma times the generator's next
    # standard normal draws (no clipping); sigma = 0 leaves it untouched.
    torch.manual_seed(0)
    model = _Recorder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.rand(64, 1, 4, 4), torch.randint(0, 3, (64,))
    train_step(model, opt, x, y, _tc(noise_sd=noise_sd, msvp=(0.0, 0.0, 0.0)),
               generator=torch.Generator().manual_seed(7))
    expected = x + noise_sd * torch.randn(x.shape,
                                          generator=torch.Generator().manual_seed(7))
    assert torch.equal(model.seen, expected)
    if noise_sd:
        assert float((model.seen - x).std()) == pytest.approx(noise_sd, rel=0.1)


def test_noise_sd_is_recorded_in_the_checkpoint(small_digits, tmp_path: Path) -> None:
    out = tmp_path / "noisy.pt"
    summary = train(_cfg(small_digits), _tc(noise_sd=0.25), small_digits, out,
                    progress=False)
    assert summary["train_config"]["noise_sd"] == 0.25
    assert load_checkpoint(out).train_config["noise_sd"] == 0.25
