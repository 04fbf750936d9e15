"""Local Lipschitz constants of the non-attention layers (docs/math.md §5, §6).

Pure functions of tensors. Each returns a constant ``L`` with
``‖f(X') − f(X)‖_F ≤ L · ‖X' − X‖_F`` for every ``X'`` in the Frobenius ball
``‖X' − X‖_F ≤ ε`` (a local constant; global where no ``X``/``ε`` is taken),
so a layer's deviation bound is ``L · ε``. All are **upper bounds** (float
rounding aside), proven against PGD and exact Jacobians in
``tests/test_local.py``.

Symbols:

============  ==================  ===============================================
symbol        variable            meaning
============  ==================  ===============================================
``x``         ``X[b, i]``         one token, ``(D,)``
``c``         ``c``               centred token ``x − mean(x)``
``γ, β``      ``gamma``, ``-``    LayerNorm scale and shift (``β`` cancels)
``η``         ``eta``             LayerNorm variance epsilon
``ε``         ``eps``             Frobenius radius of the input ball
``R``         ``radius``          LayerProject radius, LoFAST eq. (29)
``L_LN``      return value        docs/math.md §6 (extension)
============  ==================  ===============================================

Shapes: ``B`` batch, ``N`` tokens, ``D`` width.

Token matrices under a Frobenius budget. For maps that act on each token
separately (LayerNorm, per-token LayerProject), ``‖X' − X‖_F ≤ ε`` implies
``‖x'_i − x_i‖ ≤ ε`` for every token, so ``x'_i`` lies in the ε-ball around
``x_i`` where ``L_i`` holds, and
``‖f(X') − f(X)‖_F² = Σ_i ‖f(x'_i) − f(x_i)‖² ≤ Σ_i L_i² ‖x'_i − x_i‖²
≤ (max_i L_i)² ε²``: the maximum over tokens of the per-token constants at
radius ε bounds the whole layer.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from lipvit.certify.eps import check_eps, eps_per_sample
from torch import Tensor

from lipvit.spectral import gamma as gamma_k
from lipvit.spectral import spectral_norm

Mode = Literal["token", "frobenius"]

#: max_x GELU'(x) for the exact (erf) GELU, attained at x = √2:
#: ``Φ(√2) + √2 φ(√2) = (1 + erf(1))/2 + 1/(e√π)`` (GELU'' = φ(x)(2 − x²) = 0).
#: The minimum, ``Φ(−√2) − √2 φ(√2) ≈ −0.129``, is smaller in magnitude.
GELU_DERIV_MAX = (1 + math.erf(1.0)) / 2 + 1 / (math.e * math.sqrt(math.pi))

#: Relative safety margin on the GELU slope constants (covers float rounding
#: of the closed form and of the numerical maximisation for the tanh variant).
_GELU_MARGIN = 1e-9


def _norm_range(norms: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Bounds ``(low, high)`` of the exact norms whose float values are ``norms``.

    A Euclidean norm of ``dim`` entries is computed with relative error at most
    ``γ_{dim+2}`` (Higham §3.1: the sum of squares, then the square root); the
    centring of LayerNorm adds ``γ_{dim+2}`` again, covered by using
    ``2 dim + 4``. A condition such as ``‖x‖ + ε ≤ R`` decided on the float
    value could otherwise hold in float and fail in exact arithmetic.
    """
    g = gamma_k(2 * dim + 4)
    return norms * (1 - g), norms * (1 + g)


def _check_tokens(X: Tensor) -> None:
    if X.ndim != 3:
        raise ValueError(f"X must have shape (B, N, D), got {tuple(X.shape)}")
    if not X.is_floating_point():
        raise TypeError(f"X must be a floating-point tensor, got {X.dtype}")


