"""Tests for lipvit.certify.attention and .lofast (LoFAST Theorem 1 and extensions).

Brute force at tiny sizes (explicit Kronecker / Lemma-2 matrices built with
``torch.kron`` from the paper's formulas), PGD lower bounds, closed forms.
Float64, CPU, seeded.
"""

from __future__ import annotations

import math

import pytest
import torch
from lipvit.analysis.pgd import pgd_deviation
from lipvit.certify.attention import attention, attention_probs, query_key, value_output
from lipvit.certify.lofast import layer as L
from lipvit.certify.lofast import operators as O
from lipvit.certify.lofast.layer import (
    certified_lambda_max,
    key_sensitivity,
    lemma2_norm,
    lofast_bound,
    lofast_terms,
    softmax_local_constant,
)
from torch import nn

import lipvit

DT = torch.float64
TOTALS = ("total_local", "total_half", "total", "total_fast")


def layer(seed: int, B=2, N=4, D=6, H=2, d=3, qk=1.0, vo=1.0, x=1.0):
    """Random ``(X, W_q, W_k, W_v, W_o)``; ``qk``, ``vo``, ``x`` scale the parts."""
    g = torch.Generator().manual_seed(seed)
    W_q = torch.randn(H, D, d, generator=g, dtype=DT) * qk / math.sqrt(D)
    W_k = torch.randn(H, D, d, generator=g, dtype=DT) * qk / math.sqrt(D)
    W_v = torch.randn(H, D, d, generator=g, dtype=DT) * vo / math.sqrt(D)
    W_o = torch.randn(H, d, D, generator=g, dtype=DT) * vo / math.sqrt(d)
    X = torch.randn(B, N, D, generator=g, dtype=DT) * x
    return X, W_q, W_k, W_v, W_o


def kron_zeta_matrix(X, W_q, W_k, W_v, W_o, residual: bool) -> torch.Tensor:
    """``H ⊗ I + Σ_h P_h ⊗ (W_v[h] W_o[h])ᵀ`` with torch.kron, ``(B, N·D, N·D)``."""
    B, N, D = X.shape
    P = attention_probs(X, W_q, W_k)
    mats = []
    for b in range(B):
        K = torch.kron(torch.eye(N, dtype=DT) * float(residual), torch.eye(D, dtype=DT))
        for h in range(W_q.shape[0]):
            K = K + torch.kron(P[b, h], (W_v[h] @ W_o[h]).T.contiguous())
        mats.append(K)
    return torch.stack(mats)


def kron_lemma2_matrix(x: torch.Tensor, W_q: torch.Tensor, W_k: torch.Tensor):
    """Eq. (25): ``I ⊗ [x_jᵀ W_K W_Qᵀ]_j + Σ_i (e_i ⊗ I) ⊗ (x_iᵀ W_Q W_Kᵀ)``."""
    N, D = x.shape
    A = W_q @ W_k.T
    M = torch.kron(torch.eye(N, dtype=DT), x @ A.T)  # rows x_jᵀ Aᵀ
    for i in range(N):
        e_i = torch.zeros(N, 1, dtype=DT)
        e_i[i] = 1
        M = M + torch.kron(torch.kron(e_i, torch.eye(N, dtype=DT)), (x[i] @ A)[None])
    return M  # (N², N·D)


# ---------------------------------------------------------------- the map


def _randomize(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            param = (m.parametrizations.weight.original
                     if nn.utils.parametrize.is_parametrized(m, "weight") else m.weight)
            with torch.no_grad():
                param.copy_(0.5 * torch.randn(param.shape, generator=g, dtype=DT))
                if m.bias is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g, dtype=DT))


@pytest.mark.parametrize("family", ["standard", "lipschitz"])
def test_attention_matches_model(family: str) -> None:
    model = lipvit.ViT(lipvit.preset("digits-tiny", family=family)).double()
    _randomize(model, 0)
    g = torch.Generator().manual_seed(1)
    for attn in model.attention_layers():
        X = torch.randn(3, model.config.num_patches + 1, model.config.embed_dim,
                        generator=g, dtype=DT)
        W = attn.head_weights()
        b = attn.head_biases()
        assert b.b_q is None and b.b_v is None  # qkv_bias=False
        with torch.no_grad():
            ref = attn(X) - b.b_o
            bare = attention(X, *W, residual=False)
            assert torch.allclose(bare, ref, atol=1e-6, rtol=0)
            res = attention(X, *W, residual=True)
            assert torch.allclose(res, X + ref, atol=1e-6, rtol=0)
        P = attention_probs(X, W.W_q, W.W_k)
        assert not torch.allclose(P, torch.full_like(P, 1 / P.shape[-1]), atol=1e-3)


