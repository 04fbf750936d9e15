"""Smoke tests: every script in examples/ runs with small sizes and says what it did.

The scripts run in this process through ``runpy`` (a subprocess would pay torch's
import time once per script); ``sys.argv`` and the size variables are set per
test, and the thread count the scripts set is restored.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def run_example(name: str, args: list[str], monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name), *args])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return capsys.readouterr().out


def test_every_example_is_tested():
    tested = {
        "train_msvp.py",
        "bound_layer.py",
        "certify_batch.py",
        "tightness_plot.py",
        "compare_attention.py",
        "import_hf_vit.py",
        "finetune_hf_msvp.py",
    }
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_train_msvp(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("LIPVIT_EXAMPLE_EPOCHS", "1")
    out = run_example(
        "train_msvp.py", ["--out", str(tmp_path), "--msvp", "0.1"], monkeypatch, capsys
    )
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.startswith(("vanilla", "msvp"))
    }
    assert set(rows) == {"vanilla", "msvp"}
    assert float(rows["msvp"][3]) < float(rows["vanilla"][3])  # mean σ_max lower
    assert (tmp_path / "vanilla.pt").is_file() and (tmp_path / "msvp.pt").is_file()


def test_bound_layer(monkeypatch, capsys):
    out = run_example(
        "bound_layer.py",
        ["--tokens", "5", "--dim", "8", "--heads", "2", "--samples", "2"],
        monkeypatch,
        capsys,
    )
    ratios = [float(line.split()[-1]) for line in out.splitlines()[1:]]
    assert len(ratios) == 3 and all(r >= 1 for r in ratios)


def test_certify_batch(monkeypatch, capsys):
    monkeypatch.setenv("LIPVIT_EXAMPLE_EPOCHS", "1")
    out = run_example("certify_batch.py", ["--n", "4"], monkeypatch, capsys)
    assert "certified radius" in out and "head" in out
    deltas = [
        float(line.split()[1])
        for line in out.splitlines()
        if line.strip() and line.split()[0] in ("0.01", "0.05", "0.10", "0.20")
    ]
    assert len(deltas) == 4 and deltas == sorted(deltas)  # δ_out grows with ε


def test_tightness_plot(monkeypatch, capsys, tmp_path):
    png = tmp_path / "t.png"
    monkeypatch.setenv("LIPVIT_EXAMPLE_N", "2")
    out = run_example("tightness_plot.py", ["--out", str(png)], monkeypatch, capsys)
    assert png.is_file() and png.stat().st_size > 10_000
    ratios = [
        float(line.split("=")[-1]) for line in out.splitlines() if "bound/PGD" in line
    ]
    assert len(ratios) == 24 and min(ratios) >= 1


def test_compare_attention(monkeypatch, capsys, tmp_path):
    out = run_example(
        "compare_attention.py",
        ["--fast", "--attention", "dot,scsa", "--out", str(tmp_path)],
        monkeypatch,
        capsys,
    )
    models = [line.split("|")[1].strip() for line in out.splitlines()
              if line.startswith("| ") and "model" not in line]
    assert models == ["dot", "dot-msvp", "scsa", "scsa-msvp"]
    assert (tmp_path / "jacobian.png").is_file()
    assert "per-block Jacobian figure:" in out


def test_import_hf_vit(monkeypatch, capsys):
    pytest.importorskip("transformers")
    out = run_example("import_hf_vit.py", ["--n", "4"], monkeypatch, capsys)
    diff = float(out.split("vs transformers (float64): ")[1].split()[0])
    assert diff <= 1e-10
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert [r[0] for r in rows] == ["0", "1"]
    for _, sigma, spec, lofast in rows:
        assert float(sigma) > 0 and float(spec) > 0 and float(lofast) > 0
    assert "network (LoFAST): clean accuracy" in out


@pytest.mark.slow
def test_finetune_hf_msvp(monkeypatch, capsys, tmp_path):
    pytest.importorskip("transformers")
    monkeypatch.setenv("LIPVIT_EXAMPLE_EPOCHS", "1")
    out = run_example(
        "finetune_hf_msvp.py", ["--out", str(tmp_path)], monkeypatch, capsys
    )
    assert "imported" in out and "fine-tuned" in out
    diff = float(out.split("in transformers ")[1].split()[0])
    assert diff <= 1e-5
    assert (tmp_path / "finetuned-hf" / "model.safetensors").is_file()
