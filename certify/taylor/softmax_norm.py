"""The softmax path through a token-wise norm: ``‖S J_N‖`` by a weighted factorisation.

The attention sub-block's structured bound (:mod:`lipvit.certify.taylor.subblock`)
bounds its softmax path through the norm, ``‖S J_N‖``, by ``max_r R_r ‖M‖
‖J_N‖``: 7–20× the exact norm on two points of a standard Fashion-MNIST
model (docs/taylor.md §8), where a LayerNorm's ``1/s_t`` is large on the
few near-constant tokens that barely move the attention. Here ``J_N`` is
block-diagonal over tokens (``J_k`` ``D × D``: LayerNorm, a token-mode
LayerProject, or ``c I`` for one in Frobenius mode) and the weights ``w``
of an intermediate space are chosen so that each factor's norm is a largest
eigenvalue of ``D × D`` Gram matrices (docs/taylor.md §8, "Softmax path
through the norm"; ours).

Notation (one sample, heads ``h``, query rows ``r``, keys ``k``): ``Y`` the
attention's input, ``A_h = W_q[h] W_k[h]ᵀ/√d``, ``V_h = Y W_vo[h]``,
``p_{hr}`` the attention rows, ``g_{hrk} = p_{hrk}(v_{hk} − p_{hr}ᵀV_h)``
(the columns of ``V_hᵀ Ds(p_{hr})``), ``a_{hk} = A_h y_k``, ``b_{hr} =
A_hᵀ y_r``, ``Q_r = Σ_{h,k} g_{hrk} a_{hk}ᵀ``. A perturbation ``Γ`` of the
norm's input moves ``Y`` by ``Γ'_k = J_k Γ_k`` and the softmax path's output
row ``r`` by ``Q_r Γ'_r + Σ_{h,k} g_{hrk} ⟨b_{hr}, Γ'_k⟩``. Pure functions
of tensors.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from lipvit.certify.attention import value_output
from torch import Tensor

from lipvit.spectral import seeded_start, spectral_norm, top_root

WEIGHT_STEPS = 40
"""Descent steps on the weights (any weights give a sound bound; the steps
only tighten it)."""

_LR = 0.1
_TEMPERATURE = 0.02
"""Smoothing of the maxima over tokens (in ``log λ``) for the descent."""

_POWER = 2
"""Power iterations per step for each Gram's top eigenvector (warm-started)."""

_SLACK = 1e-10
"""Relative margin on the ``D × D`` Gram matrices' rounding (as
:mod:`lipvit.certify.taylor.subblock`)."""

_CHUNK_BYTES = 2**27
"""Largest ``(b, H, N, N, D)`` block of ``g`` held at once."""


class SoftmaxFactors(NamedTuple):
    """``g`` ``(B, r, H, k, D)``, ``b`` ``(B, r, H, D)``, ``Q`` ``(B, N, D, D)``
    and the norm's token Jacobians ``J`` ``(B, N, D, D)`` (module notation;
    query row ``r`` first, so that each row's products are batched matrix
    products without copies of ``g``)."""

    g: Tensor
    b: Tensor
    Q: Tensor
    J: Tensor


def softmax_factors(Y: Tensor, W_q: Tensor, W_k: Tensor, W_v: Tensor, W_o: Tensor,
                    P: Tensor, J: Tensor) -> SoftmaxFactors:
    """The factors of ``S J_N`` at the attention input ``Y`` ``(B, N, D)``.

    Args:
        W_q, W_k, W_v: ``(H, D, d)``; W_o: ``(H, d, D)``.
        P: the attention matrices at ``Y`` ``(B, H, N, N)``.
        J: the norm's clean Jacobian on each token ``(B, N, D, D)``.
    """
    A = W_q @ W_k.transpose(-1, -2) / math.sqrt(W_q.shape[-1])  # (H, D, D)
    V = torch.einsum("bnd,hde->bhne", Y, value_output(W_v, W_o))  # (B, H, N, D)
    g = P[..., None] * (V[:, :, None] - (P @ V)[:, :, :, None])  # (B, H, r, k, D)
    g = g.transpose(1, 2).contiguous()  # (B, r, H, k, D)
    B, N, H, _, D = g.shape
    a = torch.einsum("hde,bke->bhkd", A, Y).reshape(B, 1, H * N, D)  # A_h y_k
    b = torch.einsum("bre,hed->brhd", Y, A)  # (B, r, H, D): A_hᵀ y_r
    Q = g.reshape(B, N, H * N, D).transpose(-1, -2) @ a  # (B, r, D, D)
    return SoftmaxFactors(g, b, Q, J)


