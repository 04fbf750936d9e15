"""The lipschitz family's hybrid ViT (``ViTConfig.arch="hybrid"``): a ViT whose
global ℓ2 Lipschitz constant is proven by construction (docs/math.md §9).

Shapes: ``B`` batch, ``C`` channels, ``S`` image side, ``N = (S/4)²`` tokens,
``D`` width, ``H`` heads, ``d = D / H``.

Like ViT-Hybrid (Dosovitskiy et al. 2021) the tokens come from a convolutional
stem instead of a linear patch embedding; every map is 1-Lipschitz or carries
a closed-form constant:

- stem (:class:`lipvit.lipschitz_blocks.ConvTokens`): two stages of a 3×3
  convolution with operator norm ≤ 1, MaxMin, and a 2×2 pixel unshuffle, then
  a per-token linear map of spectral norm ≤ 1 to width ``D`` and a learned
  positional embedding: ``(S/4)²`` tokens, each seeing 10×10 pixels;
- ``depth`` gated attention blocks (:class:`GatedAttention`): softmax attention
  with a learned positional bias per head, ``x ↦ (1 − g) x + g Attn(x) /
  max(1, L_A)`` with ``L_A`` the attention's proven constant
  (:func:`lipvit.lipschitz_blocks.attention_lipschitz`), so each block is
  1-Lipschitz;
- head: the flattened tokens, a linear map of norm ≤ 1, MaxMin and the last
  linear layer, whose rows give the per-pair certificate.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lipvit.config import ViTConfig
from lipvit.layers import capped_linear, max_min
from lipvit.lipschitz_blocks import ConvTokens, GatedAttention, logit_spreads


class HybridViT(ConvTokens):
    """Hybrid ViT of the lipschitz family with a proven global constant
    (module docstring). ``forward(x)`` maps images ``(B, C, S, S)`` in
    ``[0, 1]`` to logits ``(B, classes)``."""

    def __init__(self, cfg: ViTConfig):
        super().__init__(cfg)
        self.blocks = nn.ModuleList(GatedAttention(cfg) for _ in range(cfg.depth))
        self.head_hidden = capped_linear(cfg.num_patches * cfg.embed_dim,
                                         cfg.head_hidden)
        self.head = capped_linear(cfg.head_hidden, cfg.num_classes)
        self.init_head()

    def forward(self, x: Tensor) -> Tensor:
        z = self.forward_features(x).flatten(1)  # (B, N·D)
        return self.head(max_min(self.head_hidden(z)))

    @torch.no_grad()
    def attention_spread(self, x: Tensor) -> list[dict[str, float]]:
        """Per block, :func:`lipvit.lipschitz_blocks.logit_spreads` on images
        ``x``: the mean logit spreads (content, positional, their sum), the
        block's gate ``g`` and its attention's constant ``L_A``."""
        out, t = [], self.tokens(x)
        for block in self.blocks:
            out.append(logit_spreads(*block.logits(t), block.gate(), block.lipschitz()))
            t = block(t)
        return out
