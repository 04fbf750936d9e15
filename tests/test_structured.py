"""Tests for lipvit.certify.lofast.structured: the structured ζ and ‖M_h(X)‖
certificates.

Brute force at tiny sizes in float64 (dense ``eigvalsh`` of the explicit
Kronecker / Lemma-2 matrices), many seeds, adversarial cases (sharp attention,
residual ``H = I``, clustered spectra, poor and non-orthonormal bases), and PGD
lower bounds through :func:`lipvit.certify.lofast.layer.lofast_bound` on the structured
route. """

from __future__ import annotations

import pytest
import torch
from lipvit.certify.attention import attention_probs, query_key, value_output
from lipvit.certify.lofast import layer as L
from lipvit.certify.lofast import operators as O
from lipvit.certify.lofast import structured as S

from tests.test_lofast import _check_sound, kron_zeta_matrix, layer

DT = torch.float64


def _lambda_max(G: torch.Tensor) -> torch.Tensor:
    return torch.linalg.eigvalsh(G)[..., -1]


def _bound(G: torch.Tensor, V: torch.Tensor) -> S.SubspaceBound:
    """:func:`S.subspace_lambda_bound` for dense ``G`` ``(B, n, n)``."""
    GV = G @ V
    trace = G.diagonal(dim1=-2, dim2=-1).sum(-1)
    fro2 = (G * G).sum((-2, -1))
    n = G.shape[-1]
    err = S.gamma(2 * n) * fro2 + 1e-300
    g = torch.linalg.matrix_norm(G)
    return S.subspace_lambda_bound(V, GV, trace, S.gamma(n) * trace.abs() + 1e-300,
                                   fro2, err, S.gamma(2 * n) * g, g)


@pytest.mark.parametrize("seed", range(12))
def test_subspace_bound_is_an_upper_bound(seed: int) -> None:
    # Random PSD G with a clustered top, random (even poor) bases of several sizes.
    g = torch.Generator().manual_seed(seed)
    n = 40
    A = torch.randn(3, n, n, generator=g, dtype=DT) / n**0.5
    G = A.mT @ A
    G[1] += 3 * torch.eye(n, dtype=DT)  # shifted spectrum, like H = I
    G[2, :4, :4] += 2 * torch.eye(4, dtype=DT)  # cluster at the top
    lam = _lambda_max(G)
    for k in (1, 3, 8, 20):
        Z = torch.randn(3, n, k, generator=g, dtype=DT)
        for it in (0, 2, 30):  # from a random basis to a converged one
            V = torch.linalg.qr(torch.linalg.matrix_power(G, it) @ Z).Q
            b = _bound(G, V)
            assert torch.all(b.upper >= lam), (k, it, b.upper - lam)
            assert torch.all(b.ritz <= lam * (1 + 1e-12))


def test_subspace_bound_exact_subspace_is_tight() -> None:
    # V spans the top eigenvectors of a matrix whose tail is tiny: bound ≈ λ_max.
    g = torch.Generator().manual_seed(1)
    n, k = 50, 5
    Q = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT)).Q
    ev = torch.cat([torch.tensor([3.0, 2.9, 2.0, 1.5, 1.0], dtype=DT),
                    torch.full((n - k,), 1e-4, dtype=DT)])
    G = ((Q * ev) @ Q.T)[None]
    b = _bound(G, Q[None, :, :k])
    assert 3.0 <= b.upper.item() <= 3.0 * (1 + 1e-9)


def test_subspace_bound_accounts_for_non_orthonormal_basis() -> None:
    # A basis with a visible orthonormality defect: still an upper bound; a
    # defect beyond 1/4 proves nothing (inf), never a wrong number.
    g = torch.Generator().manual_seed(2)
    n, k = 30, 6
    A = torch.randn(n, n, generator=g, dtype=DT)
    G = (A.T @ A)[None]
    lam = _lambda_max(G)
    Q = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=DT)).Q
    for defect in (1e-12, 1e-6, 1e-2, 0.5):
        V = (Q * (1 + defect * torch.linspace(-1, 1, k, dtype=DT)))[None]
        b = _bound(G, V)
        assert torch.all(b.upper >= lam)
    assert torch.isinf(b.upper).all()


