"""End-to-end bounds and certification: soundness against attacks on whole networks."""

from __future__ import annotations

import math

import pytest
import torch
import torchattacks
from lipvit.analysis.pgd import pgd_deviation
from lipvit.certify.certification import certified_radius, is_certified, margin
from lipvit.certify.evaluate import certify_samples
from lipvit.certify.lofast.layer import zeta_cls
from lipvit.certify.lofast.network import network_bound

import lipvit
from lipvit.checkpoint import load_checkpoint


@pytest.fixture(scope="module", params=["lipschitz", "standard"])
def trained(request, trained_ckpts):
    """The session's trained digits-tiny model of each family, in float64."""
    return load_checkpoint(trained_ckpts[request.param]).model.double()


def _random_model(family: str, seed: int, qk_scale: float = 1.0, **kw) -> lipvit.ViT:
    torch.manual_seed(seed)
    cfg = lipvit.preset("digits-tiny", family=family, **kw)
    model = lipvit.ViT(cfg).double().eval()
    with torch.no_grad():
        for block in model.blocks:
            W = (
                block.attn.qkv.parametrizations.weight.original
                if family == "lipschitz"
                else block.attn.qkv.weight
            )
            D = W.shape[1]
            W[: 2 * D] *= qk_scale * 20  # large ‖W_q W_kᵀ‖: δ2 terms matter
            W[2 * D :] *= 20  # push W_v to its cap
    return model


# fmnist-3x64's lipschitz attention: projection radius 8, caps 1 (not LoFAST's 1, 0.5).
FMNIST_ATTENTION = {"attn_radius": 8.0, "v_cap": 1.0, "o_cap": 1.0}


@pytest.fixture(scope="module")
def delta_out_pgd() -> dict:
    """PGD's lower bounds on ``δ_out`` by (family, kw, seed, ε), shared by the
    bound methods (pgd_deviation is deterministic: a private seeded generator)."""
    return {}


@pytest.mark.parametrize(("family", "kw"), [("lipschitz", {}), ("standard", {}),
                                            ("lipschitz", FMNIST_ATTENTION)])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("method", ["lofast", "specformer"])
def test_delta_out_bounds_pgd_on_whole_network(family, kw, seed, method, digits,
                                              delta_out_pgd):
    model = _random_model(family, seed, qk_scale=1.0 + seed, **kw)
    x = digits.x_test[seed * 4 : (seed + 1) * 4].double()
    bound = network_bound(model, x, method)
    for eps in (0.01, 0.1, 0.5):
        # The attack does not depend on the bound method: both methods are
        # checked against the same PGD (same model, points, ε and seed), run once.
        key = (family, tuple(sorted(kw.items())), seed, eps)
        if key not in delta_out_pgd:
            delta_out_pgd[key] = pgd_deviation(model, x, eps, steps=60, restarts=3,
                                               seed=seed)
        lower = delta_out_pgd[key]
        upper = bound.delta_out(eps)
        assert torch.all(lower <= upper * (1 + 1e-9)), (eps, lower, upper)


def test_trace_is_monotone_in_eps(digits):
    model = _random_model("lipschitz", 0)
    bound = network_bound(model, digits.x_test[:6].double())
    eps = torch.linspace(0, 1, 21, dtype=torch.float64)
    d = torch.stack([bound.delta_out(float(e)) for e in eps], dim=1)  # (B, 21)
    assert torch.all(d[:, 1:] >= d[:, :-1])
    assert torch.all(d[:, 0] == 0)


def test_fast_method_is_labelled_and_close(digits):
    model = _random_model("lipschitz", 3)
    x = digits.x_test[:4].double()
    exact = network_bound(model, x, "lofast")
    fast = network_bound(model, x, "lofast-fast")
    assert exact.exact and not fast.exact
    # Power iteration converges from below to the exact values.
    d_exact, d_fast = exact.delta_out(0.1), fast.delta_out(0.1)
    assert torch.all(d_fast <= d_exact * (1 + 1e-6))
    # Within the network's power-iteration budget (POWER_ITERATIONS, tol 1e-7).
    assert torch.allclose(d_fast, d_exact, rtol=5e-3)


def test_bad_eps_and_method(digits):
    model = _random_model("lipschitz", 0)
    bound = network_bound(model, digits.x_test[:2].double())
    for eps in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            bound.delta_out(eps)
    with pytest.raises(ValueError, match="unknown bound method"):
        network_bound(model, digits.x_test[:2].double(), "magic")


@pytest.mark.parametrize("seed", range(4))
def test_zeta_cls_is_the_exact_norm(seed):
    g = torch.Generator().manual_seed(seed)
    B, H, N, D = 2, 3, 5, 4
    P = torch.softmax(torch.randn(B, H, N, N, generator=g, dtype=torch.float64) * 3, -1)
    W_vo = torch.randn(H, D, D, generator=g, dtype=torch.float64)
    z_cls = zeta_cls(P, W_vo)
    for b in range(B):
        def row(G, b=b):  # Γ (N, D) ↦ Σ_h P_h[0] Γ W_vo[h], shape (D,)
            return torch.einsum("hn,nD,hDE->E", P[b, :, 0], G, W_vo)

        J = torch.func.jacrev(row)(torch.zeros(N, D, dtype=torch.float64))  # (D, N, D)
        exact = torch.linalg.matrix_norm(J.reshape(D, N * D), ord=2)
        assert torch.isclose(z_cls[b], exact, rtol=1e-10)


