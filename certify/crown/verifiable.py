"""A :class:`lipvit.ViT` rewritten with operators a bound-propagation verifier handles.

:func:`to_verifiable` returns a plain ``nn.Module`` computing the same function
as ``model.double()`` (equal to float rounding; the tests check 1e-6) with only
operators whose auto_LiRPA 0.3 bounds lipvit has reviewed (see
:mod:`lipvit.certify.crown.bounds`), plus three operators of our own with our own
relaxations (:mod:`lipvit.certify.crown.bounds`,
:mod:`lipvit.certify.crown.relaxations`):

=================================  ==============================================
model                              verifiable model
=================================  ==============================================
``(x − mean)/std``, patches,       one dense ``Linear`` on the flattened image
patch ``Linear``, class token,     (the embedding is affine: its matrix is read
``pos_embed``                      off the model), then a reshape to tokens
parametrised weights (caps)        their effective values, baked into plain tensors
``scaled_dot_product_attention``   ``exp(s) / Σ exp(s)`` written out, ``1/√d``
                                   folded into ``W_q``
LayerProject (LoFAST eq. 29)       ``x · ψ_R(Σ x²)`` with ``ψ_R(s) = min(1, R/√s)``
                                   the operator :class:`ProjectScale`
SLL                                ``x + ReLU(x W_1ᵀ + b) M`` with ``M = −2 T⁻¹ W_1``
LayerNorm                          ``(x − μ) · r(mean((x − μ)²)) · γ + β``,
                                   ``r(v) = 1/√(v + η)`` the operator :class:`RSqrt`
GELU (exact, erf form)             the operator :class:`GELU` (auto_LiRPA 0.3 has
                                   no bound for ``erf``)
head on the class token            indexing ``x[:, 0]`` then a ``Linear``
=================================  ==============================================

Input: the image in ``[0, 1]`` **flattened**, shape ``(B, C·S·S)`` (C-order of
``(C, S, S)``). The first operator is then a ``Linear`` on the perturbed input,
which is where auto_LiRPA handles an ℓ2 ball exactly; it must not see the
ball through any other operator first (for ℓ2 it represents the input interval
by the centre alone and only a ``Linear`` reads the radius). Output: logits
``(B, classes)``. The final norm is applied to the class token only (the head
reads nothing else), which changes nothing in the output.

Shape letters: ``B`` batch, ``C`` channels, ``S`` image side, ``N`` tokens,
``D`` width, ``H`` heads, ``d = D/H``, ``m`` hidden width.
"""

from __future__ import annotations

import copy
import math

import torch
from lipvit.certify.crown.relaxations import gelu, gelu_grad, rsqrt
from torch import Tensor, nn

from lipvit.layers import SLL, LayerProject
from lipvit.model import MLP, Attention, Block, ViT

#: Names of :class:`ProjectScale`, :class:`GELU` and :class:`RSqrt` in the
#: traced (ONNX) graph.
PROJECT_SCALE_OP = "lipvit::ProjectScale"
GELU_OP = "lipvit::GELU"
RSQRT_OP = "lipvit::RSqrt"


def project_scale(s: Tensor, radius: float) -> Tensor:
    """``ψ_R(s) = min(1, R/√s) = R / max(√s, R)`` for ``s ≥ 0`` (and 1 for ``s < 0``).

    With ``s = ‖x‖²`` this is LayerProject's factor, LoFAST eq. (29):
    ``x ↦ x · ψ_R(‖x‖²)``. Non-increasing; constant 1 on ``s ≤ R²`` and convex
    on ``s ≥ R²``.
    """
    return radius / torch.sqrt(s.clamp_min(0)).clamp_min(radius)


def _project_scale_slope(s: Tensor, radius: float) -> Tensor:
    """``ψ_R′(s)``: 0 on ``s ≤ R²``, ``−½ R s^{−3/2}`` beyond."""
    dpsi = -0.5 * radius * s.clamp_min(radius * radius).pow(-1.5)
    return torch.where(s <= radius * radius, torch.zeros_like(s), dpsi)


