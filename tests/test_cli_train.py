"""``lipvit train`` and ``lipvit info`` through click's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from lipvit.cli import main

TINY = [
    "--embed-dim",
    "16",
    "--depth",
    "1",
    "--num-heads",
    "2",
    "--epochs",
    "1",
    "--batch-size",
    "256",
    "--no-progress",
]


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def _assert_one_line_error(result) -> None:
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("Error")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "tiny.pt"
    result = _run(
        "train",
        *TINY,
        "--family",
        "lipschitz",
        "--msvp",
        "1e-3",
        "--msvp-k",
        "0",
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    assert "epoch   1/1" in result.output
    assert "saved" in result.output and "sigma_max" in result.output
    return out


def test_train_writes_files(trained: Path) -> None:
    summary = json.loads(trained.with_suffix(".json").read_text())
    assert summary["train_config"]["msvp"] == [1e-3, 0.0, 1e-3]
    assert summary["model_config"]["embed_dim"] == 16
    assert summary["model_config"]["family"] == "lipschitz"
    assert summary["train_config"]["loss_scale"] > 1  # the lipschitz family's default


def test_info_text_and_json(trained: Path) -> None:
    result = _run("info", "--ckpt", str(trained))
    assert result.exit_code == 0, result.output
    for word in ("lipschitz", "digits", "parameters", "W_q", "W_o", "test acc"):
        assert word in result.output
    data = json.loads(_run("info", "--ckpt", str(trained), "--json").output)
    assert data["finished"] and data["dataset"] == "digits"
    assert len(data["sigma_max"]["layers"]) == 1
    assert data["sigma_max"]["layers"][0]["W_v"]["max"] <= 0.5 * (1 + 1e-6)
    assert data["parameters"] > 0


def test_train_refuses_existing_out_then_resumes(trained: Path) -> None:
    before = trained.read_bytes()
    result = _run("train", *TINY, "--family", "lipschitz", "--out", str(trained))
    _assert_one_line_error(result)
    assert "--resume" in result.output
    assert trained.read_bytes() == before
    # Same options and --resume: the run is complete, nothing is retrained.
    result = _run(
        "train",
        *TINY,
        "--family",
        "lipschitz",
        "--msvp",
        "1e-3",
        "--msvp-k",
        "0",
        "--out",
        str(trained),
        "--resume",
    )
    assert result.exit_code == 0, result.output
    assert "resuming" in result.output and "epoch   1/1" not in result.output


def test_info_bad_files(tmp_path: Path) -> None:
    _assert_one_line_error(_run("info", "--ckpt", str(tmp_path / "missing.pt")))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x00\x01 not a checkpoint")
    _assert_one_line_error(_run("info", "--ckpt", str(junk)))
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.ones(2)}, foreign)
    _assert_one_line_error(_run("info", "--ckpt", str(foreign)))


def test_train_bad_inputs(tmp_path: Path) -> None:
    out = str(tmp_path / "x.pt")
    _assert_one_line_error(_run("train", *TINY, "--dataset", "cifar10", "--out", out))
    _assert_one_line_error(
        _run(
            "train",
            *TINY,
            "--dataset",
            "cifar10",
            "--data-dir",
            str(tmp_path),
            "--out",
            out,
        )
    )
    _assert_one_line_error(_run("train", *TINY, "--lr", "-1", "--out", out))
    _assert_one_line_error(_run("train", *TINY, "--msvp", "-1", "--out", out))
    _assert_one_line_error(_run("train", *TINY, "--num-heads", "3", "--out", out))
    _assert_one_line_error(_run("train", *TINY, "--adv-train", "pgd-l2", "--out", out))
    _assert_one_line_error(_run("train", *TINY, "--resume", "--force", "--out", out))
    assert not Path(out).exists()
    result = _run("train", "--family", "other")
    assert result.exit_code == 1 and "Traceback" not in result.output  # usage: 1
