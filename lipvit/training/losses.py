"""The training loss: cross-entropy on scaled logits with a Lipschitz margin."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def margin_cross_entropy(
    logits: Tensor,
    y: Tensor,
    scale: float = 1.0,
    margin: float = 0.0,
    label_smoothing: float = 0.0,
) -> Tensor:
    """``CE(scale · (logits − margin · onehot(y)))``, see :attr:`TrainConfig.margin`."""
    if margin:
        logits = logits - margin * F.one_hot(y, logits.shape[-1]).to(logits.dtype)
    return F.cross_entropy(scale * logits, y, label_smoothing=label_smoothing)
