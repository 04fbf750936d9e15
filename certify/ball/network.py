"""The ``ball`` certificate: local constants over the ε-ball composed through
the hybrid ViT or CaiT of the lipschitz family (docs/math.md §10).

The image ball of radius ``ε`` maps into a token ball of radius
``δ₀ = L_stem ε`` (the stem's proven constant). Each attention block then
multiplies the radius by its **local** constant on the ball around its clean
input (:mod:`.attention`; never above its global one, eq. 9.2 / 9.4), every
other map by its proven constant; the composition is sound by induction, as
LoFAST's (§5). The last radius ``δ`` bounds how far the features the last
linear layer reads can move, so each margin moves by at most
``‖w_y − w_j‖ δ`` (eq. 9.3, per pair). ``δ = ε L(x, ε)`` grows with ``ε``, so
radii come from bisection (:func:`lipvit.certify.certification.bisect_radius`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from lipvit.lipschitz_blocks import AttentionNorms, ClassAttention, attention_maps

from ..certification import ROUNDING, bisect_radius
from ..global_bound import Chain, pair_constants, pair_margins, proven_chain
from .attention import class_attention_local, class_head_local, self_attention_local


class BallBound(NamedTuple):
    """The logits at ``x`` and ``L(x, ε)``: the features move by at most
    ``ε L`` on the ε-ball (per sample, rounded up)."""

    logits: Tensor  # (B, classes)
    L: Tensor  # (B,)


def local_constant(attn: nn.Module, norms: AttentionNorms, t: Tensor, delta: Tensor,
                   exact: bool) -> Tensor:
    """The local constant of attention map ``attn`` (self- or class attention)
    with weight norms ``norms`` on the ball of radius ``delta`` ``(B,)`` around
    its input ``t``, ``(B,)``."""
    if isinstance(attn, ClassAttention):
        return class_attention_local(t, delta, attn.a(), attn.value, norms,
                                     attn.pos_bias, attn.radius, exact=exact)
    W_q, W_k, W_v, _ = attn.weights()
    return self_attention_local(t, delta, W_q, W_k, W_v, norms, attn.pos_bias,
                                attn.radius, exact=exact)


def attention_inputs(model: nn.Module, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Logits of ``model`` at ``x`` and the input of each of its
    :func:`attention_maps` in that pass (recorded by forward pre-hooks)."""
    inputs: list[Tensor] = []
    handles = [m.register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
               for m in attention_maps(model)]
    try:
        logits = model(x)
    finally:
        for h in handles:
            h.remove()
    return logits, inputs


class BallChain(NamedTuple):
    """Where the ε-ball's image goes through the chain, per unit ``ε``
    (:func:`ball_chain`): each attention map's input moves by at most
    ``ε L_in[k]``, the block's output (its MLP's input) by ``ε L_mid[k]``, the
    features the last layer reads by ``ε L`` (rounded up). Each ``(B,)``."""

    L_in: list[Tensor]
    L_mid: list[Tensor]
    L: Tensor


def ball_chain(chain: Chain, inputs: list[Tensor], eps: Tensor | float,
               exact: bool = True) -> BallChain:
    """:class:`BallChain` on the ε-ball around the images whose attention inputs
    (clean tokens) are ``inputs`` (:func:`attention_inputs`), ``chain`` the
    model's :func:`~lipvit.certify.global_bound.proven_chain`. The radius
    after the stem is ``ε L_stem``; each attention map multiplies it by its
    block constant with its local constant on the ball that radius describes
    around its input (capped by its global one), every other map by its
    proven constant. In the inputs' dtype (certify a float64 copy);
    differentiable (``exact=False`` for training: cheaper bounds, never
    smaller)."""
    first = inputs[0]
    eps = torch.as_tensor(eps, dtype=first.dtype, device=first.device).expand(
        first.shape[0])
    L = chain.stem.expand(first.shape[0])  # (B,)
    head = chain.head  # still to come: the head's hidden layer
    L_in, L_mid = [], []
    for k, (attn, t) in enumerate(zip(chain.maps, inputs, strict=True)):
        L_in.append(L)
        L_loc = local_constant(attn, chain.norms[k], t, eps * L, exact)
        L_A = torch.minimum(L_loc, chain.L_A[k])
        if exact and chain.class_head is not None and isinstance(attn, ClassAttention):
            # Class attention and the head's hidden layer at once (eq. 10.6).
            merged = class_head_local(t, eps * L, attn.a(), attn.value,
                                      chain.norms[k], attn.pos_bias, attn.radius,
                                      chain.class_head, chain.class_head_norm, head)
            L_A, head = torch.minimum(L_A * head, merged), 1.0
        L = L * chain.factor(k, L_A)
        L_mid.append(L)
        L = L * chain.after[k]
    return BallChain(L_in, L_mid, L * head * (1 + ROUNDING))


