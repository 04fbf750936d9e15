"""Tests for lipvit.analysis.tightness and `lipvit tightness`: soundness against
PGD, the residual choice, the figure, and the command's files matching its table."""

from __future__ import annotations

import csv
import json
import math
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from lipvit.analysis import plots as P
from lipvit.analysis import tightness as T
from matplotlib.figure import Figure

import lipvit
from lipvit.cli import main
from lipvit.errors import UnsupportedModelError
from lipvit.train import train, train_config_for

SMALL = dict(embed_dim=16, depth=2, num_heads=2, mlp_ratio=1.0)


@pytest.fixture(scope="module")
def data(digits):
    return digits


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, data):
    """A lipschitz-family digits model trained for 2 epochs by lipvit.train.train."""
    cfg = lipvit.preset(
        "digits-tiny", family="lipschitz", mean=data.mean, std=data.std, **SMALL
    )
    path = tmp_path_factory.mktemp("tight") / "lip.pt"
    train(
        cfg,
        train_config_for("lipschitz", epochs=2, device="cpu"),
        data,
        path,
        progress=False,
    )
    return path


@pytest.fixture(scope="module")
def model(ckpt):
    from lipvit.checkpoint import load_checkpoint

    return load_checkpoint(ckpt).model.double()


@pytest.fixture(scope="module")
def images(data):
    return data.x_test[:4].double()


PGD = T.PGDSettings(steps=30, restarts=2, seed=0)
EPS = [0.01, 0.1]


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


@pytest.mark.parametrize("residual", ["auto", True])
def test_layer_bounds_sound_and_ordered(model, images, residual):
    methods = [
        "naive",
        "lofast-xi",
        "lofast",
        "lofast-half",
        "lofast-local",
        "specformer",
    ]
    r = T.layer_tightness(model, images, 1, EPS, methods, residual=residual, pgd=PGD)
    assert r.target == "layer" and r.layer == 1 and r.n == 4
    assert list(r.bounds) == methods and r.pgd.shape == (2, 4)
    assert r.residual is (residual is True)  # the projection is active: H = 0 in auto
    assert all(v == 0 for v in r.violations().values()), r.violations()
    assert np.all(r.pgd > 0)
    b = r.bounds
    tol = 1e-12
    assert np.all(b["lofast-local"] <= b["lofast-half"] + tol)
    assert np.all(b["lofast-half"] <= b["lofast"] + tol)
    assert np.all(b["lofast"] <= b["lofast-xi"] + tol)
    assert np.all(b["lofast-xi"] <= b["naive"] + tol)  # ζ ≤ the naive δ1 factor


def test_layer_pgd_matches_model_block(model, images):
    # The compared map is the model's own attention on Z = norm1(X): a PGD point's
    # deviation must be reproducible by calling the block's attention directly.
    r = T.layer_tightness(model, images, 0, [0.05], ["lofast"], residual=False, pgd=PGD)
    X = T.block_inputs(model, images)[0]
    Z = model.blocks[0].norm1(X)
    assert torch.allclose(torch.linalg.matrix_norm(Z), torch.ones(4, dtype=Z.dtype))
    # A linear-in-ε sanity check: the deviation at the tiny radius is about ζ ε.
    from lipvit.certify.lofast.layer import lofast_terms

    W = [w.detach() for w in model.blocks[0].attn.head_weights()]
    zeta = lofast_terms(Z, *W, residual=False).zeta
    assert np.all(r.pgd[0] <= (zeta.numpy() * 0.05) * 1.5)
    assert np.all(r.pgd[0] >= (zeta.numpy() * 0.05) * 0.5)


def test_residual_auto_uses_identity_when_projection_is_inactive(data):
    torch.manual_seed(0)
    cfg = lipvit.preset("digits-tiny", family="lipschitz", attn_radius=1e3, **SMALL)
    m = lipvit.ViT(cfg).double().eval()
    x = data.x_test[:3].double()
    r = T.layer_tightness(m, x, 0, [0.01], ["lofast"], pgd=PGD)
    assert r.residual is True and "H = I" in r.notes[0]
    assert r.violations() == {"lofast": 0}
    std = lipvit.ViT(lipvit.preset("digits-tiny", **SMALL)).double().eval()
    r = T.layer_tightness(std, x, 0, [0.01], ["lofast", "naive"], pgd=PGD)
    assert r.residual is False and all(v == 0 for v in r.violations().values())


