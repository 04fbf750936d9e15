"""PGD against a smoothed classifier, and the smallest ℓ2 radius at which it flips.

Salman, Li, Razenshteyn, Zhang, Zhang, Bubeck & Yang, "Provably Robust Deep
Learning via Adversarially Trained Smoothed Classifiers", NeurIPS 2019, §3:
the smoothed classifier's prediction is not differentiable, so the attack
ascends the loss of the *soft* smoothed classifier

    J(x′) = −log( (1/m) Σ_i softmax(F(x′ + δ_i))_y ),   δ_i ~ N(0, σ² I),

an expectation over transformation (EOT) of ``m`` fresh noise draws per step,
by ℓ2 PGD on ``‖x′ − x‖₂ ≤ ε`` intersected with the box ``[0, 1]``
(:func:`smooth_pgd`). Whether a point ``x′`` flips the smoothed classifier
``g`` (:mod:`lipvit.certify.smoothing`) is decided by Cohen et al.'s PREDICT
at ``x′``: a class other than ``y`` returned with its binomial test at level
``α``, so each flip is real with probability ``≥ 1 − α``; an abstention is not
a flip.

:func:`smoothed_attack_radius` bisects ε per point (all points in one batch,
each at its own ε) and reports the distance of the closest flipping point: an
**upper bound** of the smoothed classifier's robust radius (with probability
``≥ 1 − α`` per point), comparable with ``smoothing``'s certified radius (a
lower bound with the same kind of probability). It says nothing about the
network ``F`` itself: :mod:`lipvit.analysis.attack_radius` attacks that.

Shapes: ``B`` points, ``m`` noise draws, ``K`` classes, images ``(B, C, S, S)``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from lipvit.certify.smoothing import base_classifier, check_noise, predict_smoothed
from torch import Tensor, nn


@dataclass(frozen=True)
class SmoothAttackSettings:
    """Strength and stopping rule of :func:`smoothed_attack_radius`.

    ``steps`` PGD steps of size ``2.5 ε / steps`` with ``m`` noise draws each
    (Salman et al.'s SmoothAdv-PGD); PREDICT at each attacked point with
    ``n_predict`` draws at level ``alpha``; the bisection stops at
    ``hi − lo ≤ rtol · hi`` or after ``max_probes`` probes; ``batch_size``
    points per forward pass (times ``m`` images).
    """

    sigma: float
    steps: int = 10
    m: int = 16
    n_predict: int = 1000
    alpha: float = 0.001
    rtol: float = 0.05
    max_probes: int = 12
    max_radius: float | None = None
    batch_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        check_noise(self.sigma, self.alpha)
        for key in ("steps", "m", "n_predict", "max_probes", "batch_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if not 0 < self.rtol < 1:
            raise ValueError(f"rtol must lie in (0, 1), got {self.rtol}")


def _soft_smoothed_loss(f: nn.Module, x: Tensor, y: Tensor, sigma: float, m: int,
                        generator: torch.Generator) -> Tensor:
    """``(B,)`` ``J(x)``: −log of the mean softmax probability of ``y`` over ``m``
    noisy copies of each image (Salman et al. 2019, §3)."""
    B = x.shape[0]
    noise = torch.randn((B, m, *x.shape[1:]), generator=generator, device=x.device,
                        dtype=x.dtype)  # (B, m, C, S, S)
    noisy = (x[:, None] + sigma * noise).flatten(0, 1)  # (B·m, C, S, S)
    probs = torch.softmax(f(noisy), dim=1).reshape(B, m, -1)  # (B, m, K)
    p_y = probs.mean(dim=1).gather(1, y[:, None]).squeeze(1)  # (B,)
    return -torch.log(p_y.clamp_min(1e-30))


def smooth_pgd(f: nn.Module, x: Tensor, y: Tensor, eps: Tensor, sigma: float,
               steps: int, m: int, generator: torch.Generator) -> Tensor:
    """ℓ2 PGD on the soft smoothed classifier's loss (EOT over ``m`` draws per
    step), from ``x``, each image within its own ``eps[b]`` and the box [0, 1].

    Args:
        f: the base classifier (:func:`lipvit.certify.smoothing.base_classifier`).
        x: images ``(B, C, S, S)``; y: labels ``(B,)``; eps: ``(B,)`` radii.

    Returns:
        ``(B, C, S, S)`` attacked images, detached, every one admissible.
    """
    shape = (-1,) + (1,) * (x.ndim - 1)
    eps = eps.to(x).reshape(shape)  # (B, 1, 1, 1)
    step = 2.5 * eps / steps
    delta = torch.zeros_like(x)
    for _ in range(steps):
        delta.requires_grad_(True)
        loss = _soft_smoothed_loss(f, x + delta, y, sigma, m, generator)
        (grad,) = torch.autograd.grad(loss.sum(), delta)
        with torch.no_grad():
            norm = grad.flatten(1).norm(dim=1).reshape(shape).clamp_min(1e-12)
            delta = delta + step * grad / norm
            size = delta.flatten(1).norm(dim=1).reshape(shape)
            delta = delta * torch.clamp(eps / size.clamp_min(1e-12), max=1.0)
            # Clipping to the box moves no point farther from x (x is inside).
            delta = (x + delta).clamp(0, 1) - x
    return (x + delta).detach()


@dataclass(frozen=True, eq=False)
class SmoothAttackResult:
    """Per-point results of :func:`smoothed_attack_radius` (arrays of length ``B``).

    ``radius``: distance of the closest point PREDICT classified as another
    class (``inf``: none found up to ``max_radius``; 0: PREDICT at the image
    itself already returns another class). ``bracket_low``: the largest ε at
    which no flip was found (not a bound). ``x_adv``: the closest points.
    """

    labels: np.ndarray
    radius: np.ndarray
    bracket_low: np.ndarray
    probes: np.ndarray
    x_adv: Tensor
    seconds: float
    settings: dict[str, Any] = field(default_factory=dict)

    def to_records(self, index) -> list[dict[str, Any]]:
        """One plain dict per point (``index``: its test-set index)."""
        return [{"index": int(index[i]), "label": int(self.labels[i]),
                 "radius": float(self.radius[i]),
                 "bracket_low": float(self.bracket_low[i]),
                 "probes": int(self.probes[i])} for i in range(len(self.labels))]


def _flipped(f: nn.Module, x: Tensor, y: Tensor, s: SmoothAttackSettings, K: int,
             generator: torch.Generator) -> Tensor:
    """``(B,)`` bool: PREDICT returns a class other than ``y`` (not an abstention)."""
    out = []
    for i in range(x.shape[0]):
        c = predict_smoothed(f, x[i], s.sigma, s.n_predict, s.alpha, K,
                             max(s.batch_size * s.m, 64), generator)
        out.append(c >= 0 and c != int(y[i]))
    return torch.tensor(out, dtype=torch.bool)


def smoothed_attack_radius(model: nn.Module, x: Tensor, y: Tensor,
                           settings: SmoothAttackSettings,
                           start: Tensor | None = None,
                           progress: Callable[[int, int], None] | None = None,
                           ) -> SmoothAttackResult:
    """Smallest ℓ2 radius per point at which :func:`smooth_pgd` flips the smoothed
    classifier (PREDICT), by bisection on ε.

    Args:
        model: the network; its float32 copy is the base classifier.
        x: images ``(B, C, S, S)`` in [0, 1]; y: labels ``(B,)`` (the class
            the attack moves away from: the label, or the smoothed prediction).
        start: ``(B,)`` first ε to probe (e.g. the certified radius; default
            0.25); it doubles until a flip is found or ``max_radius`` (default
            the box diagonal) is passed, then the bracket is bisected.
        progress: called after each probe with ``(points finished, probe)``.

    Returns:
        :class:`SmoothAttackResult`; ``radius`` is an upper bound of each
        point's robust radius under the smoothed classifier, with probability
        ``≥ 1 − α`` per point (PREDICT's test).
    """
    s = settings
    t0 = time.perf_counter()
    f = base_classifier(model)
    device = next(f.parameters(), torch.empty(0)).device
    x = x.to(device=device, dtype=torch.float32)
    y = y.to(device)
    B = x.shape[0]
    K = int(model.config.num_classes) if hasattr(model, "config") else int(
        f(x[:1]).shape[1])
    max_radius = s.max_radius or float(x.shape[1:].numel() ** 0.5)
    gen = torch.Generator(device=device)
    gen.manual_seed(s.seed)
    lo = torch.zeros(B, dtype=torch.float64)
    hi = torch.full((B,), math.inf, dtype=torch.float64)
    probe = (torch.full((B,), 0.25, dtype=torch.float64) if start is None
             else start.detach().cpu().double().clamp_min(1e-3))
    probes = torch.zeros(B, dtype=torch.long)
    x_adv = x.clone()
    at_clean = _flipped(f, x, y, s, K, gen)
    hi[at_clean] = 0.0
    for step in range(1, s.max_probes + 1):
        searching = torch.isinf(hi) & (lo < max_radius)  # no flip found yet
        open_ = (searching | (hi - lo > s.rtol * hi)) & (hi > 0)
        idx = open_.nonzero()[:, 0]
        if not idx.numel():
            break
        eps = torch.where(torch.isinf(hi), probe, (lo + hi) / 2)[idx].clamp(
            max=max_radius)
        for part in range(0, idx.numel(), s.batch_size):
            b = idx[part:part + s.batch_size]
            e = eps[part:part + s.batch_size]
            adv = smooth_pgd(f, x[b], y[b], e.to(device), s.sigma, s.steps, s.m, gen)
            flip = _flipped(f, adv, y[b], s, K, gen)
            dist = (adv - x[b]).flatten(1).double().norm(dim=1).cpu()
            closer = flip & (dist < hi[b])
            hi[b[closer]] = dist[closer]
            x_adv[b[closer]] = adv[closer]
            lo[b[~flip]] = torch.maximum(lo[b[~flip]], e[~flip])
            probe[b[~flip]] = 2 * e[~flip]
        probes[idx] += 1
        if progress is not None:
            progress(int((~open_).sum()), step)
    lo = torch.minimum(lo, hi)
    return SmoothAttackResult(
        labels=y.cpu().numpy(), radius=hi.numpy(), bracket_low=lo.numpy(),
        probes=probes.numpy(), x_adv=x_adv.detach(),
        seconds=time.perf_counter() - t0,
        settings={**asdict(s), "max_radius": max_radius})
