"""The linearised network and the streamed Jacobian norms (certify/taylor/linearized.py,
certify/taylor/jacobian_norms.py, docs/taylor.md §11) against forward-mode AD and dense
Jacobians, in float64, over seeds and both families."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from lipvit.certify.memory import MemoryBudgetError, memory_budget, parse_memory
from lipvit.certify.taylor import jacobian_norms as tangents
from lipvit.certify.taylor.forward import forward, forward_blocks
from lipvit.certify.taylor.jacobian_norms import (
    Plan,
    jacobian_norms,
    min_memory,
    plan,
    sample_bytes,
    taylor_batch,
)
from lipvit.certify.taylor.linearized import Linearized

from lipvit.config import preset
from lipvit.errors import LipvitError
from lipvit.model import ViT
from tests.conftest import nonlinear_model

F64 = torch.float64
FAMILIES = ["lipschitz", "standard"]


_model = nonlinear_model


def _images(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 8, 8, dtype=F64, generator=g)


def _collect(lin: Linearized, T: torch.Tensor, first: int, **kw) -> dict:
    got: dict = {}

    def visit(kind, i, U):
        got[(kind, i)] = U.clone()

    lin.push(T, first, visit, **kw)
    return got


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kw", [{}, {"attn_project": "token"}, {"depth": 3}])
def test_push_is_forward_mode_ad(family, seed, kw):
    """Every site input's tangent, from the image, equals forward-mode AD
    through :func:`forward` (the attention logits, queries and keys too): two
    images, each with its own five tangents, pushed together."""
    if family == "standard" and "attn_project" in kw:
        kw = {"num_heads": 1}
    model = _model(family, seed, **kw)
    x = _images(2, seed)
    E = torch.randn(2, 5, *x.shape[1:], dtype=F64,
                    generator=torch.Generator().manual_seed(9))
    lin = Linearized(model, x)
    T = lin.embed(E.flatten(0, 1))  # (10, N, D)
    got = _collect(lin, T.reshape(2, 5, *T.shape[1:]), 0, logits=True)
    got = {key: T.flatten(0, 1) for key, T in got.items()}  # sample-major, as below
    with torch.no_grad(), fwAD.dual_level():
        _, rec = forward(model, fwAD.make_dual(x.repeat_interleave(5, dim=0),
                                               E.flatten(0, 1)))
        want = {("stream", m): fwAD.unpack_dual(s).tangent
                for m, s in enumerate(rec.stream)}
        want |= {("attn_in", k): fwAD.unpack_dual(p).tangent
                 for k, p in enumerate(rec.attn_in)}
        want |= {("act_in", k): fwAD.unpack_dual(z).tangent
                 for k, z in enumerate(rec.act_in)}
        for k, block in enumerate(model.blocks):
            W = block.attn.head_weights()
            p = rec.attn_in[k]
            S = torch.einsum("bnd,hde,hme,bkm->bhnk", p, W.W_q, W.W_k, p)
            want[("logits", k)] = fwAD.unpack_dual(S).tangent / W.W_q.shape[-1] ** 0.5
            for kind, Wx in (("queries", W.W_q), ("keys", W.W_k)):
                want[(kind, k)] = fwAD.unpack_dual(torch.einsum("bnd,hde->bhne", p, Wx)
                                                   ).tangent
    assert set(got) == set(want)
    for key, T in want.items():
        assert torch.allclose(got[key], T, rtol=1e-10, atol=1e-13), key


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("site", ["norm1", "norm2"])
def test_push_from_a_later_block_with_an_injection(family, site):
    """Tangents entering at block 1's input plus a tangent added at a norm's
    output: the same as forward-mode AD of the model with that injection."""
    model = _model(family, 4, depth=3)
    x = _images(1, 4)
    with torch.no_grad():
        clean = forward(model, x)[1]
    g = torch.Generator().manual_seed(5)
    T = torch.randn(3, *clean.stream[2].shape[1:], dtype=F64, generator=g)
    U = torch.randn_like(T)
    lin = Linearized(model, x)
    got = _collect(lin, T, 1, inject=(site, U[None]))
    got = {key: G[0] for key, G in got.items()}
    for j in range(3):
        def run(a, j=j):
            X = clean.stream[2] + a * T[j]
            rec = forward_blocks(model, X, 1, {(1, site): a * U[j][None]})[1]
            return tuple(rec.stream), tuple(rec.act_in)

        _, (streams, acts) = torch.func.jvp(run, (torch.zeros((), dtype=F64),),
                                            (torch.ones((), dtype=F64),))
        for m, s in enumerate(streams, start=2):
            assert torch.allclose(got[("stream", m)][j], s[0], rtol=1e-10, atol=1e-13)
        for k, z in enumerate(acts, start=1):
            assert torch.allclose(got[("act_in", k)][j], z[0], rtol=1e-10, atol=1e-13)


def _dense(model: ViT, x: torch.Tensor) -> dict:
    """Dense Jacobians ``(out, n)`` of one image's site inputs (brute force)."""
    def sites(v):
        rec = forward(model, v[None])[1]
        return [s[0] for s in rec.stream], [p[0] for p in rec.attn_in], \
            [z[0] for z in rec.act_in]

    streams, attn_in, act_in = torch.func.jacfwd(sites)(x)
    n = x.numel()
    return {"stream": [J.reshape(*J.shape[:2], n) for J in streams],
            "attn_in": [J.reshape(-1, n) for J in attn_in],
            "act_in": [J.reshape(*J.shape[:2], n) for J in act_in]}