def test_network_bounds_sound(model, images):
    r = T.network_tightness(
        model, images, EPS, ["lofast", "lofast-fast", "specformer"], pgd=PGD
    )
    assert r.target == "network" and set(r.bounds) == {
        "lofast",
        "lofast-fast",
        "specformer",
    }
    assert r.violations()["lofast"] == 0 and r.violations()["specformer"] == 0
    assert r.methods["lofast-fast"].exact is False
    assert np.all(r.pgd[1] >= r.pgd[0])
    trace = r.traces["lofast"]
    assert trace["steps"][0] == "input" and trace["steps"][-1] == "head"
    assert trace["mean"].shape == (2, len(trace["steps"]))
    np.testing.assert_allclose(trace["mean"][:, 0], EPS)
    last = trace["mean_cls"][:, -1] if "mean_cls" in trace else trace["mean"][:, -1]
    np.testing.assert_allclose(last, r.bounds["lofast"].mean(axis=1))


def test_rows_are_consistent(model, images):
    r = T.layer_tightness(model, images, 0, EPS, ["lofast", "specformer"], pgd=PGD)
    rows = r.to_records()
    assert [(x["method"], x["eps"]) for x in rows] == [
        (m, e) for m in ("lofast", "specformer") for e in EPS
    ]
    for x in rows:
        i = EPS.index(x["eps"])
        b = r.bounds[x["method"]][i]
        assert x["bound_mean"] == pytest.approx(b.mean())
        assert x["bound_min"] <= x["bound_mean"] <= x["bound_max"]
        assert x["pgd_mean"] == pytest.approx(r.pgd[i].mean())
        assert x["ratio"] == pytest.approx(x["bound_mean"] / x["pgd_mean"])
        assert x["ratio"] >= 1 and x["violations"] == 0


def test_box_to_l2_closed_form():
    F0 = torch.tensor([[0.0, 1.0, 2.0]])
    lb = torch.tensor([[-1.0, 0.5, 2.0]])
    ub = torch.tensor([[0.5, 3.0, 2.0]])
    # gaps: max(0.5, 1) = 1, max(2, 0.5) = 2, 0  ->  sqrt(5)
    assert T.box_to_l2(F0, lb, ub).item() == pytest.approx(math.sqrt(5))


def test_bad_arguments(model, images):
    with pytest.raises(ValueError, match="layer"):
        T.layer_tightness(model, images, 7, EPS, pgd=PGD)
    with pytest.raises(ValueError, match="eps"):
        T.layer_tightness(model, images, 0, [0.0], pgd=PGD)
    with pytest.raises(ValueError, match="unknown bound method"):
        T.layer_tightness(model, images, 0, EPS, ["lofast-fast"], pgd=PGD)
    with pytest.raises(ValueError, match="unknown bound method"):
        T.network_tightness(model, images, EPS, ["naive"], pgd=PGD)
    with pytest.raises(ValueError):
        T.PGDSettings(steps=0)


def test_biased_query_refused(images):
    m = lipvit.ViT(lipvit.preset("digits-tiny", qkv_bias=True, **SMALL)).double()
    with torch.no_grad():
        m.blocks[0].attn.qkv.bias.fill_(0.1)
    with pytest.raises(UnsupportedModelError, match="bias"):
        T.layer_tightness(m.eval(), images, 0, EPS, ["lofast"], pgd=PGD)


def test_figure_series_and_scales(model, images):
    r = T.layer_tightness(model, images, 0, EPS, ["naive", "lofast"], pgd=PGD)
    fig = T.tightness_figure(r)
    assert isinstance(fig, Figure)
    top, bottom = fig.axes
    assert top.get_yscale() == "log"  # the ratio panel is clipped (test_plots)
    assert bottom.get_ylim()[1] <= P.RATIO_CLIP
    labels = [t.get_text() for t in top.get_legend().get_texts()]
    assert labels == [
        T.LAYER_METHODS["naive"].label,
        T.LAYER_METHODS["lofast"].label,
        "PGD (lower bound)",
    ]
    lines = top.get_lines()
    np.testing.assert_allclose(lines[1].get_ydata(), r.bounds["lofast"].mean(axis=1))
    np.testing.assert_allclose(lines[2].get_ydata(), r.pgd.mean(axis=1))
    assert "Frobenius" in bottom.get_xlabel() and "n = 4" in top.get_title()


# ------------------------------------------------------------------ command


