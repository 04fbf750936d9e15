"""The margins' gradients at every site of the clean point (docs/taylor.md §1).

:func:`site_gradients` runs :func:`~lipvit.certify.taylor.forward.forward`
once per class with a zero tensor added at every site's output and
differentiates each margin ``f_j − f_y`` with respect to the image and to
those tensors (autograd): the weights ``c_jᵀJ`` and ``c_jᵀG_site`` of the
certificate's first-order term and of every site's remainder. The graph is
kept (:class:`MarginGradients`), so that a linear objective of a later site
(:meth:`~MarginGradients.through_act`, :meth:`~MarginGradients.through_stream`)
is back-substituted by one more backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lipvit.certify.taylor.forward import Inject, Record, forward
from torch import Tensor

from lipvit.model import ViT


@dataclass
class MarginGradients:
    """Gradients of every margin ``f_j − f_y`` w.r.t. the image and each site, and
    the graph they came from (for :meth:`through_act`, :meth:`through_stream`).

    Attributes:
        x: ``(B, K, C, S, S)``: the image gradients.
        sites: ``{(k, site): (B, K, *site shape)}``.
        clean: the clean :class:`Record` (no graph).
        logits: the clean logits ``(B, K)``.
    """

    x: Tensor
    sites: Inject
    clean: Record
    logits: Tensor
    _xr: Tensor
    _inject: Inject
    _act_in: list[Tensor]
    _stream: list[Tensor]

    def through_act(self, k: int, v: Tensor) -> tuple[Tensor, Inject]:
        """``J_{z_k←x}ᵀ v`` and ``G_{z_k←φ}ᵀ v`` for every site ``φ`` before block
        ``k``'s activation: the clean linearised network's response, at the image
        and at those sites, to weights ``v`` ``(B, K, N, m)`` on block ``k``'s
        pre-activations (one backward pass through the kept graph)."""
        keys = [key for key in self._inject if 0 <= key[0] < k
                or (key[0] == k and key[1] != "act")]
        return self._back(self._act_in[k], keys, v)

    def through_stream(self, k: int, v: Tensor) -> tuple[Tensor, Inject]:
        """As :meth:`through_act`, for weights ``v`` ``(B, K, N, D)`` on block
        ``k``'s input ``s_{2k}``: the sites of the blocks before ``k``."""
        keys = [key for key in self._inject if 0 <= key[0] < k]
        return self._back(self._stream[2 * k], keys, v)

    def _back(self, out: Tensor, keys: list, v: Tensor) -> tuple[Tensor, Inject]:
        """``∂⟨v, out⟩`` w.r.t. the image and the sites ``keys``, by copy."""
        B, K = v.shape[:2]
        with torch.enable_grad():
            grads = torch.autograd.grad(
                out, [self._xr, *(self._inject[q] for q in keys)],
                grad_outputs=v.reshape(B * K, *v.shape[2:]), retain_graph=True,
            )
        sites = {q: g.reshape(B, K, *g.shape[1:]) for q, g in zip(keys, grads[1:],
                                                                  strict=True)}
        return grads[0].reshape(B, K, *grads[0].shape[1:]), sites


def site_gradients(model: ViT, x: Tensor, y: Tensor) -> MarginGradients:
    """Gradients of every margin ``f_j − f_y`` w.r.t. the image and each site.

    One backward pass for all samples and classes: each sample is repeated
    once per class (``K`` classes), and the graph is kept for
    :meth:`MarginGradients.through_act`.
    """
    B = x.shape[0]
    K = model.config.num_classes
    with torch.no_grad():
        logits0, clean = forward(model, x)
    shapes = {}
    for k in range(len(model.blocks)):
        shapes[(k, "norm1")] = shapes[(k, "attn")] = shapes[(k, "norm2")] = (
            clean.attn_in[k].shape[1:]
        )
        shapes[(k, "act")] = clean.act_in[k].shape[1:]
    shapes[(-1, "norm")] = clean.stream[-1].shape[2:]
    inject = {
        key: torch.zeros(
            (B * K, *s), dtype=x.dtype, device=x.device, requires_grad=True
        )
        for key, s in shapes.items()
    }
    xr = x.repeat_interleave(K, dim=0).requires_grad_(True)  # (B·K, C, S, S)
    with torch.enable_grad():
        logits, rec = forward(model, xr, inject)
        L = logits.reshape(B, K, K)  # copy (b, j) differentiates f_j − f_y
        j = torch.arange(K, device=x.device)
        total = (
            L[:, j, j]
            - L[:, j, :].gather(2, y[:, None, None].expand(B, K, 1)).squeeze(2)
        ).sum()
        grads = torch.autograd.grad(total, [xr, *inject.values()], retain_graph=True)
    g_sites = {
        key: g.reshape(B, K, *g.shape[1:])
        for key, g in zip(inject, grads[1:], strict=True)
    }
    return MarginGradients(grads[0].reshape(B, K, *x.shape[1:]), g_sites, clean,
                           logits0, xr, inject, rec.act_in, rec.stream)