def _rsqrt_slope(v: Tensor, eta: float) -> Tensor:
    """``d/dv 1/√(max(v, 0) + η)``."""
    return torch.where(v > 0, -0.5 * rsqrt(v, eta) ** 3, torch.zeros_like(v))


def _operator(name: str, fn, slope, attr: str | None, doc: str) -> type:
    """An elementwise ``fn(x, param)`` as one graph operator ``name`` (its float
    ``param`` the ONNX attribute ``attr``), with gradient ``slope(x, param)``:
    auto_LiRPA bounds it with lipvit's relaxation (:mod:`lipvit.certify.crown.bounds`);
    in plain torch it is ``fn``. Called as ``Op.apply(x, param)``."""

    class Operator(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: Tensor, param: float | None) -> Tensor:  # noqa: D102
            ctx.save_for_backward(x)
            ctx.param = param
            return fn(x, param)

        @staticmethod
        def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: D102
            (x,) = ctx.saved_tensors
            return grad * slope(x, ctx.param), None

        @staticmethod
        def symbolic(g, x, param: float | None):  # noqa: D102
            attrs = {} if attr is None else {f"{attr}_f": float(param)}
            out = g.op(name, x, **attrs)
            out.setType(x.type())  # same shape and dtype as x
            return out

    Operator.__name__ = Operator.__qualname__ = name.split("::")[1]
    Operator.__doc__ = doc
    return Operator


ProjectScale = _operator(
    PROJECT_SCALE_OP, project_scale, _project_scale_slope, "radius",
    ":func:`project_scale` (``lipvit::ProjectScale``): ``ProjectScale.apply(s, R)``.")
RSqrt = _operator(
    RSQRT_OP, rsqrt, _rsqrt_slope, "eta",
    "LayerNorm's ``1/√(v + η)`` (:func:`lipvit.certify.crown.relaxations.rsqrt`, "
    "``lipvit::RSqrt``): ``RSqrt.apply(v, η)``.")
GELU = _operator(
    GELU_OP, lambda x, _: gelu(x), lambda x, _: gelu_grad(x), None,
    "The exact GELU (:func:`lipvit.certify.crown.relaxations.gelu`, ``lipvit::GELU``): "
    "``GELU.apply(x, None)``.")


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """A plain ``nn.Linear`` holding copies of ``weight`` ``(out, in)`` and ``bias``."""
    out_f, in_f = weight.shape
    layer = nn.Linear(in_f, out_f, bias=bias is not None, dtype=weight.dtype,
                      device=weight.device)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    layer.requires_grad_(False)
    return layer


def _copy_linear(fc: nn.Linear) -> nn.Linear:
    return _linear(fc.weight.detach(), None if fc.bias is None else fc.bias.detach())


def _square(x: Tensor, two: Tensor) -> Tensor:
    """``x²`` elementwise, as ``pow(x, two)`` with ``two`` a buffer holding 2.

    auto_LiRPA bounds ``pow(·, 2)`` tightly (chord above, tangent below). A
    literal exponent is traced through an ONNX ``Cast`` that auto_LiRPA 0.3
    cannot read the value of; a buffer is read directly.
    """
    return torch.pow(x, two)


class VerifiableEmbed(nn.Module):
    """Flat image ``(B, C·S·S)`` to first-block tokens ``(B, N, D)``: ``ViT.embed``.

    ``ViT.embed`` is affine (normalisation, patch extraction, patch projection,
    class token, positional embedding), so it is one matrix and one offset:
    ``E[:, i] = embed(e_i) − embed(0)`` and ``embed(0)``.
    """

    def __init__(self, model: ViT):
        super().__init__()
        cfg = model.config
        C, S = cfg.in_chans, cfg.image_size
        self.N, self.D = cfg.num_patches + 1, cfg.embed_dim
        dtype, device = model.pos_embed.dtype, model.pos_embed.device
        basis = torch.eye(C * S * S, dtype=dtype, device=device).reshape(-1, C, S, S)
        zero = torch.zeros(1, C, S, S, dtype=dtype, device=device)
        offset = model.embed(zero).reshape(1, -1)  # (1, N·D)
        columns = model.embed(basis).reshape(C * S * S, -1) - offset  # (C·S·S, N·D)
        self.proj = _linear(columns.T, offset[0])  # weight (N·D, C·S·S)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).reshape(x.shape[0], self.N, self.D)  # (B, N, D)


