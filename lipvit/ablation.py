"""Attention ablation: what a trained model loses without its attention."""

from __future__ import annotations

import copy

from torch import nn

from lipvit.lipschitz_blocks import attention_maps


def ablate_attention(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in which every attention block's attention term is
    removed: a gated self-attention block passes its input on (its gate, part
    of the attention term, goes with it) and class attention leaves the class
    token at its constant start, 0. ``model`` is left as it is.

    Raises:
        ValueError: ``model`` has no such block (only the lipschitz family's
            hybrid ViT and CaiT have them).
    """
    out = copy.deepcopy(model)
    blocks = attention_maps(out)
    if not blocks:
        raise ValueError(
            "ablate_attention needs the lipschitz family's hybrid ViT or CaiT "
            f"(gated attention blocks); {type(model).__name__} has none")
    for block in blocks:
        block.ablated = True
    return out
