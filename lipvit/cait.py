"""The lipschitz family's CaiT (``ViTConfig.arch="cait"``): a Vision
Transformer whose only token mixing is softmax attention, with every map's
constant proven (docs/math.md §9) and local constants over the ε-ball that
its certificate composes (§10).

Shapes: ``B`` batch, ``C`` channels, ``S`` image side, ``N = (S/4)²`` tokens,
``D`` width, ``H`` heads.

Laid out as CaiT (Touvron et al. 2021): self-attention blocks over the patch
tokens, then class attention that reads the class token from them.

- tokens: the 1-Lipschitz convolutional stem of :class:`ConvTokens` (each
  token sees 10×10 pixels) and a learned positional embedding;
- ``depth`` blocks, each a gated self-attention over the tokens
  (:class:`GatedAttention`: content logits ``q_i · k_j`` and a positional
  bias, ``x ↦ (1 − g) x + g Attn(x)``, not normalised: its cost is paid by the
  certificate, locally) and a gated per-token MLP (:class:`GatedMLP`);
- class attention (:class:`ClassAttention`): ``cls_heads`` heads with a learned
  query each, pooling the tokens by content and position, each pooled token
  mapped to ``cls_value_dim`` values, stacked into the class token;
- head: a linear map of norm ≤ 1, MaxMin and the last linear layer, whose rows
  give the per-pair certificate.

No map reads the tokens flattened together and none is linear along the
token axis: tokens meet only in the attention.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lipvit.config import ViTConfig
from lipvit.layers import capped_linear, max_min
from lipvit.lipschitz_blocks import (
    ClassAttention,
    ConvTokens,
    GatedAttention,
    GatedMLP,
    logit_spreads,
)


class CaiTBlock(nn.Module):
    """Gated self-attention, then a gated per-token MLP."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.attn = GatedAttention(cfg, normalize=False)
        self.mlp = GatedMLP(cfg.embed_dim, cfg.mlp_hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.attn(x))


class LipschitzCaiT(ConvTokens):
    """CaiT of the lipschitz family (module docstring). ``forward(x)`` maps
    images ``(B, C, S, S)`` in ``[0, 1]`` to logits ``(B, classes)``."""

    def __init__(self, cfg: ViTConfig):
        super().__init__(cfg)
        self.blocks = nn.ModuleList(CaiTBlock(cfg) for _ in range(cfg.depth))
        self.cls_attn = ClassAttention(cfg)
        self.head_hidden = capped_linear(self.cls_attn.out_features, cfg.head_hidden)
        self.head = capped_linear(cfg.head_hidden, cfg.num_classes)
        self.init_head()

    def forward_head(self, t: Tensor) -> Tensor:
        """The last block's tokens ``(B, N, D)`` to logits: the class token and
        the head."""
        return self.head(max_min(self.head_hidden(self.cls_attn(t))))

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    @torch.no_grad()
    def attention_spread(self, x: Tensor) -> list[dict[str, float]]:
        """Per attention block (the self-attention blocks, then class attention),
        the mean over images, heads and queries of each query's logit spread
        ``max_j ℓ_ij − min_j ℓ_ij``: of the content logits, of the positional
        bias and of their sum, with the block's gate (1 for class attention)
        and its attention's proven global constant ``L_A``."""
        out, t = [], self.tokens(x)
        for block in self.blocks:
            attn = block.attn
            out.append(logit_spreads(*attn.logits(t), attn.gate(), attn.lipschitz()))
            t = block(t)
        content, _ = self.cls_attn.logits(t)
        one = torch.ones((), dtype=t.dtype)
        out.append(logit_spreads(content, self.cls_attn.pos_bias, one,
                            self.cls_attn.lipschitz()))
        return out