def weighted_norm(f: SoftmaxFactors, lw: Tensor, lv: Tensor) -> Tensor:
    """Upper bound ``(B,)`` on ``‖S J_N‖`` for the weights ``w_{hrk} =
    e^{lw_{hrk}}`` (``lw`` ``(B, r, H, k)``) and ``v_r = e^{lv_r}`` ``(B, N)``,
    any real ``lw``, ``lv``.

    The intermediate vector ``ξ = ((w_{hrk}⟨b_{hr}, Γ'_k⟩)_{h,r,k}, (v_r
    Γ'_r)_r)`` has ``‖ξ‖² = Σ_k Γ_kᵀ F_k Γ_k``, ``F_k = J_kᵀ(Σ_{h,r} w_{hrk}²
    b_{hr}b_{hr}ᵀ + v_k² I)J_k``, and output row ``r`` is ``G̃_r ξ_r``
    (``ξ_r`` the entries indexed by ``r``; ``G̃_r`` the columns
    ``g_{hrk}/w_{hrk}`` and ``Q_r/v_r``), so

        ‖S J_N‖ ≤ (max_k λ_max(F_k) · max_r λ_max(G_r))^½,
        G_r = Σ_{h,k} w_{hrk}⁻² g_{hrk} g_{hrk}ᵀ + v_r⁻² Q_r Q_rᵀ.
    """
    w2, v2 = (2 * lw).exp(), (2 * lv).exp()
    B, N, H, _, D = f.g.shape
    Jt = f.J.transpose(-1, -2)
    b = f.b.reshape(B, 1, N * H, D)  # rows (r, h)
    wb = w2.reshape(B, N * H, N).transpose(1, 2)[..., None] * b  # (B, k, (r, h), D)
    inner = wb.transpose(-1, -2) @ b  # (B, k, D, D): Σ_{h,r} w_{hrk}² b_{hr}b_{hr}ᵀ
    F = Jt @ inner @ f.J + v2[..., None, None] * (Jt @ f.J)
    g_w = (f.g * (-lw).exp()[..., None]).reshape(B, N, H * N, D)  # g_{hrk}/w_{hrk}
    G = g_w.transpose(-1, -2) @ g_w + f.Q @ f.Q.transpose(-1, -2) / v2[..., None, None]
    return top_root(F).amax(-1) * top_root(G).amax(-1) * (1 + _SLACK)


def initial_weights(f: SoftmaxFactors) -> tuple[Tensor, Tensor]:
    """``lw`` ``(B, r, H, k)``, ``lv`` balancing each pair's norms: ``w_{hrk}⁴ =
    ‖g_{hrk}‖/‖J_kᵀ b_{hr}‖``, ``v_r⁴ = ‖Q_r‖/‖J_r‖``."""
    tiny = torch.finfo(f.g.dtype).tiny
    gn = f.g.square().sum(-1)  # (B, r, H, k)
    JJ = f.J @ f.J.transpose(-1, -2)  # (B, k, D, D)
    fn = torch.einsum("brhd,bkde,brhe->brhk", f.b, JJ, f.b)  # ‖J_kᵀ b_{hr}‖²
    lw = 0.125 * (gn.clamp_min(tiny).log() - fn.clamp_min(tiny).log())
    q, j = (spectral_norm(t).clamp_min(tiny) for t in (f.Q, f.J))
    lv = 0.25 * (q.log() - j.log())
    return lw.clamp(-30, 30), lv.clamp(-30, 30)


def descend(f: SoftmaxFactors, lw: Tensor, lv: Tensor,
            steps: int) -> tuple[Tensor, Tensor]:
    """Weights lowering :func:`weighted_norm` (a heuristic; any result is sound).

    Adam on ``τ lse_k(log λ_k^F/τ) + τ lse_r(log λ_r^G/τ)`` (the log of the
    bound with its maxima smoothed), the gradients by Hellmann–Feynman from
    warm-started power iterations, matrix-free: ``∂λ_k^F/∂lw_{hrk} =
    2w_{hrk}² ⟨b_{hr}, J_k x_k⟩²``, ``∂λ_r^G/∂lw_{hrk} = −2w_{hrk}⁻²
    ⟨g_{hrk}, y_r⟩²`` (``x_k``, ``y_r`` the top eigenvectors of ``F_k``,
    ``G_r``).
    """
    B, N, D = f.Q.shape[:3]
    lw, lv = lw.clone().requires_grad_(), lv.clone().requires_grad_()
    opt = torch.optim.Adam([lw, lv], lr=_LR)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(steps, 1))
    # A seeded start, the same for every sample: a constant one lies in the
    # kernel of a LayerNorm's Jacobian (J 1 = 0), where the iteration only
    # amplifies rounding.
    x = seeded_start((B, N, D), f.Q.dtype, f.Q.device)
    x = x / _norm(x, torch.finfo(x.dtype).tiny)
    y = x.clone()
    with torch.no_grad():
        for _ in range(steps):
            w2, w_2, v2 = (2 * lw).exp(), (-2 * lw).exp(), (2 * lv).exp()
            x, lam_F, y, lam_G = _power(f, w2, w_2, v2, x, y)
            Jx = _apply(f.J, x)  # (B, k, D)
            dF = 2 * w2 * _key_dots(f, Jx).square()  # (B, r, H, k)
            dG = 2 * w_2 * _row_dots(f, y).square()
            pF = torch.softmax(lam_F.log() / _TEMPERATURE, -1) / lam_F  # (B, k)
            pG = torch.softmax(lam_G.log() / _TEMPERATURE, -1) / lam_G  # (B, r)
            lw.grad = pF[:, None, None, :] * dF - pG[..., None, None] * dG
            Jx2 = Jx.square().sum(-1)  # ‖J_k x_k‖²
            Qy2 = _apply(f.Q.transpose(-1, -2), y).square().sum(-1)
            lv.grad = 2 * (pF * v2 * Jx2 - pG * Qy2 / v2)
            opt.step()
            schedule.step()
    return lw.detach(), lv.detach()