class VerifiableLayerProject(nn.Module):
    """LayerProject (LoFAST eq. 29) as ``x · ψ_R(Σ x²)`` (:class:`ProjectScale`)."""

    def __init__(self, radius: float, mode: str, dtype: torch.dtype):
        super().__init__()
        self.radius, self.mode = float(radius), mode
        self.register_buffer("two", torch.tensor(2.0, dtype=dtype))  # see _square

    def forward(self, x: Tensor) -> Tensor:
        if self.mode == "token":
            s = _square(x, self.two).sum(-1, keepdim=True)  # (B, N, 1)
        else:
            B, N, D = x.shape
            s = _square(x, self.two).reshape(B, 1, N * D)  # (B, 1, N·D)
            s = s.sum(-1, keepdim=True)  # (B, 1, 1)
        return x * ProjectScale.apply(s, self.radius)


class VerifiableLayerNorm(nn.Module):
    """``nn.LayerNorm`` over the last dimension written out (biased variance); the
    affine part ``γ ⊙ · + β`` is a ``Linear`` with weight ``diag(γ)`` (auto_LiRPA
    0.3 mis-shapes the bias of an ``Add`` with a broadcast constant)."""

    def __init__(self, norm: nn.LayerNorm):
        super().__init__()
        if len(norm.normalized_shape) != 1:
            raise ValueError("only LayerNorm over the last dimension is supported")
        self.eta = float(norm.eps)
        D = norm.normalized_shape[0]
        dtype = torch.get_default_dtype() if norm.weight is None else norm.weight.dtype
        gamma = torch.ones(D, dtype=dtype) if norm.weight is None else norm.weight
        beta = torch.zeros(D, dtype=dtype) if norm.bias is None else norm.bias
        self.affine = _linear(torch.diag(gamma.detach()), beta.detach())
        self.register_buffer("two", torch.tensor(2.0, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        c = x - x.mean(-1, keepdim=True)  # (B, N, D)
        var = _square(c, self.two).mean(-1, keepdim=True)  # (B, N, 1)
        return self.affine(c * RSqrt.apply(var, self.eta))


class VerifiableAttention(nn.Module):
    """``Σ_h softmax(q_h k_hᵀ/√d) v_h W_o[h]`` with softmax as ``exp / Σ exp``."""

    def __init__(self, attn: Attention):
        super().__init__()
        self.H, self.d = attn.num_heads, attn.head_dim
        Wt = attn.head_weights_t().detach()  # (3, H, d, D), caps applied
        b = attn.head_biases()  # (H, d) each, or None
        scale = 1.0 / math.sqrt(self.d)  # SDPA's default scale, folded into q

        def part(i: int, factor: float = 1.0) -> nn.Linear:
            W = Wt[i].reshape(-1, Wt.shape[-1]) * factor  # (D, D): rows (h, j)
            bias = None if b[i] is None else b[i].detach().reshape(-1) * factor
            return _linear(W, bias)

        self.q, self.k, self.v = part(0, scale), part(1), part(2)
        self.proj = _copy_linear(attn.proj)

    def _heads(self, t: Tensor) -> Tensor:
        B, N, _ = t.shape
        return t.reshape(B, N, self.H, self.d).permute(0, 2, 1, 3)  # (B, H, N, d)

    def forward(self, x: Tensor) -> Tensor:
        B, N, D = x.shape
        q, k, v = self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x))
        scores = q.matmul(k.transpose(-1, -2))  # (B, H, N, N)
        e = torch.exp(scores)
        P = e / e.sum(-1, keepdim=True)  # (B, H, N, N), rows sum to 1
        out = P.matmul(v)  # (B, H, N, d)
        return self.proj(out.transpose(1, 2).reshape(B, N, D))  # (B, N, D)


