"""ReLU flip symbols (lipvit.certify.taylor.symbols, docs/taylor.md §5) against brute
force."""

from __future__ import annotations

import itertools

import pytest
import torch
from lipvit.analysis.pgd import pgd_deviation
from lipvit.certify.certification import bisect_radius
from lipvit.certify.taylor.certificate import taylor_bound
from lipvit.certify.taylor.forward import forward
from lipvit.certify.taylor.linearized import Linearized
from lipvit.certify.taylor.symbols import (
    Carried,
    default_max_symbols,
    flip_range,
    propagate,
    propagate_radial,
)

from lipvit.model import ViT
from tests.conftest import tiny_config

F64 = torch.float64


def _setup(seed: int, batch: int) -> tuple[ViT, torch.Generator, torch.Tensor]:
    """A 3-block lipschitz model with weights 3× their initial size (visibly
    nonlinear), a seeded generator and ``batch`` random images."""
    torch.manual_seed(seed)
    model = ViT(tiny_config("lipschitz", depth=3)).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    g = torch.Generator().manual_seed(seed)
    return model, g, torch.rand(batch, 1, 8, 8, dtype=F64, generator=g)


def test_relu_remainder_lies_in_flip_range():
    z = torch.linspace(-3, 3, 121, dtype=F64)
    z = torch.cat([z, torch.zeros(1, dtype=F64)])  # relu'(0) = 0 included
    for d in (1e-3, 0.1, 1.0, 3.0):
        delta = torch.linspace(-d, d, 201, dtype=F64)
        Z, Dl = torch.meshgrid(z, delta, indexing="ij")
        r = (Z + Dl).relu() - Z.relu() - (Z > 0) * Dl
        rho = flip_range(z, torch.full_like(z, d))
        assert torch.all(r >= -1e-15)  # ≥ 0 up to the rounding of r itself
        assert torch.all(r.amax(1) <= rho + 1e-15)
        assert torch.all((rho > 0) == (z.abs() < d * (1 + 1e-12)))


def _dense(model, x, k):
    """Dense Jacobians of every later site input w.r.t. block ``k``'s activation
    output, ``(B, *out, N, m)`` each (one sample's outputs depend on its own
    injection only)."""
    with torch.no_grad():
        _, clean = forward(model, x)
    shape = clean.act_in[k].shape

    def outputs(inj):
        _, rec = forward(model, x, {(k, "act"): inj})
        return (
            rec.stream[2 * k + 2 :],
            rec.attn_in[k + 1 :],
            rec.act_in[k + 1 :],
        )

    J = torch.func.jacrev(outputs)(torch.zeros(shape, dtype=F64))
    B = shape[0]
    # (B, *out, B, N, m) → (B, *out, N, m): sample b's outputs, sample b's injection
    return [
        [torch.stack([t[b, ..., b, :, :] for b in range(B)]) for t in group]
        for group in J
    ], clean


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k", [0, 1])
def test_symbols_match_dense_jacobians(seed, k):
    model, g, x = _setup(seed, 2)
    (streams, attn_in, act_in), clean = _dense(model, x, k)
    z = clean.act_in[k]
    rho = torch.rand(z.shape, dtype=F64, generator=g) * (
        torch.rand(z.shape, generator=g) < 0.3
    )
    sym = Carried.zeros(clean)
    tail = propagate(model, Linearized(model, x), k, rho, sym, max_symbols=10**6,
                     chunk=7)
    assert torch.all(tail == 0)
    flat = rho.flatten(1)  # (B, N·m)
    half = flat / 2

    def close(a, b):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)

    for off, G in enumerate(streams):  # (B, N, D, N, m)
        m = 2 * k + 2 + off
        Gf = G.flatten(-2)  # (B, N, D, N·m)
        close(sym.centre[m], (Gf * half[:, None, None]).sum(-1))
        close(sym.spread[m], (Gf.abs() * half[:, None, None]).sum(-1))
        # never above the triangle sum Σ_i ‖G_i‖ ρ_i
        tri = (Gf.flatten(1, 2).norm(dim=1) * flat).sum(-1)
        assert torch.all(sym.stream(m) <= tri * (1 + 1e-9))
    for off, G in enumerate(attn_in):
        Gf = G.flatten(-2)
        close(sym.attn_centre[k + 1 + off], (Gf * half[:, None, None]).sum(-1))
        close(sym.attn_spread[k + 1 + off], (Gf.abs() * half[:, None, None]).sum(-1))
    for off, G in enumerate(act_in):  # (B, N, m, N, m)
        Gf = G.flatten(-2)
        close(sym.up[k + 1 + off], (Gf.clamp_min(0) * flat[:, None, None]).sum(-1))
        close(sym.down[k + 1 + off], ((-Gf).clamp_min(0) * flat[:, None, None]).sum(-1))
    for m in range(2 * k + 2):  # nothing before the block changes
        assert torch.all(sym.spread[m] == 0) and torch.all(sym.centre[m] == 0)
    # The bounds hold at random vertices of the box (where the maxima lie).
    for _ in range(20):
        r = rho * (torch.rand(rho.shape, generator=g) < 0.5)
        for off, G in enumerate(streams):
            m = 2 * k + 2 + off
            moved = torch.einsum("bndi,bi->bnd", G.flatten(-2), r.flatten(1))
            assert torch.all(moved.flatten(1).norm(dim=1) <= sym.stream(m) * (1 + 1e-9))
            assert torch.all(moved.norm(dim=-1) <= sym.stream_token(m) * (1 + 1e-9))
        for off, G in enumerate(attn_in):
            moved = torch.einsum("bndi,bi->bnd", G.flatten(-2), r.flatten(1))
            bound = sym.attn_in(k + 1 + off) * (1 + 1e-9)
            assert torch.all(moved.flatten(1).norm(dim=1) <= bound)
        moved = torch.einsum("bdi,bi->bd", streams[-1][:, 0].flatten(-2), r.flatten(1))
        assert torch.all(moved.norm(dim=1) <= sym.cls() * (1 + 1e-9))
        for off, G in enumerate(act_in):
            moved = torch.einsum("bnui,bi->bnu", G.flatten(-2), r.flatten(1))
            assert torch.all(moved <= sym.up[k + 1 + off] * (1 + 1e-9) + 1e-15)
            assert torch.all(-moved <= sym.down[k + 1 + off] * (1 + 1e-9) + 1e-15)


