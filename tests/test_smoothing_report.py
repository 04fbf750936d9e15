"""Randomized smoothing reports the *smoothed* classifier: its accuracy and
abstention rate in ``CertifyReport``, the JSON, the CSV, the printed table and
``plot tradeoff --method smoothing``, beside (never instead of) the network's
clean accuracy; and the noise of ``certify_smoothed`` without indices is fresh
per call and per point, with indices reproducible whatever the batches."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from lipvit.certify.evaluate import certify_samples, merge_records, report_record
from lipvit.certify.smoothing import (
    SmoothingCertificate,
    SmoothingConfig,
    certify_smoothed,
)
from torch import Tensor, nn

from lipvit.checkpoint import save_checkpoint
from lipvit.cli import main
from lipvit.model import ViT
from lipvit.train import TrainConfig

SIGMA = 0.25


class Rule(nn.Module):
    """Two classes: 1 where pixel (0, 0) exceeds 1/2, else 0 (as logits). Its
    smoothed classifier is sure far from 1/2 and abstains at 1/2; it carries a
    ``config`` as lipvit's models do (``certify_samples`` reads it)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_classes=2, arch="vit")

    def forward(self, x: Tensor) -> Tensor:
        one = (x[:, 0, 0, 0] > 0.5).to(x.dtype)  # (B,)
        return torch.stack([1 - one, one], dim=1)  # (B, 2)


def _images(*x0: float) -> Tensor:
    """``(len(x0), 1, 4, 4)`` grey images whose pixel (0, 0) is each ``x0``."""
    x = torch.full((len(x0), 1, 4, 4), 0.5)
    x[:, 0, 0, 0] = torch.tensor(x0)
    return x


# Far above 1/2 (smoothed class 1), far below (class 0), at 1/2 (abstains),
# far above again. The network (no noise) says 1, 0, 0, 1.
X0 = (0.9, 0.1, 0.5, 0.9)
LABELS = torch.tensor([1, 0, 0, 0])
CFG = SmoothingConfig(sigma=SIGMA, n0=20, n_noise=200, batch_size=256)


def _expected(smoothing_records: list[dict], labels: list[int]) -> tuple[float, float]:
    """(smoothed accuracy, abstain rate) counted from per-point records."""
    n = len(labels)
    right = sum(r["prediction"] == y and r["prediction"] >= 0
                for r, y in zip(smoothing_records, labels, strict=True))
    abstained = sum(r["prediction"] < 0 for r in smoothing_records)
    return right / n, abstained / n


def test_report_fields_are_the_smoothed_classifiers():
    report = certify_samples(Rule(), _images(*X0), LABELS, ["smoothing"], [0.1, 0.5],
                             smoothing=CFG, index=range(4))
    assert report.smoothing.prediction.tolist() == [1, 0, -1, 1]
    acc, rate = _expected(report.smoothing.records(), LABELS.tolist())
    assert (acc, rate) == (0.5, 0.25)
    assert report.smoothed_accuracy == pytest.approx(acc, abs=0)
    assert report.abstain_rate == pytest.approx(rate, abs=0)
    assert report.smoothing.accuracy(LABELS) == acc
    assert report.clean_accuracy == 0.75  # the network's: right at x0 = 1/2
    rows = report.to_records()
    assert [r["eps"] for r in rows] == [0.1, 0.5]
    for row in rows:
        assert list(row)[:5] == ["method", "eps", "clean_accuracy",
                                 "smoothed_accuracy", "abstain_rate"]
        assert (row["clean_accuracy"], row["smoothed_accuracy"],
                row["abstain_rate"]) == (0.75, 0.5, 0.25)
        assert row["certified_accuracy"] <= row["smoothed_accuracy"]
    # A merge of shards recomputes them from the merged per-point outcomes.
    parts = [report_record(certify_samples(Rule(), _images(*X0)[s], LABELS[s],
                                           ["smoothing"], [0.1], smoothing=CFG,
                                           index=range(4)[s]))
             for s in (slice(0, 1), slice(1, 4))]
    merged = merge_records(parts)
    assert (merged.smoothed_accuracy, merged.abstain_rate) == (0.5, 0.25)


