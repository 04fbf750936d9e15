"""Certified training (lipvit/certified_training.py, docs/certified-training.md):
the raised logits against brute force, gradients through the double backward
pass, the ε schedule, the trainer and CLI wiring, and the refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from lipvit.certify.taylor.forward import forward

from lipvit.certified_training import CertifiedLoss, cert_eps_at, check_certifiable
from lipvit.checkpoint import load_checkpoint
from lipvit.cli import main
from lipvit.data import load_dataset
from lipvit.model import ViT
from lipvit.train import TrainConfig, margin_cross_entropy, train, train_step
from tests.conftest import nonlinear_model, tiny_config

F64 = torch.float64


def _batch(seed: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 8, 8, dtype=F64, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return x, y


def _raise(model: ViT, x: torch.Tensor, y: torch.Tensor, eps: float, stream: float):
    """``(logits, raised logits, terms)`` of one call, then the hooks removed."""
    cert = CertifiedLoss(model, stream)
    x = x.clone().requires_grad_(True)
    with cert.context():
        cert.clear()
        logits = model(x)
        raised = cert.raised_logits(logits, x, y, eps)
    cert.remove()
    return logits, raised, cert.last


@pytest.mark.parametrize("seed", range(3))
def test_first_order_term_is_the_exact_margin_gradient_norm(seed):
    """``ε‖c_j*ᵀJ‖`` against the dense Jacobian (autograd, one row per class), and
    only the strongest wrong logit is raised, by the first-order plus ReLU terms."""
    model = nonlinear_model("lipschitz", seed)
    x, y = _batch(seed)
    eps = 0.07
    logits, raised, last = _raise(model, x, y, eps, stream=0.5)
    for b in range(x.shape[0]):
        J = torch.autograd.functional.jacobian(
            lambda v, b=b: model(v.reshape(1, 1, 8, 8))[0], x[b].flatten()
        )  # (classes, 64)
        f = logits[b].detach()
        wrong = f.clone()
        wrong[y[b]] = -math.inf
        j = int(wrong.argmax())
        assert int(last["wrong"][b]) == j
        assert float(last["margin"][b]) == pytest.approx(float(f[y[b]] - f[j]))
        exact = eps * torch.linalg.vector_norm(J[j] - J[y[b]])
        assert float(last["first"][b]) == pytest.approx(float(exact), rel=1e-10)
        bump = raised[b].detach() - f
        expected = torch.zeros(10, dtype=F64)
        expected[j] = last["first"][b] + last["relu"][b]
        torch.testing.assert_close(bump, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(last["relu"], last["relu_blocks"].sum(1))


def _act_gradients(model: ViT, x: torch.Tensor, y: torch.Tensor, j: torch.Tensor):
    """The margin's gradient w.r.t. each block's ReLU output, by the certificate's
    own injection (:func:`lipvit.certify.taylor.forward.forward`), and the clean
    record."""
    with torch.no_grad():
        _, rec = forward(model, x)
    inject = {(k, "act"): torch.zeros_like(z, requires_grad=True)
              for k, z in enumerate(rec.act_in)}
    logits, _ = forward(model, x, inject)
    margin = (logits.gather(1, j[:, None]) - logits.gather(1, y[:, None])).sum()
    grads = torch.autograd.grad(margin, list(inject.values()))
    return grads, rec


@pytest.mark.parametrize("seed", range(3))
def test_relu_term_is_the_act_sites_share_bound(seed):
    """Each block's ReLU term is ``Σ |g_u,i| (‖w_i‖ρε − |z_i|)₊`` with ``g_u`` the
    ``act`` site's margin gradient of ``taylor`` (docs/taylor.md §1)."""
    model = nonlinear_model("lipschitz", seed)
    x, y = _batch(seed)
    eps, rho = 0.2, 0.8
    _, _, last = _raise(model, x, y, eps, rho)
    grads, rec = _act_gradients(model, x, y, last["wrong"])
    for k, block in enumerate(model.blocks):
        reach = rho * eps * block.mlp.fc1.weight.norm(dim=1)
        slack = (reach - rec.act_in[k].abs()).clamp_min(0)
        expected = (grads[k].abs() * slack).flatten(1).sum(1)
        assert (expected > 0).any()  # some units can flip at this radius
        torch.testing.assert_close(last["relu_blocks"][:, k], expected,
                                   rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("seed", range(3))
def test_relu_term_bounds_the_relu_remainders_brute_force(seed):
    """Lemma 2 of docs/certified-training.md: when every token at an SLL block's
    input (before ``P₂``) moves by at most ``β = ρε``, every unit's ReLU remainder
    obeys ``|r_i| ≤ (‖w_i‖β − |z_i|)₊``, so the ReLU sites' share of the margin
    drop, ``|Σ g_u,i r_i|``, is at most the block's ReLU term. Random moves of
    norm up to β per token, a quarter of them exactly β."""
    model = nonlinear_model("lipschitz", seed)
    x, y = _batch(seed, n=3)
    eps, rho = 0.15, 1.0
    beta = rho * eps
    _, _, last = _raise(model, x, y, eps, rho)
    grads, rec = _act_gradients(model, x, y, last["wrong"])
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for k, block in enumerate(model.blocks):
            z = rec.act_in[k]  # (B, N, m)
            X_mid = rec.stream[2 * k + 1]  # P₂'s input
            reach = beta * block.mlp.fc1.weight.norm(dim=1)
            bound = (reach - z.abs()).clamp_min(0)
            worst = torch.zeros(x.shape[0], dtype=F64)
            for trial in range(200):
                move = torch.randn(X_mid.shape, dtype=F64, generator=g)
                move = move / move.norm(dim=-1, keepdim=True)
                scale = 1.0 if trial % 4 == 0 else torch.rand(
                    *X_mid.shape[:2], 1, dtype=F64, generator=g)
                z2 = block.mlp.fc1(block.norm2(X_mid + beta * scale * move))
                r = torch.relu(z2) - torch.relu(z) - (z > 0).to(F64) * (z2 - z)
                assert torch.all(r.abs() <= bound + 1e-12)
                share = (grads[k] * r).flatten(1).sum(1).abs()
                worst = torch.maximum(worst, share)
            assert torch.all(worst <= last["relu_blocks"][:, k] + 1e-12)
            assert worst.max() > 0  # the moves did flip units


def test_gradients_flow_through_the_double_backward_pass():
    """The raised logits are differentiable in the weights through the
    first-order term (a second derivative): finite differences agree, and every
    block's weights get a gradient from the bump alone."""
    model = nonlinear_model("lipschitz", 0)
    x, y = _batch(0)
    cert = CertifiedLoss(model, 0.5)
    bias = model.blocks[0].mlp.fc1.bias

    def bump_sum(b: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            bias.copy_(b)
        xr = x.clone().requires_grad_(True)
        with cert.context():
            cert.clear()
            logits = model(xr)
            raised = cert.raised_logits(logits, xr, y, 0.1)
        return (raised - logits).sum()

    b0 = bias.detach().clone()
    model.zero_grad()
    bump_sum(b0).backward()
    grad = bias.grad.clone()
    for p in (model.patch_embed.proj.parametrizations.weight.original,
              model.blocks[0].attn.qkv.parametrizations.weight.original,
              model.blocks[1].mlp.fc1.weight, model.blocks[1].mlp.log_q):
        assert p.grad is not None and p.grad.abs().sum() > 0
        assert torch.isfinite(p.grad).all()
    h = 1e-6
    for i in range(0, b0.numel(), 5):
        e = torch.zeros_like(b0)
        e[i] = h
        fd = (bump_sum(b0 + e).detach() - bump_sum(b0 - e).detach()) / (2 * h)
        assert float(grad[i]) == pytest.approx(float(fd), rel=1e-4, abs=1e-8)
    cert.remove()


def test_eps_schedule():
    """Linear from ε/ramp at step 0 to ε at step ramp − 1, then ε; warm-up 0 is ε
    at once."""
    total, eps = 100, 0.1
    assert cert_eps_at(0, total, eps, 0.25) == pytest.approx(eps / 25)
    assert cert_eps_at(11, total, eps, 0.25) == pytest.approx(eps * 12 / 25)
    assert cert_eps_at(24, total, eps, 0.25) == pytest.approx(eps)
    assert all(cert_eps_at(s, total, eps, 0.25) == eps for s in range(25, 100))
    values = [cert_eps_at(s, total, eps, 0.25) for s in range(total)]
    assert values == sorted(values)
    assert all(cert_eps_at(s, total, eps, 0.0) == eps for s in range(total))
    assert cert_eps_at(99, total, eps, 1.0) == pytest.approx(eps)


@pytest.fixture(scope="module")
def digits_data():
    return load_dataset("digits")


def test_trainer_combines_cert_eps_msvp_and_relu_stability(tmp_path, digits_data):
    """Two epochs with all three: the epoch log carries the MSVP penalty, the
    unstable fraction and the certified-training radius (the schedule's value at
    the epoch's last step) and surrogate-certified fraction; the checkpoint
    keeps the settings, and a resumed run continues the schedule."""
    data = digits_data
    cfg = tiny_config("lipschitz", mean=data.mean, std=data.std)
    tc = TrainConfig(epochs=2, batch_size=256, lr=5e-3, loss_scale=128.0,
                     msvp=(1e-3, 1e-3, 1e-3), relu_stability=0.2, cert_eps=0.1,
                     cert_warmup=0.5, device="cpu")
    out = tmp_path / "m.pt"
    summary = train(cfg, tc, data, out, progress=False)
    steps = data.x_train.shape[0] // 256
    for epoch, h in enumerate(summary["history"], start=1):
        assert h["msvp_penalty"] > 0 and h["relu_unstable"] is not None
        assert h["cert_eps"] == pytest.approx(
            cert_eps_at(epoch * steps - 1, 2 * steps, 0.1, 0.5))
        assert 0 <= h["cert_acc"] <= h["train_acc"]
        assert math.isfinite(h["loss"])
    assert summary["history"][-1]["cert_eps"] == pytest.approx(0.1)
    ckpt = load_checkpoint(out)
    assert ckpt.raw["train_config"]["cert_eps"] == 0.1
    assert TrainConfig.from_dict(ckpt.raw["train_config"]) == tc
    # no hooks left behind on the saved model's modules
    assert not any(m._forward_hooks for m in ckpt.model.modules())
    longer = TrainConfig(**{**tc.to_dict(), "epochs": 3, "msvp": tc.msvp})
    with pytest.raises(Exception, match="training settings differ"):
        train(cfg, longer, data, out, resume=True, progress=False)


def test_training_lowers_the_charged_margin_drop(tmp_path, digits_data):
    """Three epochs of the tiny model with and without ``cert_eps`` (same seed and
    schedule): on test images the raise ``D`` at ε = 0.1 (first-order plus ReLU
    terms) ends well below plain training's, its ReLU part far below (measured:
    D 5.8e-4 → 1.2e-4, ReLU term 1.0e-4 → 5.8e-6). The tiny model is barely
    trained after three epochs; what the loss buys in certificates is measured on
    digits-small in docs/results/certified-training.md."""
    data = digits_data
    cfg = tiny_config("lipschitz", mean=data.mean, std=data.std)
    x, y = data.x_test[:300].double(), data.y_test[:300]
    terms = {}
    for eps in (0.0, 0.1):
        tc = TrainConfig(epochs=3, batch_size=64, lr=5e-3, loss_scale=128.0,
                         cert_eps=eps, device="cpu")
        out = tmp_path / f"m{eps}.pt"
        train(cfg, tc, data, out, progress=False)
        model = load_checkpoint(out).model.double().eval()
        _, _, last = _raise(model, x, y, 0.1, tc.cert_stream)
        terms[eps] = (float((last["first"] + last["relu"]).median()),
                      float(last["relu"].median()))
    assert terms[0.1][0] < 0.5 * terms[0.0][0]
    assert terms[0.1][1] < 0.25 * terms[0.0][1]


@pytest.mark.parametrize("mix", [0.0, 0.3, 1.0])
def test_cert_mix_weighs_the_certified_and_the_plain_loss(mix):
    """``cert_mix = κ``: the step's loss is ``κ CE(raised) + (1 − κ) CE(plain)``,
    each term computed on its own from the same weights and batch."""
    model = nonlinear_model("lipschitz", 0).float().train()
    x = torch.rand(8, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.arange(8) % 10
    cfg = TrainConfig(cert_eps=0.1, cert_mix=mix, loss_scale=4.0, device="cpu")
    cert = CertifiedLoss(model, cfg.cert_stream)
    cert.clear()
    xg = x.clone().requires_grad_(True)
    with cert.context():
        logits = model(xg)
        raised = cert.raised_logits(logits, xg, y, 0.1)
    expect = (mix * margin_cross_entropy(raised, y, 4.0, 0.0, 0.0)
              + (1 - mix) * margin_cross_entropy(logits, y, 4.0, 0.0, 0.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loss, _, _ = train_step(model, opt, x, y, cfg, cert=cert, cert_eps=0.1)
    assert loss.item() == pytest.approx(expect.item(), rel=1e-5)
    assert (raised > logits).any()  # the two terms differ


def test_checkpoints_from_before_cert_eps_resume(tmp_path, digits_data):
    """A checkpoint whose training settings predate the cert_* fields was trained
    without the loss, as their defaults say: resuming it is not refused, while a
    run asking for cert_eps is."""
    data = digits_data
    cfg = tiny_config("lipschitz", mean=data.mean, std=data.std)
    tc = TrainConfig(epochs=1, batch_size=512, lr=5e-3, loss_scale=128.0,
                     device="cpu")
    out = tmp_path / "old.pt"
    train(cfg, tc, data, out, progress=False)
    raw = torch.load(out, weights_only=False)
    for key in ("cert_eps", "cert_warmup", "cert_stream", "cert_mix"):
        del raw["train_config"][key]
    torch.save(raw, out)
    longer = TrainConfig(**{**tc.to_dict(), "epochs": 2, "msvp": tc.msvp})
    with pytest.raises(Exception, match="training settings differ \\(epochs\\)"):
        train(cfg, longer, data, out, resume=True, progress=False)
    summary = train(cfg, tc, data, out, resume=True, progress=False)
    assert len(summary["history"]) == 1
    certified = TrainConfig(**{**tc.to_dict(), "cert_eps": 0.1, "msvp": tc.msvp})
    with pytest.raises(Exception, match="training settings differ \\(cert_eps\\)"):
        train(cfg, certified, data, out, resume=True, progress=False)


# ---------------------------------------------------------------- refusals


def test_config_refusals():
    for bad in (-0.1, math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="cert_eps must be a finite number >= 0"):
            TrainConfig(cert_eps=bad)
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="cert_warmup"):
            TrainConfig(cert_warmup=bad)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="cert_stream"):
            TrainConfig(cert_stream=bad)
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="cert_mix must lie in"):
            TrainConfig(cert_mix=bad)
    with pytest.raises(ValueError, match="needs the lipschitz family"):
        check_certifiable(ViT(tiny_config("standard")))
    with pytest.raises(ValueError, match="needs the lipschitz family"):
        CertifiedLoss(ViT(tiny_config("standard")), 0.5)
    for bad in (0.0, math.nan):
        with pytest.raises(ValueError, match="cert_stream"):
            CertifiedLoss(ViT(tiny_config("lipschitz")), bad)


TINY = ["--embed-dim", "16", "--depth", "1", "--num-heads", "2", "--epochs", "1",
        "--batch-size", "256", "--no-progress"]


def _one_line_error(result, text: str) -> None:
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error"), result.output
    assert text in lines[0], result.output


@pytest.mark.parametrize("eps,text", [
    ("-0.1", "cert_eps must be a finite number >= 0, got -0.1"),
    ("nan", "cert_eps must be a finite number >= 0, got nan"),
    ("inf", "cert_eps must be a finite number >= 0, got inf"),
])
def test_cli_refuses_bad_eps_in_one_line(tmp_path: Path, eps: str, text: str):
    out = tmp_path / "m.pt"
    result = CliRunner().invoke(main, ["train", "--family", "lipschitz", *TINY,
                                       "--cert-eps", eps, "--out", str(out)])
    _one_line_error(result, text)
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_the_standard_family_in_one_line(tmp_path: Path):
    out = tmp_path / "m.pt"
    result = CliRunner().invoke(main, ["train", "--family", "standard", *TINY,
                                       "--cert-eps", "0.1", "--out", str(out)])
    _one_line_error(result, "cert_eps needs the lipschitz family")
    assert list(tmp_path.iterdir()) == []


def test_cli_trains_with_cert_eps_msvp_and_relu_stability(tmp_path: Path):
    out = tmp_path / "m.pt"
    result = CliRunner().invoke(main, [
        "train", "--family", "lipschitz", *TINY, "--msvp", "1e-3",
        "--relu-stability", "0.2", "--cert-eps", "0.1", "--cert-warmup", "0",
        "--cert-stream", "0.5", "--cert-mix", "0.5", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "cert " in result.output and "@ 0.1" in result.output
    assert "unstable" in result.output
    tc = load_checkpoint(out).raw["train_config"]
    assert (tc["cert_eps"], tc["cert_warmup"], tc["cert_stream"]) == (0.1, 0.0, 0.5)
    assert tc["cert_mix"] == 0.5
    assert tc["relu_stability"] == 0.2 and tc["msvp"] == [1e-3] * 3


# ---------------------------------------------------------------- trade-off figure


def _certify_json(path: Path, clean: float, certified: dict[float, float],
                  checkpoint: str | None = None) -> Path:
    import json

    data = {"checkpoint": checkpoint, "dataset": "digits", "n": 100,
            "clean_accuracy": clean,
            "results": [{"method": "taylor", "eps": e, "certified_accuracy": a,
                         "exact": True} for e, a in certified.items()],
            "samples": []}
    path.write_text(json.dumps(data))
    return path


def test_plot_tradeoff_one_point_per_setting(tmp_path: Path):
    from lipvit.analysis.tradeoff import TradeoffPoint, plot_tradeoff

    files = [_certify_json(tmp_path / "plain.json", 0.94, {0.05: 0.89, 0.1: 0.34}),
             _certify_json(tmp_path / "cert.json", 0.93, {0.05: 0.88, 0.1: 0.80})]
    out = tmp_path / "fig.png"
    result = CliRunner().invoke(main, [
        "plot", "tradeoff", *map(str, files), "--eps", "0.05,0.1", "--label", "plain",
        "--label", "--cert-eps 0.1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 0
    table = result.output.splitlines()
    assert table[0].split()[:2] == ["setting", "clean"]
    assert "0.3400" in result.output and "0.8000" in result.output
    fig = plot_tradeoff([TradeoffPoint("a", 0.94, {0.05: 0.89, 0.1: 0.34}),
                         TradeoffPoint("b", 0.86, {0.05: 0.82, 0.1: 0.74})],
                        method="taylor")
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    assert 0.8 < lo < 0.86 and 0.94 < hi < 1.0  # fitted to the data
    lo, hi = ax.get_ylim()
    assert 0.2 < lo < 0.34 and 0.89 < hi <= 1.0
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "a", "b", "ε = 0.05", "ε = 0.1"]
    points = [(float(ln.get_xdata()[0]), float(ln.get_ydata()[0]))
              for ln in ax.get_lines() if ln.get_marker() not in (None, "None", "")]
    assert sorted(points) == sorted([(0.94, 0.89), (0.94, 0.34), (0.86, 0.82),
                                     (0.86, 0.74)])
    assert len(ax.texts) == 0  # no two ε of a setting share a point


def test_plot_tradeoff_names_coinciding_eps():
    """A setting that certifies nothing puts every ε on one point: the figure
    says so in words, and only there."""
    from lipvit.analysis.tradeoff import TradeoffPoint, plot_tradeoff

    fig = plot_tradeoff([TradeoffPoint("plain", 0.86, {0.05: 0.66, 0.1: 0.15, 0.25: 0}),
                         TradeoffPoint("margin", 0.87, {0.05: 0, 0.1: 0, 0.25: 0})],
                        method="taylor")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["ε = 0.05, 0.1, 0.25: all 0%"]


def test_plot_tradeoff_test_accuracy_and_refusals(tmp_path: Path):
    import json

    ckpt = tmp_path / "m.pt"
    (tmp_path / "m.json").write_text(json.dumps({"test_acc": 0.925}))
    f = _certify_json(tmp_path / "c.json", 0.94, {0.1: 0.8}, checkpoint=str(ckpt))
    out = tmp_path / "fig.png"
    ok = CliRunner().invoke(main, ["plot", "tradeoff", str(f), "--eps", "0.1",
                                   "--clean", "test", "--out", str(out)])
    assert ok.exit_code == 0 and "0.9250" in ok.output, ok.output
    out.unlink()
    bad = [
        (["--eps", "0.2"], "no taylor result at eps 0.2"),
        (["--eps", "0.1", "--label", "a", "--label", "b"], "--label given 2 times"),
        (["--eps", "0.1", "--method", "lofast"], "no lofast result at eps 0.1"),
    ]
    for args, text in bad:
        result = CliRunner().invoke(main, ["plot", "tradeoff", str(f), *args,
                                           "--out", str(out)])
        _one_line_error(result, text)
        assert not out.exists()
    g = _certify_json(tmp_path / "d.json", 0.94, {0.1: 0.8})
    result = CliRunner().invoke(main, ["plot", "tradeoff", str(g), "--eps", "0.1",
                                       "--clean", "test", "--out", str(out)])
    _one_line_error(result, "no training summary")
