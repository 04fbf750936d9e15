"""Exact-mode eigenvalues cover float rounding (docs/math.md, "Rounding").

The reference is λ_max of the Gram matrix computed in 60-digit arithmetic
(mpmath) from the same float64 factors. ``torch.linalg.eigvalsh`` of the
float64 Gram matrix fell below it on 5 of the 12 cases below (before the
margin); the bounds the certificates use never do. Likewise, deciding
"LayerProject is the identity on the ball" on float norms was wrong in 123 of
300 boundary cases.
"""

from __future__ import annotations

import mpmath
import pytest
import torch
from lipvit.certify.lofast.layer import _key_sensitivity, certified_lambda_max, zeta_cls
from lipvit.certify.lofast.operators import sensitivity_matrix

from lipvit import spectral
from lipvit.spectral import eigvalsh_upper

DT = torch.float64


def _lambda_max_exact(K: torch.Tensor) -> mpmath.mpf:
    """λ_max(KᵀK) in 60-digit arithmetic from the float64 entries of ``K``."""
    with mpmath.workdps(60):
        M = mpmath.matrix(K.tolist())
        G = M.T * M
        return max(mpmath.eigsy(G, eigvals_only=True))


def _cases(n_cases: int = 12):
    g = torch.Generator().manual_seed(0)
    for i in range(n_cases):
        m, n = 6 + i % 3, 5 + i % 4
        # Nearly rank-one matrices with large entries: rounding matters most.
        u = torch.randn(m, 1, generator=g, dtype=DT)
        v = torch.randn(1, n, generator=g, dtype=DT)
        yield 1e3 * (u @ v) + torch.randn(m, n, generator=g, dtype=DT)



def test_eigvalsh_upper_is_above_the_exact_value():
    for K in _cases():
        m = K.shape[0]
        G = K.T @ K
        up = eigvalsh_upper(G, scale=K.pow(2).sum(), inner=m).item()
        exact = _lambda_max_exact(K)
        assert mpmath.mpf(up) >= exact
        assert (mpmath.mpf(up) - exact) / exact < 1e-9  # and still tight


def test_cholesky_certificate_is_above_the_exact_value():
    for K in _cases():
        G = K.T @ K
        lam = torch.linalg.eigvalsh(G)[-1].item()
        up = certified_lambda_max(G, lam, scale=float(K.pow(2).sum()),
                                  inner=K.shape[0])
        assert mpmath.mpf(up) >= _lambda_max_exact(K)


@pytest.mark.parametrize("seed", range(3))
def test_zeta_and_zeta_cls_are_above_the_exact_values(seed):
    g = torch.Generator().manual_seed(seed)
    B, H, N, D = 1, 2, 3, 4
    P = torch.softmax(3 * torch.randn(B, H, N, N, generator=g, dtype=DT), -1)
    W_v = torch.randn(H, D, 2, generator=g, dtype=DT)
    W_o = torch.randn(H, 2, D, generator=g, dtype=DT)
    zeta = _key_sensitivity(P, W_v, W_o, True, True, 100, 1e-9).value
    K = sensitivity_matrix(P, W_v @ W_o, True)[0]  # (N·D, N·D)
    assert mpmath.mpf(zeta.item()) ** 2 >= _lambda_max_exact(K)
    W_vo = W_v @ W_o
    cls = zeta_cls(P, W_vo)
    K_cls = torch.cat([sum(P[0, h, 0, n] * W_vo[h].T for h in range(H))
                       for n in range(N)], dim=1)  # (D, N·D)
    assert mpmath.mpf(cls.item()) ** 2 >= _lambda_max_exact(K_cls.T)


def test_layer_project_identity_holds_in_exact_arithmetic():
    from lipvit.certify.local import layer_project_is_identity

    g = torch.Generator().manual_seed(0)
    R, wrong = 1.0, 0
    for _ in range(300):
        x = torch.randn(1, 1, 4, generator=g, dtype=DT)
        x = 0.9 * x / torch.linalg.vector_norm(x)
        eps = R - torch.linalg.vector_norm(x).item()  # ‖x‖ + ε = R in float
        with mpmath.workdps(50):
            exact = mpmath.sqrt(sum(mpmath.mpf(v) ** 2 for v in x.flatten().tolist()))
            outside = exact + mpmath.mpf(eps) > R
        wrong += bool(layer_project_is_identity(x, R, eps)) and outside
    assert wrong == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("host_max", [0, 1024])
def test_small_cuda_problems_on_either_side_agree_with_the_cpu(monkeypatch, host_max):
    # HOST_LINALG_MAX routes small CUDA eigenproblems to LAPACK; 0 keeps them on
    # cuSOLVER. Either way the results come back on the device, equal to the CPU's
    # to rounding, and a gradient still flows through spectral_norm.
    monkeypatch.setattr(spectral, "HOST_LINALG_MAX", host_max)
    gen = torch.Generator().manual_seed(3)
    K = torch.randn(5, 40, 30, generator=gen, dtype=torch.float64)
    G = K.mT @ K
    eigh_values = lambda A: spectral.eigh(A)[0]  # noqa: E731
    for fn in (spectral.eigvalsh, eigh_values, spectral.spectral_norm):
        out = fn(G.cuda())
        assert out.device.type == "cuda"
        assert torch.allclose(out.cpu(), fn(G), rtol=1e-10)
    W = K.cuda().requires_grad_()
    spectral.spectral_norm(W).sum().backward()
    assert W.grad is not None and W.grad.device.type == "cuda"


@pytest.mark.parametrize("seed", range(4))
def test_taylor_attention_norm_is_certified_above_a_poor_estimate(seed):
    """The attention sub-block norms of ``taylor`` (subblock._certified_norm)
    are a Cholesky certificate above subspace iteration's estimate, which
    converges from below: on a spectrum with a near tie at the top a short
    iteration's estimate is below σ_max, and the certificate built on it is
    still above (a copy that returned the estimate would fail here)."""
    from lipvit.certify.lofast.layer import certified_lambda_max
    from lipvit.certify.taylor.subblock import _certified_norm

    from lipvit.spectral import ritz_lambda_max

    g = torch.Generator().manual_seed(seed)
    n = 300
    U, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT))
    V, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT))
    s = torch.linspace(1, 0.01, n, dtype=DT)
    s[1:6] = 1 - 1e-4 * torch.arange(1, 6, dtype=DT)  # near ties below σ_max = 1
    T = U @ torch.diag(s) @ V.T
    exact = torch.linalg.matrix_norm(T, ord=2)
    G = T @ T.T
    poor = ritz_lambda_max(G, k=1, iterations=3)
    assert poor.sqrt() < exact * (1 - 1e-7)  # the estimate alone is no bound
    assert certified_lambda_max(G.clone(), float(poor), 1e-10, tau_max=1e-6,
                                scale=float(T.pow(2).sum()), inner=n) >= exact**2
    bound = _certified_norm(T)
    assert exact * (1 - 1e-13) <= bound <= exact * (1 + 1e-6)