def test_report_without_smoothing_has_no_smoothed_fields(digits):
    from conftest import tiny_config

    model = ViT(tiny_config("standard")).eval()
    report = certify_samples(model, digits.x_test[:2], digits.y_test[:2],
                             ["lofast"], [0.01])
    assert report.smoothed_accuracy is None and report.abstain_rate is None
    assert all("smoothed_accuracy" not in r for r in report.to_records())


def _recording_rule(seen: list[Tensor]) -> nn.Module:
    class Recording(Rule):
        """:class:`Rule` that keeps every batch of noisy images it classifies."""

        def forward(self, x: Tensor) -> Tensor:
            seen.append(x.clone())
            return super().forward(x)

    return Recording()


def _noise(x: Tensor, index, cfg: SmoothingConfig) -> list[Tensor]:
    """Per point of ``x``: the noise (``n0 + n_noise`` draws) it was given."""
    seen: list[Tensor] = []
    certify_smoothed(_recording_rule(seen), x, cfg, index=index)
    per = len(seen) // len(x)
    return [torch.cat(seen[i * per:(i + 1) * per]) - x[i] for i in range(len(x))]


def test_without_index_every_point_and_call_draws_fresh_noise():
    cfg = SmoothingConfig(sigma=SIGMA, n0=4, n_noise=12, batch_size=8)
    x = _images(0.5, 0.5)  # the same image twice in one call
    first = _noise(x, None, cfg)
    assert first[0].shape == (16, 1, 4, 4)
    assert not torch.equal(first[0], first[1])
    second = _noise(x[:1], None, cfg)  # another call (another batch)
    assert not torch.equal(second[0], first[0])
    assert not torch.equal(second[0], first[1])
    # torch's global seed makes a run without indices reproducible.
    torch.manual_seed(7)
    a = _noise(x, None, cfg)
    torch.manual_seed(7)
    b = _noise(x, None, cfg)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    # With indices: a point's index (and seed) fixes its noise, in any call.
    same = _noise(x, [5, 5], cfg)
    assert torch.equal(same[0], same[1])
    assert torch.equal(_noise(x[:1], [5], cfg)[0], same[0])
    assert not torch.equal(_noise(x[:1], [6], cfg)[0], same[0])


def test_without_index_counts_differ_for_the_same_point():
    # At x0 = 1/2 the counts are Binomial(n, 1/2) draws: two independent
    # draws of 2000 coincide with probability about 1.8 %, of all of five
    # pairs never in practice.
    cfg = SmoothingConfig(sigma=SIGMA, n0=2, n_noise=2000, batch_size=2000)
    out = certify_smoothed(Rule(), _images(*[0.5] * 6), cfg)
    assert len({int(c) for c in out.counts[:, 1]}) > 1
    fixed = certify_smoothed(Rule(), _images(*[0.5] * 6), cfg, index=[3] * 6)
    assert len({int(c) for c in fixed.counts[:, 1]}) == 1


def test_with_indices_batch_splits_give_identical_results():
    x0 = (0.45, 0.5, 0.55, 0.6, 0.3)
    x, index = _images(*x0), [11, 3, 40, 7, 29]
    cfg = SmoothingConfig(sigma=SIGMA, n0=10, n_noise=300, batch_size=64)
    whole = certify_smoothed(Rule(), x, cfg, index=index)
    parts = [certify_smoothed(Rule(), x[s], cfg, index=index[s])
             for s in (slice(0, 2), slice(2, 3), slice(3, 5))]
    merged = SmoothingCertificate.cat([p.to_record() for p in parts])
    reverse = certify_smoothed(Rule(), x.flip(0), cfg, index=index[::-1])
    for key in ("selected", "prediction", "counts", "p_lower", "radius"):
        assert torch.equal(getattr(merged, key), getattr(whole, key)), key
        assert torch.equal(getattr(reverse, key).flip(0), getattr(whole, key)), key
    # certify_samples with other batch sizes: the same smoothed classifier.
    y = torch.tensor([0, 1, 1, 1, 0])
    reports = [certify_samples(Rule(), x, y, ["smoothing"], [0.1], smoothing=cfg,
                               index=index, batch_size=b) for b in (1, 2, 5)]
    assert len({(r.smoothed_accuracy, r.abstain_rate) for r in reports}) == 1
    assert torch.equal(reports[0].smoothing.counts, whole.counts)