def _spectral(J: torch.Tensor) -> torch.Tensor:
    return torch.linalg.matrix_norm(J, ord=2)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(3))
def test_norms_against_dense_jacobians(family, seed):
    """Exact mode equals the dense Jacobians' norms; the patch-block bound of
    the large-image mode is never below them and equals them at the embedding
    (block diagonal); per-token and per-unit norms are exact in both modes."""
    model = _model(family, seed, depth=3)
    x = _images(2, seed)
    exact = jacobian_norms(model, x)
    block = jacobian_norms(model, x, exact_max=0)
    assert exact.exact and not block.exact
    assert torch.all(block.logits.isinf())
    for b in range(2):
        J = _dense(model, x[b])
        for m, Js in enumerate(J["stream"]):  # (N, D, n)
            whole = _spectral(Js.reshape(-1, Js.shape[-1]))
            token = _spectral(Js)  # (N,)
            assert torch.allclose(exact.stream[b, m], whole, rtol=1e-10)
            assert block.stream[b, m] >= whole * (1 - 1e-12)
            for jn in (exact, block):
                assert torch.allclose(jn.stream_token[b, m], token, rtol=1e-10)
        assert torch.allclose(block.stream[b, 0], exact.stream[b, 0], rtol=1e-10)
        for k, Jp in enumerate(J["attn_in"]):
            whole = _spectral(Jp)
            assert torch.allclose(exact.attn_in[b, k], whole, rtol=1e-10)
            assert block.attn_in[b, k] >= whole * (1 - 1e-12)
        for k, Jz in enumerate(J["act_in"]):  # (N, m, n)
            for jn in (exact, block):
                assert torch.allclose(jn.act_in[k][b], Jz.norm(dim=-1), rtol=1e-10)


@pytest.mark.parametrize("refine", [0.0, 1.0, 2.0])
def test_block_bound_holds_for_any_refinement(refine, monkeypatch):
    """Exact block norms everywhere (0), only for the largest (1) or none (2:
    Frobenius norms only): the whole-matrix bound stays above the dense norm,
    and refining more never loosens it."""
    monkeypatch.setattr(tangents, "REFINE", refine)
    model = _model("standard", 7, depth=2)
    x = _images(1, 7)
    jn = jacobian_norms(model, x, exact_max=0)
    J = _dense(model, x[0])
    for m, Js in enumerate(J["stream"]):
        assert jn.stream[0, m] >= _spectral(Js.reshape(-1, Js.shape[-1])) * (1 - 1e-12)
    monkeypatch.setattr(tangents, "REFINE", 0.0)
    tight = jacobian_norms(model, x, exact_max=0)
    assert torch.all(tight.stream <= jn.stream * (1 + 1e-12))


def test_chunking_does_not_change_the_norms(monkeypatch):
    """Budgets that hold one patch or every patch of tangents at a time give
    the same norms (to rounding; every block refined, since which blocks are
    refined depends on the blocks held together)."""
    monkeypatch.setattr(tangents, "REFINE", 0.0)
    model = _model("lipschitz", 2)
    x = _images(2, 2)
    one_patch = min_memory(model)
    a = jacobian_norms(model, x, exact_max=0, max_memory=one_patch)
    b = jacobian_norms(model, x, exact_max=0)
    assert plan(model, 0, one_patch) == Plan(False, 4, 1)  # 2×2-pixel patches
    assert plan(model, 0, None).flush > 4
    for f in ("stream", "stream_token", "attn_in", "cls"):
        assert torch.allclose(getattr(a, f), getattr(b, f), rtol=1e-12)


