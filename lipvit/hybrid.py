"""The lipschitz family's hybrid ViT (``ViTConfig.arch="hybrid"``): a ViT whose
global ℓ2 Lipschitz constant is proven by construction (docs/math.md §9).

Shapes: ``B`` batch, ``C`` channels, ``S`` image side, ``N = (S/4)²`` tokens,
``D`` width, ``H`` heads, ``d = D / H``.

Like ViT-Hybrid (Dosovitskiy et al. 2021) the tokens come from a convolutional
stem instead of a linear patch embedding; every map is 1-Lipschitz or carries
a closed-form constant:

- stem: two stages of a 3×3 convolution with operator norm ≤ 1
  (:func:`lipvit.layers.capped_conv`), MaxMin, and a 2×2 pixel unshuffle (an
  isometry), then a per-token linear map of spectral norm ≤ 1 to width ``D``
  and a learned positional embedding: ``(S/4)²`` tokens, each seeing a
  10×10-pixel neighbourhood;
- ``depth`` gated attention blocks (:class:`GatedAttention`): softmax attention
  with a learned positional bias per head, ``x ↦ (1 − g) x + g Attn(x) /
  max(1, L_A)`` with ``L_A`` the attention's proven constant
  (:func:`lipvit.certify.global_bound.attention_lipschitz`), so each block is
  1-Lipschitz;
- head: the flattened tokens, a linear map of norm ≤ 1, MaxMin and the last
  linear layer, whose rows give the per-pair certificate.

Pixels are centred (``x − mean``) but not scaled: a scale would multiply the
constant, and the first convolution learns any scale its cap allows.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lipvit.certify.global_bound import attention_lipschitz, global_constant
from lipvit.config import ViTConfig
from lipvit.layers import capped_conv, capped_linear, layer_project, max_min


class GatedAttention(nn.Module):
    """``(1 − g) x + g · Attn(x) / max(1, L_A)``, 1-Lipschitz (docs/math.md §9.2).

    ``Attn(X) = Σ_h softmax(B_h + X̂ W_q[h] (X̂ W_k[h])ᵀ/√d) X̂ W_v[h] W_o[h]``
    with ``X̂`` every token projected onto the ball of radius ``attn_radius``
    and ``B_h`` a learned ``N × N`` positional bias; ``g = sigmoid(γ)``.
    """

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        D, H, N = cfg.embed_dim, cfg.num_heads, cfg.num_patches
        self.num_heads, self.head_dim, self.radius = H, cfg.head_dim, cfg.attn_radius
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D, bias=False)
        self.pos_bias = nn.Parameter(torch.zeros(H, N, N))
        self.gate_logit = nn.Parameter(torch.tensor(-2.0))
        with torch.no_grad():
            q_k, v = self.qkv.weight.split([2 * D, D])
            nn.init.normal_(q_k, std=0.15)
            nn.init.orthogonal_(v)
            nn.init.orthogonal_(self.proj.weight)

    def weights(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``W_q, W_k, W_v`` ``(H, D, d)`` and ``W_o`` ``(H, d, D)``."""
        H, d = self.num_heads, self.head_dim
        W = self.qkv.weight.reshape(3, H, d, -1)  # rows of W_q[h]ᵀ, W_k[h]ᵀ, W_v[h]ᵀ
        W_q, W_k, W_v = W.mT  # each (H, D, d)
        return W_q, W_k, W_v, self.proj.weight.T.reshape(H, d, -1)

    def lipschitz(self) -> Tensor:
        """The attention's proven constant ``L_A`` (a scalar, differentiable)."""
        return attention_lipschitz(*self.weights(), self.pos_bias, self.radius)

    def gate(self) -> Tensor:
        """``g = sigmoid(γ)``, the attention's share of the block's output."""
        return torch.sigmoid(self.gate_logit)

    def _heads(self, x: Tensor) -> Tensor:
        """Queries, keys and values of the projected tokens of ``x`` ``(B, N,
        D)``, from one product: ``(3, B, H, N, d)``."""
        B, N, D = x.shape
        x_hat = layer_project(x, self.radius)
        return self.qkv(x_hat).reshape(B, N, 3, self.num_heads, self.head_dim).permute(
            2, 0, 3, 1, 4)

    def logits(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Content logits ``X̂ A_h X̂ᵀ`` ``(B, H, N, N)`` and the positional bias
        ``(H, N, N)`` of tokens ``x`` ``(B, N, D)``; the softmax sees their sum."""
        q, k, _ = self._heads(x)
        return q @ k.mT / math.sqrt(self.head_dim), self.pos_bias

    def attend(self, x: Tensor) -> Tensor:
        """``Attn(x)`` ``(B, N, D)``, the map :meth:`lipschitz` bounds."""
        B, N, D = x.shape
        q, k, v = self._heads(x)  # each (B, H, N, d)
        P = (q @ k.mT / math.sqrt(self.head_dim) + self.pos_bias).softmax(dim=-1)
        return self.proj((P @ v).transpose(1, 2).reshape(B, N, D))

    def forward(self, x: Tensor) -> Tensor:
        g = self.gate()
        return (1 - g) * x + g * self.attend(x) / self.lipschitz().clamp_min(1.0)


class HybridViT(nn.Module):
    """Hybrid ViT of the lipschitz family with a proven global constant
    (module docstring). ``forward(x)`` maps images ``(B, C, S, S)`` in
    ``[0, 1]`` to logits ``(B, classes)``."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.config = cfg
        C, S, w, D = cfg.in_chans, cfg.image_size, cfg.stem_width, cfg.embed_dim
        self.register_buffer("mean", torch.tensor(cfg.mean).reshape(1, -1, 1, 1))
        self.stem = nn.ModuleList(
            [capped_conv(C, w, S), capped_conv(4 * w, 2 * w, S // 2)]
        )
        self.embed = capped_linear(8 * w, D)
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_patches, D))
        self.blocks = nn.ModuleList(GatedAttention(cfg) for _ in range(cfg.depth))
        self.head_hidden = capped_linear(cfg.num_patches * D, cfg.head_hidden)
        self.head = capped_linear(cfg.head_hidden, cfg.num_classes)
        for layer in (self.embed, self.head_hidden, self.head):
            nn.init.orthogonal_(layer.parametrizations.weight.original)
            nn.init.zeros_(layer.bias)

    def tokens(self, x: Tensor) -> Tensor:
        """Images ``(B, C, S, S)`` to the first block's tokens ``(B, N, D)``."""
        x = x - self.mean
        for conv in self.stem:
            x = F.pixel_unshuffle(max_min(conv(x), dim=1), 2)  # (B, 4c, S', S')
        return self.embed(x.flatten(2).mT) + self.pos_embed  # (B, N, D)

    def forward_features(self, x: Tensor) -> Tensor:
        """Images to the last block's tokens ``(B, N, D)``."""
        t = self.tokens(x)
        for block in self.blocks:
            t = block(t)
        return t

    def forward(self, x: Tensor) -> Tensor:
        z = self.forward_features(x).flatten(1)  # (B, N·D)
        return self.head(max_min(self.head_hidden(z)))

    @torch.no_grad()
    def attention_spread(self, x: Tensor) -> list[dict[str, float]]:
        """Per block, the mean over images, heads and queries of each query's
        logit spread ``max_j ℓ_ij − min_j ℓ_ij``: of the content logits, of the
        positional bias and of their sum (the logits the softmax sees), with
        the block's gate ``g`` and attention constant ``L_A``."""
        out, t = [], self.tokens(x)
        for block in self.blocks:
            content, bias = block.logits(t)

            def spread(logits: Tensor) -> float:
                return float((logits.amax(-1) - logits.amin(-1)).mean())

            out.append(dict(content=spread(content), positional=spread(bias),
                            total=spread(content + bias), gate=float(block.gate()),
                            lipschitz=float(block.lipschitz())))
            t = block(t)
        return out


def hybrid_summary(model: HybridViT, x: Tensor) -> dict[str, Any]:
    """What a trained hybrid ViT reports: its proven global constant ``L``
    (float64, :func:`lipvit.certify.global_bound.global_constant`) and, per
    block, :meth:`HybridViT.attention_spread` on images ``x``."""
    m = copy.deepcopy(model).double().eval().requires_grad_(False)
    x = x.to(device=m.pos_embed.device, dtype=torch.float64)
    return {"global_constant": float(global_constant(m).L),
            "attention": m.attention_spread(x)}


def hybrid_text(summary: dict[str, Any]) -> str:
    """One line of a :func:`hybrid_summary`: ``global constant 1.0000;
    attention logit spread 0.90 (content 0.00), gate 0.027`` (per block)."""
    blocks = "; ".join(
        f"attention logit spread {a['total']:.2f} (content {a['content']:.2f}), "
        f"gate {a['gate']:.3f}" for a in summary["attention"])
    return f"global constant {summary['global_constant']:.4f}; {blocks}"
