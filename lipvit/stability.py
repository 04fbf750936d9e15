"""ReLU-stability penalty: training a lipschitz ViT for the ``taylor`` certificate.

docs/taylor.md §10. Each SLL layer ``x ↦ x − 2 W T⁻¹ ReLU(Wᵀx + b)`` acts on
every token separately, after ``P₂`` (1-Lipschitz per token). If a token moves
by at most ``κ`` (ℓ2) before ``P₂``, unit ``i``'s pre-activation ``z_i = w_iᵀx
+ b_i`` moves by at most ``‖w_i‖κ`` (Cauchy–Schwarz), so a unit with ``|z_i| ≥
κ‖w_i‖`` cannot change sign: it is *κ-stable*. The ``taylor`` certificate pays
a chord constant and a symbol for every unit that can change sign
(docs/taylor.md §5) and nothing for a stable one. The penalty

    λ · mean over layers, tokens and units of (1 − |z_i| / (κ‖w_i‖))₊

is zero on κ-stable units and pushes the others' pre-activations away from
zero. It follows the ReLU-stability loss of Xiao et al. (ICLR 2019), which
penalises ``−tanh(1 + l_i u_i)`` of interval bounds; here the unit's own
Lipschitz move replaces the interval. The fraction of units that are not
κ-stable is tallied for the training log.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lipvit.layers import SLL


class ReLUStability:
    """The penalty on every SLL layer of ``model``, read through forward hooks.

    Call :meth:`clear` before the forward pass whose activations count, and the
    object after it: it returns ``λ ·`` the mean hinge over the pre-activations
    seen since (only those computed with gradients enabled). :meth:`remove`
    detaches the hooks.

    Args:
        model: a model with :class:`~lipvit.layers.SLL` layers (the lipschitz
            family).
        weight: ``λ > 0``.
        radius: ``κ > 0``, the per-token move before ``P₂`` that a unit should
            withstand without changing sign.

    Raises:
        ValueError: no SLL layer (a standard ViT's GELU MLP has no ReLU units to
            stabilise), or ``λ``/``κ`` not finite and positive.
    """

    def __init__(self, model: nn.Module, weight: float, radius: float):
        for name, value in (("relu_stability", weight), ("stability_radius", radius)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        layers = [m for m in model.modules() if isinstance(m, SLL)]
        if not layers:
            raise ValueError(
                "relu_stability needs ReLU units: the SLL MLPs of the lipschitz "
                "family (this model has none)"
            )
        self.weight, self.radius = float(weight), float(radius)
        self._seen: list[tuple[Tensor, Tensor]] = []
        self._unstable: Tensor | float = 0.0  # sum over calls, on the device
        self._batches = 0
        self._handles = [m.fc1.register_forward_hook(self._keep) for m in layers]

    def _keep(self, module: nn.Linear, inputs: tuple[Tensor], z: Tensor) -> None:
        if torch.is_grad_enabled():
            self._seen.append((z, module.weight))

    def clear(self) -> None:
        """Forget the pre-activations seen so far (e.g. PGD's forward passes)."""
        self._seen.clear()

    def __call__(self) -> Tensor:
        """``λ`` times the mean hinge over the pre-activations seen since
        :meth:`clear` (0 if none), a scalar with gradients; tallies the
        fraction of units that are not κ-stable."""
        if not self._seen:
            return torch.zeros(())
        hinges, unstable = [], []
        for z, W in self._seen:  # z (..., m), W (m, D)
            reach = self.radius * torch.linalg.vector_norm(W, dim=1)  # (m,) κ‖w_i‖
            hinge = (1 - z.float().abs() / reach.float()).clamp_min(0)
            hinges.append(hinge.mean())
            unstable.append((hinge > 0).float().mean().detach())
        self._seen.clear()
        self._unstable = self._unstable + torch.stack(unstable).mean()
        self._batches += 1
        return self.weight * torch.stack(hinges).mean()

    def take_unstable(self) -> float | None:
        """Mean fraction of units that could change sign, over the calls since
        the last :meth:`take_unstable` (``None`` if there were none)."""
        if self._batches == 0:
            return None
        out = float(self._unstable) / self._batches
        self._unstable, self._batches = 0.0, 0
        return out

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
