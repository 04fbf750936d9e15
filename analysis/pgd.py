"""PGD lower bound on the local deviation of a map over a Frobenius ball.

Every upper bound in ``certify/`` is compared with :func:`pgd_deviation`: the
largest ``‖fn(X') − fn(X)‖_F`` that projected gradient ascent finds with
``‖X' − X‖_F ≤ ε`` (LoFAST §6 uses the same lower bound, docs/math.md §2.3 "Paper
check"). Every evaluated point lies in the ball, so the result is a **lower
bound** of the true maximal deviation (float rounding aside); it is not a
certificate of anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from lipvit.certify.eps import eps_per_sample
from torch import Tensor

TensorMap = Callable[[Tensor], Tensor]


def _flat_norm(x: Tensor) -> Tensor:
    """Per-sample ℓ2 norm of ``x`` flattened beyond the batch dimension: ``(B,)``."""
    return torch.linalg.vector_norm(x.reshape(x.shape[0], -1), dim=1)


def _per_sample(v: Tensor, like: Tensor) -> Tensor:
    """Reshape a ``(B,)`` tensor to broadcast against ``like`` of shape ``(B, ...)``."""
    return v.reshape((-1,) + (1,) * (like.ndim - 1))


def pgd_deviation(
    fn: TensorMap,
    X: Tensor,
    eps: float | Tensor,
    steps: int = 100,
    restarts: int = 4,
    step_size: float | None = None,
    seed: int = 0,
    batch_restarts: bool = True,
) -> Tensor:
    """Largest ``‖fn(X')[b] − fn(X)[b]‖_F`` found by PGD over ``‖X'[b] − X[b]‖_F ≤ ε``.

    Projected gradient *ascent* on the squared deviation, per sample: each
    restart starts at a uniformly random point of the sphere of radius ε around
    ``X[b]``, takes ``steps`` normalised-gradient steps
    ``Γ ← Π_ε(Γ + α_k ∇/‖∇‖)`` (``Π_ε`` the projection onto the Frobenius ball,
    ``α_k`` decaying from ``step_size`` on a cosine schedule to 1 % of it), and
    the best deviation seen at any evaluated point is kept per sample. With a
    large first step the iteration behaves like power iteration on the local
    Jacobian, so a linear map's maximum ``ε‖W‖`` is reached.

    Every evaluated point is feasible, so the result is a **lower bound** of
    ``max_{‖X'−X‖_F≤ε} ‖fn(X') − fn(X)‖_F`` (float rounding aside).

    Args:
        fn: a batched map ``(B, *in) → (B, *out)`` whose output sample ``b``
            depends only on input sample ``b`` (models in eval mode).
        X: clean inputs, shape ``(B, *in)``.
        eps: radius ε ≥ 0 (a float, or a ``(B,)`` tensor of per-sample radii).
        steps: gradient steps per restart (≥ 0; 0 evaluates the starts only).
        restarts: number of random starts (≥ 1).
        step_size: first step length; defaults to 10ε (per sample): long first
            steps make the iteration a power iteration on the local Jacobian.
        seed: seed of the random starts (a private generator; global RNG state
            is untouched).
        batch_restarts: run the restarts as one batch of ``restarts·B``
            inputs (restart ``r``'s copy of sample ``b`` at row ``r·B + b``),
            for an ``fn`` that takes any batch size; ``False``: one restart
            after another, for an ``fn`` that holds tensors of its ``B``
            samples. The same starts and steps either way.

    Returns:
        ``(B,)`` tensor (dtype of ``X``, detached): the best deviation found.

    Raises:
        ValueError: for negative, NaN or infinite ``eps``, ``steps < 0``,
            ``restarts < 1``, a non-positive ``step_size``, or ``X`` without a
            batch dimension.
    """
    if X.ndim < 1 or X.shape[0] == 0:
        raise ValueError("X must have a non-empty batch dimension")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if restarts < 1:
        raise ValueError(f"restarts must be >= 1, got {restarts}")
    if step_size is not None and not step_size > 0:
        raise ValueError(f"step_size must be positive, got {step_size}")
    eps_b = eps_per_sample(eps, X.shape[0], X.dtype, X.device)  # (B,)
    X = X.detach()
    alpha0 = 10 * eps_b if step_size is None else torch.full_like(eps_b, step_size)
    gen = torch.Generator(device=X.device)
    gen.manual_seed(seed)

    with torch.no_grad():
        Y = fn(X).detach()  # (B, *out)
    draws = [torch.randn(X.shape, generator=gen, dtype=X.dtype, device=X.device)
             for _ in range(restarts)]  # each restart's start, in turn
    if not batch_restarts:
        return torch.stack([_ascend(fn, X, Y, d, eps_b, alpha0, steps)
                            for d in draws]).amax(0)
    # Every restart at once: copy r of sample b at row r·B + b.
    B, R = X.shape[0], restarts
    best = _ascend(fn, X.repeat(R, *(1,) * (X.ndim - 1)),
                   Y.repeat(R, *(1,) * (Y.ndim - 1)), torch.cat(draws),
                   eps_b.repeat(R), alpha0.repeat(R), steps)  # (R·B,)
    return best.reshape(R, B).amax(0)


def _ascend(fn: TensorMap, X: Tensor, Y: Tensor, delta: Tensor, eps: Tensor,
            alpha0: Tensor, steps: int) -> Tensor:
    """:func:`pgd_deviation`'s ascent from the start directions ``delta``
    (scaled onto the sphere of radius ``eps`` ``(B,)``) around ``X`` (``Y =
    fn(X)``): the best deviation per row ``(B,)``."""
    tiny, unit = torch.finfo(X.dtype).tiny, torch.finfo(X.dtype).eps

    def project(delta: Tensor) -> Tensor:
        # Shrink onto the ball; the factor below 1 keeps rounding inside it.
        norm = _flat_norm(delta).clamp_min(tiny)
        scale = (eps * (1 - 4 * unit) / norm).clamp(max=1)
        return delta * _per_sample(scale, delta)

    radius = eps / _flat_norm(delta).clamp_min(tiny)
    delta = project(delta * _per_sample(radius, delta))
    best = torch.zeros_like(eps)
    for k in range(steps + 1):
        with torch.enable_grad():
            Xp = (X + delta).requires_grad_(True)
            diff = (fn(Xp) - Y).reshape(X.shape[0], -1)  # (B, out)
            dev2 = diff.pow(2).sum(dim=1)  # (B,)
            grad = None
            if k < steps:
                (grad,) = torch.autograd.grad(dev2.sum(), Xp)
        best = torch.maximum(best, dev2.detach().sqrt())
        if grad is None:
            break
        alpha = alpha0 * (0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * k / steps)))
        gnorm = _flat_norm(grad).clamp_min(tiny)
        delta = project(delta + grad * _per_sample(alpha / gnorm, grad))
    return best


def pgd_margin_drop(
    model: TensorMap,
    x: Tensor,
    y: Tensor,
    eps: float,
    steps: int = 100,
    restarts: int = 2,
    seed: int = 0,
) -> Tensor:
    """Largest rise of every ``f_j − f_y`` that PGD finds on ``‖x' − x‖₂ ≤ ε``.

    Projected normalised-gradient ascent on ``f_j(x') − f_y(x')`` for every
    class ``j`` at once (each sample repeated once per class), random starts
    inside the ball, a step decaying linearly from ``0.3 ε``. Every evaluated
    point lies in the ball: a **lower bound** on the largest margin drop.

    Args:
        model: images ``(B, ...)`` to logits ``(B, K)``.
        x: clean images ``(B, ...)``; y: labels ``(B,)``.

    Returns:
        ``(B, K)`` (0 in column ``y``).
    """
    g = torch.Generator(device=x.device).manual_seed(seed)
    with torch.no_grad():
        K = model(x[:1]).shape[1]
    B = x.shape[0]
    xr = x.repeat_interleave(K, dim=0)  # (B·K, ...): copy (b, j)
    j = torch.arange(K, device=x.device).repeat(B)
    yr = y.repeat_interleave(K)
    rows = torch.arange(B * K, device=x.device)

    def gap(v: Tensor) -> Tensor:
        out = model(v)
        return out[rows, j] - out[rows, yr]

    with torch.no_grad():
        clean = gap(xr)
    best = torch.zeros(B * K, dtype=x.dtype, device=x.device)
    for _ in range(restarts):
        d = torch.randn(xr.shape, generator=g, dtype=x.dtype, device=x.device)
        d = d * _per_sample(0.5 * eps / _flat_norm(d), d)
        for k in range(steps + 1):
            d.requires_grad_(True)
            with torch.enable_grad():
                val = gap(xr + d)
                (grad,) = torch.autograd.grad(val.sum(), d)
            with torch.no_grad():
                best = torch.maximum(best, val - clean)
                step = grad / _per_sample(_flat_norm(grad).clamp_min(1e-30), grad)
                d = d + 0.3 * eps * (1 - k / (steps + 1)) * step
                shrink = (eps / _flat_norm(d).clamp_min(1e-30)).clamp(max=1)
                d = d * _per_sample(shrink, d)
    return best.reshape(B, K).detach()


def _row_norm(d: Tensor) -> Tensor:
    """``‖d_m‖₂`` per row of ``d`` ``(M, n)``, as ``(M, 1)``."""
    return torch.linalg.vector_norm(d, dim=1, keepdim=True)


def pgd_taylor_rest(fn: Callable[[Tensor], Tensor], z: Tensor, g: Tensor, H: Tensor,
                    eps: float, steps: int = 100, restarts: int = 4,
                    seed: int = 0) -> float:
    """Largest ``|fn(z + δ) − fn(z) − gᵀδ − ½δᵀHδ|`` found on ``‖δ‖₂ ≤ ε``: the
    rest of a scalar map beyond its second-order Taylor polynomial (``g``,
    ``H`` its gradient and Hessian at ``z`` ``(n,)``), by normalised-gradient
    ascent and descent from ``restarts`` random points of the sphere, the step
    decaying linearly from ``0.3 ε``. A **lower bound** of the largest rest.

    ``fn`` maps points ``(M, n)`` to values ``(M,)``: the ``2·restarts``
    trajectories (each start ascending and descending) run as one batch.
    """
    f0 = fn(z[None]).detach()  # (1,)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.stack([torch.randn(z.numel(), generator=gen, dtype=z.dtype)
                          for _ in range(restarts)])  # (restarts, n)
    sign = torch.tensor([1.0, -1.0], dtype=z.dtype).repeat(restarts)  # (M,)
    d = starts.repeat_interleave(2, 0)  # (M, n): each start, both signs
    d = eps * d / _row_norm(d)
    best = torch.zeros((), dtype=z.dtype)
    for i in range(steps):
        d.requires_grad_(True)
        with torch.enable_grad():
            rest = fn(z + d) - f0 - d @ g - 0.5 * torch.einsum("mi,ij,mj->m", d, H, d)
            (grad,) = torch.autograd.grad((sign * rest).sum(), d)
        with torch.no_grad():
            best = torch.maximum(best, rest.abs().max())
            size = 0.3 * eps * (1 - i / steps)
            d = d + size * grad / _row_norm(grad).clamp_min(1e-300)
            d = d * (eps / _row_norm(d)).clamp(max=1.0)
    return float(best)
