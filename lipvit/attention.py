"""The token mixers: dot-product attention and, for SpecFormer's comparison, others.

Shapes: ``B`` batch, ``N`` tokens, ``D`` width, ``H`` heads, ``d = D / H``.

:class:`Attention` is the ViT's multi-head dot-product attention; every other
class here replaces it inside a standard block (patch embedding, LayerNorms, GELU MLP
and head are shared); choose one with ``ViTConfig.attention``.

==========  =================================================  ======================
attention   logits / mixing of head ``h``                       source
==========  =================================================  ======================
``dot``     ``q_i·k_j / √d``                                     timm; SpecFormer
``l2``      ``−‖x_i W_q − x_j W_q‖² / √d``, values ``X A_h``     Kim et al. 2021
            with ``A_h = W_q W_qᵀ / √d`` (tied ``W_k = W_q``)    (L2Former)
``lipnorm`` ``q_i·k_j / max{u v, u w, v w}``, ``u = ‖Q‖_F``,     Dasoulas et al. 2021
            ``v = max_j ‖k_j‖``, ``w = max_j ‖v_j‖``             (LNFormer)
``scsa``    ``τ_h q̄_i·k̄_j``, ``x̄ = x / √(‖x‖² + ε)``, values    Qi et al. 2023
            ``v̄_j``                                             (LipsFormer)
``conv``    1-D convolution over the token sequence, one        CoViT, Cauchy-problem
            group of ``d`` channels per head, then ``proj``      paper §5 and its code
==========  =================================================  ======================

``head_weights()`` (the interface MSVP and the spectra use) returns per-head
``(W_q, W_k, W_v, W_o)`` for every variant that has them; its docstring says
for each variant whether ``forward`` is exactly
``Σ_h softmax(logits_h) X W_v[h] W_o[h]`` with those matrices. ``conv`` has no
query, key or value and no ``head_weights``: MSVP refuses it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lipvit.config import ViTConfig
from lipvit.layers import SpectralCap


class HeadWeights(NamedTuple):
    """Per-head attention matrices (see :meth:`Attention.head_weights`)."""

    W_q: Tensor  # (H, D, d)
    W_k: Tensor  # (H, D, d)
    W_v: Tensor  # (H, D, d)
    W_o: Tensor  # (H, d, D)


class HeadBiases(NamedTuple):
    """Attention biases; ``None`` where the layer has none.

    ``b_v`` and ``b_o`` add a constant to the output (softmax rows sum to 1, so
    ``P 1 b_vᵀ W_o = 1 b_vᵀ W_o``) and never change a perturbation; ``b_q`` and
    ``b_k`` do, and the LoFAST bound refuses layers that have them.
    """

    b_q: Tensor | None  # (H, d)
    b_k: Tensor | None  # (H, d)
    b_v: Tensor | None  # (H, d)
    b_o: Tensor | None  # (D,)


class Attention(nn.Module):
    """Multi-head dot-product self-attention ``Σ_h softmax(q_h k_hᵀ/√d) v_h W_o[h]``."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        D, H = cfg.embed_dim, cfg.num_heads
        self.num_heads, self.head_dim = H, cfg.head_dim
        self.qkv = nn.Linear(D, 3 * D, bias=cfg.qkv_bias)
        self.proj = nn.Linear(D, D)
        if cfg.family == "lipschitz":
            P = nn.utils.parametrize.register_parametrization
            P(
                self.qkv,
                "weight",
                SpectralCap(cfg.v_cap, "rows_per_head", H, (2 * D, 3 * D)),
            )
            P(self.proj, "weight", SpectralCap(cfg.o_cap, "cols_per_head", H))

    def forward(self, x: Tensor) -> Tensor:
        B, N, D = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # 3 × (B, H, N, d)
        out = F.scaled_dot_product_attention(q, k, v)  # (B, H, N, d)
        return self.proj(out.transpose(1, 2).reshape(B, N, D))

    def head_weights(self) -> HeadWeights:
        """Per-head ``(W_q, W_k, W_v, W_o)`` of shapes ``(H, D, d)×3, (H, d, D)``.

        Ignoring biases, ``forward(X) = Σ_h softmax(X W_q[h] (X W_k[h])ᵀ/√d)
        X W_v[h] W_o[h]`` exactly (LoFAST eq. 4, 6 with ``H = 0``). The
        weights are the effective ones (caps applied) and keep their gradients.
        """
        W_q, W_k, W_v = self.head_weights_t().mT  # each (H, D, d)
        H, d = self.num_heads, self.head_dim
        W_o = self.proj.weight.T.reshape(H, d, -1)  # (H, d, D)
        return HeadWeights(W_q, W_k, W_v, W_o)

    def head_weights_t(self) -> Tensor:
        """``W_q[h]ᵀ, W_k[h]ᵀ, W_v[h]ᵀ`` stacked: ``(3, H, d, D)``.

        The fused ``qkv`` weight's row blocks, reshaped without a copy (MSVP's
        hot path); :meth:`head_weights` transposes them.
        """
        W = self.qkv.weight  # (3D, D)
        return W.reshape(3, self.num_heads, self.head_dim, W.shape[1])

    def head_biases(self) -> HeadBiases:
        """Biases in the layout of :meth:`head_weights`."""
        H, d = self.num_heads, self.head_dim
        b = self.qkv.bias
        b_q, b_k, b_v = (None,) * 3 if b is None else b.reshape(3, H, d)
        return HeadBiases(b_q, b_k, b_v, self.proj.bias)


