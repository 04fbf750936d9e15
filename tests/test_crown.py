"""Tests for lipvit.certify.crown.verifiable, .lirpa_compat and .crown (CROWN backend).

The verifiable-model tests need no auto_LiRPA. The bound tests (marked
``crown``) are skipped when auto_LiRPA cannot be imported; they check CROWN's
bounds against closed forms (a linear model), against sampled points of the ℓ2
ball and against PGD (torchattacks ``PGDL2`` and a PGD on each logit and
margin), and that certified points survive attacks. Models are tiny so that
CROWN runs in seconds on a CPU.
"""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from lipvit.certify.crown import bounds as crown
from lipvit.certify.crown.lirpa_compat import INSTALL_HINT, auto_lirpa_available
from lipvit.certify.crown.verifiable import (
    ProjectScale,
    VerifiableLayerProject,
    project_scale,
    to_verifiable,
)
from torch import nn

import lipvit
from lipvit.config import ViTConfig
from lipvit.errors import LipvitError, UnsupportedModelError
from lipvit.layers import layer_project

DT = torch.float64
needs_lirpa = pytest.mark.skipif(
    not auto_lirpa_available(),
    reason="auto_LiRPA missing: pip install --no-deps -r requirements-nodeps.txt",
)
TINY = dict(image_size=8, patch_size=4, embed_dim=8, depth=2, num_heads=2,
            mlp_ratio=1.0, family="lipschitz")


def _perturbed(model: lipvit.ViT, seed: int, scale: float = 0.3) -> lipvit.ViT:
    """``model`` in float64 with every raw parameter shifted by noise (non-trivial)."""
    g = torch.Generator().manual_seed(seed)
    model = model.double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=DT))
    return model.eval()


# --- verifiable model: same function, no auto_LiRPA needed -------------------------

