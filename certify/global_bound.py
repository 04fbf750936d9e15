"""Proven global Lipschitz constants, and the certificate they give
(docs/math.md §9).

A model with ``arch="hybrid"`` (:class:`lipvit.hybrid.HybridViT`) or
``arch="cait"`` (:class:`lipvit.cait.LipschitzCaiT`) is a composition of maps
whose ℓ2 Lipschitz constants are bounded by closed formulas in their weights
(each map owns its constant, :mod:`lipvit.lipschitz_blocks`): the stem
(convolutions by the DFT of their kernels, §9.1; MaxMin and pixel
unshuffling 1; the embedding's spectral norm), gated attention blocks (eq.
9.2), per-token MLPs, class attention (eq. 9.4) and the head's hidden layer.
Their product ``L`` bounds ``‖g(x′) − g(x)‖₂ / ‖x′ − x‖₂`` everywhere for the
features ``g`` that the last linear layer ``W`` reads, so every margin ``F_y −
F_j = (w_y − w_j)ᵀ g + b_y − b_j`` moves by at most ``ε L ‖w_y − w_j‖`` on the
ε-ball: the point is certified where every such margin exceeds it (§9.3;
GloRo's per-pair constant, at most LoFAST Prop. 1's ``√2 ‖W‖ L``). The radius
is in closed form and every point costs one forward pass.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from lipvit.errors import UnsupportedModelError
from lipvit.lipschitz_blocks import AttentionNorms
from lipvit.spectral import spectral_norm

from .certification import ROUNDING

#: The architectures whose every map carries a proven constant.
PROVEN_ARCHS = ("hybrid", "cait")


def check_global(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` unless ``model`` carries proven
    constants (``arch`` ``"hybrid"`` or ``"cait"``, its attention not ablated
    by :func:`lipvit.ablate_attention`)."""
    if getattr(getattr(model, "config", None), "arch", "vit") not in PROVEN_ARCHS:
        raise UnsupportedModelError(
            "this certificate needs a model whose every map has a proven Lipschitz "
            "constant (the lipschitz family's arch 'hybrid' or 'cait'); this model "
            "has none"
        )
    if any(getattr(m, "ablated", False) for m in model.modules()):
        # An ablated block is the identity (constant 1), which its chain would
        # still charge (1 − g) + g L_A: possibly below 1, an unsound bound.
        raise UnsupportedModelError(
            "this model's attention is ablated (lipvit.ablate_attention): its "
            "blocks' proven constants no longer describe it; certify the model it "
            "was made from"
        )


class GlobalConstant(NamedTuple):
    """``L`` of the features the last layer reads, and that layer's weight."""

    L: Tensor  # () float64, rounded up
    W: Tensor  # (classes, hidden) effective weight of the last layer


class Chain(NamedTuple):
    """The proven constants of a hybrid ViT or CaiT in the order of its forward
    pass: ``L = stem · Π_k (r_k (1 − g_k) + g_k L_A,k / s_k) · after_k``, each
    attention map ``k`` a gated residual block (``r = 1``, gate ``g``, its
    output divided by ``s``) or class attention (``r = 0``, ``g = s = 1``),
    ``after_k`` the constant of the maps up to the next attention map (the
    per-token MLPs), ``head`` the head's hidden layer's. For CaiT's
    certification, ``class_head`` holds class attention's value maps through
    the head's hidden layer (``M_h = W_h W_v[h]ᵀ`` ``(H, out, D)``) and
    ``class_head_norm`` the norm of ``[M_1 … M_H]`` (docs/math.md eq. 10.6)."""

    stem: Tensor  # ()
    maps: tuple[nn.Module, ...]  # the attention maps
    norms: tuple[AttentionNorms, ...]  # their weight norms
    L_A: tuple[Tensor, ...]  # each map's global constant (9.2, 9.4)
    gate: tuple[Tensor, ...]
    scale: tuple[Tensor, ...]
    residual: tuple[float, ...]
    after: tuple[Tensor, ...]
    head: Tensor  # ()
    class_head: Tensor | None = None
    class_head_norm: Tensor | None = None

    def factor(self, k: int, L_A: Tensor) -> Tensor:
        """Map ``k``'s block constant with its attention's constant ``L_A``."""
        g = self.gate[k]
        return self.residual[k] * (1 - g) + g * L_A / self.scale[k]


