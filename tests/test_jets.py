"""Second-order Taylor models (docs/taylor.md §12): every operation's rest bound
against brute force, the margins' polynomial against autograd, the whole
margin-drop bound against PGD, the trust-region minimum against projected
gradient descent, and the taylor certificate with them (float64)."""

from __future__ import annotations

import math

import pytest
import torch
from lipvit.analysis.pgd import pgd_margin_drop, pgd_taylor_rest
from lipvit.certify.taylor import jets
from lipvit.certify.taylor import margin_jets as jet_vit
from lipvit.certify.taylor.certificate import taylor_bound
from lipvit.certify.taylor.jacobian_norms import jets_fit, jets_need, min_memory
from torch.func import jacrev
from torch.nn.attention import SDPBackend, sdpa_kernel

from lipvit.model import ViT
from tests.conftest import nonlinear_model, share_jets, tiny_config

F64 = torch.float64
Tensor = torch.Tensor
SEEDS = [0, 1, 2]
SMOOTH = {
    "exp": (jets.EXP, torch.exp, (-3.0, 2.0)),
    "reciprocal": (jets.RECIPROCAL, torch.reciprocal, (0.2, 4.0)),
    "inverse_sqrt": (jets.inverse_sqrt(1e-5), lambda v: (v + 1e-5).rsqrt(),
                     (0.01, 3.0)),
    "gelu": (jets.GELU, torch.nn.functional.gelu, (-6.0, 6.0)),
}


def _derivatives(f, x: Tensor) -> tuple:
    d1 = torch.func.vmap(torch.func.grad(f))(x)
    d2 = torch.func.vmap(torch.func.grad(torch.func.grad(f)))(x)
    d3 = torch.func.vmap(torch.func.grad(torch.func.grad(torch.func.grad(f))))(x)
    return d1, d2, d3



@pytest.mark.parametrize("name", sorted(SMOOTH))
@pytest.mark.parametrize("seed", SEEDS)
def test_smooth_functions_derivatives_and_third_derivative_bounds(name, seed):
    phi, f, (lo, hi) = SMOOTH[name]
    g = torch.Generator().manual_seed(seed)
    c = lo + (hi - lo) * torch.rand(50, generator=g, dtype=F64)
    d1, d2, _ = _derivatives(f, c)
    assert torch.allclose(phi.d1(c), d1, rtol=1e-10, atol=1e-12)
    assert torch.allclose(phi.d2(c), d2, rtol=1e-10, atol=1e-12)
    assert torch.allclose(phi.f(c), f(c), rtol=1e-12, atol=0)
    h = (hi - lo) * 0.3 * torch.rand(50, generator=g, dtype=F64)
    t = torch.linspace(-1, 1, 2001, dtype=F64)
    pts = c[:, None] + h[:, None] * t  # (50, 2001)
    inside = pts > (0 if name == "reciprocal" else -1e-5 if name == "inverse_sqrt"
                    else -math.inf)
    ok = inside.all(1)
    inside_pts = torch.where(inside, pts, c[:, None])  # outside the domain: unused
    _, _, d3 = _derivatives(f, inside_pts.reshape(-1))
    sampled = d3.abs().reshape(pts.shape).amax(1)
    bound = phi.m3(c, h)
    assert (bound[ok] >= sampled[ok] * (1 - 1e-12)).all()
    assert torch.isinf(bound[~ok]).all()


def test_gelu_third_derivative_peaks_are_the_global_maximum():
    x = torch.linspace(-8, 8, 200001, dtype=F64)
    _, _, d3 = _derivatives(torch.nn.functional.gelu, x)
    top = max(p for _, p in jets._GELU_PEAKS)
    assert d3.abs().max() <= top * (1 + 1e-9)
    assert d3.abs().max() >= top * (1 - 1e-6)
    wide = jets.GELU.m3(torch.zeros(1, dtype=F64), torch.full((1,), 10.0, dtype=F64))
    assert wide.item() == pytest.approx(top, rel=1e-9)


