"""Certified training for the ``ball`` certificate (docs/fashion-mnist.md,
"The CaiT").

``ball`` certifies class ``y`` at radius ``ε`` when every wrong class ``j`` has
``f_y − f_j > ε L(x, ε) ‖w_y − w_j‖`` (:func:`lipvit.certify.ball.network.
ball_constant`). Following GloRo (Leino et al., 2021) the cross-entropy sees
the logits in units of the bound, each wrong class raised by its pair's
constant:

    f̃_j = f_j / L(x, ε) + ε ‖w_y − w_j‖   (j ≠ y),   f̃_y = f_y / L(x, ε),

so ``f̃_y > f̃_j`` for every ``j`` is the certificate itself (in the training
precision, with the bounds' cheaper forms: never smaller). ``L`` is computed
from the attention maps' inputs of the forward pass (forward pre-hooks): no
second pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from lipvit.certify.ball.network import ball_constant
from lipvit.certify.global_bound import Chain, pair_constants, proven_chain
from lipvit.lipschitz_blocks import attention_maps


class BallLoss:
    """The ``ball`` certificate's raised logits, read through hooks (the
    interface of :class:`lipvit.certified_training.CertifiedLoss`)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._inputs: list[Tensor] = []
        self._handles = [m.register_forward_pre_hook(self._keep)
                         for m in attention_maps(model)]
        self.last: dict[str, Tensor] = {}

    def _keep(self, module: nn.Module, args: tuple[Tensor, ...]) -> None:
        if torch.is_grad_enabled():
            self._inputs.append(args[0])

    def clear(self) -> None:
        """Forget the inputs seen so far (e.g. PGD's forward passes)."""
        self._inputs = []

    @staticmethod
    @contextlib.contextmanager
    def context() -> Iterator[None]:
        yield

    def raised_logits(self, logits: Tensor, x: Tensor, y: Tensor, eps: float) -> Tensor:
        """``(B, classes)`` logits ``f̃`` (module docstring) of the forward pass
        since :meth:`clear`; ``x`` is not read (the interface's). :attr:`last`
        holds, detached, ``certified`` ``(B,)``: the training points the
        bound certifies at ``eps``."""
        if not self._inputs:
            raise RuntimeError("BallLoss: no forward pass recorded since clear()")
        chain = proven_chain(self.model, capped=True)
        L = ball_constant(chain, self._inputs, eps, exact=False)  # (B,)
        self.clear()
        raised = self._raise(logits, x, y, eps, L, chain)
        self.last = {"certified": (raised.argmax(dim=1) == y).detach()}
        return raised

    def _raise(self, logits: Tensor, x: Tensor, y: Tensor, eps: float, L: Tensor,
               chain: Chain) -> Tensor:
        """``ball``'s raised logits ``f / L + ε ‖w_y − w_j‖`` ``(B, classes)``
        (at ``y`` ``f_y / L``), ``L`` ``(B,)`` its constant on the batch from
        ``chain`` (the capped :func:`proven_chain` of this step)."""
        W = self.model.head.weight
        pair = pair_constants(W, W.new_ones(()), y)  # (B, C): ‖w_y − w_j‖
        return logits / L[:, None] + eps * pair

    def certified(self) -> Tensor:
        """``(B,)`` bool: the points of the last :meth:`raised_logits` that
        the bound certifies at its ``eps``."""
        return self.last["certified"]

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
