"""``lipvit compare``: a --fast smoke run, resuming, settings checks, the report."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from lipvit.analysis.compare import CompareSettings, runs

from lipvit.cli import main

FAST = ["compare", "--fast", "--attention", "dot,l2,conv", "--n", "8",
        "--n-jacobian", "1"]


def _invoke(args: list[str]):
    return CliRunner().invoke(main, args)


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("compare") / "run"
    result = _invoke([*FAST, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_fast_run_writes_the_report(fast_run) -> None:
    out, output = fast_run
    for name in ("compare.csv", "compare.json", "jacobian.png", "accuracy.png",
                 "report.md"):
        assert (out / name).stat().st_size > 0, name
    rows = list(csv.DictReader(open(out / "compare.csv")))
    assert [r["model"] for r in rows] == ["dot", "dot-msvp", "l2", "l2-msvp", "conv"]
    for r in rows:
        assert 0 <= float(r["clean"]) <= 1
        for key in ("linf 0.00784314 fgsm", "linf 0.0313725 pgd", "l2 0.5 pgd-l2"):
            assert 0 <= float(r[key]) <= float(r["clean"]), key
        assert float(r["cpu_per_epoch"]) > 0
    assert float(rows[0]["cpu_ratio"]) == 1.0
    # Certificates for dot-product attention only; conv has no sigma of W_q.
    assert rows[0]["certified l2 0.1"] != "" and rows[2]["certified l2 0.1"] == ""
    assert rows[4]["sigma_q"] == ""
    data = json.loads((out / "compare.json").read_text())
    assert len(data["jacobian"]["dot"]) == 2  # one value per block
    assert any("conv + MSVP left out" in n for n in data["notes"])
    assert any("l2: no certificate" in n and "dot-product attention" in n
               for n in data["notes"])
    assert data["command"].startswith("python -m lipvit compare --out ")
    report = (out / "report.md").read_text()
    assert "| model | clean |" in report and "jacobian.png" in report
    assert "| dot |" in output


def test_rerun_reuses_models_and_evaluations(fast_run) -> None:
    out, _ = fast_run
    before = (out / "compare.csv").read_text()
    result = _invoke([*FAST, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.count("trained model reused") == 5
    assert result.output.count("evaluation reused") == 5
    assert (out / "compare.csv").read_text() == before


def test_changed_settings_are_refused_or_redone(fast_run) -> None:
    out, _ = fast_run
    result = _invoke([*FAST, "--out", str(out), "--epochs", "2"])
    assert result.exit_code == 1
    assert "other settings (epochs)" in result.output
    assert "--force" in result.output and "Traceback" not in result.output
    result = _invoke([*FAST, "--out", str(out), "--attention", "dot",
                      "--eps-l2", "0.2"])
    assert result.exit_code == 0, result.output
    assert "evaluation settings changed (eps_l2)" in result.output
    assert "trained model reused" in result.output


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--attention", "l2"], "needs 'dot'"),
        (["--attention", "dot,flash"], "unknown attention"),
        (["--eps-l2", "0"], "--eps-l2 must be finite and > 0"),
        (["--msvp", "0"], "msvp must be > 0"),
    ],
)
def test_bad_options_give_one_line(args: list[str], match: str, tmp_path) -> None:
    result = _invoke(["compare", "--fast", "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 1
    assert match in result.output and "Traceback" not in result.output


def test_runs_leave_out_conv_msvp() -> None:
    plan, notes = runs(CompareSettings(attentions=("dot", "conv")))
    assert [r.name for r in plan] == ["dot", "dot-msvp", "conv"]
    assert "no W_q, W_k, W_v" in notes[0]