def ball_constant(chain: Chain, inputs: list[Tensor], eps: Tensor | float,
                  exact: bool = True) -> Tensor:
    """``L(x, ε)``, ``(B,)``: the features the last layer reads move by at most
    ``ε L`` on the ε-ball (:func:`ball_chain`'s ``L``), rounded up."""
    return ball_chain(chain, inputs, eps, exact).L


def ball_bound(model: nn.Module, x: Tensor, eps: Tensor | float,
               exact: bool = True) -> BallBound:
    """Logits and :func:`ball_constant` of ``model`` (``arch`` ``"hybrid"`` or
    ``"cait"``) at images ``x`` ``(B, C, S, S)``, ``eps`` a float or ``(B,)``,
    from one forward pass."""
    logits, inputs = attention_inputs(model, x)
    return BallBound(logits, ball_constant(proven_chain(model), inputs, eps, exact))


class BallCertificate:
    """``ball`` on a batch: one forward pass (the logits and every attention
    map's input), then the certificate at any ``ε`` and the radius from them.

    Args:
        chain: the model's :func:`~lipvit.certify.global_bound.proven_chain`
            (computed once per model).
        model: a hybrid ViT or CaiT (certify a float64 copy, in eval mode).
        x: images ``(B, C, S, S)``; ``y``: labels ``(B,)``.
    """

    def __init__(self, chain: Chain, model: nn.Module, x: Tensor, y: Tensor):
        self.chain = chain
        logits, self.inputs = attention_inputs(model, x)
        self.margins = pair_margins(logits, y)  # (B, classes), +inf at y
        # ‖w_y − w_j‖, rounded up (the constant enters per ε).
        self.pair = pair_constants(model.head.weight, torch.ones((), dtype=x.dtype,
                                                                 device=x.device), y)
        self.correct = logits.argmax(dim=1) == y

    def certified(self, eps: Tensor | float) -> Tensor:
        """``(B,)`` bool: every wrong class's margin (rounded down) exceeds
        ``ε L(x, ε) ‖w_y − w_j‖``."""
        eps = torch.as_tensor(eps, dtype=self.margins.dtype,
                              device=self.margins.device).expand(self.correct.shape[0])
        L = ball_constant(self.chain, self.inputs, eps)  # (B,)
        drop = (eps * L)[:, None] * self.pair * (1 + ROUNDING)
        return (self.margins > drop).all(dim=1) & self.correct

    def radius(self, *, rtol: float = 1e-3, certified_at=()) -> Tensor:
        """Certified radius per point, ``(B,)``: the largest ``ε`` found by
        bisection at which :meth:`certified` holds (sound: certified at the
        value returned; 0 where the point is not certified anywhere). No
        radius exceeds the one ``L(x, 0)`` gives, a lower bound of every
        ``L(x, ε)``: the search stays below it."""
        zero = torch.zeros_like(self.margins[:, 0])
        L0 = ball_constant(self.chain, self.inputs, zero)
        K = L0[:, None] * self.pair
        top = (self.margins / K.clamp_min(torch.finfo(K.dtype).tiny)).amin(dim=1)
        top = torch.where(self.correct & torch.isfinite(top), top.clamp_min(0), zero)
        return bisect_radius(self.certified, top > 0, dtype=top.dtype, rtol=rtol,
                             certified_at=certified_at, bracket=(zero, top))
