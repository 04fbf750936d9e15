"""The ViT's forward pass with tensors added at its nonlinear *sites*
(docs/taylor.md §1).

A block's sites are the norm before attention (``norm1``), the attention
(``attn``), the norm before the MLP (``norm2``) and the MLP's activation
(``act``); the final norm is the site ``(-1, "norm")``. :func:`forward` runs the
model with tensors added at the sites' outputs (zero: the model itself) and
records every site's input (:class:`Record`); :func:`forward_blocks` starts at
any block, for perturbations injected inside the network
(:mod:`lipvit.certify.taylor.symbols`). Everything ``taylor`` computes is a
derivative of exactly this function (tested against the model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lipvit.certify.attention import attention, bound_weights
from torch import Tensor

from lipvit.errors import UnsupportedModelError
from lipvit.layers import SLL, LayerProject
from lipvit.model import MLP, ViT

SITES = ("norm1", "attn", "norm2", "act")
"""Nonlinear sites of a block, in order; the final norm is the site ``"norm"``."""

Inject = dict[tuple[int, str], Tensor]


# --------------------------------------------------------------------------
# The forward pass with injections at the sites.
# --------------------------------------------------------------------------


def check_supported(model: ViT) -> None:
    """Refuse, with a one-line reason, a model the taylor method cannot bound."""
    if not isinstance(model, ViT):
        raise UnsupportedModelError(
            f"taylor needs a lipvit ViT, got {type(model).__name__}"
        )
    lipschitz = model.config.family == "lipschitz"
    for k, block in enumerate(model.blocks):
        bound_weights(block.attn)  # refuses query/key biases
        norms = (block.norm1, block.norm2)
        kinds = (LayerProject, LayerProject) if lipschitz else (torch.nn.LayerNorm,) * 2
        if not all(isinstance(n, t) for n, t in zip(norms, kinds, strict=True)):
            raise UnsupportedModelError(f"block {k}: unsupported normalisation layers")
        if lipschitz and block.norm2.mode != "token":
            raise UnsupportedModelError(f"block {k}: norm2 must project per token")
        if not isinstance(block.mlp, SLL if lipschitz else MLP):
            raise UnsupportedModelError(f"block {k}: unsupported feed-forward layer")
    if lipschitz and model.norm.mode != "token":
        raise UnsupportedModelError("the final LayerProject must project per token")


def explicit_attention(attn, p: Tensor) -> Tensor:
    """``attn(p)`` with an explicit softmax (LoFAST eq. 6, ``H = 0``, plus biases)."""
    W = attn.head_weights()
    b = attn.head_biases()
    out = attention(p, *W, residual=False)  # (B, N, D)
    if b.b_v is not None:
        out = out + torch.einsum("hd,hdE->E", b.b_v, W.W_o)
    return out + b.b_o if b.b_o is not None else out


@dataclass
class Record:
    """Clean (or dual) values of a forward pass: residual stream and site inputs."""

    stream: list[Tensor]  # 2K + 1 tensors (B, N, D): s_0, s_1, …, s_{2K}
    attn_in: list[Tensor]  # (B, N, D): norm1's output, the attention's input
    act_in: list[Tensor]  # (B, N, m): the activation's pre-activations

    def take(self, index: Tensor) -> Record:
        """The samples ``index`` ``(b,)`` of the batch."""
        return Record(*([t[index] for t in ts]
                        for ts in (self.stream, self.attn_in, self.act_in)))


def forward(
    model: ViT, x: Tensor, inject: Inject | None = None
) -> tuple[Tensor, Record]:
    """``model(x)`` with zero (or any) tensors added at every site's output.

    ``inject[(k, site)]`` is added to block ``k``'s ``site`` output and
    ``inject[(-1, "norm")]`` to the final norm's class-token output. Equal to
    ``model(x)`` without injections (tested). Returns logits ``(B, classes)``
    and a :class:`Record`.
    """
    return forward_blocks(model, model.embed(x), 0, inject)


def forward_blocks(
    model: ViT, X: Tensor, first: int, inject: Inject | None = None
) -> tuple[Tensor, Record]:
    """Blocks ``first, first+1, …`` of ``model``, the final norm and the head, on the
    stream state ``X`` ``(B, N, D)`` entering block ``first``; as :func:`forward`
    otherwise (the :class:`Record` starts at ``X``)."""
    inject = inject or {}

    def add(key: tuple[int, str], t: Tensor) -> Tensor:
        return t + inject[key] if key in inject else t

    lipschitz = model.config.family == "lipschitz"
    rec = Record([X], [], [])
    for k in range(first, len(model.blocks)):
        block = model.blocks[k]
        p = add((k, "norm1"), block.norm1(X))
        rec.attn_in.append(p)
        X = X + add((k, "attn"), explicit_attention(block.attn, p))
        rec.stream.append(X)
        q = add((k, "norm2"), block.norm2(X))
        z = block.mlp.fc1(q)  # (B, N, m)
        rec.act_in.append(z)
        if lipschitz:
            u = add((k, "act"), torch.relu(z))
            X = q - 2.0 * (u / block.mlp.T()) @ block.mlp.fc1.weight
        else:
            X = X + block.mlp.fc2(add((k, "act"), F.gelu(z)))
        rec.stream.append(X)
    cls = add((-1, "norm"), model.norm(X[:, :1])[:, 0])  # (B, D): per-token norm
    return model.head(cls), rec