# ------------------------------------------------------------------ the CLI


@pytest.fixture(scope="module")
def noisy_ckpt(digits, tmp_path_factory):
    """A digits-tiny standard ViT trained briefly under noise of σ = 0.25,
    saved with that noise in its training configuration."""
    from conftest import noise_trained_vit

    model = noise_trained_vit(digits, SIGMA, 120)
    out = tmp_path_factory.mktemp("smoothing_report") / "noisy.pt"
    save_checkpoint(out, model, train_config=TrainConfig(noise_sd=SIGMA),
                    dataset="digits")
    return out


SMOOTHING_ARGS = ["--eps", "0.1,0.25", "--n", "8", "--n0", "10", "--n-noise", "100"]


def _certify(ckpt, out, methods: str):
    result = CliRunner().invoke(main, [
        "certify", "--ckpt", str(ckpt), "--method", methods, *SMOOTHING_ARGS,
        "--json", str(out), "--csv", str(out.with_suffix(".csv"))])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def smooth_run(noisy_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("smoothing_report_run") / "smooth.json"
    return out, _certify(noisy_ckpt, out, "lofast,smoothing")


def test_cli_json_csv_and_table_carry_the_smoothed_classifier(smooth_run):
    out, output = smooth_run
    data = json.loads(out.read_text())
    samples = data["samples"]
    n = len(samples)
    acc, rate = _expected([s["smoothing"] for s in samples],
                          [s["label"] for s in samples])
    network = sum(s["prediction"] == s["label"] for s in samples) / n
    block = data["smoothing"]
    assert block["smoothed_accuracy"] == pytest.approx(acc, rel=1e-12)
    assert block["abstain_rate"] == pytest.approx(rate, rel=1e-12)
    assert block["sigma"] == SIGMA and "probabilistic" in block["guarantee"]
    assert data["clean_accuracy"] == pytest.approx(network, rel=1e-12)  # kept
    for row in (r for r in data["results"] if r["method"] == "smoothing"):
        assert row["certified_accuracy"] <= block["smoothed_accuracy"]
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))
    assert {r["method"] for r in rows} == {"lofast", "smoothing"}
    for row in rows:
        assert float(row["clean_accuracy"]) == pytest.approx(network, rel=1e-12)
        if row["method"] == "smoothing":
            assert float(row["smoothed_accuracy"]) == pytest.approx(acc, rel=1e-12)
            assert float(row["abstain_rate"]) == pytest.approx(rate, rel=1e-12)
        else:
            assert row["smoothed_accuracy"] == row["abstain_rate"] == ""
    head = output.splitlines()[0]
    assert f"network clean accuracy={network:.4f}" in head
    assert f"smoothed classifier accuracy={acc:.4f}" in head
    assert f"abstain rate={rate:.4f}" in head
    line = next(ln for ln in output.splitlines()
                if ln.startswith("smoothed classifier: accuracy"))
    assert f"accuracy {acc:.4f}" in line
    assert f"network clean accuracy {network:.4f}" in line


def test_cli_results_are_reproducible(noisy_ckpt, smooth_run, tmp_path):
    # `lipvit certify` passes the test-set indices: the same counts on a rerun
    # whatever torch's global generator did in between.
    out, _ = smooth_run
    torch.randn(100)
    again = tmp_path / "again.json"
    _certify(noisy_ckpt, again, "smoothing")
    first = json.loads(out.read_text())
    second = json.loads(again.read_text())
    assert [s["smoothing"] for s in second["samples"]] == [
        s["smoothing"] for s in first["samples"]]
    assert (second["smoothing"]["smoothed_accuracy"]
            == first["smoothing"]["smoothed_accuracy"])


def test_cli_without_smoothing_keeps_the_plain_header(noisy_ckpt):
    result = CliRunner().invoke(main, [
        "certify", "--ckpt", str(noisy_ckpt), "--method", "lofast", "--eps", "0.1",
        "--n", "2"])
    assert result.exit_code == 0, result.output
    head = result.output.splitlines()[0]
    assert "  clean accuracy=" in head and "smoothed" not in result.output


