"""Maximum Singular Value Penalization, SpecFormer eq. (11), (12), (14); Alg. 1.

| symbol                 | variable          | equation        |
|------------------------|-------------------|-----------------|
| σ(W^{Q,h}) etc.        | ``sigma``         | (12), Alg. 1    |
| λ_q, λ_k, λ_v          | ``lambdas``       | (14)            |
| u, v (persistent)      | ``u``, ``v``      | Alg. 1          |

``J = L_cls + Σ_layers Σ_heads [λ_q σ²(W_q[h]) + λ_k σ²(W_k[h]) + λ_v σ²(W_v[h])]``.
σ is estimated by power iteration with persistent vectors (updated without
gradient), ``σ = uᵀ W v`` differentiated through ``W``. Every head's own
``(D, d)`` matrix is penalised, batched over heads and layers in one matmul.
The value is an estimate from below of the true σ_max, used for training only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lipvit.errors import UnsupportedModelError
from lipvit.spectral import matrix_power_iteration


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Every submodule that implements ``head_weights()``, in order."""
    return [m for m in model.modules() if callable(getattr(m, "head_weights", None))]


class MSVP(nn.Module):
    """MSVP penalty over all attention heads of ``model``.

    Buffers ``u`` (shape ``(L, 3, H, D)``) and ``v`` (``(L, 3, H, d)``) hold the
    persistent singular-vector estimates of ``W_q, W_k, W_v`` for every layer
    ``L`` and head ``H``; they are part of ``state_dict`` and saved with every
    checkpoint.

    Args:
        model: a model with attention modules exposing ``head_weights()`` and
            ``head_weights_t()`` (all of the same shapes).
        lambdas: ``(λ_q, λ_k, λ_v)`` of eq. (14); eq. (11) is the case of equal λ.
        n_iter: power-iteration steps per call (SpecFormer: 1).
    """

    def __init__(
        self,
        model: nn.Module,
        lambdas: tuple[float, float, float],
        n_iter: int = 1,
        seed: int = 0,
    ):
        super().__init__()
        if any(not lam >= 0 for lam in lambdas):
            raise ValueError(f"MSVP weights must be >= 0, got {lambdas}")
        if n_iter < 1:
            raise ValueError(f"msvp iterations must be >= 1, got {n_iter}")
        self.modules_ = attention_modules(model)
        if not self.modules_:
            attention = getattr(getattr(model, "config", None), "attention", None)
            if attention is not None:
                raise UnsupportedModelError(
                    "MSVP penalises sigma_max of W_q, W_k, W_v; this model's token "
                    f"mixing (attention={attention!r}) has none: train it without "
                    "--msvp"
                )
            raise ValueError("model has no attention module with head_weights()")
        self.n_iter = n_iter
        # Every attention module gives its penalised matrices, transposed, as
        # head_weights_t() (dot, lipnorm, scsa: a view of the fused qkv weight,
        # the training hot path). For tied l2 attention W_q and W_k are one
        # matrix, penalised once per role (λ_q + λ_k), and W_v is its effective
        # value matrix A_h W_V[h].
        self.register_buffer("lambdas", torch.tensor(lambdas, dtype=torch.float32))
        W = self.weights()  # (L, 3, H, D, d)
        g = torch.Generator().manual_seed(seed)
        u = torch.randn(W.shape[:-1], generator=g)
        v = torch.randn(W.shape[:-2] + W.shape[-1:], generator=g)
        self.register_buffer("u", u / u.norm(dim=-1, keepdim=True))
        self.register_buffer("v", v / v.norm(dim=-1, keepdim=True))

    def weights(self) -> Tensor:
        """All penalised matrices stacked: ``(L, 3, H, D, d)`` (q, k, v)."""
        return self.weights_t().mT

    def weights_t(self) -> Tensor:
        """The transposes of :meth:`weights`: ``(L, 3, H, d, D)``."""
        try:
            return torch.stack([m.head_weights_t() for m in self.modules_])
        except RuntimeError as err:
            raise ValueError(
                f"attention layers differ in shape; MSVP needs one shape: {err}"
            ) from err

    def sigma(self, update: bool = True) -> Tensor:
        """σ estimates ``uᵀ W v`` of shape ``(L, 3, H)``, differentiable through W.

        With ``update`` the persistent vectors first take ``n_iter`` steps.
        """
        Wt = self.weights_t()  # (L, 3, H, d, D)
        if update:
            # Iterate on Wᵀ (d × D): its right vector is u, its left v.
            W_iter = Wt.detach().to(self.u.dtype)
            it = matrix_power_iteration(W_iter, self.u, self.n_iter)
            self.u.copy_(it.v)
            self.v.copy_(it.u)
        u, v = self.u.to(Wt.dtype), self.v.to(Wt.dtype)
        Wu = (Wt @ u.unsqueeze(-1)).squeeze(-1)  # (L, 3, H, d)
        return (Wu * v).sum(dim=-1)  # (L, 3, H)

    def forward(self, update: bool = True) -> tuple[Tensor, Tensor]:
        """Penalty ``Σ λ σ²`` (scalar) and the σ estimates ``(L, 3, H)`` (detached)."""
        sigma = self.sigma(update)
        penalty = (self.lambdas.to(sigma.dtype)[None, :, None] * sigma**2).sum()
        return penalty, sigma.detach()