def test_kron_moments_match_dense() -> None:
    for residual in (False, True):
        X, *W = layer(3, B=2, N=5, D=6, H=3, d=2, qk=2.0)
        P = attention_probs(X, W[0], W[1])
        W_vo = value_output(W[2], W[3])
        G = O.sensitivity_gram(P, W_vo, residual)
        m = S.kron_moments(P, W_vo, residual)
        trace = G.diagonal(dim1=-2, dim2=-1).sum(-1)
        fro2 = (G * G).sum((-2, -1))
        assert torch.allclose(m.trace, trace, rtol=1e-13)
        assert torch.allclose(m.fro2, fro2, rtol=1e-13)
        assert torch.all((m.trace - trace).abs() <= m.trace_err)
        assert torch.all((m.fro2 - fro2).abs() <= m.fro2_err)
        assert torch.all(m.fro2_err <= 1e-9 * fro2)


def test_gram_apply_matches_dense() -> None:
    X, *W = layer(4, B=2, N=5, D=6, H=2, d=3)
    P = attention_probs(X, W[0], W[1])
    G = O.sensitivity_gram(P, value_output(W[2], W[3]), True)  # (B, 30, 30)
    g = torch.Generator().manual_seed(0)
    Gamma = torch.randn(2, 4, 5, 6, dtype=DT, generator=g)
    out = S.gram_apply(Gamma, P, W[2], W[3], True)  # (B, K, N, D)
    dense = (G[:, None] @ Gamma.reshape(2, 4, 30, 1)).reshape(out.shape)
    assert torch.allclose(out, dense, atol=1e-12)


CASES = [  # (seed, qk, x, N, D, H, d): diffuse, sharp and very sharp attention
    (0, 0.1, 1.0, 9, 8, 2, 4), (1, 1.0, 1.0, 9, 8, 2, 4),
    (2, 4.0, 2.0, 7, 10, 3, 2), (3, 20.0, 3.0, 6, 8, 2, 4),
    (4, 0.01, 0.5, 12, 6, 2, 3), (5, 50.0, 1.0, 5, 12, 4, 3),
]


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_zeta_certificate_against_dense(case, residual: bool) -> None:
    seed, qk, x, N, D, H, d = case
    X, *W = layer(seed, B=3, N=N, D=D, H=H, d=d, qk=qk, x=x)
    exact = torch.linalg.matrix_norm(kron_zeta_matrix(X, *W, residual), ord=2)
    P = attention_probs(X, W[0], W[1])
    for k, n_iter in ((0, 0), (4, 3), (8, 20)):
        c = S.zeta_certificate(P, W[2], W[3], residual, k=k, n_iter=n_iter)
        assert torch.all(c.upper >= exact), (k, c.upper - exact)
        assert torch.all(c.ritz <= exact * (1 + 1e-10))
    # The library route (structured, Cholesky fallback) is within 1e-4 of exact.
    Pz = L._certified_zeta(P, W[2], W[3], residual).value
    assert torch.all(Pz >= exact) and torch.all(Pz <= exact * (1 + 1e-4))


@pytest.mark.parametrize("residual", [False, True])
def test_zeta_fallback_skipped_above_cholesky_max(monkeypatch, residual: bool) -> None:
    # Sharp attention leaves the structured certificate loose (the Cholesky
    # fallback runs); with the Gram size above ZETA_CHOLESKY_MAX_N no dense
    # Gram matrix is formed and the value is the structured certificate, sound.
    seed, qk, x, N, D, H, d = CASES[1]  # loose in both forms
    X, *W = layer(seed, B=3, N=N, D=D, H=H, d=d, qk=qk, x=x)
    exact = torch.linalg.matrix_norm(kron_zeta_matrix(X, *W, residual), ord=2)
    P = attention_probs(X, W[0], W[1])
    cert = S.zeta_certificate(P, W[2], W[3], residual)
    assert bool((cert.upper > cert.ritz * (1 + L.STRUCTURED_RTOL)).any())
    with_dense = L._certified_zeta(P, W[2], W[3], residual).value
    monkeypatch.setattr(L, "ZETA_CHOLESKY_MAX_N", N * D - 1)

    def no_gram(*args, **kwargs):
        raise AssertionError("dense Gram formed above ZETA_CHOLESKY_MAX_N")

    monkeypatch.setattr(L, "sensitivity_gram", no_gram)
    alone = L._certified_zeta(P, W[2], W[3], residual).value
    assert torch.equal(alone, cert.upper)
    assert torch.all(alone >= exact) and torch.all(alone >= with_dense)