def test_attention_matches_model_with_zeroed_qkv_biases() -> None:
    cfg = lipvit.preset("digits-tiny", family="standard", qkv_bias=True)
    model = lipvit.ViT(cfg).double()
    _randomize(model, 2)
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.qkv.bias.zero_()
        X = torch.randn(2, cfg.num_patches + 1, cfg.embed_dim, dtype=DT)
        ref = attn(X) - attn.proj.bias
        assert torch.allclose(attention(X, *attn.head_weights(), residual=False), ref,
                              atol=1e-6, rtol=0)


# ---------------------------------------------------------------- ζ, Lemma 1


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_zeta_equals_norm_of_kronecker_matrix(seed: int, residual: bool) -> None:
    X, *W = layer(seed, x=[0.5, 1, 2, 4, 1, 3][seed], qk=[1, 2, 4, 0.5, 8, 3][seed])
    K = kron_zeta_matrix(X, *W, residual)
    # vec convention: K vec(Γᵀ) = vec((HΓ + Σ_h P_h Γ M_h)ᵀ), vec(Γᵀ) = Γ.reshape(-1)
    g = torch.Generator().manual_seed(seed)
    Gamma = torch.randn(X.shape, dtype=DT, generator=g)
    P = attention_probs(X, W[0], W[1])
    direct = torch.einsum("bhnm,bmD,hDE->bnE", P, Gamma, value_output(W[2], W[3]))
    direct = direct + Gamma * float(residual)
    Kvec = (K @ Gamma.reshape(2, -1, 1)).reshape(X.shape)
    assert torch.allclose(Kvec, direct, atol=1e-12)
    assert torch.allclose(O.sensitivity_matvec(Gamma, P, W[2], W[3], residual), direct,
                          atol=1e-12)
    Y = torch.randn_like(Gamma)
    assert torch.allclose(O.sensitivity_rmatvec(Y, P, W[2], W[3], residual),
                          (K.mT @ Y.reshape(2, -1, 1)).reshape(X.shape), atol=1e-12)
    exact = torch.linalg.matrix_norm(K, ord=2)
    z = key_sensitivity(X, *W, residual=residual)
    assert z.exact and "eigvalsh" in z.method
    assert torch.allclose(z.value, exact, rtol=1e-10)
    est = key_sensitivity(X, *W, residual=residual, exact=False)
    assert not est.exact and "estimate" in est.method
    assert torch.all(est.value <= exact * (1 + 1e-10))
    assert torch.allclose(est.value, exact, rtol=1e-6)


def test_sensitivity_gram_is_ktk() -> None:
    X, *W = layer(5, N=3, D=4)
    P = attention_probs(X, W[0], W[1])
    W_vo = value_output(W[2], W[3])
    for residual in (True, False):
        K = O.sensitivity_matrix(P, W_vo, residual)
        assert torch.allclose(K, kron_zeta_matrix(X, *W, residual), atol=1e-14)
        gram = O.sensitivity_gram(P, W_vo, residual)
        assert torch.allclose(gram, K.mT @ K, atol=1e-12)


@pytest.mark.parametrize("residual", [True, False])
def test_zeta_certificate_route(monkeypatch, residual: bool) -> None:
    # Force the structured certificate (and its Cholesky fallback where it is
    # loose) at a checkable size.
    monkeypatch.setattr(L, "EIGVALSH_MAX_N", 0)
    X, *W = layer(6, B=3, N=5, D=6, qk=3.0)
    exact = torch.linalg.matrix_norm(kron_zeta_matrix(X, *W, residual), ord=2)
    z = key_sensitivity(X, *W, residual=residual)
    assert "structured" in z.method and z.exact
    assert torch.all(z.value >= exact * (1 - 1e-14))
    assert torch.all(z.value <= exact * (1 + 1e-4))


# ---------------------------------------------------------------- Lemma 2


