"""Every command validates its output paths before any work: a one-line error, exit 1.

The checkpoint and result paths given here do not exist, so a command that
reached its work would fail on them; the error must name the output instead.
"""

from __future__ import annotations

import json
import re
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


def _all_commands(group: click.Group = main, path: tuple[str, ...] = ()):
    """Yield (argv path, command) for every command of the CLI, subcommands of
    groups (plot's) included."""
    for name in group.list_commands(click.Context(group)):
        command = group.get_command(click.Context(group), name)
        if isinstance(command, click.Group):
            yield from _all_commands(command, (*path, name))
        else:
            yield [*path, name], command


def _options(command):
    return [p for p in command.params if isinstance(p, click.Option)]


def test_one_vocabulary_across_commands():
    for path, command in _all_commands():
        names = {opt for p in command.params for opt in getattr(p, "opts", [])}
        visible = {opt for p in command.params if not getattr(p, "hidden", False)
                   for opt in getattr(p, "opts", [])}
        assert "--methods" not in visible, command.name
        for p in command.params:
            if "--device" in getattr(p, "opts", []):
                assert p.default == "auto", command.name
        help_text = CliRunner().invoke(main, [*path, "--help"]).output
        assert help_text.startswith("Usage:"), (path, help_text)
        assert "None" not in help_text, (command.name, help_text)
        assert names  # every command has options


# Names whose value legitimately differs in kind between commands; each says why.
# A name listed here must still differ (a stale entry fails the test).
DIFFERENT_KINDS = {
    # The product of each command in its own shape: a checkpoint file (train), a
    # figure file (plot), an output folder (commands writing several files),
    # either for export (the format's own shape). Every help text says which.
    "--out": "the command's product",
    # train: one of auto, cpu, cuda (under torchrun each rank takes
    # cuda:<local rank> itself); elsewhere any torch device name, cuda:N too.
    "--device": "train picks cuda's index itself",
    # Commands that train choose among the datasets they can train on; those
    # that read a checkpoint take a name overriding the checkpoint's, checked
    # when the data is loaded.
    "--dataset": "training commands list their datasets",
    # spectrum: the one attention bound of its budget (a choice); certify,
    # tightness and plot: comma lists, checked against each command's methods.
    "--method": "spectrum takes one bound",
    # train: the one attention of the model (a choice); compare: a comma list of
    # the attentions to compare.
    "--attention": "compare takes a list",
    # The same relative tolerance; attack reads it as text through
    # parse_floats like its other numbers (one-line errors for nan, 0),
    # certify as a float range (its smoothing checks whether it was given).
    "--radius-tol": "parsed as text by attack",
}


def _kind(option: click.Option) -> tuple:
    """The kind of value an option takes: its click type (a range counts as its
    number type: the bounds check values, they do not change what the option
    names), whether it is a flag, and for a path what it may be."""
    t = option.type
    cls = {click.IntRange: click.types.IntParamType,
           click.FloatRange: click.types.FloatParamType}.get(type(t), type(t))
    shape = ((t.file_okay, t.dir_okay, t.allow_dash) if isinstance(t, click.Path)
             else None)
    return cls.__name__, option.is_flag, shape


def test_one_meaning_per_option_name():
    """docs/cli.md, "Output options": --json FILE and --csv FILE write the
    results, - meaning standard output, on every command; --out names the
    command's product and its help says what kind of thing; and otherwise a
    long option name takes the same kind of value on every command."""
    kinds: dict[str, dict[tuple, list[str]]] = {}
    outs = 0
    for path, command in _all_commands():
        where = " ".join(path)
        for option in _options(command):
            for name in [*option.opts, *option.secondary_opts]:
                if name.startswith("--"):
                    kinds.setdefault(name, {}).setdefault(_kind(option), []).append(
                        where)
            if option.name in ("json_path", "csv_path") or {"--json", "--csv"} & set(
                    option.opts):
                t = option.type
                assert isinstance(t, click.Path) and not t.dir_okay, where
                assert t.allow_dash and not option.is_flag, where
                assert option.metavar == "FILE" and "standard output" in option.help
            if "--out" in option.opts:
                outs += 1
                t, text = option.type, option.help or ""
                assert isinstance(t, click.Path), where
                file = re.search(r"\bfile\b", text) is not None
                folder = re.search(r"\bfolder\b", text) is not None
                assert file or folder, f"{where} --out: say file or folder: {text!r}"
                assert t.file_okay == file and t.dir_okay == folder, (where, text)
    assert outs >= 10
    for name, where in (("--json", {"certify", "attack", "info"}),
                        ("--csv", {"certify", "attack"})):
        (found,) = kinds[name].values()
        assert set(found) >= where, (name, found)
    mixed = {name: found for name, found in kinds.items() if len(found) > 1}
    unexplained = {n: f for n, f in mixed.items() if n not in DIFFERENT_KINDS}
    assert not unexplained, unexplained
    stale = set(DIFFERENT_KINDS) - set(mixed)
    assert not stale, stale


@pytest.mark.parametrize("command", [["certify", "--eps", "0.1"], ["attack"]])
def test_json_and_csv_cannot_both_be_stdout(command, tmp_path):
    r = CliRunner().invoke(main, [command[0], "--ckpt", str(tmp_path / "missing.pt"),
                                  *command[1:], "--json", "-", "--csv", "-"])
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert r.exit_code == 1 and len(errors) == 1, r.output
    assert "standard output" in errors[0] and "missing" not in errors[0]


def test_dash_sends_results_alone_to_stdout(tmp_path):
    """C.results_to_stdout: with --json - the JSON alone on standard output, the
    command's text on standard error; with a file, the text on standard output."""
    from lipvit.commands import _common as C

    @click.command()
    @C.json_option
    @C.csv_option
    @C.force_option
    @C.results_to_stdout
    def fake(json_path, csv_path, force):
        C.check_results([json_path, csv_path], force)
        click.echo("a text table")
        C.write_json(json_path, {"x": float("nan"), "y": 1}, force)
        if csv_path:
            C.write_csv(csv_path, [{"a": 1, "b": 2}], force)

    r = CliRunner().invoke(fake, ["--json", "-"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"x": None, "y": 1}
    assert r.stderr == "a text table\n"
    r = CliRunner().invoke(fake, ["--json", "-", "--csv", "-"])
    assert "standard output" in str(r.exception)
    js = tmp_path / "r.json"
    r = CliRunner().invoke(fake, ["--json", str(js), "--csv", "-"])
    assert r.exit_code == 0, r.output
    assert r.stdout == "a,b\n1,2\n" and r.stderr == "a text table\n"
    assert json.loads(js.read_text()) == {"x": None, "y": 1}
    r = CliRunner().invoke(fake, ["--json", str(js)])
    assert "--force" in str(r.exception)


NO_COMPUTE = {"plot certified", "plot gap", "plot tradeoff", "export"}
"""The commands that only draw or convert files: no --threads."""


def test_every_command_that_computes_takes_threads():
    names = {" ".join(path): command for path, command in _all_commands()}
    assert NO_COMPUTE <= set(names)
    for name, command in names.items():
        if name not in NO_COMPUTE:
            assert any("--threads" in o.opts for o in _options(command)), name
