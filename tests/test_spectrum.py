"""Tests for lipvit.analysis.spectrum and `lipvit spectrum`: exact weight spectra, block
Jacobians against brute force, the first-order comparison, files versus table."""

from __future__ import annotations

import csv
import json
import math
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from lipvit.analysis import spectrum as S
from lipvit.analysis.jacobian import full_jacobian
from matplotlib.figure import Figure

import lipvit
from lipvit.cli import main
from lipvit.train import train, train_config_for

SMALL = dict(embed_dim=16, depth=2, num_heads=2, mlp_ratio=1.0)


@pytest.fixture(scope="module")
def data(digits):
    return digits


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, data):
    """Two standard digits models (1 epoch): vanilla and a strong MSVP penalty."""
    root = tmp_path_factory.mktemp("spec")
    cfg = lipvit.preset("digits-tiny", mean=data.mean, std=data.std, **SMALL)
    paths = {}
    for name, lam in (("vanilla", 0.0), ("msvp", 0.5)):
        paths[name] = root / f"{name}.pt"
        train(
            cfg,
            train_config_for("standard", epochs=1, device="cpu", msvp=(lam, lam, lam)),
            data,
            paths[name],
            progress=False,
        )
    return paths


@pytest.fixture(scope="module")
def models(ckpts):
    from lipvit.checkpoint import load_checkpoint

    return {k: load_checkpoint(p).model.double() for k, p in ckpts.items()}


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(result):
    """Non-zero exit, no traceback, one ``Error:`` line (click's usage hint aside)."""
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    lines = [
        ln
        for ln in result.output.splitlines()
        if ln.strip() and not ln.startswith(("Usage:", "Try '"))
    ]
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.output


# ------------------------------------------------------------------ library


def test_weight_spectra_exact(models):
    m = models["vanilla"]
    w = S.weight_spectra(m)
    assert list(w) == ["W_q", "W_k", "W_v", "W_v W_o"]
    assert all(v.shape == (2, 2) for v in w.values())
    # Brute force from the fused qkv / proj weights: head h of W_q is rows h·d..(h+1)·d.
    D, d = 16, 8
    for layer, block in enumerate(m.blocks):
        W = block.attn.qkv.weight.detach()
        P = block.attn.proj.weight.detach()
        for h in range(2):
            q = W[h * d : (h + 1) * d].T  # (D, d)
            v = W[2 * D + h * d : 2 * D + (h + 1) * d].T
            o = P[:, h * d : (h + 1) * d].T  # (d, D)
            assert w["W_q"][layer, h] == pytest.approx(
                np.linalg.svd(q.numpy(), compute_uv=False)[0], rel=1e-10
            )
            assert w["W_v W_o"][layer, h] == pytest.approx(
                np.linalg.svd((v @ o).numpy(), compute_uv=False)[0], rel=1e-10
            )


def test_msvp_lowers_penalised_sigmas(models):
    w = {k: S.weight_spectra(m) for k, m in models.items()}
    rows = S.compare_weights(w, "vanilla")
    assert [(r["layer"], r["matrix"]) for r in rows] == [
        (k, m) for k in range(2) for m in ("W_q", "W_k", "W_v")
    ]
    for r in rows:
        assert r["lower: msvp"] == (r["msvp"] < r["vanilla"])
        assert r["vanilla"] == pytest.approx(
            w["vanilla"][r["matrix"]][r["layer"]].max()
        )
    # λ = 0.5 is strong: every penalised matrix ends below the vanilla one.
    assert all(r["lower: msvp"] for r in rows)
    with pytest.raises(ValueError, match="reference"):
        S.compare_weights(w, "nope")


