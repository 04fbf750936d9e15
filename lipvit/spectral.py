"""Largest singular values: one power iteration and one exact routine for all of lipvit.

Training (the MSVP penalty) and certification share these two functions.

``power_iteration`` runs on any batched linear operator given by its action
``matvec(v) = A v`` and adjoint ``rmatvec(u) = Aᵀ u``. Its value ``uᵀ A v``
converges to ``σ_max(A)`` **from below**: it is an estimate, never a certified
upper bound. ``spectral_norm`` is exact (dense SVD) and is what a certificate
may use. ``eigvalsh_upper`` is ``λ_max`` of a Gram matrix plus a margin that
covers the rounding of forming it and of the eigensolver (docs/math.md,
"Rounding"). ``eigvalsh``, ``eigh`` and ``spectral_norm`` solve small dense
problems of CUDA tensors on the host (:data:`HOST_LINALG_MAX`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

Op = Callable[[Tensor], Tensor]


class PowerIteration(NamedTuple):
    """Result of :func:`power_iteration`.

    Attributes:
        sigma: estimate ``‖A v‖`` of σ_max, shape ``batch`` (a lower estimate).
        u: left singular vector estimate, unit norm along the operator's output.
        v: right singular vector estimate, unit norm along the operator's input.
        n_iter: iterations run.
        converged: ``True`` where the relative change of sigma fell below ``tol``.
    """

    sigma: Tensor
    u: Tensor
    v: Tensor
    n_iter: int
    converged: Tensor


def seeded_start(shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | str) -> Tensor:
    """Standard normal start vectors from a private seed-0 CPU generator, then moved
    to ``device``: the same start on every device (a CUDA generator draws other
    numbers), so a certificate on the GPU equals the CPU's up to rounding; the
    global RNG is untouched. ``shape[0]`` is a batch axis: every entry gets the
    same start (a view), so that no sample's result depends on its batch."""
    gen = torch.Generator().manual_seed(0)
    one = torch.randn((1, *shape[1:]), generator=gen, dtype=dtype).to(device)
    return one.expand(shape)


def _normalize(x: Tensor, ndim: int, eps: float = 1e-30) -> Tensor:
    """Divide ``x`` by its norm over its last ``ndim`` dimensions."""
    dims = tuple(range(-ndim, 0))
    return x / torch.linalg.vector_norm(x, dim=dims, keepdim=True).clamp_min(eps)


def _norm(x: Tensor, ndim: int) -> Tensor:
    return torch.linalg.vector_norm(x, dim=tuple(range(-ndim, 0)))


@torch.no_grad()
def power_iteration(
    matvec: Op,
    rmatvec: Op,
    v: Tensor,
    n_iter: int = 1,
    *,
    in_ndim: int = 1,
    out_ndim: int = 1,
    tol: float | None = None,
    check_every: int = 1,
) -> PowerIteration:
    """Power iteration on ``AᵀA`` for σ_max(A), batched, matrix-free.

    One step is ``u ← A v / ‖A v‖``, ``v ← Aᵀ u / ‖Aᵀ u‖`` (SpecFormer Alg. 1,
    docs/math.md §4); the estimate ``σ = ‖A v‖`` is non-decreasing in exact arithmetic
    and converges to σ_max **from below**.

    Args:
        matvec: ``v ↦ A v``; maps tensors of shape ``(*batch, *in)`` to
            ``(*batch, *out)``.
        rmatvec: ``u ↦ Aᵀ u``.
        v: start vector(s), shape ``(*batch, *in)`` (need not be normalised;
            carried over between calls for persistent iteration).
        n_iter: maximum number of iterations (≥ 1).
        in_ndim: number of trailing dimensions forming the operator's input.
        out_ndim: number of trailing dimensions forming the operator's output.
        tol: stop early once every relative change of σ is below ``tol``; a
            batch entry whose change is below it at a check stops there (its
            ``σ``, ``u``, ``v`` are those it would have alone, whatever the
            batch).
        check_every: test convergence (a host synchronisation on a GPU) only
            every ``check_every`` iterations.

    Returns:
        :class:`PowerIteration` with ``sigma`` of shape ``batch`` (an estimate
        from below), unit ``u`` and ``v``.
    """
    if n_iter < 1:
        raise ValueError(f"n_iter must be >= 1, got {n_iter}")
    v = _normalize(v, in_ndim)
    sigma = None
    converged = torch.zeros((), dtype=torch.bool, device=v.device)
    done = converged  # batch entries frozen at a check: as if run alone
    it = 0
    while it < n_iter:
        it += 1
        Av = matvec(v)
        new_sigma = _norm(Av, out_ndim)
        u = Av / new_sigma.clamp_min(1e-30).reshape(new_sigma.shape + (1,) * out_ndim)
        new_v = _normalize(rmatvec(u), in_ndim)
        if sigma is None or tol is None:
            sigma, v = new_sigma, new_v
            continue
        v = torch.where(done.reshape(done.shape + (1,) * in_ndim), v, new_v)
        converged = done | ((new_sigma - sigma).abs()
                            <= tol * new_sigma.abs().clamp_min(1e-30))
        sigma = torch.where(done, sigma, new_sigma)
        if it % check_every == 0:
            done = converged
            if bool(done.all()):
                break
    # σ for the final v (one more matvec keeps u and v consistent with sigma).
    Av = matvec(v)
    sigma = torch.maximum(sigma, _norm(Av, out_ndim))
    u = _normalize(Av, out_ndim)
    return PowerIteration(sigma, u, v, it, converged)