def test_zeta_certificate_diffuse_attention_is_tight() -> None:
    # Uniform-ish attention (tiny W_q W_kᵀ): the token-constant directions
    # capture ζ and the certificate is within 1e-8 of exact, no fallback.
    for residual in (False, True):
        X, *W = layer(7, B=2, N=12, D=8, H=2, d=4, qk=1e-3)
        exact = torch.linalg.matrix_norm(kron_zeta_matrix(X, *W, residual), ord=2)
        P = attention_probs(X, W[0], W[1])
        c = S.zeta_certificate(P, W[2], W[3], residual)
        assert torch.all(c.upper >= exact)
        assert torch.all(c.upper <= exact * (1 + 1e-8)), (c.upper - exact) / exact


@pytest.mark.parametrize("seed", range(8))
def test_lemma2_structured_bound_against_dense(seed: int) -> None:
    X, W_q, W_k, *_ = layer(seed, B=2, N=5, D=8, H=3, d=2, qk=[0.5, 2, 8, 30][seed % 4],
                            x=[0.2, 1, 5][seed % 3])
    M = O.lemma2_matrix(X, query_key(W_q, W_k))  # (B, H, N², N·D)
    exact = torch.linalg.matrix_norm(M, ord=2)
    bound = S.lemma2_structured_bound(X, W_q, W_k)
    C, E = O.lemma2_factors(X, query_key(W_q, W_k))
    xi = torch.linalg.matrix_norm(C, ord=2) + torch.linalg.matrix_norm(E, ord=2)
    assert torch.all(bound >= exact)
    assert torch.all(bound <= xi * (1 + 1e-12))


def test_certified_lambda_max_small() -> None:
    g = torch.Generator().manual_seed(5)
    A = torch.randn(4, 10, 10, generator=g, dtype=DT)
    G = A + A.mT  # indefinite
    G[1] = G[1] * 1e-200  # tiny scale
    lam = torch.linalg.eigvalsh(G)[..., -1]
    up = S.certified_lambda_max_small(G)
    assert torch.all(up >= lam)
    assert torch.all(up <= lam + 1e-9 * lam.abs().clamp_min(1e-300))


@pytest.mark.parametrize("seed", range(3))
def test_structured_route_sound_against_pgd(monkeypatch, seed: int) -> None:
    # lofast_bound on the structured route (forced at a tiny size) vs PGD.
    monkeypatch.setattr(L, "EIGVALSH_MAX_N", 0)
    X, *W = layer(30 + seed, B=2, N=5, D=6, qk=[1.0, 6.0, 20.0][seed], x=1.0)
    for residual in (True, False):
        for eps in (0.01, 0.3):
            _check_sound(X, W, residual, eps, steps=60, restarts=2, seed=seed)


def test_zeta_certificate_chunks_agree(monkeypatch) -> None:
    # Memory-aware chunking: one sample per chunk gives the same numbers.
    X, *W = layer(8, B=3, N=6, D=8, H=2, d=4, qk=2.0)
    P = attention_probs(X, W[0], W[1])
    whole = S.zeta_certificate(P, W[2], W[3], True)
    monkeypatch.setattr(S, "CPU_CHUNK_BYTES", 1)
    chunked = S.zeta_certificate(P, W[2], W[3], True)
    assert torch.allclose(whole.upper, chunked.upper, rtol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_zeta_certificate_cuda_matches_cpu() -> None:
    X, *W = layer(9, B=4, N=9, D=16, H=2, d=4, qk=1.0)
    exact = torch.linalg.matrix_norm(kron_zeta_matrix(X, *W, False), ord=2)
    P = attention_probs(X, W[0], W[1])
    cpu = S.zeta_certificate(P, W[2], W[3], False)
    gpu = S.zeta_certificate(P.cuda(), W[2].cuda(), W[3].cuda(), False)
    assert gpu.upper.device.type == "cuda"
    assert torch.all(gpu.upper.cpu() >= exact)
    assert torch.allclose(gpu.upper.cpu(), cpu.upper, rtol=1e-6)
    m = S.lemma2_structured_bound(X.cuda(), W[0].cuda(), W[1].cuda())
    assert torch.allclose(m.cpu(), S.lemma2_structured_bound(X, W[0], W[1]), rtol=1e-9)
