"""CLI tests for `lipvit attack --radius` and `lipvit plot gap`."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import quick_train, tiny_config

import lipvit
from lipvit.checkpoint import save_checkpoint
from lipvit.cli import main

pytest.importorskip("torchattacks")

N = "6"
QUICK = ("--steps", "3", "--restarts", "1", "--radius-tol", "0.05")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, digits):
    """A tiny lipschitz ViT on digits, briefly trained."""
    torch.manual_seed(0)
    model = quick_train(lipvit.ViT(tiny_config("lipschitz")), digits, 60)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pt"
    save_checkpoint(path, model, dataset="digits")
    return path


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(result, match: str = ""):
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.output
    assert match in lines[0], lines[0]


@pytest.fixture(scope="module")
def results(ckpt, tmp_path_factory):
    """`attack --radius` and `certify --radius` JSON for the same 6 samples."""
    d = tmp_path_factory.mktemp("gap")
    att, cert = d / "attack.json", d / "cert.json"
    r = run("attack", "--ckpt", ckpt, "--radius", "--n", N, *QUICK, "--json", att,
            "--csv", d / "attack.csv")
    assert r.exit_code == 0, r.output
    c = run("certify", "--ckpt", ckpt, "--eps", "0.01", "--method",
            "lofast,lofast-fast", "--radius", "--n", N, "--json", cert)
    assert c.exit_code == 0, c.output
    return d, att, cert, r.output


def test_attack_radius_files(results):
    d, att, _, output = results
    data = json.loads(att.read_text())
    assert data["norm"] == "l2" and data["n"] == 6
    assert data["attacks"] == ["pgd-l2", "apgd", "apgd-t", "cw"]
    assert "not a bound" in data["quantities"]["first_order_limit"]
    assert "upper bound" in data["quantities"]["radius"]
    samples = data["samples"]
    assert len(samples) == 6 and all(s["verified"] for s in samples)
    for s in samples:
        if s["prediction"] != s["label"]:
            assert s["radius"] == 0 and s["attack"] == "clean"
        else:
            assert s["radius"] > 0 and s["attack"] in data["attacks"]
            assert s["bracket_low"] <= s["radius"]
    correct = [s["radius"] for s in samples if s["prediction"] == s["label"]]
    assert correct and data["summary"]["median_radius"] == pytest.approx(
        float(np.median(correct)))
    rows = list(csv.DictReader((d / "attack.csv").open()))
    assert [int(r["index"]) for r in rows] == [s["index"] for s in samples]
    assert float(rows[0]["radius"]) == pytest.approx(samples[0]["radius"])
    assert "median attack radius (upper bound)" in output


def test_plot_gap(results, tmp_path):
    _, att, cert, _ = results
    out = tmp_path / "gap.png"
    r = run("plot", "gap", cert, att, "--out", out, "--pdf")
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:4] == b"\x89PNG" and out.with_suffix(".pdf").is_file()
    assert "lofast-fast (estimate)" in r.output and "warning" not in r.output
    r = run("plot", "gap", cert, att, "--out", tmp_path / "one.png", "--method",
            "lofast", "--no-first-order")
    assert r.exit_code == 0, r.output
    assert "lofast-fast" not in r.output
    assert_one_line_error(run("plot", "gap", cert, att, "--out", out), "exists")
    assert_one_line_error(run("plot", "gap", cert, att, "--out", tmp_path / "x.png",
                              "--method", "crown"), "unknown method")


def _edit(src, dst, change):
    data = json.loads(src.read_text())
    change(data)
    dst.write_text(json.dumps(data))
    return dst


def test_plot_gap_refuses_mismatched_files(results, ckpt, tmp_path):
    _, att, cert, _ = results
    out = tmp_path / "g.png"

    def relabel(d):
        d["samples"][0]["label"] = (d["samples"][0]["label"] + 1) % 10

    def drop(d):
        d["samples"] = d["samples"][1:]

    def nan(d):
        d["samples"][1]["radius"] = float("nan")

    def negative(d):
        d["samples"][1]["radii"]["lofast"] = -0.1

    cases = [
        (cert, _edit(att, tmp_path / "a1.json", relabel), "label"),
        (cert, _edit(att, tmp_path / "a2.json", drop), "different samples"),
        (cert, _edit(att, tmp_path / "a3.json", nan), "radii must be >= 0"),
        (_edit(cert, tmp_path / "c4.json", negative), att, "radii must be >= 0"),
        (att, att, "no per-sample records"),
        (cert, tmp_path / "missing.json", "no such file"),
    ]
    for c, a, match in cases:
        assert_one_line_error(run("plot", "gap", c, a, "--out", out), match)
    assert not out.exists()


@pytest.mark.parametrize(("args", "match"), [
    (["--eps", "0.1"], "drop --eps"),
    (["--norm", "linf"], "drop --norm linf"),
    (["--radius-tol", "nan"], "finite"),
    (["--radius-tol", "0"], "finite and > 0"),
    (["--radius-tol", "2"], "rtol must lie in (0, 1)"),
    (["--max-radius", "-1"], "finite and > 0"),
    (["--attack", "pgd"], "unknown attack"),
    (["--json", "PARENT_IS_FILE"], "not a directory"),
])
def test_attack_radius_bad_inputs(ckpt, tmp_path, args, match):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    args = [str(blocker / "out.json") if a == "PARENT_IS_FILE" else a for a in args]
    r = run("attack", "--ckpt", ckpt, "--radius", "--n", "2", *args)
    assert_one_line_error(r, match)


def test_radius_options_need_radius(ckpt):
    assert_one_line_error(run("attack", "--ckpt", ckpt, "--eps", "0.1",
                              "--radius-tol", "0.1"), "need --radius")