def matrix_power_iteration(
    W: Tensor, v: Tensor, n_iter: int = 1, tol: float | None = None
) -> PowerIteration:
    """:func:`power_iteration` for explicit batched matrices ``W`` ``(..., m, n)``.

    ``v`` has shape ``(..., n)``. Returns estimates from below (see
    :func:`power_iteration`).
    """
    return power_iteration(
        lambda x: (W @ x.unsqueeze(-1)).squeeze(-1),
        lambda y: (W.mT @ y.unsqueeze(-1)).squeeze(-1),
        v,
        n_iter,
        tol=tol,
    )


UNIT_ROUNDOFF = torch.finfo(torch.float64).eps / 2


def gamma(k: int) -> float:
    """``γ_k = k u/(1 − k u)``, ``u`` the float64 unit roundoff (Higham §3.1)."""
    ku = k * UNIT_ROUNDOFF
    if not ku < 0.5:
        raise ValueError(f"gamma({k}) is not small: the size is beyond float64")
    return ku / (1 - ku)


HOST_LINALG_MAX = 1024
"""Largest matrix side whose dense eigen- and singular-value problems of a CUDA
tensor :func:`eigvalsh`, :func:`eigh` and :func:`spectral_norm` solve on the
host (LAPACK, one copy each way) where no gradient is needed: cuSOLVER reads
back a status per matrix of a batch, thousands of host synchronisations per
certificate (docs/results/taylor.md, "On a GPU"). ``0`` keeps every problem on the
device (``bench/user/taylor_scale.py --host-linalg-max 0`` compares)."""


def _host(A: Tensor) -> bool:
    """Whether :func:`eigvalsh`-like routines solve ``A`` on the host."""
    return (A.is_cuda and max(A.shape[-2:]) <= HOST_LINALG_MAX
            and not (A.requires_grad and torch.is_grad_enabled()))


def eigvalsh(G: Tensor) -> Tensor:
    """``torch.linalg.eigvalsh`` (ascending eigenvalues of symmetric ``G``
    ``(..., n, n)``), on the host for a small CUDA tensor (:data:`HOST_LINALG_MAX`)."""
    if _host(G):
        return torch.linalg.eigvalsh(G.cpu()).to(G.device)
    return torch.linalg.eigvalsh(G)


