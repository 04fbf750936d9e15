"""Proven global Lipschitz constants, and the certificate they give
(docs/math.md §9).

A model with ``arch="hybrid"`` (:class:`lipvit.hybrid.HybridViT`) is a
composition of maps whose ℓ2 Lipschitz constants are bounded by closed
formulas in its weights: convolutions (:func:`lipvit.spectral.conv_operator_norm`),
linear maps (exact spectral norms), MaxMin and pixel unshuffling (1), and gated
attention blocks (:func:`attention_lipschitz`, §9.2). Their product ``L``
bounds ``‖g(x′) − g(x)‖₂ / ‖x′ − x‖₂`` everywhere for the features ``g`` that
the last linear layer ``W`` reads, so every margin ``F_y − F_j = (w_y −
w_j)ᵀ g + b_y − b_j`` moves by at most ``ε L ‖w_y − w_j‖`` on the ε-ball: the
point is certified where every such margin exceeds it (§9.3; GloRo's
per-pair constant, at most LoFAST Prop. 1's ``√2 ‖W‖ L``). The radius is in
closed form and every point costs one forward pass.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from lipvit.errors import UnsupportedModelError
from lipvit.spectral import conv_operator_norm, spectral_norm

from .certification import ROUNDING


def attention_lipschitz(
    W_q: Tensor, W_k: Tensor, W_v: Tensor, W_o: Tensor, B: Tensor, radius: float
) -> Tensor:
    """Global Lipschitz constant (Frobenius norm) of the positional-bias
    attention on token-projected inputs, docs/math.md eq. (9.2):

    ``X ↦ Σ_h softmax(B_h + X̂ A_h X̂ᵀ) X̂ W_v[h] W_o[h]``, ``A_h = W_q[h]
    W_k[h]ᵀ/√d``, ``X̂`` every token of ``X`` projected onto the ball of radius
    ``R``. With ``β_h = ‖A_h‖ R²`` (no content logit exceeds it in size),
    ``P⁰_h = softmax(B_h)``, ``c_h = min(N, e^{2β_h} max_j Σ_i P⁰_h[i, j])``
    (a bound of every column sum of the attention matrix ``P_h``) and
    ``p_h = min(e^{2β_h} ‖P⁰_h‖, √c_h)`` (a bound of ``‖P_h‖``)::

        L ≤ ‖W_o‖ (max_h p_h ‖W_v‖ + (Σ_h 2 β_h² ‖W_v[h]‖² (1 + c_h))^{1/2})

    the value path (attention held fixed) plus the softmax path. Shapes:
    ``W_q, W_k, W_v`` ``(H, D, d)``, ``W_o`` ``(H, d, D)``, ``B`` ``(H, N, N)``;
    returns a scalar, differentiable in every argument.
    """
    H, D, d = W_q.shape
    A = W_q @ W_k.mT / math.sqrt(d)  # (H, D, D)
    beta = spectral_norm(A) * radius**2  # (H,)
    P0 = B.softmax(dim=-1)  # (H, N, N)
    grow = torch.exp(2 * beta)  # (H,): entrywise P ≤ e^{2β} P⁰
    W_v_all = W_v.permute(1, 0, 2).reshape(D, H * d)  # [W_v[1] … W_v[H]]
    W_o_all = W_o.reshape(H * d, -1)  # rows of every head stacked
    N = B.shape[-1]
    col = (grow * P0.sum(dim=-2).amax(dim=-1)).clamp(max=N)  # (H,) column sums of P
    P_norm = torch.minimum(grow * spectral_norm(P0), col.sqrt())  # (H,) ‖P_h‖
    value = P_norm.amax() * spectral_norm(W_v_all)
    soft = math.sqrt(2) * beta * spectral_norm(W_v) * (1 + col).sqrt()  # (H,)
    return spectral_norm(W_o_all) * (value + torch.linalg.vector_norm(soft))


def check_global(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` unless ``model`` carries a proven
    global constant (``arch="hybrid"``)."""
    if getattr(getattr(model, "config", None), "arch", "vit") != "hybrid":
        raise UnsupportedModelError(
            "the global certificate needs a model with a proven global Lipschitz "
            "constant (the lipschitz family's arch='hybrid'); this model has none"
        )


class GlobalConstant(NamedTuple):
    """``L`` of the features the last layer reads, and that layer's weight."""

    L: Tensor  # () float64, rounded up
    W: Tensor  # (classes, hidden) effective weight of the last layer


def global_constant(model: nn.Module) -> GlobalConstant:
    """Product of the proven constants of ``model``'s maps up to its last
    linear layer (docs/math.md §9.1), in ``model``'s dtype (use a float64
    copy), rounded up by :data:`~lipvit.certify.certification.ROUNDING`.

    Each block contributes ``(1 − g) + g L_A / max(1, L̂_A)``, its gate ``g``,
    ``L_A`` its attention's constant and ``L̂_A`` the same formula as the
    forward pass evaluates it (equal here: the forward divides by it).
    """
    check_global(model)
    with torch.no_grad():
        L = torch.ones((), dtype=model.pos_embed.dtype, device=model.pos_embed.device)
        for conv in model.stem:
            size = conv.parametrizations.weight[0].size
            L = L * conv_operator_norm(conv.weight, size)
        L = L * spectral_norm(model.embed.weight)
        for block in model.blocks:
            L_A = block.lipschitz()
            g = block.gate()
            L = L * ((1 - g) + g * L_A / L_A.clamp_min(1.0))
        L = L * spectral_norm(model.head_hidden.weight)
        return GlobalConstant(L * (1 + ROUNDING), model.head.weight.detach())


def pair_constants(gc: GlobalConstant, y: Tensor) -> Tensor:
    """``L ‖w_y − w_j‖`` for every class ``j``, ``(B, classes)`` (0 at ``j = y``)."""
    diff = gc.W[y][:, None, :] - gc.W[None, :, :]  # (B, classes, hidden)
    return gc.L * torch.linalg.vector_norm(diff, dim=-1) * (1 + ROUNDING)


def global_radius(logits: Tensor, y: Tensor, gc: GlobalConstant) -> Tensor:
    """Certified ℓ2 radius per point, ``(B,)``: ``min_{j≠y} (F_y − F_j) /
    (L ‖w_y − w_j‖)`` (docs/math.md eq. 9.3) with margins rounded down, itself
    lowered by :data:`ROUNDING` so that the radius is a certified value; 0
    where the point is misclassified."""
    true = logits.gather(1, y[:, None])  # (B, 1)
    margins = true - logits - ROUNDING * logits.abs().amax(dim=1, keepdim=True)
    K = pair_constants(gc, y)
    # A pair with w_y = w_j never moves: certified exactly where its margin is > 0.
    ratio = torch.where(K > 0, margins / K.clamp_min(torch.finfo(K.dtype).tiny),
                        torch.where(margins > 0, math.inf, -math.inf))
    ratio = ratio.scatter(1, y[:, None], math.inf)  # (B, classes)
    return (ratio.amin(dim=1) * (1 - ROUNDING)).clamp_min(0.0)