#: ε of LipsFormer's normalisation ``x / √(‖x‖² + ε)`` (our choice; it keeps the
#: map smooth at 0 with Lipschitz constant ``1/√ε``).
SCSA_EPS = 1e-6
#: Initial and largest temperature τ of SCSA (Swin V2's cosine attention, on
#: which LipsFormer builds, starts at 10 and clamps at 100).
SCSA_TAU_INIT, SCSA_TAU_MAX = 10.0, 100.0


def _heads(t: Tensor, H: int) -> Tensor:
    """``(B, N, D)`` → ``(B, H, N, d)``."""
    B, N, D = t.shape
    return t.reshape(B, N, H, D // H).transpose(1, 2)


def _split_qkv(attn: Attention, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Queries, keys and values of a fused-``qkv`` layer: 3 × ``(B, H, N, d)``."""
    B, N, D = x.shape
    qkv = attn.qkv(x).reshape(B, N, 3, attn.num_heads, attn.head_dim)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # 3 × (B, H, N, d)
    return q, k, v


def _merge(t: Tensor) -> Tensor:
    """``(B, H, N, d)`` → ``(B, N, D)``."""
    B, H, N, d = t.shape
    return t.transpose(1, 2).reshape(B, N, H * d)


class L2Attention(nn.Module):
    """L2 multi-head self-attention with tied query and key (Kim et al. 2021, §3).

    ``P_h = softmax(−‖x_i W_q[h] − x_j W_q[h]‖² / √d)`` and
    ``F(X) = Σ_h P_h X A_h W_V[h] W_o[h]`` with ``A_h = W_q[h] W_q[h]ᵀ / √d``:
    the value path runs through the query matrix as well, which is what makes
    L2-MHA Lipschitz (their Theorem 3.2); ``W_k = W_q`` is required for it.

    Tying: one ``nn.Linear(D, D, bias=False)`` (``qk``) holds ``W_q[h]ᵀ`` of
    every head as row blocks and computes both queries and keys, so the two
    can never drift apart. A query/key bias would cancel in ``x_i W + b −
    (x_j W + b)``, hence there is none. ``v`` holds ``W_V[h]ᵀ``; ``proj`` is
    ``W_o``.

    :meth:`head_weights` returns ``W_q = W_k`` (the same tensor) and the
    effective value matrix ``W_v[h] = A_h W_V[h]``, so ``forward`` is exactly
    ``Σ_h P_h X W_v[h] W_o[h]`` (plus the constant value/output biases).
    """

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        D, H = cfg.embed_dim, cfg.num_heads
        self.num_heads, self.head_dim = H, cfg.head_dim
        self.qk = nn.Linear(D, D, bias=False)
        self.v = nn.Linear(D, D, bias=cfg.qkv_bias)
        self.proj = nn.Linear(D, D)

    def init_weights(self) -> None:
        """Xavier-normal ``W_q`` (called after the ViT's ``trunc_normal(0.02)``).

        The value path carries ``A_h = W_q W_qᵀ/√d``, quadratic in ``W_q``: at
        ViT's 0.02 scale it starts near 0 and the class token receives almost
        nothing from the patches, so training stalls.
        """
        nn.init.xavier_normal_(self.qk.weight)

    def attention_logits(self, x: Tensor) -> Tensor:
        """``−‖q_i − q_j‖² / √d`` per head, ``(B, H, N, N)``."""
        q = _heads(self.qk(x), self.num_heads)  # (B, H, N, d)
        sq = (q * q).sum(-1)  # (B, H, N)
        # Expanded square: no sqrt, so the gradient at q_i = q_j is finite.
        dist2 = sq[..., :, None] + sq[..., None, :] - 2 * q @ q.mT  # (B, H, N, N)
        return -dist2 / math.sqrt(self.head_dim)

    def forward(self, x: Tensor) -> Tensor:
        W = self.head_weights()
        P = torch.softmax(self.attention_logits(x), dim=-1)  # (B, H, N, N)
        v = torch.einsum("bnD,hDd->bhnd", x, W.W_v)  # (B, H, N, d)
        if self.v.bias is not None:
            v = v + self.v.bias.reshape(self.num_heads, 1, self.head_dim)
        return self.proj(_merge(P @ v))

    def head_weights(self) -> HeadWeights:
        """``(W_q, W_k = W_q, W_v = A_h W_V, W_o)``: ``(H, D, d)×3, (H, d, D)``."""
        H, d = self.num_heads, self.head_dim
        D = self.qk.weight.shape[1]
        W_q = self.qk.weight.reshape(H, d, D).mT  # (H, D, d)
        W_V = self.v.weight.reshape(H, d, D).mT  # (H, D, d)
        A = W_q @ W_q.mT / math.sqrt(d)  # (H, D, D)
        W_o = self.proj.weight.T.reshape(H, d, D)  # (H, d, D)
        return HeadWeights(W_q, W_q, A @ W_V, W_o)

    def head_weights_t(self) -> Tensor:
        """:meth:`head_weights`' ``W_q, W_k, W_v`` transposed: ``(3, H, d, D)``."""
        return torch.stack(self.head_weights()[:3]).mT

    def head_biases(self) -> HeadBiases:
        b_v = None if self.v.bias is None else self.v.bias.reshape(self.num_heads, -1)
        return HeadBiases(None, None, b_v, self.proj.bias)


class LipNormAttention(Attention):
    """Dot-product attention with LipschitzNorm (Dasoulas et al. 2021, LNFormer).

    Per sample and head the scores ``Q Kᵀ`` are divided by
    ``c(X) = max{‖Q‖_F ‖Kᵀ‖_(∞,2), ‖Q‖_F ‖Vᵀ‖_(∞,2), ‖Kᵀ‖_(∞,2) ‖Vᵀ‖_(∞,2)}``
    (SpecFormer Table 1 and Appendix D), ``‖Kᵀ‖_(∞,2) = max_j ‖k_j‖₂``,
    instead of ``√d``. Weights and :meth:`head_weights` are the dot family's
    (fused ``qkv``); ``forward`` is ``Σ_h softmax(X W_q W_kᵀ Xᵀ / c_h(X)) X W_v
    W_o`` exactly.
    """

    def attention_logits(self, x: Tensor) -> Tensor:
        """Normalised scores ``q_i·k_j / c(X)``, ``(B, H, N, N)``."""
        q, k, v = _split_qkv(self, x)
        return q @ k.mT / self._c(q, k, v)[..., None, None]

    @staticmethod
    def _c(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """``c(X)`` per sample and head, ``(B, H)``."""
        u = torch.linalg.vector_norm(q, dim=(-2, -1))  # ‖Q‖_F
        nk = torch.linalg.vector_norm(k, dim=-1).amax(-1)  # max_j ‖k_j‖
        nv = torch.linalg.vector_norm(v, dim=-1).amax(-1)  # max_j ‖v_j‖
        c = torch.stack([u * nk, u * nv, nk * nv]).amax(0)
        return c.clamp_min(1e-12)  # all-zero inputs: scores are 0 anyway

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = _split_qkv(self, x)
        logits = q @ k.mT / self._c(q, k, v)[..., None, None]  # (B, H, N, N)
        return self.proj(_merge(torch.softmax(logits, dim=-1) @ v))


class SCSAttention(Attention):
    """Scaled cosine-similarity attention, LipsFormer's SCSA (Qi et al. 2023).

    Queries, keys and values are normalised per token,
    ``x̄ = x / √(‖x‖² + ε)`` (SpecFormer Table 1: the ℓ2 row normalisation of
    Q, K and V), and ``P_h = softmax(τ_h q̄_i·k̄_j)`` with a learnable
    temperature ``τ_h`` per head (initial :data:`SCSA_TAU_INIT`, clamped at
    :data:`SCSA_TAU_MAX`); the output is ``Σ_h P_h V̄_h W_o[h]``. LipsFormer's
    other components (CenterNorm, weighted residual shortcut, spectral
    initialisation) are **not** included: the comparison keeps everything but
    the attention equal to the standard family. :meth:`head_weights` returns
    the raw ``W_q, W_k, W_v`` (the normalisation acts on their outputs), so
    ``forward`` is not the linear-value form of the dot family.
    """

    def __init__(self, cfg: ViTConfig):
        super().__init__(cfg)
        self.log_tau = nn.Parameter(
            torch.full((cfg.num_heads,), math.log(SCSA_TAU_INIT))
        )

    def tau(self) -> Tensor:
        """Temperatures ``τ_h``, ``(H,)``."""
        return self.log_tau.clamp(max=math.log(SCSA_TAU_MAX)).exp()

    @staticmethod
    def normalize(t: Tensor) -> Tensor:
        """``t / √(‖t‖² + ε)`` per token (last dimension)."""
        return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + SCSA_EPS)

    def attention_logits(self, x: Tensor) -> Tensor:
        """``τ_h q̄_i·k̄_j``, ``(B, H, N, N)``."""
        q, k, _ = _split_qkv(self, x)
        return self._logits(q, k)

    def _logits(self, q: Tensor, k: Tensor) -> Tensor:
        cos = self.normalize(q) @ self.normalize(k).mT  # (B, H, N, N)
        return self.tau()[:, None, None] * cos

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = _split_qkv(self, x)
        P = torch.softmax(self._logits(q, k), dim=-1)  # (B, H, N, N)
        return self.proj(_merge(P @ self.normalize(v)))


class ConvMixing(nn.Module):
    """CoViT's token mixing: a 1-D convolution over the tokens per head group.

    As the Cauchy-problem paper's code defines it (``MultiHeadConv1D``): the
    width ``D`` is split into ``H`` groups of ``d`` channels; group ``h`` is
    convolved along the token axis with its own ``Conv1d(d, d, k)`` (stride 1,
    zero padding ``k // 2``, bias), the groups are concatenated and ``proj``
    mixes them. Output token ``i`` depends on tokens ``i − k//2 … i + k//2``
    only (locality). There is no query, key or value, hence no
    ``head_weights``: MSVP and the attention bounds do not apply.
    """

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        D, H, k = cfg.embed_dim, cfg.num_heads, cfg.conv_kernel
        self.num_heads, self.head_dim, self.kernel = H, cfg.head_dim, k
        # groups=H: one independent Conv1d(d, d, k) per head group.
        self.conv = nn.Conv1d(D, D, kernel_size=k, padding=k // 2, groups=H)
        self.proj = nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        mixed = self.conv(x.transpose(1, 2))  # (B, D, N)
        return self.proj(mixed.transpose(1, 2))  # (B, N, D)


VARIANTS: dict[str, type[nn.Module]] = {
    "l2": L2Attention,
    "lipnorm": LipNormAttention,
    "scsa": SCSAttention,
    "conv": ConvMixing,
}


def build_attention(cfg: ViTConfig) -> nn.Module:
    """The token mixer ``cfg.attention`` selects."""
    if cfg.attention == "dot":
        return Attention(cfg)
    return VARIANTS[cfg.attention](cfg)