@pytest.mark.parametrize(("family", "extra"), [
    ("lipschitz", {}),
    ("lipschitz", {"attn_project": "token", "attn_radius": 2.0}),
    ("standard", {}),
    ("standard", {"qkv_bias": True, "in_chans": 3, "mean": (0.4, 0.5, 0.6),
                  "std": (0.2, 0.25, 0.3)}),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_verifiable_model_equals_model(family, extra, seed):
    torch.manual_seed(seed)
    model = _perturbed(lipvit.ViT(lipvit.preset("digits-tiny", family=family, **extra)),
                       seed)
    twin = to_verifiable(model)
    assert not any(p.requires_grad for p in twin.parameters())
    g = torch.Generator().manual_seed(seed + 10)
    x = torch.rand(6, model.config.in_chans, 8, 8, generator=g, dtype=DT)
    x[0] = 0.0  # a corner of the box
    with torch.no_grad():
        ref, out = model(x), twin(x.flatten(1))
    assert ref.abs().max() > 0.1  # a non-trivial function
    assert torch.allclose(out, ref, rtol=0, atol=1e-6), (out - ref).abs().max()


def test_verifiable_layer_project_is_exact_on_both_sides_of_the_radius():
    # Tokens with norms below, at and above R: x·R/max(‖x‖, R) must be matched exactly.

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 4, generator=g, dtype=DT)
    x[0, :2] *= 0.01
    x[1, 0] *= 2.0 / torch.linalg.vector_norm(x[1, 0])  # exactly on the sphere
    for mode, dims in (("token", (-1,)), ("frobenius", (-2, -1))):
        for R in (0.5, 2.0):
            ours = VerifiableLayerProject(R, mode, DT)(x)
            assert torch.allclose(ours, layer_project(x, R, dims), rtol=0, atol=1e-14)


def test_project_scale_gradient_matches_autograd_of_the_formula():
    g = torch.Generator().manual_seed(0)
    s = (torch.rand(50, generator=g, dtype=DT) * 8).requires_grad_(True)
    (ours,) = torch.autograd.grad(ProjectScale.apply(s, 1.5).sum(), s)
    (ref,) = torch.autograd.grad(project_scale(s, 1.5).sum(), s)
    assert torch.allclose(ours, ref, rtol=0, atol=1e-14)


@pytest.mark.parametrize("radius", [0.5, 1.0, 5.66])
def test_project_scale_relaxation_brackets_the_function(radius):
    # Dense grid on many intervals: left of R², across it, right of it, tiny, wide.
    g = torch.Generator().manual_seed(int(radius * 100))
    R2 = radius**2
    lo = R2 + R2 * 3 * torch.randn(4000, generator=g, dtype=DT)
    width = R2 * 10 * torch.rand(4000, generator=g, dtype=DT) ** 3
    width[:50], width[50:100] = 0.0, 1e-13
    lo[100:150] = R2  # starting exactly at the kink
    up = lo + width
    k_l, b_l, k_u, b_u = crown.project_scale_relaxation(lo, up, radius)
    t = torch.linspace(0, 1, 401, dtype=DT)
    s = lo[:, None] + (up - lo)[:, None] * t  # (4000, 401)
    psi = project_scale(s, radius)
    assert torch.all(k_l[:, None] * s + b_l[:, None] <= psi)
    assert torch.all(k_u[:, None] * s + b_u[:, None] >= psi)
    # Not vacuous: exact where ψ ≡ 1; within twice ψ's range where ψ is convex.
    gap = (k_u - k_l)[:, None] * s + (b_u - b_l)[:, None]
    spread = psi.amax(1, keepdim=True) - psi.amin(1, keepdim=True)
    assert torch.all(gap[up <= R2] <= 3e-12)
    assert torch.all((gap - 2 * spread - 3e-12)[lo >= R2] <= 0)


def test_verifiable_copy_does_not_follow_the_model():
    model = _perturbed(lipvit.ViT(lipvit.preset("digits-tiny", family="lipschitz")), 0)
    twin = to_verifiable(model)
    x = torch.rand(2, 64, dtype=DT)
    before = twin(x)
    with torch.no_grad():
        model.head.bias.add_(1.0)
    assert torch.equal(twin(x), before)
    with pytest.raises(TypeError):
        to_verifiable(nn.Linear(2, 2))


# --- refusals and missing auto_LiRPA (no auto_LiRPA needed) ------------------------

def test_missing_auto_lirpa_says_how_to_install(monkeypatch):
    # None in sys.modules makes the import system report the package as absent.
    monkeypatch.setitem(sys.modules, "auto_LiRPA", None)
    assert not auto_lirpa_available()
    model = lipvit.ViT(lipvit.preset("digits-tiny", family="lipschitz"))
    x, y = torch.rand(1, 1, 8, 8), torch.tensor([0])
    with pytest.raises(LipvitError) as info:
        crown.crown_certify(model, x, y, 0.05)
    message = str(info.value)
    assert message == INSTALL_HINT
    assert "pip install --no-deps -r requirements-nodeps.txt" in message
    assert "\n" not in message


@pytest.mark.parametrize(("kwargs", "error"), [
    (dict(eps=-0.1), ValueError),
    (dict(eps=math.nan), ValueError),
    (dict(eps=math.inf), ValueError),
    (dict(eps="0.1"), TypeError),
    (dict(method="alpha-beta"), ValueError),
    (dict(x=torch.rand(2, 1, 4, 4)), ValueError),
    (dict(x=torch.rand(1, 8, 8)), ValueError),
    (dict(y=torch.tensor([0])), ValueError),
    (dict(y=torch.tensor([0.0, 1.0])), ValueError),
    (dict(y=torch.tensor([0, 10])), ValueError),
])
def test_bad_inputs_raise(kwargs, error):
    model = lipvit.ViT(lipvit.preset("digits-tiny", family="lipschitz"))
    args = dict(x=torch.rand(2, 1, 8, 8), y=torch.tensor([0, 1]), eps=0.05,
                method="CROWN") | kwargs
    with pytest.raises(error):
        crown.crown_margin_bounds(model, args["x"], args["y"], args["eps"],
                                  method=args["method"])


# --- CROWN bounds (auto_LiRPA needed) --------------------------------------------

@pytest.mark.crown
@needs_lirpa
def test_compat_import_is_idempotent_and_parameters_keep_their_names():
    from lipvit.certify.crown import lirpa_compat

    lirpa = lirpa_compat.import_auto_lirpa()
    applied = list(lirpa_compat.APPLIED)
    assert lirpa_compat.import_auto_lirpa() is lirpa
    assert lirpa_compat.APPLIED == applied  # nothing patched twice
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    bounded = lirpa.BoundedModule(net, torch.zeros(1, 3))
    # torch's parameters() passes remove_duplicate, which auto_LiRPA 0.3 lacked.
    names = [name for name, _ in bounded.named_parameters()]
    assert sorted(names) == sorted(name for name, _ in net.named_parameters())


@pytest.mark.crown
@needs_lirpa
@pytest.mark.parametrize("seed", [0, 1])
def test_linear_model_bounds_equal_closed_form(seed):
    # auto_LiRPA's own test pattern: a linear map's bound is Wx + b ± ε‖W_row‖₂,
    # and a margin's is (e_y − e_j)ᵀ(Wx + b) − ε‖W_y − W_j‖₂, both exact.
    g = torch.Generator().manual_seed(seed)
    B, K, eps = 3, 4, 0.37
    net = nn.Linear(18, K).to(DT)
    W = net.weight
    x = torch.rand(B, 18, generator=g, dtype=DT)
    lb, ub = crown.bound_module(net, x, eps)
    with torch.no_grad():
        centre = net(x)
        row = torch.linalg.vector_norm(W, dim=1)  # (K,)
    assert torch.allclose(lb, centre - eps * row, rtol=0, atol=1e-12)
    assert torch.allclose(ub, centre + eps * row, rtol=0, atol=1e-12)
    y = torch.tensor([0, 2, 3])
    C = crown.margin_spec(y, K)
    mlb, mub = crown.bound_module(net, x, eps, C=C)
    with torch.no_grad():
        exact = torch.einsum("bjk,bk->bj", C, centre) - eps * torch.linalg.vector_norm(
            torch.einsum("bjk,kn->bjn", C, W), dim=2)
    assert torch.allclose(mlb, exact, rtol=0, atol=1e-12)
    assert mub is not None and torch.all(mub >= mlb)


class _Unary(nn.Module):
    """``fn(Linear(x))``: a net whose first operator is a Linear, as required."""

    def __init__(self, fn):
        super().__init__()
        self.fc, self.fn = nn.Linear(3, 3).to(DT), fn

    def forward(self, x):
        return self.fn(self.fc(x))


@pytest.mark.crown
@needs_lirpa
@pytest.mark.parametrize(("fn", "match"), [
    (torch.erf, "cannot bound this model: no bound for onnx::Erf"),
    (lambda h: torch.sqrt(h.exp()), "Sqrt is not on lipvit's list"),  # unsound
    (lambda h: torch.reciprocal(h.exp()), "Reciprocal is not on"),
    (lambda h: 2.0 / (1.0 + h.exp()), "Reciprocal is not on|only as a softmax"),
    (lambda h: h / h.exp().sum(-1, keepdim=True), "only as a softmax"),
])
def test_unsupported_operators_are_refused_with_a_reason(fn, match):
    with pytest.raises(UnsupportedModelError, match=match):
        crown.bound_module(_Unary(fn), torch.rand(2, 3, dtype=DT), 0.1)


@pytest.mark.crown
@needs_lirpa
@pytest.mark.parametrize("identity", [False, True])
def test_fast_matmul_backward_equals_auto_lirpa(identity):
    # Our BoundMatMul replacement must give auto_LiRPA's numbers (same relaxation).
    import auto_LiRPA.operators as ops
    from auto_LiRPA.utils import eyeC

    g = torch.Generator().manual_seed(3)
    S, B, H, N, M, d = 7, 2, 3, 5, 4, 6

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=DT)

    x_l, y_l = rnd(B, H, N, d), rnd(B, H, d, M)  # y in matmul layout (…, d, M)
    x_u, y_u = x_l + rnd(B, H, N, d).abs(), y_l + rnd(B, H, d, M).abs()
    if identity:
        lA = uA = eyeC((H * N * M, B, H, N, M), torch.device("cpu"))
    else:
        lA, uA = rnd(S, B, H, N, M), rnd(S, B, H, N, M)
    results = []
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DT)  # auto_LiRPA builds identities in the default dtype
    try:
        for cls in (ops.BoundMatMul, crown._fast_matmul_class()):
            node = cls({}, [], 0, {})
            node.input_shape, node.y_shape = x_l.shape, y_l.shape
            X = SimpleNamespace(lower=x_l, upper=x_u, output_shape=x_l.shape,
                                perturbed=True)
            Y = SimpleNamespace(lower=y_l, upper=y_u, output_shape=y_l.shape,
                                perturbed=True)
            node.inputs = [X, Y]
            results.append(node.bound_backward(lA, uA, X, Y))
    finally:
        torch.set_default_dtype(previous)
    (A_ref, lb_ref, ub_ref), (A, lb, ub) = results
    for (ref_l, ref_u), (ours_l, ours_u) in zip(A_ref[:2], A[:2], strict=True):
        assert torch.allclose(ours_l, ref_l, rtol=1e-12, atol=1e-12)
        assert torch.allclose(ours_u, ref_u, rtol=1e-12, atol=1e-12)
    assert torch.allclose(lb, lb_ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(ub, ub_ref, rtol=1e-12, atol=1e-12)


def train_tiny(cfg: ViTConfig, digits, seed: int, steps: int, lr: float,
               logit_scale: float = 1.0) -> lipvit.ViT:
    """A ViT of ``cfg`` trained ``steps`` AdamW steps on digits (batches of 128,
    cross-entropy on ``logit_scale`` × logits), in float64 and eval mode."""
    torch.manual_seed(seed)
    model = lipvit.ViT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        i = torch.randint(0, digits.x_train.shape[0], (128,), generator=g)
        loss = F.cross_entropy(logit_scale * model(digits.x_train[i]),
                               digits.y_train[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval().double()


@pytest.fixture(scope="module")
def trained(digits):
    """A tiny lipschitz ViT (8×8 digits, 4×4 patches, D=8, 2 blocks) trained briefly."""
    cfg = ViTConfig(**TINY, mean=digits.mean, std=digits.std)
    model = train_tiny(cfg, digits, seed=0, steps=400, lr=3e-2, logit_scale=30)
    return model, digits.x_test[:16].to(DT), digits.y_test[:16]


def _ball_samples(x: torch.Tensor, eps: float, n: int, seed: int) -> torch.Tensor:
    """``n`` points per sample: half uniform in the ℓ2 ball, half on its sphere."""
    g = torch.Generator().manual_seed(seed)
    B, dim = x.shape[0], x[0].numel()
    d = torch.randn(n, B, dim, generator=g, dtype=x.dtype)
    d = d / torch.linalg.vector_norm(d, dim=2, keepdim=True)
    r = torch.rand(n, B, 1, generator=g, dtype=x.dtype) ** (1 / dim)
    r[n // 2:] = 1.0
    return x[None] + eps * (r * d).reshape(n, *x.shape)  # (n, B, C, S, S)


def _pgd_min(fn, x: torch.Tensor, eps: float, steps: int = 60, restarts: int = 2,
             seed: int = 0) -> torch.Tensor:
    """Smallest ``fn(x')`` ``(B,)`` found by ℓ2 PGD over ``‖x' − x‖ ≤ ε``.

    Every evaluated point is feasible; cosine-decaying normalised steps.
    """
    g = torch.Generator().manual_seed(seed)
    B = x.shape[0]

    def project(delta):
        norm = torch.linalg.vector_norm(delta.flatten(1), dim=1).clamp_min(1e-30)
        return delta * (eps / norm).clamp(max=1.0).reshape(B, 1, 1, 1)

    with torch.no_grad():
        best = fn(x)
    for _ in range(restarts):
        delta = project(eps * torch.randn(x.shape, generator=g, dtype=x.dtype))
        for k in range(steps):
            delta.requires_grad_(True)
            value = fn(x + delta)
            (grad,) = torch.autograd.grad(value.sum(), delta)
            with torch.no_grad():
                best = torch.minimum(best, value)
                step = eps * 0.5 * (0.02 + math.cos(math.pi * k / (2 * steps)))
                gnorm = torch.linalg.vector_norm(grad.flatten(1), dim=1)
                gnorm = gnorm.clamp_min(1e-30).reshape(B, 1, 1, 1)
                delta = project(delta - step * grad / gnorm)
        with torch.no_grad():
            best = torch.minimum(best, fn(x + delta))
    return best


def _torchattacks_pgd(model, x, y, eps, seed=0):
    """torchattacks ``PGDL2`` on the cross-entropy, 3 random starts: ``(3, B, ...)``."""
    torchattacks = pytest.importorskip("torchattacks")
    torch.manual_seed(seed)
    atk = torchattacks.PGDL2(model, eps=eps, alpha=eps / 5, steps=50, random_start=True)
    advs = torch.stack([atk(x, y) for _ in range(3)])
    # PGDL2 clips to [0, 1], which keeps points inside the ℓ2 ball.
    dist = torch.linalg.vector_norm((advs - x[None]).flatten(2), dim=2)
    assert torch.all(dist <= eps * (1 + 1e-9))
    return advs


@pytest.mark.crown
@needs_lirpa
@pytest.mark.parametrize(("eps", "method"), [(0.02, "CROWN"), (0.05, "CROWN"),
                                             (0.02, "IBP")])
def test_logit_bounds_contain_sampled_and_attacked_points(trained, eps, method):
    model, x, y = trained
    x, y = x[:6], y[:6]
    lb, ub = crown.crown_logit_bounds(model, x, eps, method=method)
    assert lb.shape == ub.shape == (6, 10)
    assert not torch.any(torch.isnan(lb)) and not torch.any(torch.isnan(ub))
    if method == "CROWN" and eps == 0.02:
        # Not vacuous: finite everywhere, tight for most samples.
        assert torch.all(torch.isfinite(lb)) and torch.all(torch.isfinite(ub))
        assert ((ub - lb).amax(1) < 0.1).sum() >= 3
    assert_logit_bounds_hold(model, x, y, eps, lb, ub, attack=method != "IBP")


def assert_logit_bounds_hold(model, x, y, eps, lb, ub, attack: bool = True,
                             tol: float = 1e-9) -> None:
    """Logit bounds ``lb``, ``ub`` ``(B, K)`` over the ε-ball contain 200 sampled
    points per sample and, with ``attack``, torchattacks' PGD-ℓ2 points and PGD
    minimising and maximising each logit."""
    K = lb.shape[1]
    with torch.no_grad():
        points = _ball_samples(x, eps, 200, seed=1)
        logits = model(points.flatten(0, 1)).reshape(200, *lb.shape)
        assert torch.all(logits >= lb - tol) and torch.all(logits <= ub + tol)
    if not attack:
        return
    advs = _torchattacks_pgd(model, x, y, eps)
    with torch.no_grad():
        for adv in advs:
            out = model(adv)
            assert torch.all(out >= lb - tol) and torch.all(out <= ub + tol)
    def logit(z, k, sign):
        return sign * model(z).gather(1, k[:, None])[:, 0]

    low = _pgd_min_each(lambda z, k: logit(z, k, 1), x, K, eps, steps=40, restarts=1)
    high = -_pgd_min_each(lambda z, k: logit(z, k, -1), x, K, eps, steps=40,
                          restarts=1)
    assert torch.all(low >= lb - tol), (low - lb).min()
    assert torch.all(high <= ub + tol), (ub - high).min()


@pytest.mark.crown
@needs_lirpa
def test_margin_bounds_are_below_attacked_margins_and_batched(trained):
    model, x, y = trained
    x, y, eps = x[:5], y[:5], 0.02
    mlb = crown.crown_margin_bounds(model, x, y, eps)
    assert mlb.shape == (5, 10)
    assert torch.all(mlb[torch.arange(5), y] == 0)
    tol = 1e-9
    assert torch.all(pgd_margins(model, x, y, eps) >= mlb - tol)
    with torch.no_grad():
        points = _ball_samples(x, eps, 100, seed=2)
        out = model(points.flatten(0, 1)).reshape(100, 5, 10)
        margins = out.gather(2, y[None, :, None].expand(100, 5, 1)) - out  # (100, B, K)
        assert torch.all(margins >= mlb - tol)
    # A margin bounded directly is at least as tight as the difference of the
    # logit bounds (same relaxations, one concretisation instead of two).
    lb, ub = crown.crown_logit_bounds(model, x, eps)
    naive = lb.gather(1, y[:, None]) - ub
    naive[torch.arange(5), y] = 0
    assert torch.all(mlb >= naive - 1e-9)
    # Batched bounds equal one-sample bounds.
    one = crown.crown_margin_bounds(model, x[2:3], y[2:3], eps)
    assert torch.allclose(one, mlb[2:3], rtol=0, atol=1e-10)


@pytest.mark.crown
@needs_lirpa
def test_one_bounded_model_reused_over_samples_and_eps(trained):
    """A CrownModel reused for every sample and ε gives each call's fresh bounds
    (auto_LiRPA recomputes every intermediate bound per call) and builds one
    bounded copy per batch size."""
    model, x, y = trained
    prepared = crown.crown_model(model)
    for eps in (0.05, 0.01):
        for i in range(3):
            xi, yi = x[i:i + 1], y[i:i + 1]
            reused = crown.crown_margin_bounds(model, xi, yi, eps, prepared=prepared)
            fresh = crown.crown_margin_bounds(model, xi, yi, eps)
            assert torch.equal(reused, fresh)
    assert list(prepared.cache) == [1]


def _pgd_min_each(score, x: torch.Tensor, K: int, eps: float, **kw) -> torch.Tensor:
    """``_pgd_min`` of ``K`` scores at once, ``(B, K)``: ``score(z, k)`` ``(K·B,)``
    at the points ``z`` ``(K·B, ...)`` whose block ``k`` (``B`` rows) is score
    ``k``'s attack (one batched run: the same steps per score as one run each,
    a tenth of the calls)."""
    B = x.shape[0]
    k = torch.arange(K).repeat_interleave(B)  # (K·B,) each row's score
    worst = _pgd_min(lambda z: score(z, k), x.repeat(K, *([1] * (x.ndim - 1))), eps,
                     **kw)
    return worst.reshape(K, B).T


def pgd_margins(model, x: torch.Tensor, y: torch.Tensor, eps: float, **kw
                ) -> torch.Tensor:
    """The smallest margin ``logit_y − logit_j`` ``(B, K)`` found by PGD at
    each point and class (``j = y``: 0)."""
    K = model(x[:1]).shape[1]
    yy = y.repeat(K)[:, None]

    def margin(z, k):
        out = model(z)
        return out.gather(1, yy)[:, 0] - out.gather(1, k[:, None])[:, 0]

    return _pgd_min_each(margin, x, K, eps, **kw)


def assert_survive_attacks(model, xs, ys, eps, steps: int, restarts: int) -> None:
    """Certified points ``xs`` (labels ``ys``) keep their label under torchattacks'
    PGD-ℓ2 and under PGD minimising each margin ``logit_y − logit_j`` at ``eps``."""
    advs = _torchattacks_pgd(model, xs, ys, eps)
    with torch.no_grad():
        for adv in advs:
            assert torch.all(model(adv).argmax(1) == ys)
    worst = pgd_margins(model, xs, ys, eps, steps=steps, restarts=restarts)
    worst[torch.arange(len(ys)), ys] = 1.0  # j = y: no margin
    assert torch.all(worst > 0)


@pytest.mark.crown
@needs_lirpa
def test_certified_points_survive_attacks(trained):
    model, x, y = trained
    eps = 0.01
    y_wrong = y.clone()
    y_wrong[:4] = (y[:4] + 1) % 10  # misclassified by construction
    cert = crown.crown_certify(model, x, y_wrong, eps)
    with torch.no_grad():
        pred = model(x).argmax(1)
    assert not torch.any(cert & (pred != y_wrong))
    assert cert.sum() >= 3, "the trained tiny model should certify a few points"
    assert_survive_attacks(model, x[cert], y_wrong[cert], eps, steps=60, restarts=2)
    # The other methods never certify a misclassified point either.
    for method in ("IBP",):
        other = crown.crown_certify(model, x, y_wrong, eps, method=method)
        assert not torch.any(other & (pred != y_wrong))


@pytest.mark.crown
@needs_lirpa
def test_huge_ball_gives_sound_possibly_vacuous_bounds(trained):
    model, x, _ = trained
    lb, ub = crown.crown_logit_bounds(model, x[:2], 50.0)
    assert not torch.any(torch.isnan(lb)) and not torch.any(torch.isnan(ub))
    with torch.no_grad():
        points = _ball_samples(x[:2], 50.0, 50, seed=3)
        out = model(points.flatten(0, 1)).reshape(50, 2, 10)
    assert torch.all(out >= lb - 1e-9) and torch.all(out <= ub + 1e-9)