def eigh(G: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh`` of symmetric ``G`` ``(..., n, n)``, on the host for a
    small CUDA tensor (:data:`HOST_LINALG_MAX`)."""
    if _host(G):
        lam, V = torch.linalg.eigh(G.cpu())
        return lam.to(G.device), V.to(G.device)
    return torch.linalg.eigh(G)


def eigvalsh_upper(G: Tensor, scale: Tensor | float, inner: int) -> Tensor:
    """Upper bound of ``λ_max`` of the exact Gram matrix that ``G`` rounds, ``(...)``.

    ``G`` ``(..., n, n)`` float64 was formed in floating point from factors
    ``K`` with dot products of length ``≤ inner``, and ``scale ≥ ‖K̃‖_F²``
    bounds the matrix of absolute products (``K̃ = |K|`` for ``G = KᵀK``; the
    caller states it for structured forms). Then
    ``|fl(G) − G| ≤ γ_inner K̃ᵀK̃`` entrywise, of spectral norm
    ``≤ γ_inner scale``; the symmetric eigensolver is backward stable, its
    eigenvalues those of ``fl(G) + E`` with ``‖E‖`` a modest multiple of
    ``n u ‖G‖`` (LAPACK states no constant; ``γ_{8n} ‖G‖_F`` is taken). By
    Weyl's inequality the computed ``λ_max`` plus both terms is an **upper
    bound** (docs/math.md, "Rounding"). ``scale`` is a scalar or ``(...)``.
    """
    n = G.shape[-1]
    lam = eigvalsh(G)[..., -1].clamp_min(0)
    margin = gamma(inner + 2) * torch.as_tensor(scale, dtype=G.dtype, device=G.device)
    margin = margin + gamma(8 * n) * torch.linalg.matrix_norm(G)  # Frobenius
    return lam + margin


def gram_norm(T: Tensor) -> Tensor:
    """``‖J‖`` from tangents ``T = J E`` ``(..., n, M)`` (``E`` the identity): exact,
    ``√λ_max`` of the smaller Gram matrix (``T Tᵀ`` or ``Tᵀ T``, the same
    ``λ_max``) by eigvalsh, rounded up by a relative ``1e-12``."""
    if T.shape[-2] <= T.shape[-1]:
        return top_root(T @ T.transpose(-1, -2))
    return top_root(T.transpose(-1, -2) @ T)


def ritz_lambda_max(G: Tensor, k: int = 8, iterations: int = 40) -> Tensor:
    """Estimate of ``λ_max`` of symmetric PSD ``G`` ``(..., n, n)``, ``(...)``:
    the top Ritz value of ``k``-dimensional subspace iteration from a seeded
    start, to a relative ``1e-11`` or ``iterations`` steps. It converges
    **from below**: an estimate, never a certified bound (a Cholesky
    certificate proves a value above it:
    :func:`lipvit.certify.lofast.layer.certified_lambda_max`)."""
    flat = G.reshape(-1, *G.shape[-2:])  # (batch, n, n)
    gen = torch.Generator(device=G.device).manual_seed(0)
    V = torch.randn(flat.shape[0], flat.shape[-1], min(k, flat.shape[-1]),
                    dtype=G.dtype, device=G.device, generator=gen)
    theta = torch.zeros(flat.shape[0], dtype=G.dtype, device=G.device)
    for _ in range(iterations):
        V, _ = torch.linalg.qr(flat @ V)  # (batch, n, k)
        ritz = torch.linalg.eigvalsh(V.transpose(1, 2) @ flat @ V)[:, -1]
        done = bool(((ritz - theta).abs() <= 1e-11 * ritz.abs()).all())
        theta = ritz
        if done:
            break
    return theta.reshape(G.shape[:-2])


def top_root(gram: Tensor) -> Tensor:
    """``√λ_max`` of symmetric PSD matrices ``(..., k, k)``, rounded up."""
    lam = eigvalsh(gram)[..., -1].clamp_min(0)
    return (lam * (1 + 1e-12) + 1e-300).sqrt()


def spectral_norm(W: Tensor) -> Tensor:
    """Exact largest singular value per matrix of ``W``: ``(..., m, n)`` → ``(...)``.

    Dense SVD through ``torch.linalg.matrix_norm(ord=2)``; differentiable
    (where a gradient is needed it stays on the device; else a small CUDA
    tensor's runs on the host, :data:`HOST_LINALG_MAX`). This is the value a
    certificate may use (float rounding aside).
    """
    if _host(W):
        return torch.linalg.matrix_norm(W.cpu(), ord=2).to(W.device)
    return torch.linalg.matrix_norm(W, ord=2)


def conv_operator_norm(K: Tensor, size: int) -> Tensor:
    """Upper bound of the spectral norm of the zero-padded ("same") stride-1
    convolution with kernel ``K`` ``(c_out, c_in, k, k)``, odd ``k``, on
    ``size × size`` images: a scalar tensor, differentiable.

    Zero padding by ``p = (k − 1)/2`` then cropping embeds the convolution in
    the circular one on the ``G × G`` grid, ``G = size + k − 1``, where no
    output pixel kept wraps around: ``conv = crop ∘ circ ∘ pad`` with ``pad``
    an isometry and ``crop`` a projection, so ``‖conv‖ ≤ ‖circ‖``. The
    circular convolution is block-diagonalised by the 2-D DFT (Sedghi, Gupta
    and Long, ICLR 2019): ``‖circ‖ = max_ω σ_max(K̂(ω))`` over the ``G²``
    frequencies, ``K̂(ω)`` the ``c_out × c_in`` matrix of the kernel's DFT
    (docs/math.md §9). Exact for circular padding, a bound for zeros. A real
    kernel has ``K̂(−ω) = conj K̂(ω)``, of the same singular values, so the
    half-spectrum of ``rfft2`` holds every value of the maximum.
    """
    k = K.shape[-1]
    if K.shape[-2] != k or k % 2 == 0:
        raise ValueError(f"expected a square kernel of odd side, got {tuple(K.shape)}")
    G = size + k - 1
    K_hat = torch.fft.rfft2(K, s=(G, G))  # (c_out, c_in, G, G // 2 + 1), complex
    blocks = K_hat.flatten(2).permute(2, 0, 1)  # (frequencies, c_out, c_in)
    if not blocks.requires_grad:
        return spectral_norm(blocks).amax()
    # The maximum's gradient is its largest block's: find it without a graph,
    # then differentiate that block's norm alone (2-3x faster in training).
    with torch.no_grad():
        top = spectral_norm(blocks).argmax()
    return spectral_norm(blocks.index_select(0, top.reshape(1)))[0]