def test_margin_and_radius_closed_form():
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]], dtype=torch.float64)
    y = torch.tensor([0, 0])
    m = margin(logits, y)
    assert m.tolist() == [2.0, -2.0]
    # δ_out(ε) = 4ε: certified iff 2 > √2·4ε, i.e. ε < 1/(2√2).
    r = certified_radius(m, lambda e: 4 * e, rtol=0, tol=1e-6)
    assert r[1] == 0
    assert abs(float(r[0]) - 1 / (2 * math.sqrt(2))) < 2e-6
    assert r[0] <= 1 / (2 * math.sqrt(2))
    assert bool(is_certified(m[:1], 4 * r[:1]))


def test_radii_agree_with_per_eps_certificates(trained, digits):
    """acc@r≥ε equals certified accuracy at every listed ε (per sample), and at
    other ε lies between certified accuracy at ε and at ε(1 − rtol)."""
    model = trained
    x, y = digits.x_test[:48].double(), digits.y_test[:48]
    bound = network_bound(model, x)
    m = margin(bound.logits, y)
    free = certified_radius(m, bound.delta_out)
    pos = free[free > 0]
    assert pos.numel() >= 3
    eps_list = [float(q) for q in pos.quantile(torch.tensor([0.25, 0.5, 0.75],
                                                            dtype=pos.dtype))]
    rtol = 1e-3
    report = certify_samples(model, x, y, ["lofast"], eps_list, radius=True,
                             radius_tol=rtol)
    r = report.radii["lofast"]
    for eps in eps_list:
        cert = report.certified[f"lofast@{eps}"]
        assert torch.equal(r >= eps, cert)
        assert float((r >= eps).float().mean()) == pytest.approx(
            [x.certified_accuracy for x in report.results if x.eps == eps][0])
    for eps in (float(pos.min()) * 1.7, float(pos.median()) * 1.01):  # not listed
        cert = is_certified(m, bound.delta_out(eps))
        assert torch.all(cert[r >= eps])  # acc@r≥ε ≤ certified accuracy at ε
        assert torch.all(r[cert] >= eps * (1 - rtol))  # equal up to the tolerance
    assert torch.all(is_certified(m, bound.delta_out(r))[r > 0])  # r is certified


def _attack_l2(model, x, y, eps, seed=0):
    """Strongest of torchattacks PGDL2 (restarts) and a margin PGD: adversarial x'."""
    torch.manual_seed(seed)
    atk = torchattacks.PGDL2(
        model, eps=eps, alpha=eps / 8, steps=100, random_start=True
    )
    atk.set_model_training_mode(model_training=False)
    best = x.clone()
    best_margin = margin(model(x), y)
    for _ in range(3):
        adv = atk(x.float(), y).to(x.dtype)
        # torchattacks clips to [0, 1]: that is inside the ℓ2 ball (a subset), fine.
        assert torch.all((adv - x).flatten(1).norm(dim=1) <= eps * (1 + 1e-5))
        m = margin(model(adv), y)
        better = m < best_margin
        best[better], best_margin[better] = adv[better], m[better]
    return best, best_margin


def test_certified_points_survive_attacks(trained, digits):
    model = trained
    x, y = digits.x_test[:64].double(), digits.y_test[:64]
    bound = network_bound(model, x)
    radii = certified_radius(margin(bound.logits, y), bound.delta_out)
    assert (radii > 0).sum() >= 3, "the model should certify some points"
    # A budget at which some, not all, certified points hold (from the data).
    eps = float(radii[radii > 0].median())
    report = certify_samples(model, x, y, ["lofast", "lofast-fast"], [eps])
    cert = report.certified[f"lofast@{eps}"]
    assert cert.sum() > 0
    xs, ys = x[cert], y[cert]
    _, worst = _attack_l2(model.float(), xs.float(), ys, eps)
    model.double()
    assert torch.all(worst > 0), "a certified point was broken by PGD"
    m = margin(model(xs), ys)
    lower = pgd_deviation(model, xs, eps, steps=60, restarts=2)
    assert torch.all(lower <= network_bound(model, xs).delta_out(eps))
    assert torch.all(m > math.sqrt(2) * lower)


def test_certified_radius_is_sound(trained, digits):
    model = trained
    x, y = digits.x_test[:32].double(), digits.y_test[:32]
    bound = network_bound(model, x)
    m = margin(bound.logits, y)
    r = certified_radius(m, bound.delta_out, rtol=0, tol=1e-4)
    pos = r > 0
    assert torch.all(is_certified(m, bound.delta_out(r))[pos])
    assert torch.all(~is_certified(m, bound.delta_out(r + 2e-4)) | (r >= 10.0))
    if pos.any():
        radius = float(r[pos].min())
        _, worst = _attack_l2(model.float(), x[pos].float(), y[pos], radius)
        model.double()
        assert torch.all(worst > 0)


def test_report_counts_and_exact_flags(trained, digits):
    x, y = digits.x_test[:16].double(), digits.y_test[:16]
    report = certify_samples(
        trained,
        x,
        y,
        ["lofast", "lofast-fast", "specformer"],
        [0.01, 0.05],
        radius=True,
    )
    assert report.n == 16 and len(report.results) == 6
    for r in report.results:
        assert r.exact == (r.method != "lofast-fast")
        assert 0 <= r.certified_accuracy <= report.clean_accuracy
        assert r.seconds_per_sample > 0
    # A larger ε never certifies more; SpecFormer never beats LoFAST here.
    c = report.certified
    assert torch.all(c["lofast@0.05"] <= c["lofast@0.01"])
    assert c["specformer@0.01"].sum() <= c["lofast@0.01"].sum()
    assert set(report.radii) == {"lofast", "lofast-fast", "specformer"}
