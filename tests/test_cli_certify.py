"""``lipvit certify`` through click's CliRunner: table, JSON schema, CSV, bad input."""

from __future__ import annotations

import csv
import importlib
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


def test_dash_writes_the_results_to_stdout(ckpt):
    """--json - / --csv -: standard output holds the results alone, the table
    goes to standard error."""
    args = ["certify", "--ckpt", str(ckpt), "--eps", "0.01", "--method", "lofast",
            "--n", "3"]
    result = CliRunner().invoke(main, [*args, "--json", "-"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["n"] == 3 and [r["method"] for r in data["results"]] == ["lofast"]
    assert "lofast" in result.stderr
    result = CliRunner().invoke(main, [*args, "--csv", "-"])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(result.stdout.splitlines()))
    assert [r["method"] for r in rows] == ["lofast"]


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


def test_default_method_is_taylor_without_its_radius_search(ckpt, tmp_path):
    """No --method: taylor, the strongest sound method, where the model supports
    it; its costly radius search runs only with --radius."""
    js = tmp_path / "out.json"
    result = CliRunner().invoke(main, ["certify", "--ckpt", str(ckpt), "--eps", "0.01",
                                       "--n", "4", "--json", str(js)])
    assert result.exit_code == 0, result.output
    data = json.loads(js.read_text())
    assert [r["method"] for r in data["results"]] == ["taylor"]
    assert "taylor" in data["quantities"] and "note:" not in result.output
    assert all(s["radius"] is None and "radii" not in s for s in data["samples"])


def test_default_falls_back_to_lofast_in_one_line(ckpt, monkeypatch):
    from lipvit.errors import UnsupportedModelError

    command = importlib.import_module("lipvit.commands.certify")  # the module

    def unsupported(model):
        raise UnsupportedModelError("block 0: unsupported feed-forward layer")

    for module in (command, importlib.import_module("lipvit.certify.methods")):
        monkeypatch.setattr(module, "check_supported", unsupported)
    result = CliRunner().invoke(main, ["certify", "--ckpt", str(ckpt), "--eps", "0.01",
                                       "--n", "4"])
    assert result.exit_code == 0, result.output
    (note,) = [ln for ln in result.output.splitlines() if ln.startswith("note:")]
    assert "taylor cannot bound this model (block 0: unsupported feed-forward " \
           "layer); certifying with lofast" in note
    assert [ln.split()[0] for ln in result.output.splitlines()
            if ln.startswith(("lofast", "taylor"))] == ["lofast"]
    assert "--method taylor" not in result.output  # not supported: not suggested


def test_nothing_certified_names_the_stronger_method_first(ckpt):
    def last_line(*args):
        result = CliRunner().invoke(main, ["certify", "--ckpt", str(ckpt), "--eps",
                                           "5", "--n", "3", *args])
        assert result.exit_code == 0, result.output
        return result.output.strip().splitlines()[-1]

    line = last_line("--method", "lofast,lofast-fast")
    assert line.startswith("nothing is certified at these eps with lofast, "
                           "lofast-fast: --method taylor")
    assert line.index("--method taylor") < line.index("smaller --eps")
    assert "largest eps any point reaches" in line  # the bound methods' radii
    line = last_line("--method", "taylor")  # the strongest was used; no radii
    assert "--method" not in line
    assert line == ("nothing is certified at these eps with taylor: use a smaller "
                    "--eps, or --radius for every point's certified radius")


def test_threads_and_no_progress_bar_off_a_terminal(ckpt):
    """--threads sets the command's CPU threads and restores them after; the
    progress bar stays quiet where stderr is not a terminal (CliRunner's)."""
    import torch

    before = torch.get_num_threads()
    result = CliRunner().invoke(main, ["certify", "--ckpt", str(ckpt), "--eps",
                                       "0.01", "--method", "lofast", "--n", "4",
                                       "--threads", "2"])
    assert result.exit_code == 0, result.output
    assert torch.get_num_threads() == before
    assert "samples [" not in result.output and "certify:" not in result.output


def test_small_vits_compute_on_one_thread_and_keep_the_random_state():
    """``cpu_threads`` with ``threads=0``: one thread for a ViT under a million
    parameters, torch's count for a larger one (told without building it) and
    for the hybrid; choosing draws no random numbers."""
    import torch

    from lipvit.config import ViTConfig
    from lipvit.runtime import cpu_threads

    cpu, before = torch.device("cpu"), torch.get_num_threads()
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with cpu_threads(ViTConfig(), cpu):
        assert torch.get_num_threads() == 1
    assert torch.equal(torch.get_rng_state(), state)
    for big in (ViTConfig(embed_dim=512, num_heads=8),
                ViTConfig(family="lipschitz", arch="hybrid", patch_size=4)):
        with cpu_threads(big, cpu):
            assert torch.get_num_threads() == before