def layernorm_local_lipschitz(
    X: Tensor,
    gamma: Tensor | None,
    eta: float,
    eps: float | Tensor,
    per_token: bool = False,
) -> Tensor:
    """Local Lipschitz constant of LayerNorm on the ε-ball, docs/math.md §6 (extension).

    ``LN(x) = √D γ ⊙ c / sqrt(‖c‖² + Dη) + β`` with ``c = x − mean(x)``. The map
    ``c ↦ c / sqrt(‖c‖² + κ)`` has Jacobian
    ``(I − c cᵀ/(‖c‖² + κ)) / sqrt(‖c‖² + κ)`` of norm ``1/sqrt(‖c‖² + κ)``;
    centring is an orthogonal projection (1-Lipschitz), so on the ball
    ``‖x' − x‖ ≤ ε`` (convex) ``‖c'‖ ≥ ‖c‖ − ε`` and the mean value inequality
    gives, per token,

        L_LN(x, ε) = ‖γ‖_∞ √D / sqrt( max(‖c‖ − ε, 0)² + D η ).

    For the token matrix under a Frobenius budget ε the result is
    ``max_i L_LN(x_i, ε)`` (module docstring). An **upper bound**; ``inf``
    where ``η = 0`` and a token's ball reaches ``c = 0``.

    Args:
        X: clean LayerNorm inputs, ``(B, N, D)``.
        gamma: LayerNorm weight ``(D,)``, or ``None`` for ``γ = 1``.
        eta: LayerNorm epsilon η ≥ 0 (``nn.LayerNorm.eps``).
        eps: Frobenius radius ε ≥ 0, a float or ``(B,)``.
        per_token: return every token's constant ``L_LN(x_i, ε)``, ``(B, N)``.

    Returns:
        ``(B,)`` tensor in ``X``'s dtype (``(B, N)`` with ``per_token``).
    """
    _check_tokens(X)
    check_eps(eta, name="eta")
    eps_b = eps_per_sample(eps, X.shape[0], X.dtype, X.device)  # (B,)
    D = X.shape[-1]
    g_inf = (torch.ones((), dtype=X.dtype, device=X.device) if gamma is None
             else gamma.detach().to(X.dtype).abs().amax())
    c_norm = torch.linalg.vector_norm(X - X.mean(-1, keepdim=True), dim=-1)  # (B, N)
    c_low, _ = _norm_range(c_norm, D)  # exact ‖c‖ ≥ c_low
    lower = (c_low - eps_b[:, None]).clamp_min(0)  # (B, N): min ‖c'‖ on the ball
    L = g_inf * math.sqrt(D) / (lower.square() + D * eta).sqrt()  # (B, N)
    L = L * (1 + gamma_k(8))  # the rounding of these few operations
    return L if per_token else L.amax(-1)


def _vector_norms(X: Tensor, mode: Mode) -> Tensor:
    """Norms of the vectors LayerProject acts on: ``(B, N)`` (token) or ``(B, 1)``."""
    if mode == "token":
        return torch.linalg.vector_norm(X, dim=-1)  # (B, N)
    if mode == "frobenius":
        return torch.linalg.vector_norm(X, dim=(-2, -1))[:, None]  # (B, 1)
    raise ValueError(f"mode must be 'token' or 'frobenius', got {mode!r}")


def _vector_size(X: Tensor, mode: Mode) -> int:
    """Entries of one projected vector: ``D`` (token) or ``N·D`` (frobenius)."""
    return X.shape[-1] if mode == "token" else X.shape[-2] * X.shape[-1]


def layer_project_local_lipschitz(
    X: Tensor,
    radius: float,
    eps: float | Tensor,
    mode: Mode = "token",
    per_token: bool = False,
) -> Tensor:
    """Local Lipschitz constant of LayerProject (LoFAST eq. 29) on the ε-ball.

    ``p(x) = x R/‖x‖`` if ``‖x‖ > R`` else ``x``: the projection onto the
    radius-R ball, 1-Lipschitz everywhere. Where the whole ε-ball around ``x``
    lies outside the radius-R ball (``‖x‖ − ε > R``), ``p(y) = R y/‖y‖`` on it,
    with Jacobian ``R (I − ŷŷᵀ)/‖y‖`` of norm ``R/‖y‖ ≤ R/(‖x‖ − ε)`` (< 1),
    and the mean value inequality on the convex ball gives that constant.
    Otherwise the constant is 1 (the ball meets the region where ``p`` is the
    identity). ``mode="token"`` projects every token separately and takes the
    maximum over tokens (module docstring); ``"frobenius"`` projects the whole
    token matrix. An **upper bound**.

    Args:
        X: clean inputs, ``(B, N, D)``.
        radius: ``R > 0``.
        eps: Frobenius radius ε ≥ 0, a float or ``(B,)``.
        mode: ``"token"`` or ``"frobenius"`` (as ``lipvit.layers.LayerProject``).
        per_token: return each projected vector's constant, ``(B, N)`` (token)
            or ``(B, 1)`` (frobenius).

    Returns:
        ``(B,)`` tensor in ``X``'s dtype, values in ``(0, 1]``.
    """
    _check_tokens(X)
    check_eps(radius, positive=True, name="radius")
    eps_b = eps_per_sample(eps, X.shape[0], X.dtype, X.device)  # (B,)
    low, _ = _norm_range(_vector_norms(X, mode), _vector_size(X, mode))
    gap = low - eps_b[:, None]  # (B, N) or (B, 1): min ‖y‖ on the ball
    L = torch.where(gap > radius, radius / gap.clamp_min(radius), torch.ones_like(gap))
    L = (L * (1 + gamma_k(4))).clamp_max(1)
    return L if per_token else L.amax(-1)


