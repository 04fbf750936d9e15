"""What a trained hybrid ViT or CaiT reports: its proven global constant, what
its attention looks at, and what it loses without it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lipvit.ablation import ABLATED_KEY, ablate_attention, ablations
from lipvit.certify.certification import float64_model
from lipvit.certify.global_bound import global_constant


def proven_summary(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Any]:
    """On images ``x`` with labels ``y`` (a float64 copy of ``model``): the
    proven global constant ``L`` (:func:`lipvit.certify.global_bound.
    global_constant`), per attention block the model's ``attention_spread``
    (mean logit spreads, gate, ``L_A``), and the accuracy with and without the
    attention (:func:`lipvit.ablate_attention`; CaiT: also without its
    self-attention alone)."""
    m = float64_model(model)
    x = x.to(device=m.pos_embed.device, dtype=torch.float64)
    y = y.to(m.pos_embed.device)
    with torch.no_grad():
        acc = float((m(x).argmax(1) == y).double().mean())
        ablated = {ABLATED_KEY[which]:
                   float((ablate_attention(m, which)(x).argmax(1) == y).double().mean())
                   for which in ablations(m)}
    return {"arch": m.config.arch, "global_constant": float(global_constant(m).L),
            "attention": m.attention_spread(x), "accuracy": acc, **ablated,
            "points": int(x.shape[0])}


def proven_text(summary: dict[str, Any]) -> str:
    """One line of a :func:`proven_summary`: ``global constant 1.0000;
    attention logit spread 0.90 (content 0.00), gate 0.027; ...; accuracy
    0.897, without attention 0.100`` (older summaries lack the last part)."""
    blocks = "; ".join(
        f"attention logit spread {a['total']:.2f} (content {a['content']:.2f}"
        + (f", of it with the image {a['image']:.2f}" if "image" in a else "")
        + f"), gate {a['gate']:.3f}" for a in summary["attention"])
    text = f"global constant {summary['global_constant']:.4f}; {blocks}"
    if "ablated_accuracy" in summary:
        text += (f"; accuracy {summary['accuracy']:.3f}, without attention "
                 f"{summary['ablated_accuracy']:.3f}"
                 + (f", without self-attention {summary['self_ablated_accuracy']:.3f}"
                    if "self_ablated_accuracy" in summary else "")
                 + f" ({summary['points']} test images)")
    return text
