"""Randomized smoothing (``lipvit.certify.smoothing``): Clopper–Pearson bounds,
radii against closed forms, abstention, PGD on the smoothed classifier, the
JSON's round trip and shards."""

from __future__ import annotations

import csv
import json
import math
from statistics import NormalDist

import pytest
import torch
from click.testing import CliRunner
from lipvit.analysis.gap import join, summary_rows, violations
from lipvit.analysis.plots import (
    plot_certification_gap,
    plot_certified_accuracy,
    probabilistic_label,
)
from lipvit.analysis.smoothing_attack import (
    SmoothAttackSettings,
    smooth_pgd,
    smoothed_attack_radius,
)
from lipvit.certify.evaluate import certify_samples, merge_records, report_record
from lipvit.certify.smoothing import (
    SmoothingConfig,
    base_classifier,
    certify_smoothed,
    clopper_pearson_lower,
    predict_smoothed,
    recompute,
    smoothing_radius,
)
from scipy.stats import beta
from torch import Tensor, nn

from lipvit.checkpoint import save_checkpoint
from lipvit.cli import main
from lipvit.train import TrainConfig

SIGMA = 0.25
PHI_INV = NormalDist().inv_cdf  # the standard normal quantile, without scipy


class Threshold(nn.Module):
    """Two classes: 1 where pixel (0, 0) exceeds ``t``, else 0 (as logits).

    Under noise of standard deviation σ its smoothed classifier has ``p_1 =
    Φ((x₀ − t)/σ)`` and the same decision boundary, so the true robust radius
    of every point is ``|x₀ − t|`` (Cohen et al. 2019, the linear case)."""

    def __init__(self, t: float) -> None:
        super().__init__()
        self.t = t

    def forward(self, x: Tensor) -> Tensor:
        one = (x[:, 0, 0, 0] > self.t).float()  # (B,)
        return torch.stack([1 - one, one], dim=1)  # (B, 2)


class Constant(nn.Module):
    """Always class ``c`` of ``K``."""

    def __init__(self, c: int, K: int = 10) -> None:
        super().__init__()
        self.c, self.K = c, K

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.one_hot(torch.full((x.shape[0],), self.c),
                                     self.K).float()


def _image(x0: float) -> Tensor:
    x = torch.full((1, 1, 4, 4), 0.5)
    x[0, 0, 0, 0] = x0
    return x


@pytest.mark.parametrize("alpha", [0.001, 0.05])
@pytest.mark.parametrize("k, n", [(0, 10), (1, 10), (7, 10), (10, 10), (99, 100),
                                  (9_990, 10_000), (100_000, 100_000)])
def test_clopper_pearson_is_the_beta_quantile(k, n, alpha):
    # The one-sided (1 - alpha) Clopper-Pearson lower bound is the alpha quantile
    # of Beta(k, n - k + 1) (0 at k = 0); at k = n it is alpha^(1/n) in closed form.
    got = clopper_pearson_lower(k, n, alpha)
    want = 0.0 if k == 0 else beta.ppf(alpha, k, n - k + 1)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-15)
    if k == n:
        assert got == pytest.approx(alpha ** (1 / n), rel=1e-9)
    assert got <= k / n


def test_clopper_pearson_refuses_impossible_counts():
    for k, n in [(-1, 10), (11, 10), (0, 0)]:
        with pytest.raises(ValueError):
            clopper_pearson_lower(k, n, 0.001)


def test_constant_classifier_radius_is_the_closed_form():
    # p_A = 1: every draw hits, p_lower = alpha^(1/n), R = sigma Phi^-1(alpha^(1/n)).
    cfg = SmoothingConfig(sigma=SIGMA, n0=10, n_noise=5000, alpha=0.001,
                          batch_size=512)
    out = certify_smoothed(Constant(3), torch.rand(2, 1, 4, 4), cfg, num_classes=10)
    p = 0.001 ** (1 / 5000)
    assert out.counts[:, 3].tolist() == [5000, 5000]
    assert out.prediction.tolist() == [3, 3]
    assert out.p_lower.tolist() == pytest.approx([p, p], rel=1e-9)
    assert out.radius.tolist() == pytest.approx([SIGMA * PHI_INV(p)] * 2, rel=1e-9)