class VerifiableSLL(nn.Module):
    """SLL ``x − 2 (ReLU(x W_1ᵀ + b)/T) W_1`` as ``x + ReLU(fc1(x)) M``.

    ``M = −2 T⁻¹ W_1`` (``W_1 = fc1.weight``, shape ``(m, D)``).
    """

    def __init__(self, sll: SLL):
        super().__init__()
        W1 = sll.fc1.weight.detach()  # (m, D)
        T = sll.T().detach()  # (m,)
        self.fc1 = _copy_linear(sll.fc1)
        self.out = _linear((-2.0 * W1 / T[:, None]).T, None)  # weight (D, m)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.out(torch.relu(self.fc1(x)))


class VerifiableGELUMLP(nn.Module):
    """timm's MLP ``fc2(GELU(fc1(x)))``, the exact GELU as :class:`GELU`."""

    def __init__(self, mlp: MLP):
        super().__init__()
        self.fc1, self.fc2 = _copy_linear(mlp.fc1), _copy_linear(mlp.fc2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(GELU.apply(self.fc1(x), None))


def _norm(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    if isinstance(module, LayerProject):
        return VerifiableLayerProject(module.radius, module.mode, dtype)
    if isinstance(module, nn.LayerNorm):
        return VerifiableLayerNorm(module)
    raise TypeError(f"no verifiable form for normalisation {type(module).__name__}")


class VerifiableBlock(nn.Module):
    """:class:`lipvit.model.Block` of either family."""

    def __init__(self, block: Block, dtype: torch.dtype):
        super().__init__()
        self.family = block.family
        self.norm1, self.norm2 = _norm(block.norm1, dtype), _norm(block.norm2, dtype)
        self.attn = VerifiableAttention(block.attn)
        if isinstance(block.mlp, SLL):
            self.mlp: nn.Module = VerifiableSLL(block.mlp)
        elif isinstance(block.mlp, MLP):
            self.mlp = VerifiableGELUMLP(block.mlp)
        else:
            name = type(block.mlp).__name__
            raise TypeError(f"no verifiable form for feed-forward {name}")

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        if self.family == "standard":
            return x + self.mlp(self.norm2(x))
        return self.mlp(self.norm2(x))


class VerifiableViT(nn.Module):
    """Plain-module twin of a :class:`lipvit.ViT`: flat images ``(B, C·S·S)`` to logits.

    Built by :func:`to_verifiable`; holds copies of the weights (it does not
    follow later changes to the model) and has no trainable parameters.
    """

    def __init__(self, model: ViT):
        super().__init__()
        dtype = model.pos_embed.dtype
        self.config = model.config
        self.embed = VerifiableEmbed(model)
        self.blocks = nn.ModuleList(VerifiableBlock(b, dtype) for b in model.blocks)
        self.norm = _norm(model.norm, dtype)
        self.head = _copy_linear(model.head)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.embed(x)  # (B, N, D)
        for block in self.blocks:
            tokens = block(tokens)
        # Both final norms act per token, and the head reads the class token only.
        cls = tokens[:, 0].unsqueeze(1)  # (B, 1, D)
        return self.head(self.norm(cls)[:, 0])  # (B, classes)


def to_verifiable(model: ViT, dtype: torch.dtype = torch.float64) -> VerifiableViT:
    """Verifier-friendly copy of ``model`` computing the same function (see module doc).

    Args:
        model: a :class:`lipvit.ViT` of either family (its mode does not matter:
            neither family has dropout or batch statistics).
        dtype: floating type of the copy. The model is copied to it first, so
            the twin computes ``copy.deepcopy(model).to(dtype)`` (its capped
            weights recomputed in ``dtype``); float64 by default, the dtype
            bounds are computed in.

    Returns:
        A :class:`VerifiableViT` in eval mode on the model's device, taking
        flattened images ``x.reshape(B, -1)``.
    """
    if not isinstance(model, ViT):
        raise TypeError(f"expected a lipvit.ViT, got {type(model).__name__}")
    with torch.no_grad():
        source = copy.deepcopy(model).to(dtype).eval()
        twin = VerifiableViT(source)
    return twin.eval()
