"""Certified training for the ``margin`` certificate (docs/certified-training.md
§7).

``margin`` certifies class ``y`` at radius ``ε`` when every wrong class ``j``
has ``f_y − f_j > D_j(x, ε)``, ``D_j`` its bound on the margin's drop
(:class:`lipvit.certify.follow.network.MarginCertificate`, docs/math.md §11;
never above ``ball``'s ``ε L(x, ε) ‖w_y − w_j‖``). As :mod:`.ball_loss` does
for ``ball``, the cross-entropy sees the logits in units of ``ball``'s
constant ``L``, each wrong class raised by its drop bound:

    f̃_j = (f_j + D_j) / L   (j ≠ y),   f̃_y = f_y / L,

so ``f̃_y > f̃_j`` for every ``j`` is ``margin``'s certificate. ``D`` is the
certificate's bound computed differentiably in the training precision
(double backpropagation through the margins' gradients at every site), with
the cheaper forms training reads for ``ball`` (the capped maps at their caps,
``exact=False``: never smaller), on the first ``points`` images of each batch
(about 0.45 s an image on the Fashion-MNIST CaiT, two CPU threads, float32,
forward and backward); the rest of the batch sees ``ball``'s raised logits.
The operator norms the bound reads (the stem's, ``‖W₁‖``, ``‖W_a − W_b‖``)
enter as constants of the current weights: their gradients are not followed.
A step whose gradients are not finite (a degenerate case of the bound's
derivative) is skipped by the training loop and counted in :attr:`skipped`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lipvit.certify.follow.network import MarginCertificate
from lipvit.certify.global_bound import Chain

from .ball_loss import BallLoss


class MarginLoss(BallLoss):
    """``margin``'s raised logits on the first ``points`` images of each batch,
    ``ball``'s on the rest (the interface of
    :class:`lipvit.certified_training.CertifiedLoss`)."""

    def __init__(self, model: nn.Module, points: int):
        super().__init__(model)
        self.points = points
        self.skipped = 0  # steps the training loop skipped: gradients not finite

    def _raise(self, logits: Tensor, x: Tensor, y: Tensor, eps: float, L: Tensor,
               chain: Chain) -> Tensor:
        raised = super()._raise(logits, x, y, eps, L, chain)
        n = min(self.points, y.shape[0])
        if n == 0 or eps <= 0:
            return raised
        y, classes = y[:n], logits.shape[1]
        every = torch.arange(classes, device=y.device).expand(n, classes)
        wrong = every[every != y[:, None]].view(n, classes - 1)  # (n, classes − 1)
        cert = MarginCertificate(chain, self.model, x[:n], y, targets=wrong,
                                 differentiable=True)
        self.clear()  # the certificate's own forward pass went through the hooks
        drop, _ = cert.drops(torch.full((n,), eps, dtype=x.dtype, device=x.device))
        drop = torch.zeros_like(logits[:n]).scatter(1, wrong, drop)  # none at y
        own = (logits[:n] + drop) / L[:n, None]
        finite = torch.isfinite(own).all(dim=1, keepdim=True)  # else ball's row
        return torch.cat([torch.where(finite, own, raised[:n]), raised[n:]])
