"""Checkpoints: round trip, atomic writes, and every bad file a user can hand us."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from lipvit.checkpoint import FORMAT_VERSION, load_checkpoint, save_checkpoint
from lipvit.errors import CheckpointError
from lipvit.model import ViT
from lipvit.msvp import MSVP
from lipvit.spectral import spectral_norm
from lipvit.train import TrainConfig


@pytest.mark.parametrize("family", ["standard", "lipschitz"])
def test_round_trip(tmp_path: Path, family: str) -> None:
    torch.manual_seed(0)
    cfg = tiny_config(family, mean=(0.3,), std=(0.4,))
    model = ViT(cfg)
    if (
        family == "lipschitz"
    ):  # make the caps bind so the loaded weights must re-apply them
        with torch.no_grad():
            for attn in model.attention_layers():
                attn.proj.parametrizations.weight.original.mul_(40.0)
    msvp = MSVP(model, (1e-3, 2e-3, 3e-3))
    msvp.sigma(update=True)
    tc = TrainConfig(epochs=3, msvp=(1e-3, 2e-3, 3e-3))
    summary = {"test_acc": 0.5, "history": [{"epoch": 1}]}
    path = save_checkpoint(
        tmp_path / "m.pt",
        model,
        train_config=tc,
        msvp=msvp,
        summary=summary,
        dataset="digits",
        extra={"epoch": 3},
    )
    assert sorted(os.listdir(tmp_path)) == ["m.pt"]  # no temporary file left
    ckpt = load_checkpoint(path)
    assert ckpt.config == cfg
    assert ckpt.dataset == "digits"
    assert ckpt.summary == summary
    assert TrainConfig.from_dict(ckpt.train_config) == tc
    assert torch.equal(ckpt.msvp["u"], msvp.u) and torch.equal(ckpt.msvp["v"], msvp.v)
    assert ckpt.raw["normalization"] == {"mean": [0.3], "std": [0.4]}
    assert ckpt.raw["extra"] == {"epoch": 3}
    assert not ckpt.model.training
    x = torch.rand(4, 1, 8, 8)
    model.eval()
    assert torch.equal(ckpt.model(x), model(x))
    if family == "lipschitz":
        for attn in ckpt.model.attention_layers():
            assert torch.all(
                spectral_norm(attn.head_weights().W_o.double())
                <= cfg.o_cap * (1 + 1e-6)
            )
    # Overwriting keeps one file.
    save_checkpoint(path, model, dataset="digits")
    assert sorted(os.listdir(tmp_path)) == ["m.pt"]
    assert load_checkpoint(path).summary is None


def test_save_refuses_non_vit(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path / "x.pt", torch.nn.Linear(2, 2))
    assert not list(tmp_path.iterdir())


def _expect_error(path: Path, match: str) -> str:
    with pytest.raises(CheckpointError, match=match) as err:
        load_checkpoint(path)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.fixture()
def saved(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    return save_checkpoint(tmp_path / "good.pt", ViT(tiny_config()), dataset="digits")


def test_missing_and_directory(tmp_path: Path) -> None:
    _expect_error(tmp_path / "absent.pt", "does not exist")
    _expect_error(tmp_path, "not a file")


def test_truncated(saved: Path, tmp_path: Path) -> None:
    data = saved.read_bytes()
    for cut in (len(data) // 2, 100, 0):
        bad = tmp_path / f"cut{cut}.pt"
        bad.write_bytes(data[:cut])
        _expect_error(bad, "not a readable checkpoint")


def test_foreign_files(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello, I am not a checkpoint\n")
    _expect_error(text, "not a readable checkpoint")
    tensor = tmp_path / "tensor.pt"
    torch.save(torch.ones(3), tensor)
    _expect_error(tensor, "not a lipvit checkpoint")
    plain = tmp_path / "plain.pt"
    torch.save({"state_dict": {}}, plain)
    _expect_error(plain, "not a lipvit checkpoint")


class _Payload:
    """An arbitrary object: the safe loader must refuse to rebuild it."""


def test_pickled_objects_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "obj.pt"
    torch.save({"format": "lipvit-checkpoint", "x": _Payload()}, path)
    message = _expect_error(path, "refused for safety")
    assert "_Payload" in message
    assert "weights_only" not in message and "trust" not in message


def test_future_version(saved: Path, tmp_path: Path) -> None:
    raw = torch.load(saved, weights_only=True)
    raw["format_version"] = FORMAT_VERSION + 1
    raw["lipvit_version"] = "9.0.0"
    future = tmp_path / "future.pt"
    torch.save(raw, future)
    message = _expect_error(future, "upgrade lipvit")
    assert "9.0.0" in message


def test_weights_that_do_not_fit_the_config(saved: Path, tmp_path: Path) -> None:
    raw = torch.load(saved, weights_only=True)
    raw["model_config"]["depth"] = 3
    bad = tmp_path / "mismatch.pt"
    torch.save(raw, bad)
    _expect_error(bad, "do not fit")
    raw["model_config"] = {"bogus": 1}
    torch.save(raw, bad)
    _expect_error(bad, "do not fit")


def test_state_dict_mismatch_names_the_keys(saved: Path, tmp_path: Path) -> None:
    raw = torch.load(saved, weights_only=True)
    key = next(iter(raw["state_dict"]))
    raw["state_dict"]["extra.weight"] = raw["state_dict"].pop(key)
    bad = tmp_path / "keys.pt"
    torch.save(raw, bad)
    message = _expect_error(bad, "do not fit")
    assert f"missing keys {key}" in message
    assert "unexpected keys extra.weight" in message
    raw = torch.load(saved, weights_only=True)
    raw["state_dict"][key] = torch.zeros(1, 2, 3)
    torch.save(raw, bad)
    message = _expect_error(bad, "do not fit")
    assert key in message and "size mismatch" in message