@pytest.mark.parametrize("seed,D,d", [(0, 6, 3), (1, 6, 3), (2, 10, 2), (3, 9, 4)])
def test_lemma2_norm_equals_explicit_matrix(seed: int, D: int, d: int) -> None:
    # D = 10, d = 2 and D = 9, d = 4 use the reduced operator (2d < D).
    X, W_q, W_k, W_v, W_o = layer(seed, N=4, D=D, H=2, d=d, qk=2.0, x=1.5)
    W_qk = query_key(W_q, W_k)
    M = O.lemma2_matrix(X, W_qk)  # (B, H, N², N·D)
    for b in range(X.shape[0]):
        for h in range(W_q.shape[0]):
            assert torch.allclose(M[b, h], kron_lemma2_matrix(X[b], W_q[h], W_k[h]),
                                  atol=1e-12)
    g = torch.Generator().manual_seed(9)
    Gamma = torch.randn(2, 2, 4, D, dtype=DT, generator=g)  # (B, H, N, D)
    Xh = X[:, None]  # (B, 1, N, D)
    direct = Gamma @ W_qk @ Xh.mT + Xh @ W_qk @ Gamma.mT  # Γ A Xᵀ + X A Γᵀ
    assert torch.allclose(O.lemma2_matvec(Gamma, X, W_qk), direct, atol=1e-12)
    Mvec = (M @ Gamma.reshape(2, 2, -1, 1)).reshape(direct.shape)
    assert torch.allclose(Mvec, direct, atol=1e-12)
    Y = torch.randn_like(direct)
    MtY = (M.mT @ Y.reshape(2, 2, -1, 1)).reshape(Gamma.shape)
    assert torch.allclose(O.lemma2_rmatvec(Y, X, W_qk), MtY, atol=1e-12)
    exact = torch.linalg.matrix_norm(M, ord=2)  # (B, H)
    m = lemma2_norm(X, W_q, W_k)
    assert torch.allclose(m.value, exact, rtol=1e-10)
    est = lemma2_norm(X, W_q, W_k, exact=False)
    assert torch.all(est.value <= exact * (1 + 1e-10))
    assert torch.allclose(est.value, exact, rtol=1e-6)
    # ξ relaxation, eq. (26), is an upper bound of ‖M_h(X)‖.
    xi = lofast_terms(X, W_q, W_k, W_v, W_o).xi
    assert torch.all(xi >= exact * (1 - 1e-12))


def test_lemma2_certificate_route(monkeypatch) -> None:
    monkeypatch.setattr(L, "EIGVALSH_MAX_N", 0)
    X, W_q, W_k, *_ = layer(7, N=5, D=8, H=2, d=2, qk=2.0)
    exact = torch.linalg.matrix_norm(O.lemma2_matrix(X, query_key(W_q, W_k)), ord=2)
    m = lemma2_norm(X, W_q, W_k)
    assert "Cholesky" in m.method
    assert torch.all(m.value >= exact * (1 - 1e-14))
    assert torch.all(m.value <= exact * (1 + 1e-4))


def test_lemma2_structured_route(monkeypatch) -> None:
    monkeypatch.setattr(L, "EIGVALSH_MAX_N", 0)
    monkeypatch.setattr(L, "LEMMA2_CHOLESKY_MAX_N", 0)
    X, W_q, W_k, *_ = layer(7, N=5, D=8, H=2, d=2, qk=2.0)
    exact = torch.linalg.matrix_norm(O.lemma2_matrix(X, query_key(W_q, W_k)), ord=2)
    m = lemma2_norm(X, W_q, W_k)
    assert "structured" in m.method and m.exact
    assert torch.all(m.value >= exact * (1 - 1e-14))
    C, E = O.lemma2_factors(X, query_key(W_q, W_k))
    xi = torch.linalg.matrix_norm(C, ord=2) + torch.linalg.matrix_norm(E, ord=2)
    assert torch.all(m.value <= xi * (1 + 1e-12))  # never above ξ, eq. (26)


# ---------------------------------------------------------------- certificate


def test_certified_lambda_max() -> None:
    g = torch.Generator().manual_seed(0)
    A = torch.randn(60, 40, generator=g, dtype=DT)
    G = A.T @ A
    G[:3, :3] += 5 * torch.eye(3, dtype=DT)  # a cluster at the top
    lam = torch.linalg.eigvalsh(G)[-1].item()
    copy = G.clone()
    good = certified_lambda_max(G, lam * (1 - 1e-9))
    assert lam <= good <= lam * (1 + 1e-6)
    assert torch.equal(G, copy)  # restored exactly
    for lower in (0.0, 0.3 * lam, 0.99 * lam, 2.0 * lam):  # poor estimates stay sound
        assert certified_lambda_max(G, lower) >= lam
    # An estimate above λ_max is accepted as it is (a true upper bound).
    assert certified_lambda_max(G, 2.0 * lam) == pytest.approx(2.0 * lam, rel=1e-6)