def test_what_the_caller_holds_splits_the_batch_not_the_norms(monkeypatch):
    """Bytes the caller holds beside the tangents (``taylor_bound``: its
    samples' graphs and symbols) split the batch into parts of one sample,
    each a part of the batch's ``Linearized``, with the norms of one part
    (the exact Gram mode, every field)."""
    model = _model("standard", 1)
    x = _images(3, 1)
    lin = Linearized(model, x)
    whole = jacobian_norms(model, x, lin=lin)
    parts, split = [], tangents.norms_of_batch

    def spy(model, x, *args):
        parts.append(len(x))
        return split(model, x, *args)

    monkeypatch.setattr(tangents, "norms_of_batch", spy)
    one = sample_bytes(model, plan(model, tangents.EXACT_GRAM_MAX, None))
    apart = jacobian_norms(model, x, lin=lin, held=memory_budget(None) - one)
    assert parts == [3, 1, 1, 1] and whole.exact and apart.exact
    for f in (*tangents._BATCHED, "act_in", "variance"):
        for a, b in zip(getattr(apart, f), getattr(whole, f), strict=True):
            assert torch.allclose(a, b, rtol=1e-12), f


def test_a_batch_of_fashion_mnist_is_one_taylor_call_at_4_gib():
    """The exact Jacobian norms' tangents (about 1.2 GiB a sample at 28×28) go
    a part at a time beside the batch: ``taylor_batch`` counts what each
    sample holds through the call and one sample's tangents, so 32 samples of
    ``fmnist-3x64`` share one call at the default 4 GiB."""
    model = ViT(preset("fmnist-3x64", family="lipschitz")).double()
    assert sample_bytes(model, plan(model, tangents.EXACT_GRAM_MAX, None)) > 2**30
    assert taylor_batch(model, 4 * 2**30) >= 32


def test_a_budget_below_one_patch_is_refused_in_one_line():
    model = _model("standard", 0)
    with pytest.raises(MemoryBudgetError) as err:
        plan(model, 0, min_memory(model) - 1)
    assert "\n" not in str(err.value) and "--max-memory" in str(err.value)
    assert isinstance(err.value, LipvitError)


@pytest.mark.parametrize("text, value", [("512M", 512 * 2**20), ("2G", 2 * 2**30),
                                         ("1.5GiB", 3 * 2**29), ("4096", 4096),
                                         ("64kb", 64 * 2**10)])
def test_parse_memory(text, value):
    assert parse_memory(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-1G", "0", "nanM", "infG"])
def test_parse_memory_refuses_nonsense(text):
    with pytest.raises(LipvitError):
        parse_memory(text)


@pytest.mark.parametrize("family", FAMILIES)
def test_large_image_mode_is_finite_at_zero(family, monkeypatch):
    """Without the exact logit norms (``+inf``), ε = 0 still gives a zero drop
    (``inf · 0`` is not taken as a bound) and positive ε a finite one."""
    from lipvit.certify.taylor.certificate import taylor_bound

    monkeypatch.setattr("lipvit.certify.taylor.jacobian_norms.EXACT_GRAM_MAX", 0)
    model = _model(family, 3, patch_size=4)  # 5 tokens: any size
    x = _images(2, 3)
    with torch.no_grad():
        y = model(x).argmax(1)
    tb = taylor_bound(model, x, y)
    assert torch.all(tb.margin_drop(0.0) == 0)
    assert torch.all(tb.margin_drop(1e-2).isfinite())
    assert torch.all(tb.radius() >= 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_bounds_are_not_changed_by_later_model_changes(family):
    """``taylor`` and the ``lofast`` chain evaluate lazily: changing the model
    afterwards (training on, moving it to another device or dtype) must not
    change a bound computed before, nor its mode."""
    from lipvit.certify.lofast.network import network_bound
    from lipvit.certify.taylor.certificate import taylor_bound

    model = _model(family, 6, depth=2, patch_size=4).train()  # 5 tokens: any size
    x = _images(3, 6)
    with torch.no_grad():
        y = model(x).argmax(1)
    tb, nb = taylor_bound(model, x, y), network_bound(model, x, "lofast")
    assert model.training
    before = (tb.margin_drop(0.02), tb.radius(), nb.delta_out(0.02))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    model.float()
    after = (tb.margin_drop(0.02), tb.radius(), nb.delta_out(0.02))
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_taylor_on_cuda_matches_cpu(family):
    """Every step of ``taylor`` on the GPU (tangents, norms, symbols, radius):
    the same certificate as on the CPU, every tensor on the device."""
    from lipvit.certify.taylor.certificate import taylor_bound

    model = _model(family, 5, depth=3)
    x = _images(3, 5)
    with torch.no_grad():
        y = model(x).argmax(1)
    cpu = taylor_bound(model, x, y)
    gpu = taylor_bound(model.cuda(), x.cuda(), y.cuda())
    assert gpu.margins.device.type == "cuda"
    for eps in (1e-3, 3e-2):
        assert gpu.margin_drop(eps).device.type == "cuda"
        assert torch.allclose(gpu.margin_drop(eps).cpu(), cpu.margin_drop(eps),
                              rtol=1e-9, atol=1e-12)
    assert torch.allclose(gpu.radius().cpu(), cpu.radius(), rtol=1e-6)
    large = jacobian_norms(model.cuda(), x.cuda(), exact_max=0)
    assert large.stream.device.type == "cuda"
