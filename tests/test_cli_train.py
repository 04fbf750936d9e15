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
    stdout = _run("info", "--ckpt", str(trained), "--json", "-")
    assert stdout.exit_code == 0, stdout.output
    data = json.loads(stdout.stdout)  # the JSON alone
    assert data["finished"] and data["dataset"] == "digits"
    assert len(data["sigma_max"]["layers"]) == 1
    assert data["sigma_max"]["layers"][0]["W_v"]["max"] <= 0.5 * (1 + 1e-6)
    assert data["parameters"] > 0


def test_info_json_file(trained: Path, tmp_path: Path) -> None:
    """--json FILE as on every command: the text still printed, an existing
    FILE replaced only with --force."""
    js = tmp_path / "info.json"
    result = _run("info", "--ckpt", str(trained), "--json", str(js))
    assert result.exit_code == 0, result.output
    assert "parameters" in result.stdout
    assert json.loads(js.read_text())["dataset"] == "digits"
    _assert_one_line_error(_run("info", "--ckpt", str(trained), "--json", str(js)))
    forced = _run("info", "--ckpt", str(trained), "--json", str(js), "--force")
    assert forced.exit_code == 0, forced.output


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


# ---------------------------------------------------------------- defaults in the help

HELP_FIELDS = ("epochs", "batch_size", "lr", "optimizer", "weight_decay", "warmup",
               "label_smoothing", "grad_clip", "loss_scale", "margin",
               "relu_stability", "stability_radius", "cert_eps", "cert_warmup",
               "cert_stream", "cert_mix", "noise_sd", "augment")


def _option_help(name: str) -> str:
    from lipvit.commands.train import train_command

    (option,) = [p for p in train_command.params if p.name == name]
    return " ".join(option.help.split())


@pytest.mark.parametrize("field", HELP_FIELDS)
def test_train_help_states_the_defaults_the_code_uses(field):
    """For every model ``train`` builds with defaults of its own, the value the
    help states for it is the one :func:`train_config_for` gives that model's
    dataset, family and architecture (what the command then trains with)."""
    import re

    from lipvit.commands.train import _shown, default_models
    from lipvit.train import train_config_for

    text = _option_help(field)
    stated = re.search(r"\[default: (.*)\]", text).group(1)
    groups = [g.strip() for g in stated.split(";")]
    for label, (dataset, family, arch) in default_models().items():
        value = _shown(getattr(train_config_for(family, dataset, arch=arch), field))
        if len(groups) == 1 and "(" not in groups[0]:
            assert groups[0] == value, (field, label)
            continue
        (shown,) = [g for g in groups if re.search(rf"[(,] ?{re.escape(label)}[,)]", g)]
        assert shown.startswith(value + " ("), (field, label, shown, value)


def test_fashion_mnist_cait_defaults_are_its_own():
    """The CaiT's schedule (ARCH_DEFAULTS) is what its help line says, not the
    family's (the help once stated the family's eight values)."""
    text = _option_help("epochs")
    assert "12 (--preset fmnist-cait)" in text


def test_the_lipschitz_default_certifies_most_in_the_measured_table():
    """The rule of DEFAULT_PRESET: on Fashion-MNIST the lipschitz default is
    the lipvit model that certifies most at ε = 0.25 and 0.5 (their sum) in
    the measured table."""
    import importlib.util

    from lipvit.commands.train import DEFAULT_PRESET

    root = Path(__file__).parent.parent
    spec = importlib.util.spec_from_file_location(
        "readme_tables", root / "bench" / "readme_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    table = json.loads((root / "docs/figures/peer_lipschitz_cnn.json").read_text())
    presets = {"cait": "fmnist-cait", "hybrid": "fmnist-hybrid"}
    rows = {presets[m[1]]: table[m[0]] for name in table
            if (m := tables.LIPVIT_SYSTEM.fullmatch(name))}
    assert set(rows) == set(presets.values())
    score = {preset: sum(row["certified"][e] for e in ("0.25", "0.5"))
             for preset, row in rows.items()}
    assert DEFAULT_PRESET["fashion-mnist", "lipschitz"] == max(score, key=score.get)


def test_certify_help_names_the_default_method_of_each_architecture():
    import re

    from lipvit.certify.methods import DEFAULT_METHODS

    from lipvit.commands.certify import certify

    (option,) = [p for p in certify.params if p.name == "method_text"]
    text = " ".join(option.help.split())
    for arch, method in DEFAULT_METHODS.items():
        label = "lipvit's ViT" if arch == "vit" else arch
        assert re.search(rf"{method} \([^)]*{re.escape(label)}", text), (arch, text)


def test_train_help_is_grouped():
    from lipvit.commands.train import HELP_GROUPS, train_command

    grouped = [n for names in HELP_GROUPS.values() for n in names]
    assert sorted(grouped) == sorted([*(p.name for p in train_command.params),
                                      "help"])
    text = _run("train", "--help").output
    titles = [t for t in HELP_GROUPS if t + ":" in text]
    assert titles == list(HELP_GROUPS)
    assert "Other options" not in text
    assert text.index("--epochs") > text.index("Optimisation:") > text.index(
        "--preset")