def _power(f: SoftmaxFactors, w2: Tensor, w_2: Tensor, v2: Tensor, x: Tensor,
           y: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:data:`_POWER` matrix-free power iterations on every ``F_k`` and
    ``G_r`` of :func:`weighted_norm` from ``x`` ``(B, N, D)`` and ``y``:
    the new unit vectors and their Rayleigh quotients ``(B, N)``."""
    tiny = torch.finfo(x.dtype).tiny
    B, N, H, _, D = f.g.shape
    Jt, Qt = f.J.transpose(-1, -2), f.Q.transpose(-1, -2)
    for _ in range(_POWER):
        Jx = _apply(f.J, x)  # (B, k, D)
        s = (_key_dots(f, Jx) * w2).reshape(B, N * H, N)
        keys = s.transpose(1, 2) @ f.b.reshape(B, N * H, D)  # (B, k, D)
        Fx = _apply(Jt, keys + v2[..., None] * Jx)
        lam_F = (Fx * x).sum(-1).clamp_min(tiny)
        x = Fx / _norm(Fx, tiny)
        t = (_row_dots(f, y) * w_2).reshape(B, N, 1, H * N)
        Gy = ((t @ f.g.reshape(B, N, H * N, D))[:, :, 0]
              + _apply(f.Q, _apply(Qt, y)) / v2[..., None])
        lam_G = (Gy * y).sum(-1).clamp_min(tiny)
        y = Gy / _norm(Gy, tiny)
    return x, lam_F, y, lam_G


def _key_dots(f: SoftmaxFactors, Jx: Tensor) -> Tensor:
    """``⟨b_{hr}, J_k x_k⟩`` ``(B, r, H, k)`` for ``Jx`` ``(B, k, D)``."""
    B, N, H, D = f.b.shape
    return (f.b.reshape(B, N * H, D) @ Jx.transpose(1, 2)).reshape(B, N, H, N)


def _row_dots(f: SoftmaxFactors, y: Tensor) -> Tensor:
    """``⟨g_{hrk}, y_r⟩`` ``(B, r, H, k)`` for ``y`` ``(B, r, D)``."""
    B, N, H, _, D = f.g.shape
    g = f.g.reshape(B, N, H * N, D)
    return (y[:, :, None] @ g.transpose(-1, -2)).reshape(B, N, H, N)  # yᵀ gᵀ: fast


def _apply(M: Tensor, x: Tensor) -> Tensor:
    """``M_t x_t`` ``(B, N, D)`` for matrices ``M`` ``(B, N, D, D)``: an einsum
    (a batched ``M @ x[..., None]`` is several times slower on a CPU; the
    einsum's results do not depend on the batch's size)."""
    return torch.einsum("bnde,bne->bnd", M, x)


def _norm(v: Tensor, tiny: float) -> Tensor:
    """``‖v‖`` over the last axis, at least ``tiny`` (kept as an axis)."""
    return torch.linalg.vector_norm(v, dim=-1, keepdim=True).clamp_min(tiny)


def softmax_norm_bound(Y: Tensor, W_q: Tensor, W_k: Tensor, W_v: Tensor, W_o: Tensor,
                       P: Tensor, J: Tensor, steps: int = WEIGHT_STEPS) -> Tensor:
    """Upper bound ``(B,)`` on ``‖S J_N‖``, the softmax path of the attention at
    ``Y`` ``(B, N, D)`` through the norm's block-diagonal Jacobian ``J``
    ``(B, N, D, D)``: :func:`weighted_norm` at the better of the initial and
    the descended weights, in chunks of samples (arguments as
    :func:`softmax_factors`)."""
    B, H, N, _ = P.shape
    per_sample = H * N * N * Y.shape[-1] * Y.element_size() * 4
    step = max(1, _CHUNK_BYTES // per_sample)
    out = []
    for i in range(0, B, step):
        sl = slice(i, i + step)
        f = softmax_factors(Y[sl], W_q, W_k, W_v, W_o, P[sl], J[sl])
        out.append(factor_bound(f, steps))
    return torch.cat(out)


def factor_bound(f: SoftmaxFactors, steps: int = WEIGHT_STEPS) -> Tensor:
    """:func:`weighted_norm` ``(B,)`` at the better of the initial and the
    descended weights."""
    lw0, lv0 = initial_weights(f)
    low = SoftmaxFactors(*(t.float() for t in f))  # the descent is a heuristic
    lw, lv = (t.to(lw0.dtype) for t in descend(low, lw0.float(), lv0.float(), steps))
    # fmin: a NaN from a degenerate descent never replaces the start's bound
    return torch.fmin(weighted_norm(f, lw0, lv0), weighted_norm(f, lw, lv))