@pytest.mark.parametrize("distance", [0.05, 0.2, 0.5])
def test_threshold_classifier_radius_against_its_known_p_a(distance):
    # x0 = t + d: p_A = Phi(d / sigma) and the smoothed classifier's true radius
    # is d. The certified radius is below it (with probability >= 1 - alpha; at
    # this seed, always) and close to it: within the Clopper-Pearson width.
    n = 20_000
    cfg = SmoothingConfig(sigma=SIGMA, n0=100, n_noise=n, alpha=0.001,
                          batch_size=4096, seed=1)
    out = certify_smoothed(Threshold(0.4), _image(0.4 + distance), cfg,
                           num_classes=2, index=[0])
    p_a = NormalDist().cdf(distance / SIGMA)
    assert out.prediction.tolist() == [1] and int(out.counts.sum()) == n
    assert out.p_lower[0] <= p_a
    r = float(out.radius[0])
    assert r <= distance
    slack = 6 * math.sqrt(p_a * (1 - p_a) / n)
    assert r >= SIGMA * PHI_INV(p_a - slack)
    assert r == pytest.approx(SIGMA * PHI_INV(float(out.p_lower[0])), rel=1e-9)


def test_abstention_is_not_certified():
    # x0 = t exactly: p_A = 1/2, so the lower bound is below 1/2 and CERTIFY
    # abstains: prediction -1, radius 0, certified at no eps whatever the label.
    cfg = SmoothingConfig(sigma=SIGMA, n0=100, n_noise=4000, batch_size=1024)
    out = certify_smoothed(Threshold(0.4), _image(0.4), cfg, num_classes=2,
                           index=[0])
    assert out.prediction.tolist() == [-1] and out.radius.tolist() == [0.0]
    assert out.p_lower[0] < 0.5
    for y in (0, 1):
        assert not out.certified(torch.tensor([y]), 1e-9).any()
        assert out.certified_radius(torch.tensor([y])).tolist() == [0.0]
    record = out.records()[0]
    assert record["prediction"] == -1 and record["selected"] in (0, 1)
    assert recompute(record, cfg) == (pytest.approx(float(out.p_lower[0])), 0.0)


def test_wrong_prediction_is_not_certified():
    cfg = SmoothingConfig(sigma=SIGMA, n0=10, n_noise=500, batch_size=256)
    out = certify_smoothed(Constant(3), torch.rand(1, 1, 4, 4), cfg, num_classes=10)
    assert out.radius[0] > 0.5
    assert not out.certified(torch.tensor([2]), 0.01).any()
    assert out.certified(torch.tensor([3]), 0.5).all()
    assert out.certified_radius(torch.tensor([2])).tolist() == [0.0]


@pytest.mark.parametrize("bad", [dict(sigma=0.0), dict(sigma=-1.0),
                                 dict(sigma=math.nan), dict(alpha=0.0),
                                 dict(alpha=1.0), dict(n0=0), dict(n_noise=0),
                                 dict(batch_size=0), dict(n0=1.5)])
def test_config_validation(bad):
    with pytest.raises(ValueError, match="smoothing"):
        SmoothingConfig(**{"sigma": SIGMA, **bad})


def test_smoothing_radius_is_zero_at_or_below_one_half():
    assert smoothing_radius(0.5, 1.0) == 0.0 and smoothing_radius(0.3, 1.0) == 0.0
    assert smoothing_radius(NormalDist().cdf(1.5), 0.5) == pytest.approx(0.75)


@pytest.fixture(scope="module")
def noisy_vit(digits):
    """A digits-tiny standard ViT trained under Gaussian noise of σ = 0.25."""
    from conftest import noise_trained_vit

    return noise_trained_vit(digits, SIGMA, 300)