def _table(output: str) -> list[list[str]]:
    lines = output.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("method"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip() or line.startswith(("wrote", "warning", "note")):
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


@pytest.mark.parametrize("target", [["--layer", "1"], ["--network"]])
def test_command_files_agree_with_table(ckpt, tmp_path, target):
    out = tmp_path / "t"
    r = run(
        "tightness",
        "--ckpt",
        ckpt,
        *target,
        "--eps",
        "0.01,0.05",
        "--n",
        "3",
        "--pgd-steps",
        "20",
        "--pgd-restarts",
        "1",
        "--out",
        out,
    )
    assert r.exit_code == 0, r.output
    for name in ("tightness.png", "tightness.csv", "tightness.json"):
        assert (out / name).is_file()
    data = json.loads((out / "tightness.json").read_text())
    assert data["n"] == 3 and data["eps"] == [0.01, 0.05]
    assert data["target"] == ("network" if "--network" in target else "layer")
    assert all(
        v == 0 for m, v in data["violations"].items() if data["methods"][m]["exact"]
    )
    with (out / "tightness.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(data["rows"]) == 2 * len(data["methods"])
    printed = _table(r.stdout)
    assert len(printed) == len(rows)
    for line, row in zip(printed, rows, strict=True):
        assert line[0] == row["method"]
        assert float(line[1]) == pytest.approx(float(row["eps"]))
        assert float(line[2]) == pytest.approx(float(row["bound_mean"]), rel=1e-3)
        assert float(line[3]) == pytest.approx(float(row["pgd_mean"]), rel=1e-3)
        assert float(line[4]) == pytest.approx(float(row["ratio"]), rel=1e-3)
        assert float(row["ratio"]) == pytest.approx(
            float(row["bound_mean"]) / float(row["pgd_mean"])
        )
    samples = data["samples"]
    assert len(samples["index"]) == 3 and np.asarray(samples["pgd"]).shape == (3, 2)
    # No silent overwrite.
    again = run(
        "tightness", "--ckpt", ckpt, *target, "--eps", "0.01", "--n", "2", "--out", out
    )
    assert_one_line_error(again)
    assert "exists" in again.output


@pytest.mark.parametrize(
    "args",
    [
        ["--layer", "5"],
        ["--layer", "0", "--network"],
        ["--eps", "-0.1"],
        ["--eps", "nan"],
        ["--method", "lofast,bogus"],
        ["--network", "--method", "naive"],
        ["--n", "0"],
    ],
)
def test_command_bad_inputs(ckpt, tmp_path, args):
    assert_one_line_error(
        run(
            "tightness",
            "--ckpt",
            ckpt,
            "--out",
            tmp_path / "o",
            "--pgd-steps",
            "2",
            *args,
        )
    )


def test_command_bad_checkpoint(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"nope")
    assert_one_line_error(run("tightness", "--ckpt", bad, "--out", tmp_path / "o"))
    assert_one_line_error(
        run("tightness", "--ckpt", tmp_path / "missing.pt", "--out", tmp_path / "o")
    )


@pytest.mark.crown
@pytest.mark.skipif(not T.crown_available(), reason="auto_LiRPA is not installed")
def test_crown_bounds_sound(data):
    torch.manual_seed(0)
    cfg = lipvit.preset(
        "digits-tiny",
        family="lipschitz",
        embed_dim=16,
        depth=1,
        num_heads=2,
        mlp_ratio=1.0,
        patch_size=4,
    )
    m = lipvit.ViT(cfg).double().eval()
    x = data.x_test[:2].double()
    for residual in (True, False):
        r = T.layer_tightness(
            m, x, 0, [0.01, 0.05], ["lofast", "crown"], residual=residual, pgd=PGD
        )
        assert set(r.bounds) == {"lofast", "crown"} and r.violations() == {
            "lofast": 0,
            "crown": 0,
        }
    r = T.network_tightness(m, x, [0.01], ["lofast", "crown"], pgd=PGD)
    assert "crown" in r.bounds and r.violations()["crown"] == 0
    # CROWN's margin bounds as margin drops: above targeted PGD on every pair.
    from lipvit.analysis.margin_tightness import margin_tightness

    r = margin_tightness(m, x, [0.01, 0.05], ["crown"], pgd=PGD)
    assert "crown" in r.bounds and r.violations()["crown"] == 0
    assert r.pgd.max() > 0 and np.all(np.isfinite(r.bounds["crown"]))


# ------------------------------------------------------------------ margin drops


def _standard(seed: int):
    torch.manual_seed(seed)
    return lipvit.ViT(lipvit.preset("digits-tiny", **SMALL)).double().eval()


@pytest.mark.parametrize("which", ["lipschitz", 0, 1])
def test_margin_bounds_sound_against_targeted_pgd(model, images, which):
    """Every sound bound on every wrong-class margin drop lies above what a
    targeted PGD attack finds on that margin (float64; a trained lipschitz
    model and two random standard ViTs, whose taylor bound is second order)."""
    from lipvit.analysis import margin_tightness as M

    net = model if which == "lipschitz" else _standard(which)
    x = images[:2] if which != "lipschitz" else images
    r = M.margin_tightness(net, x, EPS, ["taylor", "lofast", "lofast-fast",
                                         "specformer"], pgd=PGD)
    K = net.config.num_classes
    assert r.target == "margin" and r.pgd.shape == (len(EPS), x.shape[0] * (K - 1))
    assert set(r.bounds) == {"taylor", "lofast", "lofast-fast", "specformer"}
    assert np.all(r.pgd >= 0) and np.all(r.pgd[1] >= r.pgd[0] * 0.999)
    assert r.pgd.max() > 0  # the attack moved the margins: the test has teeth
    violations = r.violations()
    assert all(violations[m] == 0 for m in ("taylor", "lofast", "specformer"))
    # taylor's drop is capped by √2·δ_out: never above lofast's.
    assert np.all(r.bounds["taylor"] <= r.bounds["lofast"] * (1 + 1e-9))
    # At the small radius taylor's first-order term is nearly exact.
    assert np.median(r.bounds["taylor"][0] / np.maximum(r.pgd[0], 1e-300)) < 3


def test_margin_columns_are_the_wrong_classes(model, images):
    """Column ``b·(K − 1) + i`` is image ``b``'s ``i``-th wrong class: the
    targeted PGD drops of one image equal pgd_margin_drop's without column y."""
    from lipvit.analysis import margin_tightness as M
    from lipvit.analysis.pgd import pgd_margin_drop

    x = images[:3]
    r = M.margin_tightness(model, x, [0.05], ["lofast"], pgd=PGD)
    y = model(x).argmax(1)
    full = pgd_margin_drop(model, x, y, 0.05, steps=PGD.steps, restarts=PGD.restarts,
                           seed=PGD.seed)  # (B, K)
    K = full.shape[1]
    for b in range(3):
        wrong = [j for j in range(K) if j != y[b]]
        np.testing.assert_allclose(r.pgd[0, b * (K - 1):(b + 1) * (K - 1)],
                                   full[b, wrong].numpy())
    lofast = r.bounds["lofast"][0].reshape(3, K - 1)
    assert np.all(lofast == lofast[:, :1])  # √2·δ_out: one value per image


def test_margin_figure_draws_medians(model, images):
    """The lines of a margin figure are medians over the (image, class) pairs."""
    from lipvit.analysis import margin_tightness as M

    r = M.margin_tightness(model, images, EPS, ["taylor", "lofast"], pgd=PGD)
    top, _ = T.tightness_figure(r).axes
    drawn = [ln for ln in top.get_lines() if len(ln.get_xdata())]
    np.testing.assert_allclose(drawn[0].get_ydata(),
                               np.median(r.bounds["taylor"], axis=1))
    np.testing.assert_allclose(drawn[-1].get_ydata(), np.median(r.pgd, axis=1))
    assert "pairs" in top.get_title() and "margin" in top.get_ylabel()


def test_off_scale_bounds_are_named_not_drawn():
    """A bound above OFF_SCALE × PGD at every ε (SpecFormer's 1e23) is named in
    the legend with its range; one that crosses the top is drawn and its
    largest value given."""
    eps = np.array([0.01, 0.1])
    pgd = (np.array([1e-3, 1e-2]),) * 3
    crossing = np.array([2e-3, 1e9])
    bounds = {"tight": (np.array([2e-3, 3e-2]),) * 3, "crossing": (crossing,) * 3,
              "huge": (np.array([1e23, 1e25]),) * 3}
    top, _ = P.plot_tightness(eps, bounds, pgd).axes
    labels = [t.get_text() for t in top.get_legend().get_texts()]
    assert "huge: off the scale, 1e+23–1e+25" in labels
    assert "crossing (up to 1e+09, above the axis)" in labels
    drawn = [ln for ln in top.get_lines() if len(ln.get_xdata())]
    assert len(drawn) == 3  # tight, crossing, PGD
    assert top.get_ylim()[1] == pytest.approx(P.OFF_SCALE * 1e-2)


def test_margin_command(ckpt, tmp_path):
    out = tmp_path / "m"
    r = run("tightness", "--ckpt", ckpt, "--margins", "--eps", "0.01,0.05", "--n", "2",
            "--pgd-steps", "10", "--pgd-restarts", "1", "--out", out)
    assert r.exit_code == 0, r.output
    data = json.loads((out / "tightness.json").read_text())
    assert data["target"] == "margin" and data["n"] == 2 * 9
    assert set(data["methods"]) == {"taylor", "lofast", "specformer"}
    assert all(v == 0 for v in data["violations"].values())
    with (out / "tightness.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {float(r["bound_median"]) <= float(r["bound_max"]) for r in rows} == {True}
    assert_one_line_error(run("tightness", "--ckpt", ckpt, "--margins", "--network",
                              "--out", tmp_path / "x"))
    assert_one_line_error(run("tightness", "--ckpt", ckpt, "--margins", "--method",
                              "naive", "--out", tmp_path / "y"))
