"""Local Lipschitz constants of attention over a Frobenius ball
(docs/math.md §10, ours).

Pure functions of tensors. Each returns, per sample, a constant ``L`` with
``‖f(X′) − f(X)‖ ≤ L ‖X′ − X‖_F`` for every ``X′`` with ``‖X′ − X‖_F ≤ δ``:
the supremum of the Jacobian's norm over the ball is bounded through what is
known at the clean tokens ``X`` (the attention matrix, the keys' and queries'
reach, the values' spread) and how far the ball lets each of them move. All
are **upper bounds**; ``tests/test_ball.py`` checks them against dense
Jacobians at points of the ball and against PGD, in float64.

============  ==================  ==============================================
symbol        variable            meaning
============  ==================  ==============================================
``δ``         ``delta``           Frobenius radius of the ball, ``(B,)``
``P⁰``        ``P0``              attention matrix at ``X``
``Δ_ij``      ``Delta``           bound of the move of content logit ``ij``
``P̄``         ``P_bar``           entrywise bound of the attention on the ball
``κ_j``       ``kappa``           ``‖A x̂_jᵀ‖``: a query's reach through key ``j``
``ρ_i``       ``rho``             ``‖x̂_i A‖``: a key's reach through query ``i``
``σ_i``       ``sigma``           values' spread under row ``i``
============  ==================  ==============================================

Shapes: ``B`` batch, ``N`` tokens, ``D`` width, ``H`` heads, ``d`` head width.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from lipvit.layers import layer_project
from lipvit.lipschitz_blocks import AttentionNorms, class_attention_paths
from lipvit.spectral import eigvalsh_upper, gamma, spectral_norm


def attention_upper(P0: Tensor, Delta: Tensor) -> Tensor:
    """Entrywise bound of a softmax row whose logits move by at most
    ``Delta``: ``P̄_ij = min(1, P⁰_ij e^{Δ_ij} / Σ_k P⁰_ik e^{−Δ_ik})``
    (docs/math.md eq. 10.1). ``P0`` and ``Delta`` broadcast; rows on the last
    axis."""
    return (P0 * Delta.exp() / (P0 * (-Delta).exp()).sum(dim=-1, keepdim=True)).clamp(
        max=1.0)


def _spread2(v: Tensor, centre: Tensor) -> Tensor:
    """``‖v_j − c_i‖²`` for values ``v`` ``(..., N, d)`` and centres ``c``
    ``(..., M, d)``: ``(..., M, N)``, by the expansion ``‖v‖² + ‖c‖² − 2 c·v``
    plus the bound of its float error (``γ_{d+2} (‖v‖ + ‖c‖)²``), so never
    below the exact value."""
    vv = (v * v).sum(dim=-1)[..., None, :]  # (..., 1, N)
    cc = (centre * centre).sum(dim=-1)[..., :, None]  # (..., M, 1)
    err = gamma(v.shape[-1] + 2) * (vv.sqrt() + cc.sqrt()) ** 2
    return (vv + cc - 2 * centre @ v.mT).clamp_min(0) + err


class SelfBall(NamedTuple):
    """What self-attention's bounds on a ball are made of (per sample, per
    head): ``P0``, ``P_bar``, ``P_low`` ``(B, H, N, N)`` the attention at ``X``
    and its entrywise bounds on the ball (eq. 10.1 and its mirror), ``P_norm``
    ``(B, H)`` a bound of ``‖P_h(X′)‖``, ``soft`` ``(B,)`` the softmax path's
    bound ``‖W_o‖ (2 max_t Σ_h c_{h,t})^{1/2}`` (eq. 10.2)."""

    P0: Tensor
    P_bar: Tensor
    P_low: Tensor
    P_norm: Tensor
    soft: Tensor


def self_ball(
    X: Tensor,
    delta: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    W_v: Tensor,
    norms: AttentionNorms,
    B: Tensor,
    radius: float,
    exact: bool = True,
) -> SelfBall:
    """:class:`SelfBall` of ``X ↦ Σ_h softmax(B_h + X̂ A_h X̂ᵀ) X̂ W_v[h] W_o[h]``
    on the ball of radius ``delta`` around ``X`` (docs/math.md §10): the logit
    moves of eq. (10.3), the attention's bounds of eq. (10.1), the values'
    spread of eq. (10.4) and the softmax path's bound of eq. (10.2). Shapes
    as :func:`self_attention_local`."""
    d = W_q.shape[-1]
    R = radius
    x_hat = layer_project(X, R)  # (B, N, D)
    q, k, v = (torch.einsum("bnD,hDd->bhnd", x_hat, W) for W in (W_q, W_k, W_v))
    P0 = (q @ k.mT / math.sqrt(d) + B).softmax(dim=-1)  # (B, H, N, N)
    A_norm = norms.content[None, :, None]  # (1, H, 1) ‖A_h‖
    beta = A_norm * R**2
    kappa = torch.einsum("hDd,bhnd->bhnD", W_q, k).norm(dim=-1) / math.sqrt(d)
    # (B, H, N) each
    rho = torch.einsum("hDd,bhnd->bhnD", W_k, q).norm(dim=-1) / math.sqrt(d)
    dl = delta[:, None, None]  # (B, 1, 1)
    # Logit moves, eq. (10.3): u κ_j + ρ_i w + ‖A‖ u w with u² + w² ≤ δ² (i ≠ j).
    Delta = (dl[..., None] * (kappa[:, :, None, :] ** 2 + rho[..., None] ** 2).sqrt()
             + (A_norm * dl ** 2 / 2)[..., None])  # (B, H, N, N)
    diag = dl * (kappa + rho) + A_norm * dl**2  # (B, H, N): i = j, u = w ≤ δ
    Delta = torch.minimum(torch.diagonal_scatter(Delta, diag, dim1=-2, dim2=-1),
                          (2 * beta)[..., None])
    P_bar = attention_upper(P0, Delta)
    P_low = attention_upper(P0, -Delta)  # numerator down, denominator up
    P_norm = P_bar.sum(dim=-2).amax(dim=-1).sqrt()  # (B, H)
    if exact:
        P_norm = torch.minimum(P_norm, spectral_norm(P_bar) * (1 + 1e-12))
    # Values' spread under row i, eq. (10.4): around the clean mean v̄_i.
    W_v_h = norms.value_head[None, :, None]  # (1, H, 1) ‖W_v[h]‖
    e2 = _spread2(v, P0 @ v)  # (B, H, N, N)
    m = P_bar.amax(dim=-1)  # (B, H, N) ≥ max_j P_ij
    sigma = (torch.minimum((P_bar * e2).sum(dim=-1), e2.amax(dim=-1)).sqrt()
             + W_v_h * dl * m.sqrt())
    sigma = torch.minimum(sigma, W_v_h * R)
    kappa_bar = torch.minimum(kappa + A_norm * dl, A_norm * R)
    rho_bar = torch.minimum(rho + A_norm * dl, A_norm * R)
    K = torch.minimum((P_bar * kappa_bar[:, :, None, :] ** 2).sum(dim=-1),
                      (kappa_bar**2).amax(dim=-1, keepdim=True))  # (B, H, N)
    c = sigma**2 * K + torch.einsum("bhi,bhit->bht", sigma**2 * rho_bar**2, P_bar)
    soft = norms.out * (2 * c.sum(dim=1).amax(dim=-1)).sqrt()  # (B,)
    return SelfBall(P0, P_bar, P_low, P_norm, soft)


def self_attention_local(
    X: Tensor,
    delta: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    W_v: Tensor,
    norms: AttentionNorms,
    B: Tensor,
    radius: float,
    exact: bool = True,
) -> Tensor:
    """Local constant of ``X ↦ Σ_h softmax(B_h + X̂ A_h X̂ᵀ) X̂ W_v[h] W_o[h]``
    (:class:`lipvit.lipschitz_blocks.GatedAttention`'s attention) on the ball
    of radius ``delta`` around ``X``, docs/math.md eq. (10.2):

        L ≤ ‖W_o‖ (max_h ‖P̄_h‖ ‖W_v‖ + (2 max_t Σ_h c_{h,t})^{1/2}),
        c_t = σ̄_t² K_t + Σ_i σ̄_i² ρ̄_i² P̄_it,   K_i = Σ_j P̄_ij κ̄_j²,

    the value path with the attention bounded entrywise on the ball, and the
    softmax path with the logits' reach and the values' spread as the ball
    allows them (:func:`self_ball`). ``‖P̄_h‖`` is bounded by ``(max_j Σ_i
    P̄_ij)^{1/2}`` (rows of the attention sum to 1) and, with ``exact``, also
    by the dense spectral norm of ``P̄_h`` (float64 certification; training
    takes the first alone).

    Shapes: ``X`` ``(B, N, D)``, ``delta`` ``(B,)``, ``W_q, W_k, W_v`` ``(H, D,
    d)``, ``norms`` the weights' (:func:`lipvit.lipschitz_blocks.
    attention_norms`), ``B`` ``(H, N, N)``; returns ``(B,)``, differentiable.
    """
    return self_local(self_ball(X, delta, W_q, W_k, W_v, norms, B, radius, exact),
                      norms)


def self_local(ball: SelfBall, norms: AttentionNorms) -> Tensor:
    """Eq. (10.2) from a :class:`SelfBall`: ``‖W_o‖ max_h ‖P̄_h‖ ‖W_v‖`` plus
    the softmax path's bound, ``(B,)``."""
    return norms.out * ball.P_norm.amax(dim=-1) * norms.value + ball.soft


class ClassBall(NamedTuple):
    """What class attention's bounds on a ball are made of (per sample):
    ``P0``, ``P_bar``, ``P_low`` ``(B, H, N)`` the attention at ``X`` and its
    bounds on the ball (:func:`class_envelope`), ``soft`` ``(B, H)`` ``‖a_h‖
    s̄_h`` (the values' spread on the ball, eq. 10.4)."""

    P0: Tensor
    P_bar: Tensor
    P_low: Tensor
    soft: Tensor


def class_envelope(P0: Tensor, a_norm: Tensor, delta: Tensor, radius: float
                   ) -> tuple[Tensor, Tensor]:
    """Eq. (10.1b): ``P̲_h[j] ≤ P_h[j](X′) ≤ P̄_h[j]`` for class attention
    ``P_h = softmax_j(B_h[j] + a_h · x̂_j)`` on the ball ``‖X′ − X‖_F ≤ δ``.
    Token ``j``'s logit moves by at most ``‖a_h‖ γ_j`` (``γ_j ≤ min(δ, 2R)``,
    ``Σ_j γ_j² ≤ δ²``); ``P_h[j]`` grows with its own logit and falls with
    the others', and Jensen on the others' share of the denominator (weights
    ``π_k = P_k/(1 − P_j)``) gives

        P̄_j = σ(logit P_j + ‖a_h‖ min(δ r_j, 2 min(δ, 2R))),   r_j² = 1 + Σ_{k≠j} π_k²
        P̲_j = σ(logit P_j − ‖a_h‖ min(√2 δ, 2 min(δ, 2R)))

    (``γ_j + Σ_k π_k γ_k ≤ r_j δ`` and ``γ_j + max_k γ_k ≤ √2 δ`` by
    Cauchy–Schwarz), each also held by eq. (10.1)'s ``min(1, e^{2Δ_h} P_j)``
    and ``e^{−2Δ_h} P_j``, ``Δ_h = ‖a_h‖ min(δ, 2R)``. ``P0`` ``(B, H, N)``,
    ``a_norm`` ``(H,)``, ``delta`` ``(B,)``; returns ``(P̄, P̲)``, rounded
    outwards by ``10⁻¹²``, differentiable."""
    Delta = (a_norm * torch.minimum(delta, torch.full_like(delta, 2 * radius))[:, None]
             )[..., None]  # (B, H, 1) Δ_h
    move = (a_norm * delta[:, None])[..., None]  # (B, H, 1) ‖a_h‖ δ
    info = torch.finfo(P0.dtype)
    p = P0.clamp(info.tiny, 1 - info.eps)
    rest = 1 - p  # (B, H, N)
    others = (p.square().sum(dim=-1, keepdim=True) - p.square()).clamp_min(0.0)
    r = (1 + (others / rest.square()).clamp(max=1.0)).sqrt()  # Σ_{k≠j} π_k² ≤ 1
    logit = p.log() - rest.log()
    up = torch.sigmoid(logit + torch.minimum(move * r, 2 * Delta)) * (1 + 1e-12)
    up = torch.where(P0 < 1 - info.eps, up, torch.ones_like(up))
    P_bar = torch.minimum(up, P0 * (2 * Delta).exp()).clamp(max=1.0)
    low = torch.sigmoid(logit - torch.minimum(move * math.sqrt(2), 2 * Delta))
    P_low = torch.maximum(low * (1 - 1e-12), P0 * (-2 * Delta).exp())
    return P_bar, torch.minimum(P_low, P0)


def class_ball(X: Tensor, delta: Tensor, a: Tensor, W_v: Tensor,
               norms: AttentionNorms, B: Tensor, radius: float, exact: bool = True
               ) -> ClassBall:
    """:class:`ClassBall` of class attention at tokens ``X`` ``(B, N, D)`` on
    the ball of radius ``delta`` ``(B,)``: the attention's bounds
    :func:`class_envelope` (eq. 10.1b) and the values' spread bounded at ``X`` plus
    what the ball adds (eq. 10.4). With ``exact`` the spread is measured on
    the values; else (training) on the tokens, times ``‖W_v[h]‖`` (cheaper,
    never smaller). ``a`` ``(H, D)``, ``W_v`` ``(H, D, d)``, ``B`` ``(H, N)``."""
    R = radius
    x_hat = layer_project(X, R)  # (B, N, D)
    P0 = (x_hat @ a.T).mT.add(B).softmax(dim=-1)  # (B, H, N)
    a_norm = norms.content  # (H,)
    P_bar, P_low = class_envelope(P0, a_norm, delta, R)  # (B, H, N)
    W_v_h = norms.value_head  # (H,)
    centre = P0 @ x_hat  # (B, H, D) the clean pooled tokens
    if exact:  # ‖(x̂_j − x̄_h) W_v[h]‖²
        values = torch.einsum("bnD,hDv->bhnv", x_hat, W_v)
        centres = torch.einsum("bhD,hDv->bhv", centre, W_v)[..., None, :]
        e2 = _spread2(values, centres)[..., 0, :]
    else:  # ‖x̂_j − x̄_h‖² ‖W_v[h]‖², the tokens shared by every head
        e2 = _spread2(x_hat, centre) * W_v_h[:, None] ** 2
    m = P_bar.amax(dim=-1)  # (B, H)
    sigma = (torch.minimum((P_bar * e2).sum(dim=-1), e2.amax(dim=-1)).sqrt()
             + W_v_h * delta[:, None] * m.sqrt())
    sigma = torch.minimum(sigma, W_v_h * R)  # (B, H)
    return ClassBall(P0, P_bar, P_low, a_norm * sigma)


def class_attention_local(
    X: Tensor,
    delta: Tensor,
    a: Tensor,
    W_v: Tensor,
    norms: AttentionNorms,
    B: Tensor,
    radius: float,
    exact: bool = True,
) -> Tensor:
    """Local constant of class attention ``X ↦ [(Σ_j P_h[j] x̂_j) W_v[h]]_h``,
    ``P_h = softmax(B_h + X̂ a_h)``
    (:class:`lipvit.lipschitz_blocks.ClassAttention`) on the ball of radius
    ``delta`` around ``X``, docs/math.md eq. (10.5): eq. (9.4)'s two paths with
    :func:`class_ball`'s ``P̄`` and spreads.

    Shapes: ``X`` ``(B, N, D)``, ``delta`` ``(B,)``, ``a`` ``(H, D)``, ``W_v``
    ``(H, D, d)``, ``norms`` the weights' (``content = ‖a_h‖``), ``B`` ``(H,
    N)``; returns ``(B,)``, differentiable.
    """
    ball = class_ball(X, delta, a, W_v, norms, B, radius, exact)
    return sum(class_attention_paths(norms, ball.P_bar, ball.soft, exact))


def class_head_local(
    X: Tensor,
    delta: Tensor,
    a: Tensor,
    W_v: Tensor,
    norms: AttentionNorms,
    B: Tensor,
    radius: float,
    M: Tensor,
    M_norm: Tensor,
    head_norm: Tensor,
    chunk: int = 16,
) -> Tensor:
    """Local constant of class attention followed by the head's hidden layer,
    ``X ↦ W c(X)``, on the ball of radius ``delta`` around ``X``, docs/math.md
    eq. (10.6) (certification only: float64, dense per sample):

        L ≤ ‖[C_1 … C_N]‖ + ‖M‖ ‖η‖ + ‖W‖ (max_j μ_j)^{1/2},   C_j = Σ_h P⁰_h[j] M_h,

    the value path exact at ``X`` (``M_h = W_h W_v[h]ᵀ`` ``(out, D)``, ``W_h``
    the columns of ``W`` that read head ``h``; the norm of the ``out × N·D``
    matrix from the ``out × out`` Gram ``Σ_j C_j C_jᵀ``, rounded up) plus what
    the ball can change in it (``η_hj ≥ |P_h[j] − P⁰_h[j]|``, ``‖M‖`` the norm
    of ``[M_1 … M_H]``), and the softmax path of (10.5) through ``‖W‖``.
    ``M`` ``(H, out, D)``; returns ``(B,)``.
    """
    ball = class_ball(X, delta, a, W_v, norms, B, radius)
    eta = torch.maximum(ball.P_bar - ball.P0, ball.P0 - ball.P_low)  # (B, H, N)
    eta_norm = (eta.sum(dim=-2).amax(dim=-1) * eta.sum(dim=-1).amax(dim=-1)).sqrt()
    exact = []
    for start in range(0, X.shape[0], chunk):
        P0 = ball.P0[start:start + chunk]  # (b, H, N)
        C = torch.einsum("bhn,hoD->bnoD", P0, M)  # (b, N, out, D)
        G = torch.einsum("bnoD,bnpD->bop", C, C)  # (b, out, out)
        scale = (C * C).sum(dim=(1, 2, 3))  # ‖[C_j]‖_F² ≥ ‖|K|‖_F²
        exact.append(eigvalsh_upper(G, scale, C.shape[1] * C.shape[3]).sqrt())
    _, soft = class_attention_paths(norms, ball.P_bar, ball.soft)
    return torch.cat(exact) + M_norm * eta_norm + head_norm * soft
