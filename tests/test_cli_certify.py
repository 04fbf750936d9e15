"""``lipvit certify`` through click's CliRunner: table, JSON schema, CSV, bad input."""

from __future__ import annotations

import csv
import json

import pytest
from click.testing import CliRunner

from lipvit.cli import main


@pytest.fixture(scope="module")
def ckpt(trained_ckpts):
    return trained_ckpts["lipschitz"]


def test_certify_writes_schema_and_agrees_with_table(ckpt, tmp_path):
    js, cs = tmp_path / "out.json", tmp_path / "out.csv"
    result = CliRunner().invoke(main, [
        "certify", "--ckpt", str(ckpt), "--eps", "0.001,0.01", "--method",
        "lofast,lofast-fast,specformer", "--radius", "--n", "12", "--json", str(js),
        "--csv", str(cs)])
    assert result.exit_code == 0, result.output
    data = json.loads(js.read_text())
    assert {"checkpoint", "dataset", "n", "clean_accuracy", "results",
            "samples"} <= set(data)
    assert data["n"] == 12 and len(data["samples"]) == 12
    assert len(data["results"]) == 6
    for r in data["results"]:
        assert set(r) >= {"method", "eps", "certified_accuracy", "seconds_per_sample",
                          "exact"}
        assert r["exact"] == (r["method"] != "lofast-fast")
        # Each row's certified accuracy is the mean of the per-sample flags.
        key = f"{r['method']}@{r['eps']}"
        flags = [s["certified"][key] for s in data["samples"]]
        assert r["certified_accuracy"] == pytest.approx(sum(flags) / len(flags))
        assert f"{r['certified_accuracy']:.4g}" in result.output
    for s in data["samples"]:
        keys = {"index", "label", "prediction", "margin", "radius", "certified"}
        assert keys <= set(s)
        if s["radius"] > 0.01:
            assert s["certified"]["lofast@0.01"]
    rows = list(csv.DictReader(cs.open()))
    assert len(rows) == 6 and rows[0]["method"] == "lofast"


@pytest.mark.parametrize("args, message", [
    (["--eps", "-0.1"], "eps"),
    (["--eps", "nan"], "eps"),
    (["--eps", "0"], "eps"),
    (["--eps", "0.1", "--method", "magic"], "unknown method"),
])
def test_bad_input_is_one_line(ckpt, args, message):
    result = CliRunner().invoke(main, ["certify", "--ckpt", str(ckpt), *args])
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_missing_and_corrupt_checkpoint(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    for path in (tmp_path / "missing.pt", bad):
        result = CliRunner().invoke(main, ["certify", "--ckpt", str(path), "--eps",
                                           "0.1"])
        assert result.exit_code == 1
        assert len(result.output.strip().splitlines()) == 1
        assert "Traceback" not in result.output


def test_refuses_to_overwrite(ckpt, tmp_path):
    js = tmp_path / "out.json"
    js.write_text("{}")
    result = CliRunner().invoke(main, ["certify", "--ckpt", str(ckpt), "--eps", "0.1",
                                       "--n", "2", "--json", str(js)])
    assert result.exit_code == 1 and "--force" in result.output
    assert js.read_text() == "{}"