def test_jacobian_spectrum_against_brute_force(models, data):
    m = models["msvp"]
    x = data.x_test[:3].double()
    jac = S.jacobian_spectrum(m, x, "exact")
    assert jac.exact and jac.sigma.shape == (2, 3)
    power = S.jacobian_spectrum(m, x, "power")
    assert not power.exact
    X = S.block_inputs(m, x)
    for k, block in enumerate(m.blocks):
        J = full_jacobian(lambda Z, b=block: b(Z) - Z, X[k])  # (B, ND, ND)
        sv = torch.linalg.svdvals(J)[:, 0].numpy()
        np.testing.assert_allclose(jac.sigma[k], sv, rtol=1e-8)
        assert np.all(power.sigma[k] <= sv * (1 + 1e-8))  # from below
        np.testing.assert_allclose(power.sigma[k], sv, rtol=1e-3)
        l1 = J.abs().sum(1).amax(1).numpy()  # max column sum
        linf = J.abs().sum(2).amax(1).numpy()  # max row sum
        np.testing.assert_allclose(jac.l1_linf[k], np.sqrt(l1 * linf), rtol=1e-10)
        assert np.all(jac.l1_linf[k] >= sv)
    np.testing.assert_allclose(jac.sum_sigma, jac.sigma.sum(0))


def test_first_order_deviation(models, data):
    m = models["vanilla"]
    x = data.x_test[:3].double()
    jac = S.jacobian_spectrum(m, x, "exact")
    dev = S.first_order_deviation(m, x, [0.01, 0.05], jac, pgd_steps=20, pgd_restarts=1)
    gain = float(
        torch.linalg.matrix_norm(m.patch_embed.proj.weight.detach(), ord=2)
        / m.std.min()
    )
    assert dev.gain == pytest.approx(gain)
    np.testing.assert_allclose(
        dev.first_order[1], 0.05 * gain * np.exp(jac.sigma.sum(0)), rtol=1e-12
    )
    np.testing.assert_allclose(
        dev.product[0], 0.01 * gain * np.prod(1 + jac.sigma, axis=0), rtol=1e-12
    )
    assert np.all(dev.product <= dev.first_order)
    assert dev.certified.shape == dev.pgd.shape == (2, 3)
    assert np.all(dev.certified >= dev.pgd)  # certified is an upper bound
    assert np.all(dev.pgd > 0)
    with pytest.raises(ValueError, match="eps"):
        S.first_order_deviation(m, x, [-1.0], jac)
    with pytest.raises(ValueError, match="another"):
        S.first_order_deviation(m, x[:2], [0.1], jac)


def test_bad_modes(models, data):
    x = data.x_test[:2].double()
    with pytest.raises(ValueError, match="mode"):
        S.jacobian_spectrum(models["vanilla"], x, "dense")
    with pytest.raises(ValueError, match="exact=True"):
        big = (
            lipvit.ViT(
                lipvit.preset("digits-tiny", embed_dim=128, num_heads=2, depth=1)
            )
            .double()
            .eval()
        )
        S.jacobian_spectrum(big, x, "exact")


# ------------------------------------------------------------------ command


def _tables(output: str) -> dict[str, list[list[str]]]:
    """Printed tables by their first header word."""
    tables, lines, i = {}, output.splitlines(), 0
    while i < len(lines):
        if i + 1 < len(lines) and set(lines[i + 1].replace(" ", "")) == {"-"}:
            rows = []
            j = i + 2
            while (
                j < len(lines) and lines[j].strip() and not lines[j].startswith("wrote")
            ):
                rows.append(re.split(r"\s{2,}", lines[j].strip()))
                j += 1
            tables.setdefault(lines[i].split()[0] + str(len(tables)), rows)
            i = j
        else:
            i += 1
    return tables