@pytest.mark.parametrize("seed", range(3))
def test_tail_bound_covers_every_vertex(seed):
    model, g, x = _setup(seed, 1)
    with torch.no_grad():
        _, clean = forward(model, x)
    z = clean.act_in[0]
    rho = torch.zeros_like(z)
    units = torch.randperm(z.numel(), generator=g)[:10]
    rho.view(-1)[units] = torch.rand(10, dtype=F64, generator=g)
    tail = propagate(model, Linearized(model, x), 0, rho, Carried.zeros(clean),
                     max_symbols=3)
    sll = model.blocks[0].mlp
    column = -2.0 * sll.fc1.weight / sll.T()[:, None]  # (m, D)
    score = rho.flatten() * column.norm(dim=1).repeat(z.shape[1])
    chosen = score.topk(3).indices
    rest = [int(u) for u in units if int(u) not in set(chosen.tolist())]
    N, m = z.shape[1:]
    worst = 0.0
    for vertex in itertools.product((0.0, 1.0), repeat=len(rest)):
        R = torch.zeros(N, column.shape[1], dtype=F64)
        for on, u in zip(vertex, rest, strict=True):
            R[u // m] += on * rho.view(-1)[u] * column[u % m]
        worst = max(worst, float(R.detach().norm()))
    assert worst <= float(tail[0]) * (1 + 1e-12)
    assert worst > 0


@pytest.fixture(scope="module")
def stream_pgd() -> dict:
    """PGD's deviations by (seed, ε, stream state): the attacks do not depend on
    ``max_symbols`` (the same model, points and ε, and pgd_deviation's private
    seeded generator), so both symbol counts are checked against the same
    attacks, run once."""
    return {}


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("max_symbols", [1, 256])
def test_stream_budgets_bound_pgd(seed, max_symbols, stream_pgd):
    model, g, x = _setup(seed, 2)
    with torch.no_grad():
        y = model(x).argmax(1)
    tb = taylor_bound(model, x, y, max_symbols=max_symbols)

    def attack(key, fn, **kw):
        if (seed, *key) not in stream_pgd:
            stream_pgd[(seed, *key)] = pgd_deviation(fn, x, key[0], steps=30, **kw)
        return stream_pgd[(seed, *key)]

    flips = 0
    for eps in (1e-3, 1e-2, 0.1):
        _, budgets, cls = tb.walk(torch.full((2,), eps, dtype=F64))
        for m, budget in enumerate(budgets):
            def stream(v, m=m):
                return forward(model, v)[1].stream[m]
            found = attack((eps, m), stream, restarts=2)
            assert torch.all(found <= budget.all * (1 + 1e-9)), (eps, m)
        last = attack((eps, "cls"),
                      lambda v: forward(model, v)[1].stream[-1][:, 0])
        assert torch.all(last <= cls * (1 + 1e-9))
        with torch.no_grad():
            z = forward(model, x)[1].act_in[-1]
        flips += int((z.abs() < 0.05).sum())
    assert flips > 0  # some units are near their kink: symbols are exercised


def test_bisect_radius_bracket_closed_form():
    # certified iff ε < 0.3 (sample 0) or ε < 0.02 (sample 1); bracket lows are
    # checked: sample 1's 0.05 is not certified and is dropped to 0.
    truth = torch.tensor([0.3, 0.02], dtype=F64)
    probes = []

    def certified(e):
        probes.append(e.clone())
        return e < truth

    r = bisect_radius(
        certified, torch.tensor([True, True]), rtol=1e-4,
        bracket=(torch.tensor([0.01, 0.05], dtype=F64),
                 torch.tensor([1.0, 1.0], dtype=F64)),
    )
    assert torch.all(r < truth) and torch.all(r > truth * (1 - 2e-4))
    assert all(float(p.max()) <= 1.0 for p in probes)


@pytest.mark.parametrize("site, project", [("norm1", "frobenius"), ("norm1", "token"),
                                           ("norm2", "token")])
def test_radial_symbols_match_jvps(site, project):
    """``propagate_radial``: each vector's column ``−x̂`` at the projection's output,
    pushed through the clean linearised network (torch.func.jvp of the model with
    an injection), scaled by ``s/2``; stream states and pre-activations."""
    torch.manual_seed(0)
    model = ViT(tiny_config("lipschitz", depth=2, attn_project=project)).double().eval()
    x = torch.rand(2, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, clean = forward(model, x)
    k = 0
    X = clean.stream[0] if site == "norm1" else clean.stream[1]
    T = 1 if site == "norm1" and project == "frobenius" else X.shape[1]
    s = torch.rand(2, T, dtype=F64, generator=torch.Generator().manual_seed(2))
    s[0, 0] = 0.0  # no symbol there
    sym = Carried.zeros(clean)
    propagate_radial(Linearized(model, x), clean, k, site, s, sym, chunk=5)
    if T == 1:
        col = -X / X.flatten(1).norm(dim=1)[:, None, None]  # (B, N, D)
        cols = [(col * s[:, 0, None, None], s[:, 0])]
    else:
        x_hat = -X / X.norm(dim=-1, keepdim=True)
        cols = []
        for t in range(T):
            c = torch.zeros_like(X)
            c[:, t] = x_hat[:, t] * s[:, t, None]
            cols.append((c, s[:, t]))

    def jvp(c):  # the linearised network's response to injecting c at the site
        def run(a):
            _, rec = forward(model, x, {(k, site): a * c})
            return rec.stream, rec.act_in
        return torch.func.jvp(run, (torch.zeros((), dtype=F64),),
                              (torch.ones((), dtype=F64),))[1]

    centre = [torch.zeros_like(S) for S in clean.stream]
    up = [torch.zeros_like(z) for z in clean.act_in]
    for c, _ in cols:
        streams, acts = jvp(c)
        for m, S in enumerate(streams):
            centre[m] += S / 2
        for kk, Z in enumerate(acts):
            up[kk] += Z.clamp_min(0)
    first = 2 * k + (1 if site == "norm1" else 2)
    for m in range(len(clean.stream)):
        assert torch.allclose(sym.centre[m], centre[m], rtol=1e-10, atol=1e-14)
        if m < first:
            assert torch.all(sym.centre[m] == 0)
    for kk in range(len(clean.act_in)):
        assert torch.allclose(sym.up[kk], up[kk], rtol=1e-10, atol=1e-14)
    assert bool(sym.up[0].abs().sum() > 0)


def test_default_max_symbols_follows_the_image_dimension():
    """Four symbols per image dimension, never fewer than 1024 (digits keep the
    former fixed count; Fashion-MNIST's 784 pixels get 3136)."""
    assert default_max_symbols(64) == 1024
    assert default_max_symbols(784) == 4 * 784
    assert default_max_symbols(3 * 32 * 32) == 4 * 3072
