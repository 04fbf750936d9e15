"""PGD adversarial examples for adversarial training (``TrainConfig.adv_train``).

Shapes: ``B`` batch, ``C`` channels, ``S`` image side.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def pgd_attack(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    norm: Literal["linf", "l2"],
    eps: float,
    steps: int,
    alpha: float | None = None,
    loss_scale: float = 1.0,
    generator: torch.Generator | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> Tensor:
    """PGD with a random start (Madry et al. 2018), for adversarial training.

    Ascends ``CE(loss_scale · model(x'), y)`` over ``‖x' − x‖ ≤ eps`` (ℓ∞ or
    ℓ2 per image) intersected with ``[0, 1]``: sign steps (ℓ∞) or
    normalised-gradient steps (ℓ2) of size ``alpha`` (default
    ``2.5 · eps / steps``), each followed by the projection onto the ball and a
    clamp to ``[0, 1]``. Parameters receive no gradient.

    Args:
        model: classifier on images in ``[0, 1]``.
        x: images ``(B, C, S, S)``.
        y: labels ``(B,)``.

    Returns:
        Perturbed images ``(B, C, S, S)``, detached.
    """
    alpha = 2.5 * eps / steps if alpha is None else alpha
    ctx = autocast if autocast is not None else contextlib.nullcontext
    B = x.shape[0]

    def per_image(v: Tensor) -> Tensor:
        return v.reshape(B, 1, 1, 1)

    if norm == "linf":
        delta = (
            torch.rand(x.shape, device=x.device, generator=generator) * 2 - 1
        ) * eps
    else:
        delta = torch.randn(x.shape, device=x.device, generator=generator)
        radius = eps * torch.rand(B, device=x.device, generator=generator)
        delta = delta * per_image(
            radius / delta.flatten(1).norm(dim=1).clamp_min(1e-12)
        )
    delta = (x + delta).clamp(0, 1) - x
    for _ in range(steps):
        delta.requires_grad_(True)
        with ctx():
            logits = model(x + delta)
        loss = F.cross_entropy(loss_scale * logits.float(), y)
        (grad,) = torch.autograd.grad(loss, delta)
        with torch.no_grad():
            if norm == "linf":
                delta = (delta + alpha * grad.sign()).clamp(-eps, eps)
            else:
                g = grad.flatten(1).norm(dim=1).clamp_min(1e-12)
                delta = delta + alpha * grad / per_image(g)
                n = delta.flatten(1).norm(dim=1)
                delta = delta * per_image((eps / n.clamp_min(1e-12)).clamp(max=1.0))
            delta = (x + delta).clamp(0, 1) - x
    return (x + delta).detach()
