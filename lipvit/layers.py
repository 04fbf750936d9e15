"""Building blocks of the lipschitz ViT family (LoFAST §5.2, docs/math.md §5).

Every layer here is 1-Lipschitz in ℓ2 (Frobenius for token matrices), or has a
spectral norm held below a cap by construction:

- :func:`layer_project` / :class:`LayerProject`: ``x ↦ x·R/‖x‖`` if ``‖x‖ > R``
  (LoFAST eq. 29), per token or for the whole token matrix; a projection onto a
  convex set, hence 1-Lipschitz.
- :class:`SpectralCap`: a ``torch.nn.utils.parametrize`` parametrisation that
  rescales each (block of a) weight so its exact spectral norm is at most
  ``cap``: ``W ↦ W · min(1, cap / σ_max(W))`` with σ_max from a dense SVD.
- :class:`SLL`: the SDP-based Lipschitz layer of Araujo et al. (2023),
  ``x ↦ x − 2 W T⁻¹ ReLU(Wᵀx + b)``, ``T_ii = Σ_j |WᵀW|_ij q_j / q_i``.
- :class:`ConvCap` / :func:`capped_conv`: a stride-1 "same" convolution whose
  operator norm on ``size × size`` images is at most 1
  (:func:`lipvit.spectral.conv_operator_norm`).
- :func:`max_min`: the MaxMin activation (Anil et al. 2019), GroupSort with
  groups of two: a permutation of its input wherever it is differentiable,
  hence 1-Lipschitz and gradient-norm preserving.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from lipvit.spectral import conv_operator_norm, spectral_norm

Blocks = Literal["whole", "rows_per_head", "cols_per_head"]


def layer_project(x: Tensor, radius: float, dims: tuple[int, ...] = (-1,)) -> Tensor:
    """LayerProject, LoFAST eq. (29): ``x·R/‖x‖`` where ``‖x‖ > R``, else ``x``.

    Args:
        x: any tensor.
        radius: ``R``.
        dims: dimensions forming the vector that is projected: ``(-1,)`` per
            token, ``(-2, -1)`` the whole ``(N, D)`` token matrix (Frobenius).
    """
    norm = torch.linalg.vector_norm(x, dim=dims, keepdim=True)
    return x * (radius / norm.clamp_min(radius))


class LayerProject(nn.Module):
    """Module form of :func:`layer_project` (``mode="token"`` or ``"frobenius"``)."""

    def __init__(self, radius: float, mode: Literal["token", "frobenius"] = "token"):
        super().__init__()
        self.radius = float(radius)
        self.mode = mode

    def forward(self, x: Tensor) -> Tensor:
        return layer_project(
            x, self.radius, (-1,) if self.mode == "token" else (-2, -1)
        )

    def extra_repr(self) -> str:
        return f"radius={self.radius:g}, mode={self.mode}"


class SpectralCap(nn.Module):
    """Parametrisation holding spectral norms at or below ``cap`` exactly.

    ``blocks`` selects which matrices are capped inside a ``(out, in)`` weight:
    ``"whole"`` the weight itself; ``"rows_per_head"`` the ``heads`` row blocks
    of the rows ``row_slice`` (a fused qkv weight's per-head ``W_v[h]ᵀ``);
    ``"cols_per_head"`` the ``heads`` column blocks (an output projection's
    per-head ``W_o[h]ᵀ``). Each block ``B`` becomes ``B · min(1, cap/σ_max(B))``
    with σ_max from a dense SVD, so the cap holds in the effective weights up to
    float rounding.
    """

    def __init__(
        self,
        cap: float,
        blocks: Blocks = "whole",
        heads: int = 1,
        row_slice: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.cap, self.blocks, self.heads, self.row_slice = (
            float(cap),
            blocks,
            heads,
            row_slice,
        )

    def _scale(self, B: Tensor) -> Tensor:
        sigma = spectral_norm(B)
        return (self.cap / sigma.clamp_min(1e-12)).clamp(max=1.0)

    def forward(self, W: Tensor) -> Tensor:
        if self.blocks == "whole":
            return W * self._scale(W)
        out_f, in_f = W.shape
        if self.blocks == "cols_per_head":
            blocks = W.reshape(out_f, self.heads, in_f // self.heads).transpose(0, 1)
            scale = self._scale(blocks)  # (H,)
            return (blocks * scale[:, None, None]).transpose(0, 1).reshape(out_f, in_f)
        lo, hi = self.row_slice if self.row_slice else (0, out_f)
        blocks = W[lo:hi].reshape(
            self.heads, (hi - lo) // self.heads, in_f
        )  # (H, d, in)
        capped = (blocks * self._scale(blocks)[:, None, None]).reshape(hi - lo, in_f)
        return torch.cat([W[:lo], capped, W[hi:]], dim=0)


def capped_linear(
    in_features: int, out_features: int, cap: float = 1.0, bias: bool = True
) -> nn.Linear:
    """``nn.Linear`` whose weight has spectral norm ≤ ``cap`` by construction."""
    layer = nn.Linear(in_features, out_features, bias=bias)
    nn.utils.parametrize.register_parametrization(layer, "weight", SpectralCap(cap))
    return layer


class SLL(nn.Module):
    """SDP-based Lipschitz residual layer (Araujo et al., ICLR 2023), 1-Lipschitz.

    ``y = x − 2 · (ReLU(x W + b) / T) Wᵀ`` for row vectors ``x`` of width ``D``,
    ``W`` of shape ``(D, m)`` and ``T_i = Σ_j |WᵀW|_ij · q_j / q_i`` with
    ``q = exp(log_q)`` (docs/math.md §5). Attribute names follow timm's MLP
    (``fc1`` holds ``W`` and ``b``).
    """

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)  # weight (m, D) = Wᵀ
        self.log_q = nn.Parameter(torch.zeros(hidden))

    def T(self) -> Tensor:
        """Diagonal of ``T`` (shape ``(m,)``), strictly positive."""
        Wt = self.fc1.weight  # (m, D)
        q = torch.exp(self.log_q)
        gram = (Wt @ Wt.T).abs()  # (m, m) = |WᵀW|
        return (gram * q[None, :] / q[:, None]).sum(dim=1).clamp_min(1e-12)

    def forward(self, x: Tensor) -> Tensor:
        z = torch.relu(self.fc1(x)) / self.T()  # (..., m)
        return x - 2.0 * z @ self.fc1.weight  # (..., D)


class ConvCap(nn.Module):
    """Parametrisation of a conv kernel ``K`` ``(c_out, c_in, k, k)``:
    ``K · min(1, 1/‖conv_K‖)`` with ``‖conv_K‖`` the bound of
    :func:`lipvit.spectral.conv_operator_norm` on ``size × size`` images, so
    the zero-padded convolution is 1-Lipschitz in ℓ2 by construction."""

    def __init__(self, size: int):
        super().__init__()
        self.size = int(size)

    def forward(self, K: Tensor) -> Tensor:
        return K / conv_operator_norm(K, self.size).clamp_min(1.0)


def capped_conv(in_channels: int, out_channels: int, size: int,
                kernel_size: int = 3) -> nn.Conv2d:
    """A "same" ``nn.Conv2d`` on ``size × size`` images whose operator norm is
    at most 1 by construction (:class:`ConvCap`), initialised orthogonal."""
    conv = nn.Conv2d(in_channels, out_channels, kernel_size,
                     padding=kernel_size // 2)
    nn.init.orthogonal_(conv.weight.view(out_channels, -1))
    nn.init.zeros_(conv.bias)
    nn.utils.parametrize.register_parametrization(conv, "weight", ConvCap(size))
    return conv


def max_min(x: Tensor, dim: int = -1) -> Tensor:
    """MaxMin along ``dim`` (even length): the halves ``a, b`` become
    ``max(a, b), min(a, b)``; 1-Lipschitz in ℓ2 (a permutation of the pairs).
    Computed as ``b + r, a − r`` with ``r = ReLU(a − b)`` (5× faster to
    differentiate than ``torch.maximum``/``minimum`` on a CPU)."""
    a, b = x.chunk(2, dim=dim)
    r = torch.relu(a - b)
    return torch.cat([b + r, a - r], dim=dim)
