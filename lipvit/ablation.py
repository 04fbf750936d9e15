"""Attention ablation: what a trained model loses without its attention."""

from __future__ import annotations

import copy

from torch import nn

from lipvit.lipschitz_blocks import ClassAttention, attention_maps

WHICH = ("all", "self")


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
