"""Vision Transformer in two families: ``standard`` and ``lipschitz``.

Shapes: ``B`` batch, ``C`` channels, ``N`` tokens (patches + class token), ``D``
width, ``H`` heads, ``d = D / H`` head width.

The standard family is timm's pre-norm ViT (LayerNorm, GELU MLP) as SpecFormer
trains it. The lipschitz family is LoFAST's §5.2 architecture (docs/math.md §5):
LayerProject in place of LayerNorm, a projection of the token matrix before each
attention, SLL feed-forward layers, a patch embedding and head of spectral norm
≤ 1, and per-head caps on ``‖W_v[h]‖`` and ``‖W_o[h]‖``. Models know nothing
about bounds: ``Attention.head_weights`` is the one interface certification and
the MSVP penalty use. ``ViTConfig.attention`` swaps the standard family's
dot-product attention for one of the token mixers of :mod:`lipvit.attention`
(L2, LipschitzNorm, scaled cosine similarity, CoViT's convolution).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lipvit.attention import (  # noqa: F401 (Attention and the heads' types: model API)
    Attention,
    HeadBiases,
    HeadWeights,
    build_attention,
)
from lipvit.cait import LipschitzCaiT
from lipvit.config import ViTConfig
from lipvit.hybrid import HybridViT
from lipvit.layers import SLL, LayerProject, capped_linear


class MLP(nn.Module):
    """timm's feed-forward block ``fc2(GELU(fc1(x)))`` (standard family)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """One transformer block.

    standard: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``.
    lipschitz: ``x + attn(norm1(x))`` with ``norm1`` the projection of the token
    matrix (LoFAST §5.2), then ``mlp(norm2(x))`` where ``mlp`` is an SLL layer,
    already a 1-Lipschitz residual map, and ``norm2`` a per-token LayerProject
    with ``R = √D``.
    """

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        D = cfg.embed_dim
        self.family = cfg.family
        self.attn = build_attention(cfg)
        if cfg.family == "standard":
            self.norm1 = nn.LayerNorm(D, eps=cfg.norm_eps)
            self.norm2 = nn.LayerNorm(D, eps=cfg.norm_eps)
            self.mlp: nn.Module = MLP(D, cfg.mlp_hidden)
        else:
            self.norm1 = LayerProject(cfg.attn_radius, cfg.attn_project)
            self.norm2 = LayerProject(math.sqrt(D), "token")
            self.mlp = SLL(D, cfg.mlp_hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        if self.family == "standard":
            return x + self.mlp(self.norm2(x))
        return self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """Non-overlapping patches, flattened, then one linear map (a strided conv).

    The patches are disjoint, so the map's spectral norm on the whole image is
    ``‖proj.weight‖``; the lipschitz family caps it at 1.
    """

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.patch_size = cfg.patch_size
        fan_in = cfg.in_chans * cfg.patch_size**2
        self.proj = (
            capped_linear(fan_in, cfg.embed_dim)
            if cfg.family == "lipschitz"
            else nn.Linear(fan_in, cfg.embed_dim)
        )

    def patches(self, x: Tensor) -> Tensor:
        """Images ``(B, C, S, S)`` to flattened patches ``(B, N-1, C·p·p)``."""
        p = self.patch_size
        return F.unfold(x, kernel_size=p, stride=p).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.patches(x))  # (B, N-1, D)


class ViT(nn.Module):
    """Vision Transformer classifier on images in ``[0, 1]``.

    ``forward(x) = forward_head(forward_features(x))``; per-channel
    normalisation happens inside (``normalize``).
    """

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.config = cfg
        D = cfg.embed_dim
        self.register_buffer("mean", torch.tensor(cfg.mean).reshape(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(cfg.std).reshape(1, -1, 1, 1))
        self.patch_embed = PatchEmbed(cfg)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D))
        self.pos_embed = nn.Parameter(torch.randn(1, cfg.num_patches + 1, D) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        if cfg.family == "standard":
            self.norm: nn.Module = nn.LayerNorm(D, eps=cfg.norm_eps)
            self.head = nn.Linear(D, cfg.num_classes)
        else:
            self.norm = LayerProject(math.sqrt(D), "token")
            self.head = capped_linear(D, cfg.num_classes)
        self.apply(self._init_weights)
        for attn in self.attention_layers():  # a variant's own initialisation
            init = getattr(attn, "init_weights", None)
            if init is not None:
                init()

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            # A parametrised weight is computed; initialise what it is computed from.
            weight = (
                m.parametrizations.weight.original
                if nn.utils.parametrize.is_parametrized(m, "weight")
                else m.weight
            )
            nn.init.trunc_normal_(weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def normalize(self, x: Tensor) -> Tensor:
        """``(x − mean) / std`` per channel; Lipschitz constant ``1 / min(std)``."""
        return (x - self.mean) / self.std

    def embed(self, x: Tensor) -> Tensor:
        """Images ``(B, C, S, S)`` to the first block's input tokens ``(B, N, D)``."""
        tokens = self.patch_embed(self.normalize(x))  # (B, N-1, D)
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)  # (B, 1, D)
        return torch.cat([cls, tokens], dim=1) + self.pos_embed  # (B, N, D)

    def forward_features(self, x: Tensor) -> Tensor:
        """Images to final normalised tokens ``(B, N, D)``."""
        tokens = self.embed(x)
        for block in self.blocks:
            tokens = block(tokens)
        return self.norm(tokens)

    def pool(self, tokens: Tensor) -> Tensor:
        """Final tokens ``(B, N, D)`` → the head's input ``(B, D)``: the class token.

        ``attention="conv"`` (CoViT) averages all tokens instead, as CoViT does
        (its code pools before the final LayerNorm; here the tokens are
        normalised first, like every other variant's).
        """
        if self.config.attention == "conv":
            return tokens.mean(dim=1)
        return tokens[:, 0]

    def forward_head(self, tokens: Tensor) -> Tensor:
        """Final tokens ``(B, N, D)`` → logits ``(B, classes)`` (:meth:`pool`)."""
        return self.head(self.pool(tokens))

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def attention_layers(self) -> list[nn.Module]:
        """Every block's token mixer (an :class:`Attention` for ``"dot"``)."""
        return [block.attn for block in self.blocks]


def build_model(cfg: ViTConfig) -> ViT | HybridViT | LipschitzCaiT:
    """The model ``cfg`` describes: a :class:`ViT`, a
    :class:`lipvit.hybrid.HybridViT` where ``cfg.arch == "hybrid"``, a
    :class:`lipvit.cait.LipschitzCaiT` where it is ``"cait"``."""
    return {"hybrid": HybridViT, "cait": LipschitzCaiT}.get(cfg.arch, ViT)(cfg)
