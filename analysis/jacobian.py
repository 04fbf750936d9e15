"""Jacobian spectra of token maps (Cauchy-problem paper eq. 5, 15, 16; docs/math.md §7).

The Cauchy-problem paper bounds a residual network's first-order deviation by
``ε · exp(Σ_k ‖J_{F_k}‖)`` (eq. 15) and reports per-block ``σ_max(J)``, exactly
for small models and by the estimate ``‖J‖_2 ≤ sqrt(‖J‖_1 ‖J‖_∞)`` (eq. 16)
for large ones.

Symbols:

=============  ==================  =========================================
symbol         variable            meaning
=============  ==================  =========================================
``J``          ``J``               Jacobian of one sample's map at ``X[b]``,
                                   an ``(N·D) × (N·D)`` matrix
``σ_max(J)``   ``sigma``           largest singular value, ``‖J‖_2``
``‖J‖_1``      ``norm_1``          max column absolute sum
``‖J‖_∞``      ``norm_inf``        max row absolute sum
=============  ==================  =========================================

Shapes: ``B`` batch, ``N`` tokens, ``D`` width. A *token map* ``fn`` takes
``(B, N, D)`` to ``(B, N, D)`` (any trailing shape works) and is
sample-independent: output ``b`` depends on input ``b`` only. That lets one
call on the whole batch give every sample's JVP/VJP at once, and the Jacobian
of ``X ↦ Σ_b fn(X)[b]`` with respect to ``X[b]`` is sample ``b``'s Jacobian
(the "sum trick"), so no ``vmap`` over ``fn``'s forward pass is needed.

Which numbers are what:

- :func:`block_jacobian_sigma` ``exact=True``: σ_max from a dense SVD of the
  full Jacobian (exact up to float rounding; small sizes only).
- :func:`block_jacobian_sigma` ``exact=False``: JVP/VJP power iteration, an
  estimate **from below** of σ_max.
- :func:`jacobian_l1_linf_estimate`: ``sqrt(‖J‖_1 ‖J‖_∞)``, an **upper bound**
  of σ_max at the point ``X`` (Hölder / Riesz–Thorin: ``‖J‖_2² ≤ ‖J‖_1 ‖J‖_∞``).

None of these is a local Lipschitz constant over a ball: they describe the
Jacobian at ``X`` only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from lipvit.spectral import power_iteration

TensorMap = Callable[[Tensor], Tensor]

#: Largest per-sample input size ``prod(X.shape[1:])`` for ``exact=True``:
#: the dense Jacobian has this many rows and columns.
EXACT_MAX_SIZE = 2048


def _ad_friendly():
    """Context forcing the math attention kernel.

    ``F.scaled_dot_product_attention``'s fused CPU kernels have no forward-mode
    AD and no vmap rule for their backward; the math kernel (matmul + softmax)
    has both and computes the same function.
    """
    return sdpa_kernel(SDPBackend.MATH)


def _check(fn: TensorMap, X: Tensor) -> Tensor:
    """Validate ``X`` and check that ``fn`` keeps the batch size; returns ``fn(X)``."""
    if X.ndim < 2 or X.shape[0] == 0:
        raise ValueError(f"X must have shape (B, ...), B >= 1, got {tuple(X.shape)}")
    if not X.is_floating_point():
        raise TypeError(f"X must be a floating-point tensor, got {X.dtype}")
    with torch.no_grad():
        Y = fn(X)
    if Y.shape[0] != X.shape[0]:
        raise ValueError(
            f"fn changed the batch size: {tuple(X.shape)} -> {tuple(Y.shape)}")
    return Y


def full_jacobian(fn: TensorMap, X: Tensor, chunk_size: int | None = None) -> Tensor:
    """Dense per-sample Jacobians of ``fn`` at ``X``: ``(B, m, n)``.

    ``m = prod(fn(X).shape[1:])``, ``n = prod(X.shape[1:])``. Rows come from
    ``torch.func.jacrev`` (a ``vmap`` over VJPs, ``chunk_size`` rows at a time)
    applied to the sum over the batch (sample independence makes block ``b``
    of that Jacobian sample ``b``'s Jacobian).
    """
    Y = _check(fn, X)
    B, n, m = X.shape[0], X[0].numel(), Y[0].numel()
    with _ad_friendly():
        J = torch.func.jacrev(lambda Z: fn(Z).sum(0), chunk_size=chunk_size)(X.detach())
    # (*out, B, *in) -> (m, B, n) -> (B, m, n)
    return J.reshape(m, B, n).transpose(0, 1).detach()


def block_jacobian_sigma(
    fn: TensorMap,
    X: Tensor,
    exact: bool = False,
    n_iter: int = 500,
    tol: float | None = 1e-9,
    seed: int = 0,
    max_size: int = EXACT_MAX_SIZE,
) -> Tensor:
    """σ_max of the Jacobian of a token map at ``X`` (Cauchy eq. 15, docs/math.md §7).

    Args:
        fn: sample-independent batched map ``(B, N, D) → (B, N, D)`` (any
            trailing shapes), differentiable by ``torch.func``.
        X: points, shape ``(B, N, D)``.
        exact: ``True``: dense Jacobian (``torch.func.jacrev``, rows vmapped)
            and ``torch.linalg.svdvals`` — exact up to float rounding, refused
            above ``max_size``. ``False``: matrix-free power iteration on
            ``JᵀJ`` with ``torch.func.jvp`` (``v ↦ J v``) and ``torch.func.vjp``
            (``u ↦ Jᵀ u``) through :func:`lipvit.spectral.power_iteration` —
            an estimate **from below** that converges to σ_max; it never
            forms ``J``.
        n_iter: maximum power iterations (``exact=False``).
        tol: relative-change stopping tolerance (``exact=False``); ``None``
            runs all ``n_iter`` iterations.
        seed: seed of the random start vector (``exact=False``).
        max_size: largest ``prod(X.shape[1:])`` accepted with ``exact=True``.

    Returns:
        ``(B,)`` tensor, dtype of ``X``: σ_max(J_b) (``exact=True``) or a lower
        estimate of it (``exact=False``).

    Raises:
        ValueError: bad shapes, or ``exact=True`` above ``max_size``.
    """
    Y = _check(fn, X)
    X = X.detach()
    n, m = X[0].numel(), Y[0].numel()
    if exact:
        if max(n, m) > max_size:
            raise ValueError(
                f"exact=True forms a {m}x{n} Jacobian per sample, above max_size="
                f"{max_size}; use exact=False (matrix-free, a lower estimate)")
        return torch.linalg.svdvals(full_jacobian(fn, X))[:, 0]

    # J v for every sample at once: one batched forward-mode pass.
    def matvec(V: Tensor) -> Tensor:
        return torch.func.jvp(fn, (X,), (V,))[1]

    def rmatvec(U: Tensor) -> Tensor:
        return vjp_fn(U)[0]

    gen = torch.Generator(device=X.device)
    gen.manual_seed(seed)
    V0 = torch.randn(X.shape, generator=gen, dtype=X.dtype, device=X.device)
    with _ad_friendly():
        _, vjp_fn = torch.func.vjp(fn, X)  # reused: Jᵀ u for every sample
        res = power_iteration(matvec, rmatvec, V0, n_iter, in_ndim=X.ndim - 1,
                              out_ndim=Y.ndim - 1, tol=tol)
    return res.sigma.detach()


def jacobian_l1_linf_estimate(
    fn: TensorMap, X: Tensor, chunk_size: int = 256
) -> Tensor:
    """``sqrt(‖J‖_1 ‖J‖_∞)`` per sample, Cauchy paper eq. (16): upper bound of σ_max(J).

    ``‖J‖_1`` is the largest column absolute sum, ``‖J‖_∞`` the largest row
    absolute sum; ``σ_max(J)² ≤ ‖J‖_1 ‖J‖_∞`` (Hölder), so the result is an
    **upper bound** of σ_max of the Jacobian at ``X`` (float rounding aside),
    not a local Lipschitz constant over a ball.

    Rows of every sample's Jacobian are computed ``chunk_size`` at a time by a
    ``vmap`` over VJPs of ``Σ_b fn(X)[b]`` (one batched backward pass per chunk,
    for all samples), where the paper's reference code runs one backward pass
    per output entry. Only the running row maxima and column sums are kept:
    memory is ``O(chunk_size · B · n)``.

    Args:
        fn: sample-independent batched map ``(B, *in) → (B, *out)``.
        X: points, shape ``(B, *in)``.
        chunk_size: Jacobian rows per vmapped VJP.

    Returns:
        ``(B,)`` tensor, dtype of ``X``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    Y = _check(fn, X)
    X = X.detach()
    B, m = X.shape[0], Y[0].numel()
    out_shape = Y.shape[1:]
    col_sums = torch.zeros(B, X[0].numel(), dtype=X.dtype, device=X.device)
    row_max = torch.zeros(B, dtype=X.dtype, device=X.device)
    with _ad_friendly():
        _, vjp_fn = torch.func.vjp(lambda Z: fn(Z).sum(0), X)
        rows_vjp = torch.func.vmap(lambda u: vjp_fn(u)[0])
        for start in range(0, m, chunk_size):
            c = min(chunk_size, m - start)
            U = torch.zeros(c, m, dtype=Y.dtype, device=Y.device)
            U[torch.arange(c), torch.arange(start, start + c)] = 1  # rows of I_m
            U = U.reshape(c, *out_shape)  # (c, *out)
            rows = rows_vjp(U).detach().abs().reshape(U.shape[0], B, -1)  # (c, B, n)
            row_max = torch.maximum(row_max, rows.sum(-1).amax(0))
            col_sums += rows.sum(0)
    return (col_sums.amax(-1) * row_max).sqrt()