def _base(seed: int, shape: tuple, n: int):
    """A jet with all three coefficients nonzero, ``GELU(c + Lδ)``, and the
    function it models."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(*shape, generator=g, dtype=F64)
    L = torch.randn(*shape, n, generator=g, dtype=F64)

    def f(d: Tensor) -> Tensor:  # (M, n) -> (M, *shape)
        return torch.nn.functional.gelu(c + torch.einsum("...n,mn->m...", L, d))

    return jets.apply(jets.input_jet(c, L), jets.GELU), f


def _ball(n: int, eps: float, m: int = 3000, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(m, n, generator=g, dtype=F64)
    d = d / d.norm(dim=1, keepdim=True)
    radius = torch.rand(m, 1, generator=g, dtype=F64) ** (1 / n)
    radius[: m // 2] = 1.0  # half on the sphere, where the rests are largest
    return eps * d * radius


def _assert_rest_bounded(j: jets.Jet, f, eps: float, n: int):
    d = _ball(n, eps)
    z = f(d)  # (M, *S)
    poly = (j.centre + torch.einsum("...n,mn->m...", j.L, d)
            + 0.5 * torch.einsum("...nk,mn,mk->m...", j.Q, d, d))
    gap = (z - poly).abs().amax(0)
    e = torch.tensor(eps, dtype=F64)
    memo = jets.BackSubstitution(j.node, []).bounds(e)
    r = memo[id(j.node)][0]
    assert (gap <= r * (1 + 1e-9) + 1e-13).all(), (gap / r).max()
    return gap, r


OPS = {
    "affine": lambda a, fa, b, fb, W: (jets.affine(a, W), lambda d: fa(d) @ W),
    "product": lambda a, fa, b, fb, W: (jets.contract("ij,ij->ij", a, b),
                                        lambda d: fa(d) * fb(d)),
    "contraction": lambda a, fa, b, fb, W: (jets.contract("ij,kj->ik", a, b),
                                            lambda d: torch.einsum("mij,mkj->mik",
                                                                   fa(d), fb(d))),
    "square_sum": lambda a, fa, b, fb, W: (jets.contract("ij,ij->i", a, a),
                                           lambda d: (fa(d) ** 2).sum(-1)),
    "exp": lambda a, fa, b, fb, W: (jets.apply(a, jets.EXP), lambda d: fa(d).exp()),
    "sum": lambda a, fa, b, fb, W: (jets.reduce_sum(a, -1), lambda d: fa(d).sum(-1)),
    "softmax": lambda a, fa, b, fb, W: (jet_vit.softmax(jets.restructure(
        a, lambda t, k: t[None])), lambda d: fa(d)[:, None].softmax(-1)),
    "layer_norm": lambda a, fa, b, fb, W: (
        jet_vit.layer_norm(a, _ln(a.shape[-1])),
        lambda d: _ln(a.shape[-1])(fa(d))),
}


def _ln(D: int) -> torch.nn.LayerNorm:
    torch.manual_seed(D)
    ln = torch.nn.LayerNorm(D).double()
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    return ln


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("eps", [0.01, 0.1, 0.4])
def test_operations_rest_brute_force(op, seed, eps):
    n = 3
    a, fa = _base(seed, (3, 4), n)
    b, fb = _base(seed + 100, (3, 4), n)
    W = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed), dtype=F64)
    with torch.no_grad():
        j, f = OPS[op](a, fa, b, fb, W)
        _assert_rest_bounded(j, f, eps, n)


@pytest.mark.parametrize("seed", SEEDS)
def test_operations_polynomials_are_the_taylor_polynomials(seed):
    """A chain of every operation: its ``L``, ``Q`` are the autograd gradient
    and Hessian of the modelled function."""
    n = 3
    a, fa = _base(seed, (3, 4), n)
    b, fb = _base(seed + 7, (3, 4), n)
    ln = _ln(4)
    j = jet_vit.layer_norm(jets.contract("ij,ij->ij", a, b), ln)
    j = jet_vit.softmax(jets.restructure(j, lambda t, k: t[None]))

    def f(d: Tensor) -> Tensor:
        return ln(fa(d[None]) * fb(d[None]))[:, None].softmax(-1)[0, 0]

    zero = torch.zeros(n, dtype=F64)
    assert torch.allclose(j.c.detach()[0], f(zero), atol=1e-12)
    assert torch.allclose(j.L[0], jacrev(f)(zero), atol=1e-10)
    assert torch.allclose(j.Q[0], jacrev(jacrev(f))(zero), atol=1e-9)


def _model(seed: int):
    """The standard nonlinear model with 4×4 patches (5 tokens): the second-order
    models' bounds hold at any size, and each costs ``n²`` times the (fewer)
    activations."""
    return nonlinear_model("standard", seed, patch_size=4)


def _margins(model: ViT, x: Tensor, y: int):
    """``z ↦ logit_y − logits`` on a flat image ``(n,)`` → ``(K,)``, or on a
    batch ``(M, n)`` → ``(M, K)``."""
    def m(z: Tensor) -> Tensor:
        out = model(z.reshape(-1, *x.shape))
        out = out[:, y, None] - out
        return out[0] if z.dim() == 1 else out

    return m


@pytest.mark.parametrize("seed", SEEDS)
def test_margin_jet_is_the_second_order_taylor_polynomial(seed):
    model = _model(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.rand(1, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=F64)
    jm = jet_vit.JetMargins(model, x, 3)
    m = _margins(model, x, 3)
    with sdpa_kernel(SDPBackend.MATH):
        z = x.flatten()
        g, H = jacrev(m)(z), jacrev(jacrev(m))(z)
    assert torch.allclose(jm.gradient, g, atol=1e-9 * (1 + g.abs().max()))
    assert torch.allclose(jm.hessian, H, atol=1e-9 * (1 + H.abs().max()))


@pytest.fixture(scope="module")
def jets_cache() -> dict:
    """Second-order models built once for this module (see
    :func:`tests.conftest.share_jets`): the margin tests' images are the first
    of the taylor tests' (the same models, seeds and labels), and the jets do
    not depend on ε."""
    return {}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("eps", [0.02, 0.1])
def test_margin_rest_and_drop_bound_pgd(seed, eps, monkeypatch, jets_cache):
    share_jets(monkeypatch, jets_cache)
    model = _model(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.rand(1, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=F64)
    y = int(model(x[None]).argmax())
    jm = jet_vit.JetMargins(model, x, y)
    e = torch.tensor(eps, dtype=F64)
    r = jm.remainder(e)
    m = _margins(model, x, y)
    with sdpa_kernel(SDPBackend.MATH):
        for k in range(10):
            if k != y:
                found = pgd_taylor_rest(lambda z, k=k: m(z)[:, k], x.flatten(),
                                        jm.gradient[k], jm.hessian[k], eps, steps=60,
                                        restarts=3, seed=k)
                assert found <= r[k].item() * (1 + 1e-9), (k, found, r[k].item())
        drop = pgd_margin_drop(model, x[None], torch.tensor([y]), eps, steps=60)[0]
    assert (drop <= jm.drop(e) * (1 + 1e-9) + 1e-12).all()


def _pgd_quadratic(g: Tensor, Q: Tensor, eps: float, steps: int = 3000) -> Tensor:
    """``min_{‖δ‖≤ε} gᵀδ + ½δᵀQδ`` by projected gradient descent from several
    starts (an upper bound on the minimum)."""
    best = torch.tensor(math.inf, dtype=F64)
    lam, V = torch.linalg.eigh(Q)
    starts = [-g / g.norm().clamp_min(1e-300) * eps, V[:, 0] * eps, -V[:, 0] * eps]
    step = 1 / (lam.abs().max() + g.norm() / eps + 1)
    for d in starts:
        for _ in range(steps):
            d = d - step * (g + Q @ d)
            d = d * (eps / d.norm()).clamp(max=1.0)
            best = torch.minimum(best, g @ d + 0.5 * d @ Q @ d)
    return best


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", ["definite", "indefinite", "hard", "zero_gradient"])
@pytest.mark.parametrize("eps", [0.01, 1.0])
def test_quadratic_minimum_is_a_tight_lower_bound(seed, case, eps):
    g = torch.Generator().manual_seed(seed)
    n = 6
    A = torch.randn(n, n, generator=g, dtype=F64)
    Q = A @ A.T if case == "definite" else A + A.T
    grad = torch.randn(n, generator=g, dtype=F64)
    if case == "hard":  # the gradient orthogonal to the lowest eigenvector
        lam, V = torch.linalg.eigh(Q)
        grad = grad - (grad @ V[:, 0]) * V[:, 0]
    if case == "zero_gradient":
        grad = torch.zeros(n, dtype=F64)
    bound = jets.QuadraticForm(grad, Q).minimum(torch.tensor(eps, dtype=F64))
    found = _pgd_quadratic(grad, Q, eps)
    assert bound <= found + 1e-12
    assert bound >= found - 1e-6 * (1 + found.abs())


@pytest.mark.parametrize("seed", [0, 1])
def test_taylor_with_jets_certifies_no_less_and_survives_pgd(seed, monkeypatch,
                                                            jets_cache):
    share_jets(monkeypatch, jets_cache)
    model = _model(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(3, 1, 8, 8, generator=g, dtype=F64)
    with torch.no_grad():
        y = model(x).argmax(1)
    with_jets = taylor_bound(model, x, y).radius(rtol=1e-4)
    monkeypatch.setattr(jet_vit, "supports", lambda model: False)
    without = taylor_bound(model, x, y).radius(rtol=1e-4)
    assert (with_jets >= without * (1 - 2e-4)).all()
    assert (with_jets > 1.5 * without).any()  # the jets act on this model
    for b in range(3):
        if with_jets[b] > 0:
            drop = pgd_margin_drop(model, x[b:b + 1], y[b:b + 1], float(with_jets[b]),
                                   steps=60)
            margins = model(x[b:b + 1])[0, y[b]] - model(x[b:b + 1])[0]
            assert (drop[0] < margins.detach() + 1e-12)[torch.arange(10) != y[b]].all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_jets_on_cuda_match_cpu():
    """The second-order models on the GPU: the same polynomial and bounds."""
    model = nonlinear_model("standard", 0)
    x = torch.rand(1, 8, 8, generator=torch.Generator().manual_seed(0), dtype=F64)
    cpu = jet_vit.JetMargins(model, x, 3)
    gpu = jet_vit.JetMargins(model.cuda(), x.cuda(), 3)
    e = torch.tensor(0.05, dtype=F64)
    for a, b in ((cpu.gradient, gpu.gradient), (cpu.hessian, gpu.hessian),
                 (cpu.remainder(e), gpu.remainder(e.cuda())),
                 (cpu.drop(e), gpu.drop(e.cuda()))):
        assert b.device.type == "cuda"
        assert torch.allclose(b.cpu(), a, rtol=1e-6, atol=1e-10)


def test_supports_and_memory_estimate():
    assert not jet_vit.supports(ViT(tiny_config("lipschitz")))
    assert not jet_vit.supports(ViT(tiny_config("standard", attention="l2")))
    assert not jet_vit.supports(ViT(tiny_config("standard", image_size=32)))
    model = nonlinear_model("standard", 0)
    assert jet_vit.supports(model)
    x = torch.rand(1, 8, 8, dtype=F64)
    jm = jet_vit.JetMargins(model, x, 0)
    assert 0 < jm.back.nbytes() <= jet_vit.jet_bytes(model)


def test_jets_are_built_only_within_the_memory_budget(monkeypatch, jets_cache):
    """``--max-memory`` holds for the second-order models too: where one
    sample's (``jet_bytes`` beside the tangents' ``min_memory``) does not fit,
    ``taylor`` builds none and certifies without them (smaller, still sound)."""
    share_jets(monkeypatch, jets_cache)
    model = _model(0)
    x = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(0), dtype=F64)
    with torch.no_grad():
        y = model(x).argmax(1)
    need = jets_need(model)
    assert need == jet_vit.jet_bytes(model) + min_memory(model)
    assert jets_fit(model, need) and jets_fit(model, None)
    assert not jets_fit(model, need - 1)
    e = torch.full((2,), 0.05, dtype=F64)
    within = taylor_bound(model, x, y, max_memory=need)
    below = taylor_bound(model, x, y, max_memory=need - 1)
    assert "jet" in within.remainders(e) and "jet" not in below.remainders(e)
    assert torch.equal(within.grad_norm, below.grad_norm)
    assert (within.radius() >= below.radius() * (1 - 2e-3)).all()


def test_cli_says_when_the_jets_do_not_fit(trained_ckpts):
    from click.testing import CliRunner

    from lipvit.cli import main

    ckpt = str(trained_ckpts["standard"])
    args = ["certify", "--ckpt", ckpt, "--eps", "0.001", "--n", "1",
            "--method", "taylor"]
    small = CliRunner().invoke(main, [*args, "--max-memory", "20M"])
    assert small.exit_code == 0, small.output
    (note,) = [ln for ln in small.output.splitlines() if ln.startswith("note:")]
    assert "without its second-order models" in note and "--max-memory" in note
    default = CliRunner().invoke(main, args)
    assert default.exit_code == 0 and "note:" not in default.output
