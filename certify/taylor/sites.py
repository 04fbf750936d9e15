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
from typing import NamedTuple

import torch
from lipvit.certify.taylor.forward import Inject, Record, forward
from torch import Tensor

from lipvit.model import ViT


class _Graph(NamedTuple):
    """The forward pass of every (sample, class) copy with zero tensors added at
    the sites, kept for backward passes: the image copies ``xr`` ``(B·K, C, S,
    S)``, the added tensors and the recorded pre-activations and stream states."""

    xr: Tensor
    inject: Inject
    act_in: list[Tensor]
    stream: list[Tensor]


def _graph(model: ViT, x: Tensor, clean: Record) -> tuple[_Graph, Tensor]:
    """:class:`_Graph` of ``x`` ``(B, C, S, S)`` (each sample repeated once per class,
    ``K`` classes) and its logits ``(B·K, K)``; ``clean`` gives the sites' shapes."""
    B, K = x.shape[0], model.config.num_classes
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
    return _Graph(xr, inject, rec.act_in, rec.stream), logits


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
    _model: ViT
    _images: Tensor  # (B, C, S, S)
    _graph: _Graph | None  # built again at the first backward pass where None

    def take(self, index: Tensor) -> MarginGradients:
        """The gradients of the samples ``index`` ``(b,)`` of the batch; their own
        graph (a forward pass of their copies) is built at the first
        back-substitution that needs it, so that it costs what they do. The
        batch's graph is let go (and built again if it is needed again): a
        radius search that narrows to some samples does not come back to all
        of them, and both graphs at once would hold twice the memory."""
        self._graph = None
        sites = {q: g[index] for q, g in self.sites.items()}
        return MarginGradients(self.x[index], sites, self.clean.take(index),
                               self.logits[index], self._model, self._images[index],
                               None)

    def through_act(self, k: int, v: Tensor) -> tuple[Tensor, Inject]:
        """``J_{z_k←x}ᵀ v`` and ``G_{z_k←φ}ᵀ v`` for every site ``φ`` before block
        ``k``'s activation: the clean linearised network's response, at the image
        and at those sites, to weights ``v`` ``(B, K, N, m)`` on block ``k``'s
        pre-activations (one backward pass through the kept graph)."""
        keys = [key for key in self.sites if 0 <= key[0] < k
                or (key[0] == k and key[1] != "act")]
        return self._back(lambda g: g.act_in[k], keys, v)

    def through_stream(self, k: int, v: Tensor) -> tuple[Tensor, Inject]:
        """As :meth:`through_act`, for weights ``v`` ``(B, K, N, D)`` on block
        ``k``'s input ``s_{2k}``: the sites of the blocks before ``k``."""
        keys = [key for key in self.sites if 0 <= key[0] < k]
        return self._back(lambda g: g.stream[2 * k], keys, v)

    def _back(self, out, keys: list, v: Tensor) -> tuple[Tensor, Inject]:
        """``∂⟨v, out(graph)⟩`` w.r.t. the image and the sites ``keys``, by copy."""
        if self._graph is None:
            self._graph = _graph(self._model, self._images, self.clean)[0]
        graph = self._graph
        B, K = v.shape[:2]
        with torch.enable_grad():
            grads = torch.autograd.grad(
                out(graph), [graph.xr, *(graph.inject[q] for q in keys)],
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
    graph, logits = _graph(model, x, clean)
    with torch.enable_grad():
        L = logits.reshape(B, K, K)  # copy (b, j) differentiates f_j − f_y
        j = torch.arange(K, device=x.device)
        total = (
            L[:, j, j]
            - L[:, j, :].gather(2, y[:, None, None].expand(B, K, 1)).squeeze(2)
        ).sum()
        grads = torch.autograd.grad(total, [graph.xr, *graph.inject.values()],
                                    retain_graph=True)
    g_sites = {
        key: g.reshape(B, K, *g.shape[1:])
        for key, g in zip(graph.inject, grads[1:], strict=True)
    }
    return MarginGradients(grads[0].reshape(B, K, *x.shape[1:]), g_sites, clean,
                           logits0, model, x, graph)