# --------------------------------------------------------- plot tradeoff


@pytest.fixture
def tradeoff_calls(monkeypatch):
    """The arguments every ``plot_tradeoff`` call gets (nothing is drawn)."""
    import lipvit.analysis.tradeoff as tradeoff

    calls = []
    monkeypatch.setattr(tradeoff, "plot_tradeoff",
                        lambda points, **kw: calls.append((list(points), kw)))
    return calls


def _tradeoff(*args: str):
    return CliRunner().invoke(main, ["plot", "tradeoff", *args])


def _smoothing_json(path, clean: float, smoothed: float | None, samples=()) -> str:
    data = {"checkpoint": None, "dataset": "digits", "n": 4,
            "clean_accuracy": clean,
            "results": [{"method": m, "eps": 0.1, "certified_accuracy": 0.25,
                         "exact": m != "smoothing"} for m in ("lofast", "smoothing")],
            "smoothing": {"sigma": SIGMA, "alpha": 0.001},
            "samples": list(samples)}
    if smoothed is not None:
        data["smoothing"]["smoothed_accuracy"] = smoothed
    path.write_text(json.dumps(data))
    return str(path)


def test_plot_tradeoff_smoothing_uses_the_smoothed_accuracy(tradeoff_calls, tmp_path):
    new = _smoothing_json(tmp_path / "new.json", clean=0.9, smoothed=0.6)
    # A file from before smoothed_accuracy: recounted from its samples.
    old = _smoothing_json(tmp_path / "old.json", clean=0.9, smoothed=None, samples=[
        {"label": y, "prediction": y, "smoothing": {"prediction": p}}
        for y, p in ((1, 1), (2, -1), (3, 3), (4, 0))])
    result = _tradeoff(new, old, "--method", "smoothing", "--eps", "0.1", "--out",
                       str(tmp_path / "f.png"))
    assert result.exit_code == 0, result.output
    (points, kw), = tradeoff_calls
    assert [(p.label, p.clean, p.certified) for p in points] == [
        ("new", 0.6, {0.1: 0.25}), ("old", 0.5, {0.1: 0.25})]
    assert kw["method"] == "smoothing"
    assert kw["clean_label"] == "smoothed classifier accuracy (certified points)"
    assert "smoothed classifier accuracy" in result.output.splitlines()[0]
    # Another method of the same file keeps the network's clean accuracy.
    tradeoff_calls.clear()
    result = _tradeoff(new, "--method", "lofast", "--eps", "0.1", "--out",
                       str(tmp_path / "g.png"))
    assert result.exit_code == 0, result.output
    assert tradeoff_calls[0][0][0].clean == 0.9


def test_plot_tradeoff_smoothing_refusals(tradeoff_calls, tmp_path):
    new = _smoothing_json(tmp_path / "new.json", clean=0.9, smoothed=0.6)
    result = _tradeoff(new, "--method", "smoothing", "--eps", "0.1", "--clean",
                       "test", "--out", str(tmp_path / "f.png"))
    assert result.exit_code == 1 and "network's test accuracy" in result.output
    bare = _smoothing_json(tmp_path / "bare.json", clean=0.9, smoothed=None)
    result = _tradeoff(bare, "--method", "smoothing", "--eps", "0.1", "--out",
                       str(tmp_path / "g.png"))
    assert result.exit_code == 1 and "no smoothed classifier accuracy" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not tradeoff_calls


def test_plot_tradeoff_from_a_certify_run(tradeoff_calls, smooth_run, tmp_path):
    out, _ = smooth_run
    data = json.loads(out.read_text())
    result = _tradeoff(str(out), "--method", "smoothing", "--eps", "0.1,0.25",
                       "--out", str(tmp_path / "f.png"))
    assert result.exit_code == 0, result.output
    (point,), _ = tradeoff_calls[0]
    assert point.clean == data["smoothing"]["smoothed_accuracy"]
    rows = {r["eps"]: r["certified_accuracy"] for r in data["results"]
            if r["method"] == "smoothing"}
    assert point.certified == rows
