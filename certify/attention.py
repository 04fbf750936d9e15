"""The multi-head self-attention map that LoFAST and SpecFormer bound (LoFAST eq. 4-6).

Symbols (docs/math.md §2; shapes use ``B`` batch, ``N`` tokens, ``D`` width, ``H``
heads, ``d`` head width):

=============  ==========  ===================================================
paper          code        meaning
=============  ==========  ===================================================
``X``          ``X``       clean token matrix, ``(B, N, D)``
``W_l^Q``      ``W_q``     per-head query weights, ``(H, D, d)``
``W_l^K``      ``W_k``     per-head key weights, ``(H, D, d)``
``W_l^V``      ``W_v``     per-head value weights, ``(H, D, d)``
``W_l^O``      ``W_o``     per-head output weights, ``(H, d, D)``
``P_l(X)``     ``P``       attention matrices, eq. (4), ``(B, H, N, N)``
``W^Q W^Kᵀ``   ``W_qk``    ``A_l = W_q[h] W_k[h]ᵀ``, ``(H, D, D)``
``W^V W^O``    ``W_vo``    ``M_l = W_v[h] W_o[h]``, ``(H, D, D)``
``H``          residual    ``H = I`` (``residual=True``) or ``0``
=============  ==========  ===================================================

``F(X) = H X + Σ_h P_h(X) X W_v[h] W_o[h]`` (eq. 6) is exactly what
:class:`lipvit.model.Attention` computes with its biases removed (``b_v`` and
``b_o`` only add a constant; bounds refuse layers with ``b_q``/``b_k``), plus the
block's residual when ``residual=True``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from lipvit.errors import UnsupportedModelError


class LayerShape(NamedTuple):
    """Sizes of one attention layer applied to a batch of token matrices."""

    B: int
    N: int
    D: int
    H: int
    d: int


def check_layer(
    X: Tensor, W_q: Tensor, W_k: Tensor, W_v: Tensor, W_o: Tensor
) -> LayerShape:
    """Validate shapes, dtypes and devices of a layer and its input.

    Raises:
        ValueError: on a shape mismatch.
        TypeError: on non-floating or mixed dtypes / devices.
    """
    tensors = {"X": X, "W_q": W_q, "W_k": W_k, "W_v": W_v, "W_o": W_o}
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.dtype != X.dtype or t.device != X.device:
            raise TypeError(
                f"{name} has dtype/device {t.dtype}/{t.device}, "
                f"X has {X.dtype}/{X.device}"
            )
    if X.ndim != 3:
        raise ValueError(f"X must have shape (B, N, D), got {tuple(X.shape)}")
    B, N, D = X.shape
    if W_q.ndim != 3 or W_q.shape[1] != D:
        raise ValueError(f"W_q must have shape (H, {D}, d), got {tuple(W_q.shape)}")
    H, _, d = W_q.shape
    for name, W, want in (("W_k", W_k, (H, D, d)), ("W_v", W_v, (H, D, d)),
                          ("W_o", W_o, (H, d, D))):
        if tuple(W.shape) != want:
            raise ValueError(f"{name} must have shape {want}, got {tuple(W.shape)}")
    if min(B, N, D, H, d) < 1:
        raise ValueError("all of B, N, D, H, d must be >= 1")
    return LayerShape(B, N, D, H, d)


def attention_logits(X: Tensor, W_q: Tensor, W_k: Tensor) -> Tensor:
    """Scaled logits ``X W_q[h] (X W_k[h])ᵀ / √d`` of every head, ``(B, H, N, N)``."""
    d = W_q.shape[-1]
    q = torch.einsum("bnD,hDd->bhnd", X, W_q)  # (B, H, N, d)
    k = torch.einsum("bnD,hDd->bhnd", X, W_k)  # (B, H, N, d)
    return q @ k.transpose(-1, -2) / math.sqrt(d)  # (B, H, N, N)


def attention_probs(X: Tensor, W_q: Tensor, W_k: Tensor) -> Tensor:
    """Row-wise softmax attention ``P_h(X)``, LoFAST eq. (4), ``(B, H, N, N)``."""
    return torch.softmax(attention_logits(X, W_q, W_k), dim=-1)


def value_output(W_v: Tensor, W_o: Tensor) -> Tensor:
    """``W_vo[h] = W_v[h] W_o[h]`` (``M_h`` of docs/math.md §2), ``(H, D, D)``."""
    return W_v @ W_o


def query_key(W_q: Tensor, W_k: Tensor) -> Tensor:
    """``W_qk[h] = W_q[h] W_k[h]ᵀ`` (``A_h`` of docs/math.md §2, no ``1/√d``)."""
    return W_q @ W_k.transpose(-1, -2)


def bound_weights(attn: nn.Module) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``attn.head_weights()`` (``W_q, W_k, W_v, W_o``, detached) for the bounds.

    The bounds take eq. (6), which has no query/key bias: a layer whose
    ``b_q`` or ``b_k`` is non-zero is refused (``b_v`` and ``b_o`` only add a
    constant).

    Raises:
        UnsupportedModelError: a non-zero query or key bias.
    """
    b = attn.head_biases()
    if any(t is not None and bool((t != 0).any()) for t in (b.b_q, b.b_k)):
        raise UnsupportedModelError(
            "the attention bounds need bias-free query and key maps (qkv_bias=False)"
        )
    return tuple(W.detach() for W in attn.head_weights())


def attention(
    X: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    W_v: Tensor,
    W_o: Tensor,
    residual: bool = True,
) -> Tensor:
    """The attention layer ``F(X) = H X + Σ_h P_h(X) X W_v[h] W_o[h]``, LoFAST eq. (6).

    Args:
        X: token matrices, ``(B, N, D)``.
        W_q, W_k, W_v: ``(H, D, d)``; W_o: ``(H, d, D)`` (as returned by
            :meth:`lipvit.model.Attention.head_weights`).
        residual: ``H = I`` if true (the model's ``x + attn(x)``), else ``H = 0``.

    Returns:
        ``(B, N, D)``, differentiable in all inputs.
    """
    check_layer(X, W_q, W_k, W_v, W_o)
    P = attention_probs(X, W_q, W_k)  # (B, H, N, N)
    v = torch.einsum("bnD,hDd->bhnd", X, W_v)  # (B, H, N, d)
    out = torch.einsum("bhnm,bhmd,hdE->bnE", P, v, W_o)  # (B, N, D)
    return out + X if residual else out
