"""Certified training: a loss that trains a lipschitz ViT for ``taylor`` certificates.

docs/certified-training.md. ``taylor`` (docs/taylor.md §1) certifies class
``y`` at radius ``ε`` when, for every wrong class ``j`` and ``c_j = e_j − e_y``,

    f_y(x) − f_j(x) > ‖c_jᵀJ‖ ε + Σ_sites |g_site,jᵀ r_site|,

``J`` the image-to-logits Jacobian, ``g_site,j`` the margin's gradient with
respect to a site's output and ``r_site`` the site's remainder. In a lipschitz
model the remainders that cost the most are the ReLU units of the SLL layers
that can change sign (docs/taylor.md §5, §10). Following GloRo (Leino et al.,
2021), the loss is the cross-entropy of logits in which the strongest wrong
class ``j*`` (largest logit) is raised by a bound-like estimate of its margin
drop over the ε-ball:

    f̃_j* = f_j* + ε ‖c_j*ᵀJ‖ + Σ_blocks Σ_tokens Σ_units |g_u,j*| (‖w_i‖ ρ ε − |z_i|)₊,

``z_i = w_iᵀ P₂(x_t) + b_i`` a unit's pre-activation, ``g_u,j*`` the margin's
gradient with respect to the unit's ReLU output (the ``act`` site of
:mod:`lipvit.certify.taylor.sites`) and ``ρ`` (``TrainConfig.cert_stream``) the move
of a token at an SLL input per unit of image perturbation. The first term is
**exact** (the same first-order term ``taylor`` computes, here in the training
precision); the second **bounds** the ReLU sites' share ``Σ |g_u,i| |r_i|``
whenever every token at an SLL input moves by at most ``ρε`` (Lemma 2 of the
docs); ``ρε`` itself is a **training surrogate**, not a bound, and the other
sites' remainders (projections, attention) are left out. Certification
afterwards is always the real certificate.

Both gradients come from one extra backward pass with ``create_graph=True``
(double backpropagation) for the one class ``j*``; ε ramps linearly from 0 to
``cert_eps`` over the first ``cert_warmup`` fraction of the training steps
(:func:`cert_eps_at`). Dot-product attention runs in PyTorch's math kernel
during that step: the fused CPU kernel has no second derivative.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lipvit.layers import SLL


def cert_eps_at(step: int, total: int, eps: float, warmup: float) -> float:
    """ε of training step ``step`` (0-based) of ``total``: linear from ``eps/ramp``
    to ``eps`` over the first ``ramp = ⌈warmup · total⌉`` steps, then ``eps``.

    ``warmup = 0`` gives ``eps`` at once.
    """
    ramp = math.ceil(warmup * total)
    if step >= ramp:
        return float(eps)
    return float(eps) * (step + 1) / ramp


def check_certifiable(model: nn.Module) -> None:
    """Refuse, in one line (``ValueError``), a model the loss cannot handle.

    The ReLU term needs every block's feed-forward layer to be an SLL (the
    lipschitz family); the standard family's GELU units have no sign to
    stabilise and its certificate is set by other remainders (LayerNorm,
    attention), which this loss does not model.
    """
    blocks = list(getattr(model, "blocks", []))
    if not blocks or not all(isinstance(getattr(b, "mlp", None), SLL) for b in blocks):
        family = getattr(getattr(model, "config", None), "family", "this")
        raise ValueError(
            f"cert_eps needs the lipschitz family (SLL feed-forward layers); "
            f"the {family} family is not supported"
        )


class CertifiedLoss:
    """The bound-aware cross-entropy on ``model``'s SLL layers, read through hooks.

    Usage in a training step: :meth:`clear` before the forward pass whose
    activations count (after any PGD), run the forward pass on an input that
    requires gradients inside :meth:`context`, then call :meth:`raised_logits`
    on its logits.

    Args:
        model: a lipschitz-family ViT (:func:`check_certifiable`).
        stream: ``ρ``, the per-token move at an SLL input per unit of image
            perturbation assumed by the ReLU term (stream units per image unit).

    Raises:
        ValueError: a model without SLL layers, or ``ρ`` not finite and > 0.
    """

    def __init__(self, model: nn.Module, stream: float):
        check_certifiable(model)
        if not (math.isfinite(stream) and stream > 0):
            raise ValueError(f"cert_stream must be a finite number > 0, got {stream}")
        self.stream = float(stream)
        self._layers: list[SLL] = [b.mlp for b in model.blocks]
        self._z: dict[int, Tensor] = {}
        self._y: dict[int, Tensor] = {}
        self._handles = []
        for k, sll in enumerate(self._layers):
            self._handles += [
                sll.fc1.register_forward_hook(self._keeper(self._z, k)),
                sll.register_forward_hook(self._keeper(self._y, k)),
            ]
        self.last: dict[str, Tensor] = {}

    @staticmethod
    def _keeper(store: dict[int, Tensor], k: int):
        def hook(module: nn.Module, inputs: tuple[Tensor], out: Tensor) -> None:
            if torch.is_grad_enabled():
                store[k] = out

        return hook

    def clear(self) -> None:
        """Forget the activations seen so far (e.g. PGD's forward passes)."""
        self._z.clear()
        self._y.clear()

    @staticmethod
    @contextlib.contextmanager
    def context() -> Iterator[None]:
        """Attention in the math kernel (differentiable twice)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            yield

    def raised_logits(self, logits: Tensor, x: Tensor, y: Tensor, eps: float) -> Tensor:
        """``logits`` with the strongest wrong class raised by its estimated drop.

        Args:
            logits: ``(B, classes)`` of the forward pass on ``x`` since
                :meth:`clear`.
            x: the images ``(B, C, S, S)``, requiring gradients.
            y: labels ``(B,)``.
            eps: the radius of this step (``0``: ``logits`` unchanged).

        Returns:
            ``(B, classes)``, differentiable (twice through the network). The
            terms, detached, are in :attr:`last`: ``wrong`` (``j*``), ``margin``
            (``f_y − f_j*``), ``first`` (``ε‖c_j*ᵀJ‖``) and ``relu`` (the ReLU
            term), each ``(B,)``, and ``relu_blocks`` ``(B, blocks)``.
        """
        K = len(self._layers)
        if len(self._y) != K or len(self._z) != K:
            raise RuntimeError("CertifiedLoss: no forward pass recorded since clear()")
        if eps <= 0:
            self.clear()
            return logits
        dt = torch.promote_types(logits.dtype, torch.float32)  # bf16 → float32
        logits32 = logits.to(dt)
        wrong = logits32.detach().scatter(1, y[:, None], -math.inf)
        j = wrong.argmax(dim=1)  # (B,) strongest wrong class
        margin = logits32.gather(1, j[:, None]) - logits32.gather(1, y[:, None])
        ys = [self._y[k] for k in range(K)]
        grads = torch.autograd.grad(margin.sum(), [x, *ys], create_graph=True)
        first = eps * grads[0].to(dt).flatten(1).norm(dim=1)  # (B,)
        beta = self.stream * eps
        terms = []
        for k, sll in enumerate(self._layers):
            Wt = sll.fc1.weight.to(dt)  # (m, D): row i is w_iᵀ
            # y = q − 2 (u/T) Wt, so ∂m/∂u = −2 (∂m/∂y) Wtᵀ / T  (B, N, m)
            g_u = -2.0 * (grads[1 + k].to(dt) @ Wt.T) / sll.T().to(dt)
            reach = beta * torch.linalg.vector_norm(Wt, dim=1)  # (m,) ‖w_i‖ρε
            slack = (reach - self._z[k].to(dt).abs()).clamp_min(0)  # (B, N, m)
            terms.append((g_u.abs() * slack).flatten(1).sum(dim=1))
        self.clear()
        relu_blocks = torch.stack(terms, dim=1)  # (B, K)
        relu = relu_blocks.sum(dim=1)
        bump = first + relu
        self.last = {"wrong": j, "margin": -margin.detach().squeeze(1),
                     "first": first.detach(), "relu": relu.detach(),
                     "relu_blocks": relu_blocks.detach()}
        return logits32 + F.one_hot(j, logits32.shape[1]).to(bump.dtype) * bump[:, None]

    def certified(self) -> Tensor:
        """``(B,)`` bool: the points of the last :meth:`raised_logits` whose
        margin beat the raise."""
        last = self.last
        return last["margin"] > last["first"] + last["relu"]

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