def layer_project_is_identity(
    X: Tensor, radius: float, eps: float | Tensor, mode: Mode = "token"
) -> Tensor:
    """Whether LayerProject (LoFAST eq. 29) is the identity on the whole ε-ball.

    True where ``‖x‖ + ε ≤ R`` for every projected vector (each token for
    ``mode="token"``, since every token moves by at most ε; the token matrix
    for ``"frobenius"``): then ``p(X') = X'`` for all ``‖X' − X‖_F ≤ ε``. The
    test is decided on an upper bound of the exact norm (:func:`_norm_range`),
    so float rounding never makes it true where the exact condition fails.

    Returns:
        ``(B,)`` bool tensor.
    """
    _check_tokens(X)
    check_eps(radius, positive=True, name="radius")
    eps_b = eps_per_sample(eps, X.shape[0], X.dtype, X.device)  # (B,)
    _, high = _norm_range(_vector_norms(X, mode), _vector_size(X, mode))
    return ((high + eps_b[:, None]) * (1 + gamma_k(2)) <= radius).all(-1)


def linear_norm(W: Tensor) -> Tensor:
    """Lipschitz constant of ``x ↦ W x + b``: the exact spectral norm ``‖W‖``.

    Dense SVD through :func:`lipvit.spectral.spectral_norm` (exact up to float
    rounding, no power-iteration estimate). Applied to every token of a token
    matrix the map ``X ↦ X Wᵀ`` is ``I_N ⊗ W`` with the same norm, so the
    deviation bound is ``ε ‖W‖``, attained (auto_LiRPA's closed form).

    Args:
        W: weight ``(out, in)`` (or a batch ``(..., out, in)``).

    Returns:
        A scalar tensor (or ``(...)``).
    """
    if W.ndim < 2:
        raise ValueError(f"W must be a matrix, got shape {tuple(W.shape)}")
    return spectral_norm(W.detach())


def _gelu_tanh_deriv(x: float) -> float:
    """Derivative of the tanh GELU ``x/2 (1 + tanh(k (x + 0.044715 x³)))``."""
    k = math.sqrt(2 / math.pi)
    u = k * (x + 0.044715 * x**3)
    t = math.tanh(u)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)


def gelu_deriv_max(approximate: Literal["none", "tanh"] = "none") -> float:
    """``max_x |GELU'(x)|`` plus a relative safety margin of 1e-9.

    ``"none"`` (erf GELU, ``nn.GELU()``): closed form :data:`GELU_DERIV_MAX`
    ``= (1 + erf(1))/2 + 1/(e√π) ≈ 1.12890``. ``"tanh"``: maximised
    numerically (golden-section search on [1, 2], which brackets the unique
    maximum; the negative minimum near x ≈ −1.5 is smaller in magnitude and
    checked too).
    """
    if approximate == "none":
        return GELU_DERIV_MAX * (1 + _GELU_MARGIN)
    if approximate != "tanh":
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    a, b = 1.0, 2.0
    r = (math.sqrt(5) - 1) / 2
    for _ in range(100):  # interval shrinks by 0.618 per step: far below 1e-15
        x1, x2 = b - r * (b - a), a + r * (b - a)
        if _gelu_tanh_deriv(x1) < _gelu_tanh_deriv(x2):
            a = x1
        else:
            b = x2
    top = _gelu_tanh_deriv((a + b) / 2)
    low = min(_gelu_tanh_deriv(-1 - i / 1000) for i in range(1001))
    return max(top, -low) * (1 + _GELU_MARGIN)


def gelu_mlp_local_lipschitz(
    W1: Tensor, W2: Tensor, approximate: Literal["none", "tanh"] = "none"
) -> Tensor:
    """Lipschitz constant of ``x ↦ W2 GELU(W1 x + b1) + b2``, docs/math.md §6.

    ``‖W2‖ · max|GELU'| · ‖W1‖``: GELU acts elementwise, so its Jacobian is
    diagonal with entries bounded by ``max|GELU'|`` (:func:`gelu_deriv_max`),
    and spectral norms are exact (dense SVD). A global constant, hence valid
    on every ball; applied per token it bounds the token matrix map too
    (``I_N ⊗`` the per-token Jacobian). An **upper bound**.

    Args:
        W1: ``fc1.weight``, ``(hidden, D)``.
        W2: ``fc2.weight``, ``(D, hidden)``.
        approximate: the GELU variant (``nn.GELU(approximate=...)``).

    Returns:
        Scalar tensor.
    """
    return linear_norm(W2) * gelu_deriv_max(approximate) * linear_norm(W1)