def proven_chain(model: nn.Module, capped: bool = False) -> Chain:
    """The :class:`Chain` of ``model`` (``arch`` ``"hybrid"`` or ``"cait"``), in
    its dtype, differentiable where gradients are enabled (training reads it;
    certification computes it once per model). With ``capped`` the maps whose
    norm is capped at 1 by construction (the stem's convolutions and
    embedding, the MLPs, the head's hidden layer) count as their caps instead
    of their computed norms: an upper bound that costs no decomposition, for
    training."""
    check_global(model)
    maps, norms, L_A, gate, scale, residual, after = [], [], [], [], [], [], []
    one = torch.ones((), dtype=model.pos_embed.dtype, device=model.pos_embed.device)

    def add(attn: nn.Module, g: Tensor, normalize: bool, r: float, rest: Tensor):
        maps.append(attn)
        norms.append(attn.norms())
        L_A.append(attn.lipschitz(norms[-1]))
        gate.append(g)
        scale.append(L_A[-1].clamp_min(1.0) if normalize else one)
        residual.append(r)
        after.append(rest)

    for block in model.blocks:
        attn = getattr(block, "attn", block)
        mlp = block.mlp.constant(capped) if hasattr(block, "mlp") else one
        add(attn, attn.gate(), attn.normalize, 1.0, mlp)
    if model.config.arch == "cait":
        add(model.cls_attn, one, False, 0.0, one)
    head = one if capped else spectral_norm(model.head_hidden.weight)
    stem = one if capped else model.stem_lipschitz()
    M = M_norm = None
    if model.config.arch == "cait" and not capped:
        ca = model.cls_attn
        # (out, H, d): the columns of the hidden layer that read each head
        W = model.head_hidden.weight.reshape(-1, ca.num_heads, ca.value_dim)
        M = torch.einsum("ohv,hDv->hoD", W, ca.value)  # (H, out, D): W_h W_v[h]ᵀ
        M_norm = spectral_norm(M.permute(1, 0, 2).reshape(M.shape[1], -1))
    return Chain(stem, tuple(maps), tuple(norms), tuple(L_A), tuple(gate),
                 tuple(scale), tuple(residual), tuple(after), head, M, M_norm)


def global_constant(model: nn.Module) -> GlobalConstant:
    """Product of the proven constants of ``model``'s maps up to its last
    linear layer (:func:`proven_chain`, docs/math.md §9), in ``model``'s dtype
    (use a float64 copy), rounded up by
    :data:`~lipvit.certify.certification.ROUNDING`. A gated attention block
    contributes ``(1 − g) + g L_A / s``, its gate ``g``, ``L_A`` its
    attention's constant (9.2) and ``s`` what its forward pass divides the
    attention by (the hybrid: ``max(1, L_A)``, the same formula; CaiT: 1);
    CaiT's per-token MLPs ``(1 − g) + g ‖W₁‖‖W₂‖`` and its class attention
    (9.4)."""
    with torch.no_grad():
        chain = proven_chain(model)
        L = chain.stem * chain.head
        for k, L_A in enumerate(chain.L_A):
            L = L * chain.factor(k, L_A) * chain.after[k]
        return GlobalConstant(L * (1 + ROUNDING), model.head.weight.detach())


def pair_constants(W: Tensor, L: Tensor, y: Tensor) -> Tensor:
    """``L ‖w_y − w_j‖`` for every class ``j``, ``(B, classes)`` (0 at ``j =
    y``), rounded up; ``W`` the last layer's weight ``(classes, hidden)``, ``L``
    a scalar or one per sample ``(B,)``."""
    diff = W[y][:, None, :] - W[None, :, :]  # (B, classes, hidden)
    L = L.reshape(-1, 1) if L.ndim else L
    return L * torch.linalg.vector_norm(diff, dim=-1) * (1 + ROUNDING)


def pair_margins(logits: Tensor, y: Tensor) -> Tensor:
    """``F_y − F_j`` rounded down by ``ROUNDING · max|F|``, ``(B, classes)``,
    ``+inf`` at ``j = y``."""
    true = logits.gather(1, y[:, None])  # (B, 1)
    margins = true - logits - ROUNDING * logits.abs().amax(dim=1, keepdim=True)
    return margins.scatter(1, y[:, None], math.inf)


def global_radius(logits: Tensor, y: Tensor, gc: GlobalConstant) -> Tensor:
    """Certified ℓ2 radius per point, ``(B,)``: ``min_{j≠y} (F_y − F_j) /
    (L ‖w_y − w_j‖)`` (docs/math.md eq. 9.3) with margins rounded down, itself
    lowered by :data:`ROUNDING` so that the radius is a certified value; 0
    where the point is misclassified."""
    margins = pair_margins(logits, y)
    K = pair_constants(gc.W, gc.L, y)
    # A pair with w_y = w_j never moves: certified exactly where its margin is > 0.
    ratio = torch.where(K > 0, margins / K.clamp_min(torch.finfo(K.dtype).tiny),
                        torch.where(margins > 0, math.inf, -math.inf))
    return (ratio.amin(dim=1) * (1 - ROUNDING)).clamp_min(0.0)
