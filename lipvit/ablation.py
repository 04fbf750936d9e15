"""Attention ablation: what a trained model loses without its attention."""

from __future__ import annotations

import copy

from torch import nn

from lipvit.lipschitz_blocks import ClassAttention, attention_maps

WHICH = ("all", "self")  # ablate_attention: every attention term, or the self-attention
ABLATED_KEY = {"all": "ablated_accuracy", "self": "self_ablated_accuracy"}
"""Where summaries and ``lipvit info --json`` keep each ablation's accuracy."""


def ablations(model: nn.Module) -> tuple[str, ...]:
    """The ``which`` of :func:`ablate_attention` that differ on ``model``:
    ``("all", "self")`` where it has class attention (CaiT), else ``("all",)``
    (the hybrid ViT's attention is all self-attention)."""
    if any(isinstance(m, ClassAttention) for m in model.modules()):
        return WHICH
    return WHICH[:1]


def ablate_attention(model: nn.Module, which: str = "all") -> nn.Module:
    """A copy of ``model`` in which attention blocks' attention terms are
    removed: a gated self-attention block passes its input on (its gate, part
    of the attention term, goes with it) and class attention leaves the class
    token at its constant start, 0. ``which="all"`` removes every one;
    ``"self"`` only the self-attention blocks, where tokens meet each other
    (CaiT's class attention, its only path to the head, stays). ``model`` is
    left as it is.

    Raises:
        ValueError: ``model`` has no such block (only the lipschitz family's
            hybrid ViT and CaiT have them), or ``which`` is not in
            :data:`WHICH`.
    """
    if which not in WHICH:
        raise ValueError(f"which must be one of {WHICH}, not {which!r}")
    out = copy.deepcopy(model)
    blocks = attention_maps(out)
    if not blocks:
        raise ValueError(
            "ablate_attention needs the lipschitz family's hybrid ViT or CaiT "
            f"(gated attention blocks); {type(model).__name__} has none")
    for block in blocks:
        block.ablated = which == "all" or not isinstance(block, ClassAttention)
    return out
