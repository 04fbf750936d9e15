"""Maps with proven ℓ2 Lipschitz constants, the parts of the lipschitz family's
hybrid ViT (:mod:`lipvit.hybrid`) and CaiT (:mod:`lipvit.cait`):
docs/math.md §9.

Each part owns its constant: a pure function of its weights, differentiable,
that bounds ``‖f(X′) − f(X)‖_F / ‖X′ − X‖_F`` for **all** inputs. The
certificates (:mod:`lipvit.certify.global_bound`, :mod:`lipvit.certify.ball`)
compose them; the training loss reads them too.

Shapes: ``B`` batch, ``C`` channels, ``S`` image side, ``N = (S/4)²`` tokens,
``D`` width, ``H`` heads, ``d`` head width.

============  ==================  ==============================================
symbol        variable            meaning
============  ==================  ==============================================
``R``         ``radius``          token projection radius before an attention
``A_h``       ``A``               ``W_q[h] W_k[h]ᵀ / √d`` (self-attention)
``a_h``       ``a``               ``W_k[h] q_h / √d`` (class attention)
``β_h``       ``beta``            ``‖A_h‖ R²`` or ``‖a_h‖ R``: no content logit
                                  exceeds it in size
``B_h``       ``B``               learned positional bias
``P⁰_h``      ``P0``              ``softmax(B_h)``
``g``         ``gate``            ``sigmoid(γ)``, a residual block's gate
============  ==================  ==============================================
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lipvit.config import ViTConfig
from lipvit.layers import capped_conv, capped_linear, layer_project, max_min
from lipvit.spectral import conv_operator_norm, spectral_norm


class AttentionNorms(NamedTuple):
    """The weight norms an attention map's constants are made of (exact
    spectral norms, computed once and shared by the global and the local
    bounds): ``content`` ``(H,)`` is ``‖A_h‖`` (self-attention) or ``‖a_h‖``
    (class attention), ``value_head`` ``(H,)`` ``‖W_v[h]‖``, ``value`` ``‖[W_v[1]
    … W_v[H]]‖``, ``out`` ``‖W_o‖`` (the heads' ``W_o[h]`` stacked by rows)."""

    content: Tensor
    value_head: Tensor
    value: Tensor
    out: Tensor


def value_norms(W_v: Tensor, W_o: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``‖W_v[h]‖`` ``(H,)``, ``‖[W_v[1] … W_v[H]]‖`` and ``‖W_o‖`` of ``W_v``
    ``(H, D, d)`` and ``W_o`` ``(H, d, D_out)`` (``None``: no output map, 1)."""
    H, D, d = W_v.shape
    W_v_all = W_v.permute(1, 0, 2).reshape(D, H * d)  # [W_v[1] … W_v[H]]
    v_all = spectral_norm(W_v_all)
    if W_o is None:
        return spectral_norm(W_v), v_all, torch.ones_like(v_all)
    W_o_all = W_o.reshape(H * d, -1)  # rows of every head stacked
    return spectral_norm(W_v), v_all, spectral_norm(W_o_all)


def attention_norms(W_q: Tensor, W_k: Tensor, W_v: Tensor, W_o: Tensor
                    ) -> AttentionNorms:
    """:class:`AttentionNorms` of self-attention, ``A_h = W_q[h] W_k[h]ᵀ/√d``;
    ``W_q, W_k, W_v`` ``(H, D, d)``, ``W_o`` ``(H, d, D)``."""
    A = W_q @ W_k.mT / math.sqrt(W_q.shape[-1])  # (H, D, D)
    return AttentionNorms(spectral_norm(A), *value_norms(W_v, W_o))


def attention_lipschitz(norms: AttentionNorms, B: Tensor, radius: float) -> Tensor:
    """Global Lipschitz constant (Frobenius norm) of the positional-bias
    attention on token-projected inputs, docs/math.md eq. (9.2):

    ``X ↦ Σ_h softmax(B_h + X̂ A_h X̂ᵀ) X̂ W_v[h] W_o[h]``, ``A_h = W_q[h]
    W_k[h]ᵀ/√d``, ``X̂`` every token of ``X`` projected onto the ball of radius
    ``R``. With ``β_h = ‖A_h‖ R²`` (no content logit exceeds it in size),
    ``P⁰_h = softmax(B_h)``, ``c_h = min(N, e^{2β_h} max_j Σ_i P⁰_h[i, j])``
    (a bound of every column sum of the attention matrix ``P_h``) and
    ``p_h = min(e^{2β_h} ‖P⁰_h‖, √c_h)`` (a bound of ``‖P_h‖``)::

        L ≤ ‖W_o‖ (max_h p_h ‖W_v‖ + (Σ_h 2 β_h² ‖W_v[h]‖² (1 + c_h))^{1/2})

    the value path (attention held fixed) plus the softmax path. ``norms``
    from :func:`attention_norms`, ``B`` ``(H, N, N)``; returns a scalar,
    differentiable.
    """
    beta = norms.content * radius**2  # (H,)
    P0 = B.softmax(dim=-1)  # (H, N, N)
    grow = torch.exp(2 * beta)  # (H,): entrywise P ≤ e^{2β} P⁰
    N = B.shape[-1]
    col = (grow * P0.sum(dim=-2).amax(dim=-1)).clamp(max=N)  # (H,) column sums of P
    P_norm = torch.minimum(grow * spectral_norm(P0), col.sqrt())  # (H,) ‖P_h‖
    value = P_norm.amax() * norms.value
    soft = math.sqrt(2) * beta * norms.value_head * (1 + col).sqrt()  # (H,)
    return norms.out * (value + torch.linalg.vector_norm(soft))


def class_attention_lipschitz(norms: AttentionNorms, B: Tensor, radius: float
                              ) -> Tensor:
    """Global Lipschitz constant (Frobenius norm in, ℓ2 out) of class attention
    with a learned query on token-projected inputs, docs/math.md eq. (9.4):

    ``X ↦ Σ_h (Σ_j P_h[j] x̂_j) W_v[h] W_o[h]``, ``P_h = softmax(B_h + X̂ a_h)``.
    With ``β_h = ‖a_h‖ R`` and ``P̄_h[j] = min(1, e^{2β_h} P⁰_h[j])`` (every
    ``P_h[j]`` is at most it), ``ν_j = min(max_h P̄_h[j] ‖W_v‖², Σ_h P̄_h[j]
    ‖W_v[h]‖²)`` and ``μ_j = Σ_h β_h² ‖W_v[h]‖² P̄_h[j]``::

        L ≤ ‖W_o‖ ((max_j ν_j)^{1/2} + (max_j μ_j)^{1/2})

    ``norms`` with ``content = ‖a_h‖`` (:meth:`ClassAttention.norms`), ``B``
    ``(H, N)``; returns a scalar, differentiable.
    """
    beta = norms.content * radius  # (H,)
    P_bar = (torch.exp(2 * beta)[:, None] * B.softmax(dim=-1)).clamp(max=1.0)  # (H, N)
    return sum(class_attention_paths(norms, P_bar, beta * norms.value_head))


def class_attention_paths(norms: AttentionNorms, P_bar: Tensor, soft: Tensor,
                          exact: bool = True) -> tuple[Tensor, Tensor]:
    """``‖W_o‖ (max_j ν_j)^{1/2}`` and ``‖W_o‖ (max_j μ_j)^{1/2}``, the value
    and softmax paths of class attention (docs/math.md §9.4), from bounds
    ``P_bar`` ``(..., H, N)`` of the
    attention weights and ``soft`` ``(..., H)`` of ``‖a_h‖ s_h``, ``s_h`` a
    bound of the values' spread ``(Σ_j P_h[j] ‖v_hj − v̄_h‖²)^{1/2}``:
    ``ν_j = min(max_h P̄_h[j] ‖W_v‖², Σ_h P̄_h[j] ‖W_v[h]‖²)`` and ``μ_j = Σ_h
    soft_h² P̄_h[j]``; returns shape ``(...)``. The value path is also at
    most ``‖Q̄‖``, ``Q̄ = diag(‖W_v[h]‖) P̄`` ``(H × N)`` (the Kronecker bound,
    eq. 9.5): its dense spectral norm with ``exact``, else ``(‖Q̄‖₁
    ‖Q̄‖_∞)^{1/2}`` (training). The global bound (9.4) takes ``P̄_h = min(1,
    e^{2β_h} P⁰_h)`` and ``s_h = ‖W_v[h]‖ R``; the local one (§10) the
    ball's."""
    v_h = norms.value_head**2  # (H,)
    nu = torch.minimum(P_bar.amax(dim=-2) * norms.value**2,
                       (P_bar * v_h[:, None]).sum(dim=-2))  # (..., N)
    Q = P_bar * norms.value_head[:, None]  # (..., H, N)
    if exact:
        Q_norm = spectral_norm(Q) * (1 + 1e-12)
    else:
        Q_norm = (Q.sum(dim=-2).amax(dim=-1) * Q.sum(dim=-1).amax(dim=-1)).sqrt()
    value = torch.minimum(nu.amax(dim=-1).sqrt(), Q_norm)
    mu = (soft[..., None] ** 2 * P_bar).sum(dim=-2)  # (..., N)
    return norms.out * value, norms.out * mu.amax(dim=-1).sqrt()


class ConvTokens(nn.Module):
    """Images ``(B, C, S, S)`` in ``[0, 1]`` to ``(S/4)²`` tokens of width ``D``
    through a 1-Lipschitz convolutional stem (ViT-Hybrid's stem in place of a
    linear patch embedding; docs/math.md §9.1): two stages of a 3×3
    convolution of operator norm ≤ 1 (:func:`lipvit.layers.capped_conv`),
    MaxMin and a 2×2 pixel unshuffle (an isometry), then a per-token linear map
    of spectral norm ≤ 1 and a learned positional embedding. Each token sees a
    10×10-pixel neighbourhood. Pixels are centred (``x − mean``) but not scaled:
    a scale would multiply the constant, and the first convolution learns any
    scale its cap allows. The base of the models that read such tokens."""

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

    def tokens(self, x: Tensor,
               activation: Callable[[Tensor, int], Tensor] | None = None) -> Tensor:
        """Images ``(B, C, S, S)`` to the first block's tokens ``(B, N, D)``;
        ``activation(z, i)`` in place of stage ``i``'s MaxMin if given (the
        ``margin`` certificate's chord slopes, docs/math.md eq. 11.13)."""
        x = x - self.mean
        for i, conv in enumerate(self.stem):
            z = conv(x)
            z = max_min(z, dim=1) if activation is None else activation(z, i)
            x = F.pixel_unshuffle(z, 2)  # (B, 4c, S', S')
        return self.embed(x.flatten(2).mT) + self.pos_embed  # (B, N, D)

    def init_head(self) -> None:
        """Orthogonal weights and zero biases for the embedding and the head's
        two layers (the subclass's ``head_hidden`` and ``head``)."""
        for layer in (self.embed, self.head_hidden, self.head):
            nn.init.orthogonal_(layer.parametrizations.weight.original)
            nn.init.zeros_(layer.bias)

    def forward_features(self, x: Tensor) -> Tensor:
        """Images to the last block's tokens ``(B, N, D)`` (the subclass's
        ``blocks``)."""
        t = self.tokens(x)
        for block in self.blocks:
            t = block(t)
        return t

    def stem_lipschitz(self) -> Tensor:
        """Proven constant of :meth:`tokens`: the convolutions' bounds (9.1)
        times the embedding's spectral norm (MaxMin, unshuffling, positions
        and centring cost nothing)."""
        L = spectral_norm(self.embed.weight)
        for conv in self.stem:
            size = conv.parametrizations.weight[0].size  # the image side it caps for
            L = L * conv_operator_norm(conv.weight, size)
        return L


class GatedAttention(nn.Module):
    """``(1 − g) x + g · Attn(x) / s`` (docs/math.md §9.2), ``s = max(1, L_A)``
    where ``normalize`` (so the block is 1-Lipschitz by construction), else 1.

    ``Attn(X) = Σ_h softmax(B_h + X̂ W_q[h] (X̂ W_k[h])ᵀ/√d) X̂ W_v[h] W_o[h]``
    with ``X̂`` every token projected onto the ball of radius ``attn_radius``
    and ``B_h`` a learned ``N × N`` positional bias; ``g = sigmoid(γ)``.
    ``ablated`` (:func:`lipvit.ablate_attention`) removes the attention term:
    the block passes its input on.
    """

    ablated: bool = False

    def __init__(self, cfg: ViTConfig, normalize: bool = True, gate: float = -2.0):
        super().__init__()
        D, H, N = cfg.embed_dim, cfg.num_heads, cfg.num_patches
        self.num_heads, self.head_dim, self.radius = H, cfg.head_dim, cfg.attn_radius
        self.normalize = normalize
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D, bias=False)
        self.pos_bias = nn.Parameter(torch.zeros(H, N, N))
        self.gate_logit = nn.Parameter(torch.tensor(float(gate)))
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

    def norms(self) -> AttentionNorms:
        """Its weights' norms (:func:`attention_norms`)."""
        return attention_norms(*self.weights())

    def lipschitz(self, norms: AttentionNorms | None = None) -> Tensor:
        """The attention's proven constant ``L_A`` (eq. 9.2; a scalar,
        differentiable), from ``norms`` where given."""
        return attention_lipschitz(norms or self.norms(), self.pos_bias, self.radius)

    def gate(self) -> Tensor:
        """``g = sigmoid(γ)``, the attention's share of the block's output."""
        return torch.sigmoid(self.gate_logit)

    def scale(self) -> Tensor:
        """``s``, what the attention's output is divided by."""
        if not self.normalize:
            return self.pos_bias.new_ones(())
        return self.lipschitz().clamp_min(1.0)

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
        if self.ablated:
            return x
        g = self.gate()
        return (1 - g) * x + g * self.attend(x) / self.scale()


class GatedMLP(nn.Module):
    """The per-token feed-forward block ``(1 − g) x + g W₂ MaxMin(W₁ x + b₁) +
    g b₂``, ``‖W₁‖, ‖W₂‖ ≤ 1`` by construction: 1-Lipschitz on every token, so
    on the token matrix (Frobenius)."""

    def __init__(self, dim: int, hidden: int, gate: float = 0.0):
        super().__init__()
        self.fc1 = capped_linear(dim, hidden)
        self.fc2 = capped_linear(hidden, dim)
        self.gate_logit = nn.Parameter(torch.tensor(float(gate)))
        for layer in (self.fc1, self.fc2):
            nn.init.orthogonal_(layer.parametrizations.weight.original)
            nn.init.zeros_(layer.bias)

    def gate(self) -> Tensor:
        return torch.sigmoid(self.gate_logit)

    def constant(self, capped: bool = False) -> Tensor:
        """``(1 − g) + g ‖W₁‖ ‖W₂‖`` (at most 1); with ``capped`` the caps'
        ``‖W₁‖, ‖W₂‖ ≤ 1`` instead of the norms (training: no decomposition)."""
        g = self.gate()
        if capped:
            return (1 - g) + g
        return (1 - g) + g * spectral_norm(self.fc1.weight) * spectral_norm(
            self.fc2.weight)

    def forward(self, x: Tensor) -> Tensor:
        g = self.gate()
        return (1 - g) * x + g * self.fc2(max_min(self.fc1(x)))


class ClassAttention(nn.Module):
    """Class attention with a learned query (CaiT's class-attention layer, its
    class token a constant): the class token is ``c = [(Σ_j P_h[j] x̂_j)
    W_v[h]]_h``, the heads stacked, ``P_h = softmax_j(B_h[j] + a_h · x̂_j)``,
    ``a_h = W_k[h] q_h / √d_k``, the tokens projected onto the ball of radius
    ``attn_radius`` (docs/math.md §9.4).

    ``heads`` heads, each pooling the tokens with its own positional bias
    ``B_h`` (initialised to a Gaussian window around one token of the grid, so
    that the heads tile the image) and content logits, then mapping the
    pooled token by ``W_v[h]`` ``(D, d_v)``. No output projection: the head's
    first layer reads the ``H·d_v`` stacked values (a ``W_o`` would merge into
    it). Pooling before the value map is the same map (values are linear in
    the tokens) at ``H·D·d_v`` instead of ``N·D·H·d_v`` operations.
    ``ablated`` (:func:`lipvit.ablate_attention`) removes the attention: the
    class token stays the constant it starts from, 0.
    """

    ablated: bool = False

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        D, N = cfg.embed_dim, cfg.num_patches
        H, d_k, d_v = cfg.cls_heads or N, cfg.cls_key_dim, cfg.cls_value_dim
        self.num_heads, self.key_dim, self.value_dim = H, d_k, d_v
        self.radius, self.content = cfg.attn_radius, float(cfg.cls_content)
        self.out_features = H * d_v
        # Content logits of order one from the start (‖a_h‖ ≈ 1): attention that
        # looks at the tokens, for training to keep or drop.
        self.query = nn.Parameter(torch.randn(H, d_k))
        self.key = nn.Linear(D, H * d_k, bias=False)
        self.value = nn.Parameter(torch.empty(H, D, d_v))
        self.pos_bias = nn.Parameter(_tiling_bias(H, N))
        with torch.no_grad():
            nn.init.normal_(self.key.weight, std=1 / math.sqrt(D))
            for W in self.value:
                nn.init.orthogonal_(W)

    def a(self) -> Tensor:
        """``a_h = W_k[h] q_h / √d_k``, ``(H, D)``: content logit ``a_h · x̂_j``;
        rescaled to norm ``cls_content`` where that is set."""
        W_k = self.key.weight.reshape(self.num_heads, self.key_dim, -1)  # (H, d_k, D)
        a = torch.einsum("hk,hkD->hD", self.query, W_k) / math.sqrt(self.key_dim)
        if self.content:
            a = self.content * a / torch.linalg.vector_norm(a, dim=-1, keepdim=True)
        return a

    def norms(self) -> AttentionNorms:
        """Its weights' norms, ``content = ‖a_h‖``, ``out = 1`` (no ``W_o``)."""
        v_h, v_all, _ = value_norms(self.value, None)
        return AttentionNorms(torch.linalg.vector_norm(self.a(), dim=-1), v_h, v_all,
                              torch.ones_like(v_all))

    def lipschitz(self, norms: AttentionNorms | None = None) -> Tensor:
        """Its proven constant (eq. 9.4; a scalar, differentiable), from
        ``norms`` where given."""
        return class_attention_lipschitz(norms or self.norms(), self.pos_bias,
                                         self.radius)

    def logits(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Content logits ``a_h · x̂_j`` ``(B, H, N)`` of tokens ``x`` ``(B, N,
        D)`` and the projected tokens ``(B, N, D)``."""
        x_hat = layer_project(x, self.radius)
        return torch.einsum("bnD,hD->bhn", x_hat, self.a()), x_hat

    def forward(self, x: Tensor) -> Tensor:
        """The class token ``(B, H·d_v)`` read from tokens ``x`` ``(B, N, D)``."""
        if self.ablated:
            return x.new_zeros(x.shape[0], self.out_features)
        S, x_hat = self.logits(x)
        P = (S + self.pos_bias).softmax(dim=-1)  # (B, H, N)
        pooled = P @ x_hat  # (B, H, D)
        return torch.einsum("bhD,hDv->bhv", pooled, self.value).flatten(1)  # (B, H·d_v)


def attention_maps(model: nn.Module) -> list[nn.Module]:
    """``model``'s attention maps in the order a forward pass runs them: its
    gated self-attention blocks, then (CaiT) its class attention."""
    return [m for m in model.modules()
            if isinstance(m, GatedAttention | ClassAttention)]


def logit_spreads(content: Tensor, bias: Tensor, gate: Tensor, L_A: Tensor
                  ) -> dict[str, float]:
    """What an attention block's logits look like on a batch: the mean over
    images, heads and queries of each query's spread ``max_j ℓ_ij − min_j
    ℓ_ij`` of the content logits ``(B, H, [N,] N)`` (keys on the last axis), of
    the positional bias and of their sum (what the softmax sees), with the
    block's gate ``g`` and its attention's proven constant ``L_A``. ``image``
    is the spread of the content logits less their mean over the batch: the
    part that changes with the image (content logits can also carry position,
    through the positional embedding in the tokens)."""

    def spread(logits: Tensor) -> float:
        return float((logits.amax(-1) - logits.amin(-1)).mean())

    return dict(content=spread(content), image=spread(content - content.mean(0)),
                positional=spread(bias), total=spread(content + bias),
                gate=float(gate), lipschitz=float(L_A))


def _tiling_bias(H: int, N: int) -> Tensor:
    """``(H, N)`` positional logits: head ``h`` a Gaussian window (one token's
    width) around one of ``H`` tokens spread evenly over the ``√N × √N`` grid."""
    side = math.isqrt(N)
    grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side),
                                      indexing="ij"), dim=-1).reshape(-1, 2).float()
    centres = grid[torch.linspace(0, N - 1, H).round().long()]  # (H, 2)
    return -((grid[None] - centres[:, None]) ** 2).sum(dim=-1) / 2  # (H, N)