def test_pgd_on_the_smoothed_classifier_does_not_flip_a_certified_point(
        noisy_vit, digits):
    # A Monte Carlo check of Cohen et al.'s Theorem 1 at a fixed seed: Salman
    # et al.'s EOT attack at eps = the certified radius never makes PREDICT
    # return another class; at four times the radius it flips some points (the
    # attack has teeth).
    x, y = digits.x_test[:12], digits.y_test[:12]
    cfg = SmoothingConfig(sigma=SIGMA, n0=50, n_noise=2000, alpha=0.001,
                          batch_size=1024)
    cert = certify_smoothed(noisy_vit, x, cfg, index=range(12))
    ok = (cert.prediction == y) & (cert.radius > 0.05)
    assert int(ok.sum()) >= 4
    xs, ys, r = x[ok], y[ok], cert.radius[ok].float()
    f = base_classifier(noisy_vit)
    gen = torch.Generator().manual_seed(0)
    flips = {}
    for scale in (1.0, 4.0):
        adv = smooth_pgd(f, xs, ys, scale * r, SIGMA, steps=20, m=32, generator=gen)
        dist = (adv - xs).flatten(1).norm(dim=1)
        assert torch.all(dist <= scale * r * (1 + 1e-5))
        preds = [predict_smoothed(f, a, SIGMA, 2000, 0.001, 10, 1024, gen) for a in adv]
        flips[scale] = sum(p not in (-1, int(c))
                           for p, c in zip(preds, ys, strict=True))
    assert flips[1.0] == 0
    assert flips[4.0] > 0


def test_attack_radius_is_above_the_certified_radius(noisy_vit, digits):
    x, y = digits.x_test[:6], digits.y_test[:6]
    cfg = SmoothingConfig(sigma=SIGMA, n0=50, n_noise=2000, batch_size=1024)
    cert = certify_smoothed(noisy_vit, x, cfg, index=range(6))
    ok = (cert.prediction == y) & (cert.radius > 0)
    assert ok.any()
    settings = SmoothAttackSettings(sigma=SIGMA, steps=10, m=16, n_predict=500,
                                    rtol=0.1, max_probes=8)
    res = smoothed_attack_radius(noisy_vit, x[ok], y[ok], settings,
                                 start=cert.radius[ok])
    assert (res.radius >= cert.radius[ok].numpy()).all()
    assert torch.isfinite(torch.from_numpy(res.radius)).any()  # some flip found


def test_shards_merge_to_the_single_run(noisy_vit, digits):
    # Each point's noise is seeded by its test index: two shards merged equal
    # one run on every point (what `torchrun ... lipvit certify` relies on).
    x, y = digits.x_test[:5], digits.y_test[:5]
    index = [11, 3, 40, 7, 29]
    cfg = SmoothingConfig(sigma=SIGMA, n0=20, n_noise=300, batch_size=128)
    kw = dict(methods=["smoothing", "lofast"], eps_list=[0.1, 0.3], smoothing=cfg,
              radius=True)
    whole = report_record(certify_samples(noisy_vit, x, y, index=index, **kw))
    parts = [report_record(certify_samples(noisy_vit, x[s], y[s], index=index[s],
                                           **kw)) for s in (slice(0, 2), slice(2, 5))]
    merged = report_record(merge_records(parts))
    for key in ("smoothing", "certified", "radii", "predictions"):
        assert merged[key] == whole[key]
    other = certify_samples(noisy_vit, x, y, index=[i + 1 for i in index], **kw)
    assert report_record(other)["smoothing"]["counts"] != whole["smoothing"]["counts"]


def test_certify_samples_labels_the_guarantee(noisy_vit, digits):
    cfg = SmoothingConfig(sigma=SIGMA, n0=20, n_noise=200, batch_size=128)
    report = certify_samples(noisy_vit, digits.x_test[:3], digits.y_test[:3],
                             ["lofast", "smoothing", "lofast-fast"], [0.1],
                             smoothing=cfg)
    rows = {r["method"]: r for r in report.to_records()}
    assert rows["smoothing"]["guarantee"] == "probabilistic"
    assert rows["smoothing"]["exact"] is False
    assert (rows["smoothing"]["sigma"], rows["smoothing"]["alpha"],
            rows["smoothing"]["n0"], rows["smoothing"]["n_noise"]) == (
                SIGMA, 0.001, 20, 200)
    assert rows["lofast"]["guarantee"] == "deterministic" and rows["lofast"]["exact"]
    assert rows["lofast-fast"]["guarantee"] == "estimate"
    assert "sigma" not in rows["lofast"]
    with pytest.raises(ValueError, match="SmoothingConfig"):
        certify_samples(noisy_vit, digits.x_test[:2], digits.y_test[:2],
                        ["smoothing"], [0.1])


