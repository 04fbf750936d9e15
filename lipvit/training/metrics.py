"""What the trainer measures on a model: test accuracy and exact σ_max per head.

Shapes: ``L`` attention layers, ``H`` heads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from lipvit.msvp import attention_modules
from lipvit.spectral import spectral_norm


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 1024) -> float:
    """Top-1 accuracy of ``model`` on ``(x, y)`` in float32 (in eval mode)."""
    was_training = model.training
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=x.device)
    with parametrize.cached():
        for i in range(0, x.shape[0], batch_size):
            pred = model(x[i : i + batch_size]).argmax(dim=-1)
            correct += (pred == y[i : i + batch_size]).sum()
    model.train(was_training)
    return float(correct) / max(1, x.shape[0])


def head_sigmas(model: nn.Module) -> Tensor:
    """Exact σ_max of every head's ``W_q, W_k, W_v, W_o``: shape ``(L, 4, H)``.

    Dense SVDs (:func:`lipvit.spectral.spectral_norm`), not power-iteration
    estimates; ``L`` attention layers in model order. A model without
    query/key/value matrices (``attention="conv"``) gives shape ``(0, 4, 0)``.
    """
    with torch.no_grad():
        mods = attention_modules(_unwrap(model))
        if not mods:
            return torch.empty(0, 4, 0)
        return torch.stack(
            [
                torch.stack(
                    [spectral_norm(W.float()) for W in m.head_weights()]
                )  # (4, H)
                for m in mods
            ]
        ).cpu()  # (L, 4, H)


def sigma_summary(model: nn.Module) -> dict[str, Any]:
    """Mean and max exact σ_max of the penalised matrices (``W_q, W_k, W_v``).

    ``mean`` averages over all heads, layers and the three kinds; ``mean_q``
    etc. per kind; ``per_layer`` lists ``[q, k, v, o]`` means per layer. Every
    value is ``None`` for a model without those matrices (``attention="conv"``).
    """
    s = head_sigmas(model)  # (L, 4, H)
    if s.numel() == 0:
        keys = ("mean", "max", "mean_q", "mean_k", "mean_v", "mean_o")
        return {**dict.fromkeys(keys), "per_layer": []}
    qkv = s[:, :3]
    return {
        "mean": float(qkv.mean()),
        "max": float(qkv.max()),
        "mean_q": float(s[:, 0].mean()),
        "mean_k": float(s[:, 1].mean()),
        "mean_v": float(s[:, 2].mean()),
        "mean_o": float(s[:, 3].mean()),
        "per_layer": [[float(x) for x in layer.mean(dim=1)] for layer in s],
    }


def _unwrap(model: nn.Module) -> nn.Module:
    return (
        model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    )
