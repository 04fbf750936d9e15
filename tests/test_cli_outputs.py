"""Every command validates its output paths before any work: a one-line error, exit 1.

The checkpoint and result paths given here do not exist, so a command that
reached its work would fail on them; the error must name the output instead.
"""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from lipvit.cli import main

UNWRITABLE = Path("/proc/lipvit-no-such-dir")  # nobody, not even root, creates here


def _commands(ckpt: str, result: str) -> dict[str, tuple[list[str], list[str], str]]:
    """name -> (arguments, output option(s), kind of output: "file" or "dir")."""
    return {
        "train": (["train", "--epochs", "1"], ["--out"], "file"),
        "certify": (["certify", "--ckpt", ckpt, "--eps", "0.1"], ["--json", "--csv"],
                    "file"),
        "attack": (["attack", "--ckpt", ckpt, "--eps", "0.1"], ["--json", "--csv"],
                   "file"),
        "plot": (["plot", "certified", result], ["--out"], "file"),
        "plot gap": (["plot", "gap", result, result], ["--out"], "file"),
        "tightness": (["tightness", "--ckpt", ckpt, "--eps", "0.1"], ["--out"], "dir"),
        "spectrum": (["spectrum", "--ckpt", ckpt], ["--out"], "dir"),
        "features": (["features", "--ckpt", ckpt], ["--out"], "dir"),
        "pipeline": (["pipeline", "--fast"], ["--out"], "dir"),
    }


def _bad_outputs(tmp: Path, kind: str, suffix: str) -> dict[str, tuple[Path, str]]:
    """input name -> (path, a phrase the message must contain)."""
    a_file = tmp / "a-file.pt"
    a_file.write_text("x")
    a_dir = tmp / "a-dir"
    a_dir.mkdir(exist_ok=True)
    name = f"out{suffix}" if kind == "file" else "out"
    cases = {
        "unwritable parent": (UNWRITABLE / name, "cannot write"),
        "file as parent": (a_file / "sub" / name, "is a file, not a directory"),
    }
    if kind == "file":
        cases["directory"] = (a_dir, "is a directory")
        existing = tmp / f"exists{suffix}"
        existing.write_text("{}")
        cases["exists, no --force"] = (existing, "--force")  # train: or --resume
    else:
        cases["a file"] = (a_file, "is a file")
    return cases


def sweep(tmp: Path):
    """Yield (command, input, option, exit code, output) for every bad output."""
    ckpt, result = str(tmp / "missing.pt"), str(tmp / "missing.json")
    for command, (args, options, kind) in _commands(ckpt, result).items():
        suffix = {"train": ".pt", "plot": ".png", "plot gap": ".png"}.get(command,
                                                                          ".json")
        for case, (path, phrase) in _bad_outputs(tmp, kind, suffix).items():
            for option in options:
                r = CliRunner().invoke(main, [*args, option, str(path)])
                yield command, case, option, path, phrase, r


def test_every_command_refuses_bad_outputs_before_work(tmp_path):
    seen = set()
    for command, case, option, path, phrase, r in sweep(tmp_path):
        where = f"{command} {option} {path} ({case}): {r.output!r}"
        assert r.exit_code == 1, where
        assert r.exception is None or isinstance(r.exception, SystemExit), where
        assert "Traceback" not in r.output, where
        errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
        assert len(errors) == 1, where
        assert phrase in errors[0], where
        assert "missing" not in errors[0], where  # the output was checked first
        seen.add(command)
    assert len(seen) == 9


@pytest.mark.parametrize("argv", [
    ["certify", "--bogus"], ["nope"], ["--bogus"], ["train", "--family", "other"],
    ["certify", "--ckpt", "x.pt", "--eps", "-1"],
])
def test_usage_errors_exit_1(argv):
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output


def test_os_errors_are_one_line(tmp_path):
    # A checkpoint path that is a directory: an OSError deep in loading.
    r = CliRunner().invoke(main, ["info", str(tmp_path)])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert len([ln for ln in r.output.splitlines() if ln.startswith("Error:")]) == 1


def _all_commands():
    from lipvit.commands import COMMANDS

    for command in COMMANDS:
        if isinstance(command, click.Group):
            yield from command.commands.values()
        else:
            yield command


def test_one_vocabulary_across_commands():
    for command in _all_commands():
        names = {opt for p in command.params for opt in getattr(p, "opts", [])}
        visible = {opt for p in command.params if not getattr(p, "hidden", False)
                   for opt in getattr(p, "opts", [])}
        assert "--methods" not in visible, command.name
        for p in command.params:
            if "--device" in getattr(p, "opts", []):
                assert p.default == "auto", command.name
        help_text = CliRunner().invoke(main, [*_path(command), "--help"]).output
        assert "None" not in help_text, (command.name, help_text)
        assert names  # every command has options


def _path(command) -> list[str]:
    return ["plot", command.name] if command.name == "certified" else [command.name]