def test_smoothing_beside_a_capped_model_reads_its_own_weights(digits):
    # A lipschitz ViT's weights are parametrized (spectral caps), and torch's
    # parametrization cache keys a weight by the module it was registered on,
    # which every copy shares: smoothing's float32 base classifier must not
    # meet the float64 copy that the other methods certify under that cache.
    from tests.conftest import nonlinear_model

    model = nonlinear_model("lipschitz", 0).float()
    x, y = digits.x_test[:2], digits.y_test[:2]
    cfg = SmoothingConfig(sigma=SIGMA, n0=10, n_noise=20, batch_size=16)
    report = certify_samples(model, x, y, ["smoothing", "lofast"], [0.01],
                             smoothing=cfg)
    with torch.no_grad():
        assert torch.equal(report.predictions, model.double()(x.double()).argmax(1))


@pytest.fixture(scope="module")
def noisy_ckpt(noisy_vit, tmp_path_factory):
    """:func:`noisy_vit` saved with its noise in the training configuration."""
    out = tmp_path_factory.mktemp("smoothing") / "noisy.pt"
    save_checkpoint(out, noisy_vit, train_config=TrainConfig(noise_sd=SIGMA),
                    dataset="digits")
    return out


@pytest.fixture(scope="module")
def smooth_run(noisy_ckpt, tmp_path_factory):
    """`certify --method smoothing,lofast --radius --json` on 6 points, and its
    printed output."""
    out = tmp_path_factory.mktemp("smooth_run") / "smooth.json"
    result = CliRunner().invoke(main, [
        "certify", "--ckpt", str(noisy_ckpt), "--eps", "0.1,0.25", "--method",
        "smoothing,lofast", "--radius", "--n", "6", "--n0", "20", "--n-noise", "400",
        "--json", str(out), "--csv", str(out.with_suffix(".csv"))])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_cli_json_round_trip(smooth_run):
    # Every count is in the JSON, and p_lower, the radius and every certified
    # flag recompute from them; the row's certified accuracy is their mean.
    out, output = smooth_run
    assert "no (probabilistic)" in output
    assert "smoothed classifier" in output
    data = json.loads(out.read_text())
    assert data["smoothing"]["sigma"] == SIGMA  # the checkpoint's --noise-sd
    assert "probabilistic" in data["smoothing"]["guarantee"]
    assert "probabilistic" in data["quantities"]["smoothing"]["certificate"]
    cfg = SmoothingConfig(**{k: data["smoothing"][k] for k in
                             ("sigma", "n0", "n_noise", "alpha", "batch_size",
                              "seed")})
    for row in (r for r in data["results"] if r["method"] == "smoothing"):
        assert (row["guarantee"], row["exact"]) == ("probabilistic", False)
        assert (row["sigma"], row["alpha"], row["n0"], row["n_noise"]) == (
            SIGMA, 0.001, 20, 400)
        flags = []
        for s in data["samples"]:
            sm = s["smoothing"]
            assert sum(sm["counts"]) == 400 and len(sm["counts"]) == 10
            p, r = recompute(sm, cfg)
            assert (p, r) == (sm["p_lower"], sm["radius"])
            ok = sm["prediction"] == s["label"] and r > row["eps"]
            assert s["certified"][f"smoothing@{row['eps']}"] == ok
            flags.append(ok)
        assert row["certified_accuracy"] == pytest.approx(sum(flags) / len(flags))
    for s in data["samples"]:  # radii: the smoothed radius where it is right
        sm = s["smoothing"]
        want = sm["radius"] if sm["prediction"] == s["label"] else 0.0
        assert s["radii"]["smoothing"] == want
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))
    assert {r["guarantee"] for r in rows if r["method"] == "smoothing"} == {
        "probabilistic"}