def test_exact_false_builds_no_large_matrix(monkeypatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("dense matrix built in exact=False mode")

    for module, name in ((L, "sensitivity_gram"), (O, "sensitivity_matrix"),
                         (L, "lemma2_gram"), (O, "lemma2_matrix"),
                         (L, "certified_lambda_max")):
        monkeypatch.setattr(module, name, forbidden)
    X, *W = layer(8, N=6, D=8, H=2, d=4)
    b = lofast_bound(X, *W, 0.1, exact=False)
    assert not b.exact and b.method.count("estimate") == 2


# ---------------------------------------------------------------- softmax


def test_softmax_local_constant_brute_force() -> None:
    g = torch.Generator().manual_seed(0)
    for scale, rho in [(0.1, 0.05), (1.0, 0.5), (3.0, 0.2), (5.0, 2.0), (0.0, 1e-3)]:
        z = torch.randn(40, 7, generator=g, dtype=DT) * scale  # 40 rows
        c = softmax_local_constant(z.reshape(1, 40, 7), torch.tensor([rho], dtype=DT))
        assert 0 < c.item() <= 0.5
        delta = torch.randn(40, 200, 7, generator=g, dtype=DT)
        delta = delta * (rho * torch.rand(40, 200, 1, generator=g, dtype=DT)
                         / delta.norm(dim=-1, keepdim=True))
        change = (torch.softmax(z[:, None] + delta, -1) - torch.softmax(z, -1)[:, None])
        assert torch.all(change.norm(dim=-1) <= c * delta.norm(dim=-1) * (1 + 1e-9))
        # The Jacobian norm along the way never exceeds c.
        p = torch.softmax(z[:, None] + delta, -1)  # (40, 200, 7)
        J = torch.diag_embed(p) - p[..., :, None] * p[..., None, :]
        assert torch.all(torch.linalg.eigvalsh(J)[..., -1] <= c * (1 + 1e-12))
    # Diffuse attention: c ≈ 1/N, far below the global ½.
    c = softmax_local_constant(torch.zeros(1, 65, 65, dtype=DT), torch.tensor([1e-4]))
    assert c.item() == pytest.approx(1 / 65, rel=1e-3)


# ---------------------------------------------------------------- soundness


def _check_sound(X, W, residual: bool, eps: float, steps=100, restarts=4,
                 seed=0) -> None:
    b = lofast_bound(X, *W, eps, residual=residual)
    pgd = pgd_deviation(lambda Z: attention(Z, *W, residual=residual), X, eps,
                        steps=steps, restarts=restarts, seed=seed)
    tol = 1 + 1e-9
    assert torch.all(pgd <= b.total_local * tol), (pgd, b.total_local)
    assert torch.all(b.total_local <= b.total_half * tol)
    assert torch.all(b.total_half <= b.total * tol)
    assert torch.all(b.total <= b.total_fast * tol)
    assert torch.all(b.delta_1 <= b.delta_1_naive * tol)
    assert torch.allclose(b.total, b.delta_1 + b.delta_2_tight)
    assert torch.allclose(b.total_half, b.delta_1 + b.delta_2_tight / 2)


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_sound_random_layers(seed: int, residual: bool) -> None:
    X, *W = layer(10 + seed, B=3, x=[0.3, 1.0, 2.0, 0.05, 1.0, 1.5][seed],
                  qk=[1.0, 1.0, 1.0, 1.0, 0.2, 2.0][seed])
    for eps in (0.01, 0.5):
        _check_sound(X, W, residual, eps, seed=seed)


@pytest.mark.parametrize("seed,qk,x", [(0, 8.0, 1.0), (1, 20.0, 1.0), (2, 3.0, 6.0),
                                       (3, 12.0, 3.0), (4, 50.0, 0.5), (5, 4.0, 15.0)])
def test_sound_adversarial_scalings(seed: int, qk: float, x: float) -> None:
    # Large ‖W_q W_kᵀ‖ and large-norm inputs: sharp softmax, δ2 dominates.
    X, *W = layer(20 + seed, B=2, N=4, D=6, qk=qk, x=x)
    for residual in (True, False):
        for eps in (0.005, 0.3):
            _check_sound(X, W, residual, eps, steps=100, restarts=4, seed=seed)


def test_sound_on_model_layer() -> None:
    # The layer of a (randomised) lipschitz-family model at its projected input.
    model = lipvit.ViT(lipvit.preset("digits-tiny", family="lipschitz")).double()
    _randomize(model, 3)
    attn = model.blocks[0].attn
    X = model.blocks[0].norm1(torch.randn(2, 17, 32, dtype=DT) * 3)  # ‖X‖_F ≤ 1
    W = [w.detach() for w in attn.head_weights()]
    for eps in (0.01, 0.1):
        _check_sound(X, W, True, eps, steps=60, restarts=2)


@pytest.mark.parametrize("residual", [True, False])
def test_delta_1_attained_by_pgd_on_linear_term(residual: bool) -> None:
    X, *W = layer(30, B=3, qk=2.0)
    P = attention_probs(X, W[0], W[1])
    eps = 0.2
    b = lofast_bound(X, *W, eps, residual=residual)

    def linear(Z):  # X' ↦ A(X' − X): the Δ1 term of eq. (10), Z restarts × samples
        r = len(Z) // len(X)
        return O.sensitivity_matvec(Z - X.repeat(r, 1, 1), P.repeat(r, 1, 1, 1),
                                    W[2], W[3], residual)

    pgd = pgd_deviation(linear, X, eps, steps=200, restarts=2)
    assert torch.all(pgd <= b.delta_1 * (1 + 1e-10))
    assert torch.allclose(pgd, b.delta_1, rtol=1e-4)
    assert torch.all(b.delta_1_naive >= b.delta_1 * (1 - 1e-12))


# ---------------------------------------------------------------- API


def test_terms_and_per_sample_eps() -> None:
    X, *W = layer(40, B=3)
    terms = lofast_terms(X, *W)
    eps = torch.tensor([0.0, 0.05, 0.2], dtype=DT)
    b = terms.bound(eps)
    for i, e in enumerate(eps.tolist()):
        one = lofast_bound(X, *W, e)
        for name in TOTALS + ("delta_1", "delta_1_naive", "zeta"):
            assert torch.allclose(getattr(b, name)[i], getattr(one, name)[i],
                                  rtol=1e-12)
    assert torch.all(b.total[0] == 0)
    assert torch.equal(terms.delta(eps), b.total)
    assert torch.equal(terms.delta(eps, "local"), b.total_local)
    with pytest.raises(ValueError):
        terms.delta(eps, "nonsense")


def test_float32_rounds_up() -> None:
    X, *W = layer(41, B=2, qk=2.0)
    X32, W32 = X.float(), [w.float() for w in W]
    b32 = lofast_bound(X32, *W32, 0.1)
    b64 = lofast_bound(X32.double(), *[w.double() for w in W32], 0.1)
    for name in TOTALS + ("zeta",):
        assert getattr(b32, name).dtype == torch.float32
        assert torch.all(getattr(b32, name).double() >= getattr(b64, name))
    fast = lofast_bound(X32, *W32, 0.1, exact=False)
    assert fast.total.dtype == torch.float32
    assert torch.allclose(fast.total.double(), b64.total, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    X, *W = layer(42, B=2)
    cpu = lofast_bound(X, *W, 0.1)
    gpu = lofast_bound(X.cuda(), *[w.cuda() for w in W], 0.1)
    assert gpu.total.device.type == "cuda"
    assert torch.allclose(gpu.total.cpu(), cpu.total, rtol=1e-9)


@pytest.mark.parametrize("eps, error", [
    (-0.1, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
    (-float("inf"), ValueError), (torch.tensor([0.1, -0.1]), ValueError),
    ("x", TypeError), (True, TypeError),
])
def test_bad_eps(eps, error) -> None:
    X, *W = layer(43)
    with pytest.raises(error):
        lofast_bound(X, *W, eps)
    with pytest.raises(error):
        lofast_terms(X, *W).bound(eps)


def test_bad_shapes() -> None:
    X, W_q, W_k, W_v, W_o = layer(44)
    with pytest.raises(ValueError):
        lofast_bound(X[0], W_q, W_k, W_v, W_o, 0.1)
    with pytest.raises(ValueError):
        lofast_bound(X, W_q, W_k, W_v, W_o.transpose(1, 2), 0.1)
    with pytest.raises(TypeError):
        lofast_bound(X.float(), W_q, W_k, W_v, W_o, 0.1)