def test_command_files_agree_with_tables(ckpts, tmp_path):
    out = tmp_path / "s"
    r = run(
        "spectrum",
        "--ckpt",
        ckpts["vanilla"],
        "--ckpt",
        ckpts["msvp"],
        "--n",
        "3",
        "--eps",
        "0.01",
        "--pgd-steps",
        "5",
        "--pgd-restarts",
        "1",
        "--out",
        out,
    )
    assert r.exit_code == 0, r.output
    for name in (
        "spectra.png",
        "jacobian.png",
        "spectrum.json",
        "weights.csv",
        "jacobian.csv",
        "deviation.csv",
    ):
        assert (out / name).is_file(), name
    data = json.loads((out / "spectrum.json").read_text())
    assert list(data["weights"]) == ["vanilla", "msvp"] and data["n"] == 3
    tables = list(_tables(r.stdout).values())
    weights, lower, jac, dev = tables
    with (out / "weights.csv").open() as f:
        w_rows = list(csv.DictReader(f))
    assert len(w_rows) == 2 * 4 * 2 * 2  # checkpoints × matrices × blocks × heads
    for line in weights:
        label, block = line[0], int(line[1])
        for col, matrix in zip(line[2:], ("W_q", "W_k", "W_v", "W_v W_o"), strict=True):
            csv_max = max(
                float(x["sigma_max"])
                for x in w_rows
                if x["checkpoint"] == label
                and int(x["block"]) == block
                and x["matrix"] == matrix
            )
            assert float(col) == pytest.approx(csv_max, rel=1e-3)
            assert csv_max == pytest.approx(max(data["weights"][label][matrix][block]))
    assert lower == [["msvp", "yes", "yes", "yes"]]
    with (out / "jacobian.csv").open() as f:
        j_rows = list(csv.DictReader(f))
    assert len(j_rows) == 2 * 2 * 3
    for line in jac:
        vals = [
            float(x["sigma_max"])
            for x in j_rows
            if x["checkpoint"] == line[0] and int(x["block"]) == int(line[1])
        ]
        assert float(line[2]) == pytest.approx(np.mean(vals), rel=1e-3)
        assert line[5] == "exact"
    with (out / "deviation.csv").open() as f:
        d_rows = list(csv.DictReader(f))
    assert [[x["checkpoint"], float(x["eps"])] for x in d_rows] == [
        [line[0], float(line[1])] for line in dev
    ]
    for x, line in zip(d_rows, dev, strict=True):
        assert float(line[2]) == pytest.approx(float(x["first_order_mean"]), rel=1e-3)
        assert float(line[3]) == pytest.approx(float(x["product_mean"]), rel=1e-3)
        assert float(line[4]) == pytest.approx(float(x["certified_mean"]), rel=1e-3)
        assert float(x["certified_mean"]) >= float(x["pgd_mean"])


def test_figures(models, data):
    from lipvit.analysis.plots import plot_jacobian_violin, plot_spectra

    w = {k: S.weight_spectra(m) for k, m in models.items()}
    fig = plot_spectra(w)
    assert isinstance(fig, Figure) and len(fig.axes) == 4
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
        "vanilla",
        "msvp",
    ]
    jac = S.jacobian_spectrum(models["vanilla"], data.x_test[:3].double())
    fig = plot_jacobian_violin(
        {
            "σ": {f"block {k}": jac.sigma[k] for k in range(2)},
            "est": {f"block {k}": jac.l1_linf[k] for k in range(2)},
        }
    )
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["block 0", "block 1"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["σ", "est"]


@pytest.mark.parametrize(
    "args",
    [
        ["--label", "a"],  # one label for two checkpoints
        ["--label", "a", "--label", "a"],
        ["--eps", "0"],
        ["--jacobian", "dense"],
    ],
)
def test_command_bad_inputs(ckpts, tmp_path, args):
    assert_one_line_error(
        run(
            "spectrum",
            "--ckpt",
            ckpts["vanilla"],
            "--ckpt",
            ckpts["msvp"],
            "--n",
            "2",
            "--out",
            tmp_path / "o",
            *args,
        )
    )


def test_command_bad_checkpoint(tmp_path):
    assert_one_line_error(
        run("spectrum", "--ckpt", tmp_path / "missing.pt", "--out", tmp_path / "o")
    )


def test_nan_free_summary(ckpts, tmp_path):
    out = tmp_path / "one"
    r = run(
        "spectrum",
        "--ckpt",
        ckpts["vanilla"],
        "--n",
        "2",
        "--eps",
        "none",
        "--out",
        out,
    )
    assert r.exit_code == 0, r.output
    data = json.loads((out / "spectrum.json").read_text())
    assert data["comparison"]["rows"] == [] and data["deviation"]["vanilla"] is None
    sig = data["jacobian"]["vanilla"]["sigma_mean"]
    assert all(math.isfinite(s) and s > 0 for s in sig)