def test_plot_certified_draws_smoothing_as_its_own_labelled_series(smooth_run,
                                                                     tmp_path):
    out, _ = smooth_run
    for x_axis in ("eps", "radius"):
        figure = tmp_path / f"{x_axis}.png"
        result = CliRunner().invoke(main, ["plot", "certified", str(out), "--out",
                                           str(figure), "--x", x_axis])
        assert result.exit_code == 0, result.output
        labels = [line.split("  ")[0] for line in result.output.splitlines()[2:-1]]
        smooth = [lab for lab in labels if "smoothing" in lab]
        assert len(smooth) == 1 and "probabilistic: smoothed classifier" in smooth[0]
        assert "σ = 0.25" in smooth[0] and "1 − α = 0.999" in smooth[0]
        assert any("lofast" in lab and "probabilistic" not in lab for lab in labels)
    curves = {"lofast": ([0.1, 0.25], [0.5, 0.1]),
              probabilistic_label("smoothing", 0.25, 0.001): ([0.1, 0.25], [0.8, 0.6])}
    ax = plot_certified_accuracy(curves).axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    smooth = next(ln for lab, ln in lines.items() if "smoothing" in lab)
    assert smooth.get_linestyle() == ":" and smooth.get_marker() == "*"
    assert lines["lofast"].get_linestyle() == "-"
    assert lines["lofast"].get_zorder() > smooth.get_zorder()


def test_gap_labels_smoothing_and_never_counts_it_as_a_violation(smooth_run):
    # The smoothed classifier's radius may exceed the network's attack radius:
    # labelled probabilistic, drawn as stars, not a violation of soundness.
    out, _ = smooth_run
    cert = json.loads(out.read_text())
    attack = {"samples": [{"index": s["index"], "label": s["label"],
                           "prediction": s["prediction"], "radius": 1e-4,
                           "first_order_limit": 1e-4} for s in cert["samples"]]}
    gap = join(cert, attack)
    assert gap.probabilistic == {"smoothing"} and "smoothing" not in gap.estimates
    assert "smoothing" not in violations(gap)
    assert any(gap.certified["smoothing"] > 1e-4)
    labels = {r.method: r.label for r in summary_rows(gap)}
    assert labels["smoothing"] == "smoothing (probabilistic: smoothed classifier)"
    assert labels["lofast"] == "lofast"
    fig = plot_certification_gap(gap.attack, gap.certified,
                                 probabilistic=gap.probabilistic)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any(t.startswith("smoothing (probabilistic") for t in legend)
    assert any("sound radius of the network" in t for t in legend)


@pytest.mark.parametrize("args, message", [
    (["--sigma", "0"], "sigma"),
    (["--sigma", "-0.5"], "sigma"),
    (["--alpha", "0"], "alpha"),
    (["--alpha", "1.5"], "alpha"),
    (["--n0", "0"], "--n0"),
    (["--n-noise", "0"], "--n-noise"),
    (["--radius-tol", "0.01"], "--radius-tol"),
])
def test_bad_smoothing_input_is_one_line(noisy_ckpt, args, message):
    result = CliRunner().invoke(main, ["certify", "--ckpt", str(noisy_ckpt), "--eps",
                                       "0.1", "--method", "smoothing", "--n", "2",
                                       *args])
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and message in lines[0]


def test_smoothing_options_need_the_method_and_sigma_needs_noise(noisy_ckpt,
                                                                  noisy_vit, tmp_path):
    result = CliRunner().invoke(main, ["certify", "--ckpt", str(noisy_ckpt),
                                       "--eps", "0.1", "--method", "lofast",
                                       "--n-noise", "10"])
    assert result.exit_code == 1 and "smoothing only" in result.output
    plain = tmp_path / "no-train-config.pt"  # no recorded noise: --sigma needed
    save_checkpoint(plain, noisy_vit, dataset="digits")
    result = CliRunner().invoke(main, ["certify", "--ckpt", str(plain), "--eps", "0.1",
                                       "--method", "smoothing", "--n", "2"])
    assert result.exit_code == 1 and "--noise-sd" in result.output
    assert len(result.output.strip().splitlines()) == 1
