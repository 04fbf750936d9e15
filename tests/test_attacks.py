"""Tests for lipvit.analysis.attacks: robust accuracy through torchattacks, tiny ViT."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lipvit.analysis import attacks as A

import lipvit

pytest.importorskip("torchattacks")


@pytest.fixture(scope="module")
def trained(digits):
    """A standard digits-tiny ViT trained 100 steps, and 64 test points."""
    torch.manual_seed(0)
    data = digits
    model = lipvit.ViT(lipvit.preset("digits-tiny", family="standard"))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        i = torch.randint(0, data.x_train.shape[0], (128,), generator=g)
        loss = F.cross_entropy(model(data.x_train[i]), data.y_train[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model, data.x_test[:64], data.y_test[:64]


def test_trained_model_is_accurate(trained):
    model, x, y = trained
    with torch.no_grad():
        assert (model(x).argmax(1) == y).float().mean() > 0.7


@pytest.mark.parametrize(("norm", "names", "eps"), [
    ("linf", ["fgsm", "pgd", "cw-pgd"], 8 / 255),
    ("l2", ["pgd-l2", "apgd"], 0.5),
])
def test_attacks_lower_accuracy(trained, norm, names, eps):
    model, x, y = trained
    r = A.robust_accuracy(model, x, y, names, eps, norm)
    for name in names:
        assert r.robust_accuracy[name] < r.clean_accuracy - 0.05, name
        assert r.rejected[name] == 0
    assert r.worst_case_accuracy <= min(r.robust_accuracy.values())


def test_per_sample_consistency(trained):
    model, x, y = trained
    r = A.robust_accuracy(model, x, y, ["pgd-l2", "cw"], 0.4, "l2")
    assert r.n == 64 and r.attacks == ("pgd-l2", "cw")
    with torch.no_grad():
        clean = (model(x).argmax(1) == y).numpy()
    np.testing.assert_array_equal(r.clean_correct, clean)
    for name, c in r.correct.items():
        assert c.dtype == bool and c.shape == (64,)
        assert not np.any(c & ~r.clean_correct), name  # robust ⇒ clean correct
        assert r.robust_accuracy[name] <= r.clean_accuracy
    np.testing.assert_array_equal(r.worst_case, r.correct["pgd-l2"] & r.correct["cw"])
    assert r.worst_case_accuracy <= min(r.robust_accuracy.values())


@pytest.mark.parametrize(("name", "norm", "eps"), [
    ("fgsm", "linf", 4 / 255), ("pgd", "linf", 4 / 255), ("cw-pgd", "linf", 4 / 255),
    ("pgd-l2", "l2", 0.3), ("apgd", "l2", 0.3), ("apgd", "linf", 8 / 255),
])
def test_adversarial_points_lie_in_the_ball(trained, name, norm, eps):
    """APGD returns the clean point where it finds no adversarial one, so its
    ε gives it a few successes; the seed makes the random starts independent
    of the tests run before."""
    model, x, y = trained
    torch.manual_seed(0)
    x_adv = A.perturb(model, x[:32], y[:32], name, eps, norm, steps=5)
    assert x_adv.shape == x[:32].shape
    assert torch.all(A.admissible(x[:32], x_adv, eps, norm))
    assert float(x_adv.min()) >= 0 and float(x_adv.max()) <= 1
    dist = A.perturbation_norm(x_adv - x[:32], norm)
    assert float(dist.max()) <= eps * (1 + 1e-5) + 1e-6
    assert float(dist.max()) > 0.5 * eps  # it actually moved


def test_admissible_rejects_points_outside():
    x = torch.full((2, 1, 2, 2), 0.5)
    x_adv = x.clone()
    x_adv[0, 0, 0, 0] += 0.2  # ℓ2 = ℓ∞ = 0.2
    x_adv[1] = 0.5 + 0.09  # ℓ∞ 0.09, ℓ2 0.18
    np.testing.assert_array_equal(A.admissible(x, x_adv, 0.1, "linf"), [False, True])
    np.testing.assert_array_equal(A.admissible(x, x_adv, 0.19, "l2"), [False, True])
    out_of_box = x.clone()
    out_of_box[0, 0, 0, 0] = 1.05
    assert not A.admissible(x, out_of_box, 1.0, "linf")[0]


def test_cw_success_counts_only_within_eps(trained):
    # CW has no ε ball: a sample counts as broken iff CW's point is
    # misclassified AND within ε. CW is deterministic, so perturb reproduces it.
    model, x, y = trained
    x, y = x[:24], y[:24]
    x_adv = A.perturb(model, x, y, "cw", 1.0, "l2", steps=30)
    with torch.no_grad():
        clean = model(x).argmax(1) == y
        fooled = model(x_adv).argmax(1) != y
    dist = A.perturbation_norm(x_adv - x, "l2")
    found = (clean & fooled).numpy()
    assert found.sum() >= 4
    eps = float(torch.quantile(dist[clean & fooled], 0.5))
    r = A.robust_accuracy(model, x, y, ["cw"], eps, "l2", steps=30)
    broken = clean.numpy() & ~r.correct["cw"]
    expected = found & (dist.numpy() <= eps * (1 + 1e-5) + 1e-6 * 8)
    np.testing.assert_array_equal(broken, expected)
    assert r.rejected["cw"] == int((found & ~expected).sum()) > 0


@pytest.mark.parametrize(("norm", "ta_norm"), [("linf", "Linf"), ("l2", "L2")])
def test_autoattack_has_the_original_counts(trained, norm, ta_norm):
    import torchattacks

    model = trained[0]
    atk = A.build_attack("autoattack", model, 8 / 255, norm, n_classes=10)
    assert isinstance(atk, torchattacks.AutoAttack)
    assert atk.version == "standard" and atk.norm == ta_norm and atk.eps == 8 / 255
    parts = atk._autoattack.attacks
    assert [type(p).__name__ for p in parts] == ["APGD", "APGDT", "FAB", "Square"]
    apgd, apgdt, fab, square = parts
    # Croce & Hein (2020): 100 iterations, 1 restart, 9 target classes, 5000 queries.
    assert apgd.steps == apgdt.steps == fab.steps == 100
    assert all(p.n_restarts == 1 for p in parts)
    assert apgd.loss == "ce" and apgd.eot_iter == 1 and apgd.thr_decr == 0.75
    assert apgdt.n_target_classes == fab.n_target_classes == 9 and fab.multi_targeted
    assert square.n_queries == 5000
    assert all(p.norm == ta_norm and p.eps == 8 / 255 for p in parts)
    few = A.build_attack("autoattack", model, 0.1, norm, n_classes=4)
    assert few._autoattack.attacks[1].n_target_classes == 3


def test_autoattack_runs_and_is_at_least_as_strong_as_pgd(trained):
    # A large ℓ2 ball: APGD-CE breaks every point, so the ensemble stops early.
    model, x, y = trained
    r = A.robust_accuracy(model, x[:6], y[:6], ["pgd-l2", "autoattack"], 3.0, "l2")
    assert r.robust_accuracy["autoattack"] == 0.0
    assert r.rejected["autoattack"] == 0
    assert r.worst_case_accuracy == 0.0


def test_presets_follow_specformer():
    st, at = A.ATTACK_PRESETS["specformer-st"], A.ATTACK_PRESETS["specformer-at"]
    assert st.attacks == ("fgsm", "pgd") and st.norm == "linf"
    assert math.isclose(st.eps, 2 / 255) and st.settings["steps"] == 2
    assert at.attacks == ("pgd", "cw-pgd", "autoattack") and at.norm == "linf"
    assert math.isclose(at.eps, 8 / 255) and at.settings["steps"] == 20
    for preset in (st, at):
        A.resolve_settings(preset.attacks, preset.norm, **preset.settings)


def test_seeded_and_global_rng_untouched(trained):
    model, x, y = trained
    state = torch.random.get_rng_state()
    a = A.perturb(model, x[:16], y[:16], "pgd", 4 / 255, "linf", steps=3, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = A.perturb(model, x[:16], y[:16], "pgd", 4 / 255, "linf", steps=3, seed=5)
    c = A.perturb(model, x[:16], y[:16], "pgd", 4 / 255, "linf", steps=3, seed=6)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_restarts_only_remove_survivors(trained):
    model, x, y = trained
    one = A.robust_accuracy(model, x, y, ["pgd"], 3 / 255, "linf", steps=3)
    three = A.robust_accuracy(model, x, y, ["pgd"], 3 / 255, "linf", steps=3,
                              restarts=3)
    # restart 0 uses the same seed, so survivors of three restarts survived one.
    assert not np.any(three.correct["pgd"] & ~one.correct["pgd"])


def test_margin_closed_form():
    logits = torch.tensor([[3.0, 1.0, 2.0], [0.0, 5.0, -1.0]])
    labels = torch.tensor([0, 2])
    torch.testing.assert_close(A.margin(logits, labels), torch.tensor([-1.0, 6.0]))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"attacks": ["foo"]}, "unknown attack"),
    ({"attacks": ["pgd-l2"]}, "does not attack in linf"),
    ({"attacks": ["pgd"], "norm": "l1"}, "norm must be"),
    ({"eps": -0.1}, "eps"),
    ({"eps": float("nan")}, "eps"),
    ({"stepz": 3}, "unknown attack settings"),
    ({"steps": 0}, "steps"),
    ({"attacks": []}, "at least one"),
    ({"attacks": ["pgd", "pgd"]}, "twice"),
])
def test_bad_inputs(trained, kwargs, match):
    model, x, y = trained
    args = {"attacks": ["pgd"], "eps": 0.1, "norm": "linf", **kwargs}
    with pytest.raises(ValueError, match=match):
        A.robust_accuracy(model, x[:2], y[:2], **args)


def test_images_must_be_in_unit_box(trained):
    model, x, y = trained
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        A.robust_accuracy(model, x[:2] * 3, y[:2], ["pgd"], 0.1)


def test_attacks_compute_a_parametrised_models_weights_once():
    """An attack on a lipschitz CaiT (spectral and orthogonal parametrisations)
    computes its weights once (``fixed_weights``), finds the same points as
    with the weights recomputed at every forward pass (to rounding: without
    autograd on the weights some kernels differ), and leaves the
    parameters as it found them."""
    from test_ball import cait_config
    from torch.nn.utils import parametrize

    from lipvit.cait import LipschitzCaiT

    torch.manual_seed(0)
    model = LipschitzCaiT(cait_config(8)).double().eval()
    x = torch.rand(4, 1, 8, 8, dtype=torch.float64)
    y = model(x).argmax(dim=1)
    conv = model.stem[0].parametrizations.weight
    calls = []
    hook = conv.register_forward_hook(lambda *_: calls.append(1))
    try:
        fixed = A.perturb(model, x, y, "pgd-l2", 0.5, "l2", steps=5, seed=1)
        once = len(calls)
        calls.clear()
        plain = A.perturb.__wrapped__(model, x, y, "pgd-l2", 0.5, "l2", steps=5, seed=1)
    finally:
        hook.remove()
    assert once == 1 and len(calls) >= 5  # one a step
    assert torch.allclose(fixed, plain, rtol=0, atol=1e-12)  # the same to rounding
    assert all(q.requires_grad for q in model.parameters())
    assert not parametrize._cache_enabled
