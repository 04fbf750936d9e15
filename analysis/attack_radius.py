"""Smallest adversarial ℓ2 radius per sample: bisection on ε, worst case over attacks.

For each correctly classified image ``x`` with label ``y`` the search looks for
the smallest ``r`` such that a strong attack finds ``x'`` in the box
``[0, 1]`` with ``‖x' − x‖₂ ≤ r`` and ``argmax F(x') ≠ y``. Every adversarial
point is **verified** (its prediction re-computed, its distance measured in
float64) and the reported radius is the verified distance of the closest one:
an **upper bound** of the true robust radius (an adversarial point exists at
that distance), never a certificate. The true radius lies between a certified
radius and this one.

Attacks (``RADIUS_ATTACKS``), all run through torchattacks:

==========  ============================================================
``pgd-l2``  ``torchattacks.PGDL2`` (cross-entropy), ``restarts`` random starts
``apgd``    ``torchattacks.APGD`` ℓ2, cross-entropy (Croce & Hein 2020)
``apgd-t``  ``torchattacks.APGDT`` ℓ2, targeted DLR loss, ``targets`` classes
``cw``      ``torchattacks.CW`` (Carlini & Wagner 2017) for each ``c`` in
            ``cw_c``: a minimum-norm attack, run once (no ε), its points
            seed the bisection's upper end
==========  ============================================================

Per-sample ε. torchattacks takes one scalar ``eps``; the bisection needs one
ε per sample. Every attack therefore runs in centred variables ``z``: the
attacked "image" is the constant ``z₀ = ½``, attacked with the scalar radius
``½``, and the model sees

    x'(z) = clip(x + k (z − ½), 0, 1),   k = 2 ε_b  (per sample b).

``‖z − ½‖ ≤ ½`` gives ``‖k (z − ½)‖ ≤ ε_b``, and clipping to the box moves no
point farther from ``x`` (projection onto a convex set containing ``x``), so
every attacked point is admissible for its own ``ε_b``; the box ``z ∈ [0, 1]``
that torchattacks enforces allows each pixel to move by ``ε_b``, which the ℓ2
ball allows anyway. One attack call thus attacks a whole batch, each sample at
its own ε. CW runs in the same variables with ``k = 2``: every pixel can move
across the whole box, which removes CW's tanh-space weakness (in image
variables a pixel at exactly 0 or 1 cannot move, see :mod:`lipvit.analysis.attacks`).
APGD and APGD-T are called one run (restart, target class) at a time on the
whole batch (``attack_single_run``), because their ``perturb`` re-batches the
still-unbroken samples, which would detach a sample from its ε.

Bisection (per sample, all samples in one batch): ``hi`` is the closest
verified adversarial distance so far (CW's, or ``∞``), ``lo`` the largest ε at
which every attack failed. The next ε is ``(lo + hi)/2``; without ``hi`` it is
the first-order limit, then doubles up to ``max_radius``. A sample stops when
``hi − lo ≤ rtol·hi`` or ``lo ≥ max_radius`` (no adversarial point found:
radius ``∞``). ``lo`` is **not** a lower bound of anything: attacks may fail
where adversarial points exist.

First-order limit: ``min_{j≠y} m_j(x) / ‖∇_x m_j(x)‖₂`` with
``m_j = F_y − F_j`` — the distance to the linearised decision boundary, exact
for a linear model without the box; an **estimate**, neither an upper nor a
lower bound for a nonlinear one.

Shapes: ``n`` samples, ``B`` a batch, ``K`` classes, images ``(·, C, S, S)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from lipvit.analysis.attacks import (
    _fork_rng,
    _num_classes,
    _predict,
    _torchattacks,
    perturbation_norm,
    with_fixed_weights,
)
from lipvit.certify.certification import margin as certification_margin
from torch import Tensor, nn

RADIUS_ATTACKS: tuple[str, ...] = ("pgd-l2", "apgd", "apgd-t", "cw")
CLEAN = "clean"  # the sample is misclassified: radius 0, the image itself
NONE = "none"  # no adversarial point found up to max_radius: radius ∞
Z_EPS = 0.5  # the scalar radius every attack gets in the centred variables
MAX_PROBES = 40


@dataclass(frozen=True)
class RadiusSettings:
    """Strength and stopping rule of :func:`attack_radius` (validated here).

    ``max_radius`` ``None``: the box diagonal ``√(C·S·S)`` (no point of the
    box is farther from ``x``).
    """

    attacks: tuple[str, ...] = RADIUS_ATTACKS
    steps: int = 50  # iterations of pgd-l2, apgd, apgd-t
    restarts: int = 2  # random starts of pgd-l2 and apgd
    targets: int = 3  # target classes of apgd-t (the runner-up classes)
    cw_c: tuple[float, ...] = (0.1, 1.0, 10.0)
    cw_steps: int = 100
    rtol: float = 0.01
    max_radius: float | None = None
    seed: int = 0
    batch_size: int = 256

    def __post_init__(self) -> None:
        if not self.attacks:
            raise ValueError("give at least one attack")
        for name in self.attacks:
            if name not in RADIUS_ATTACKS:
                raise ValueError(f"attack {name!r} has no radius search; choose from "
                                 f"{', '.join(RADIUS_ATTACKS)}")
        if len(set(self.attacks)) != len(self.attacks):
            raise ValueError(f"attack listed twice: {list(self.attacks)}")
        for key in ("steps", "restarts", "targets", "cw_steps", "batch_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if not self.cw_c or not all(np.isfinite(c) and c > 0 for c in self.cw_c):
            raise ValueError(f"cw_c must be positive numbers, got {self.cw_c}")
        if not (np.isfinite(self.rtol) and 0 < self.rtol < 1):
            raise ValueError(f"rtol must lie in (0, 1), got {self.rtol}")
        if self.max_radius is not None and not (
                np.isfinite(self.max_radius) and self.max_radius > 0):
            raise ValueError(f"max_radius must be positive and finite, "
                             f"got {self.max_radius}")


@dataclass(frozen=True, eq=False)
class RadiusResult:
    """Per-sample results of :func:`attack_radius` (arrays of length ``n``).

    ``radius``: verified distance of the closest adversarial point (upper
    bound of the true robust radius; 0 for misclassified samples, ``inf``
    where none was found). ``attack``: which attack found it (``"clean"``,
    ``"none"``). ``x_adv``: those points ``(n, C, S, S)`` (the image itself
    where none). ``verified``: re-checked at the end (misclassified, in the
    box, at distance ``radius``). ``bracket_low``: largest ε at which every
    attack failed (not a bound). ``first_order``: the first-order limit (an
    estimate). ``probes``: bisection steps per sample.
    """

    labels: np.ndarray
    predictions: np.ndarray
    radius: np.ndarray
    attack: list[str]
    x_adv: Tensor
    verified: np.ndarray
    bracket_low: np.ndarray
    first_order: np.ndarray
    probes: np.ndarray
    seconds: float
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(self.labels.shape[0])

    @property
    def correct(self) -> np.ndarray:
        return self.predictions == self.labels

    def to_records(self, index: Sequence[int]) -> list[dict[str, Any]]:
        """One plain dict per sample (``index``: its test-set index)."""
        return [{"index": int(index[i]), "label": int(self.labels[i]),
                 "prediction": int(self.predictions[i]),
                 "radius": float(self.radius[i]), "attack": self.attack[i],
                 "verified": bool(self.verified[i]),
                 "bracket_low": float(self.bracket_low[i]),
                 "first_order_limit": float(self.first_order[i]),
                 "probes": int(self.probes[i])} for i in range(self.n)]


def first_order_limit(model: nn.Module, x: Tensor, y: Tensor,
                      batch_size: int = 256) -> Tensor:
    """First-order limit ``min_{j≠y} m_j / ‖∇_x m_j‖₂``, ``m_j = F_y − F_j``: ``(n,)``.

    The ℓ2 distance from ``x`` to the linearised decision boundary — exact for
    an affine classifier (ignoring the box ``[0, 1]``), an **estimate** for
    others, neither an upper nor a lower bound. One backward pass per class,
    gradients by autograd. Misclassified samples (margin ≤ 0) get 0; a class
    whose margin has zero gradient is ignored (``inf`` if all are).
    """
    out = []
    for i in range(0, x.shape[0], batch_size):
        xb = x[i:i + batch_size].detach().clone().requires_grad_(True)
        yb = y[i:i + batch_size]
        with torch.enable_grad():
            logits = model(xb)  # (B, K)
            true = logits.gather(1, yb[:, None])  # (B, 1)
            m = true - logits  # (B, K): m_j, 0 at j = y
            limit = torch.full((xb.shape[0],), float("inf"), dtype=torch.float64,
                               device=x.device)
            for j in range(logits.shape[1]):
                (grad,) = torch.autograd.grad(m[:, j].sum(), xb, retain_graph=True)
                gnorm = perturbation_norm(grad.double(), "l2")  # (B,)
                ratio = m[:, j].detach().double() / gnorm
                use = (yb != j) & (gnorm > 0)
                limit = torch.where(use, torch.minimum(limit, ratio), limit)
        clean = certification_margin(logits.detach(), yb) > 0
        out.append(torch.where(clean, limit, torch.zeros_like(limit)))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


class Centred(nn.Module):
    """The model in centred variables: ``z ↦ F(clip(x + k (z − ½), 0, 1))``.

    ``x`` ``(B, C, S, S)`` and ``k`` ``(B,)`` are fixed per sample; inputs must
    be the same batch (``(B, C, S, S)``). ``‖z − ½‖₂ ≤ r`` maps into the ball of
    radius ``k·r`` around ``x`` intersected with the box (see the module note).
    """

    def __init__(self, model: nn.Module, x: Tensor, k: Tensor):
        super().__init__()
        self.model, self.x, self.k = model, x, k

    def image(self, z: Tensor) -> Tensor:
        """The admissible image ``clip(x + k (z − ½), 0, 1)`` of ``z``."""
        assert z.shape == self.x.shape, "a centred model attacks its own batch"
        step = self.k.to(z.dtype).reshape(-1, 1, 1, 1) * (z - 0.5)  # (B, C, S, S)
        return (self.x + step).clamp(0, 1)

    def forward(self, z: Tensor) -> Tensor:
        return self.model(self.image(z))


def perturb_per_sample(model: nn.Module, x: Tensor, y: Tensor, eps: Tensor,
                       attack: str, settings: RadiusSettings,
                       run: int = 0) -> Tensor:
    """One run of ``attack`` with radius ``eps[b]`` for sample ``b``: ``(B, C, S, S)``.

    ``run`` picks the restart (``pgd-l2``, ``apgd``: seed ``seed + run``) or the
    target class (``apgd-t``: the ``run + 2``-th largest logit). The points lie
    in ``[0, 1]`` with ``‖x' − x‖₂ ≤ eps`` (not filtered for success).
    """
    ta = _torchattacks()
    s = settings
    centred = Centred(model, x, eps / Z_EPS)  # k·½ = ε per sample
    z0 = torch.full_like(x, 0.5)
    with _fork_rng(x.device):
        torch.manual_seed(s.seed + run)
        if attack == "pgd-l2":
            atk = ta.PGDL2(centred, eps=Z_EPS, alpha=2.5 * Z_EPS / s.steps,
                           steps=s.steps, random_start=True)
            z = atk(z0, y)
        elif attack == "apgd":
            atk = ta.APGD(centred, norm="L2", eps=Z_EPS, steps=s.steps,
                          seed=s.seed + run)
            z = atk.attack_single_run(z0, y)[3]
        elif attack == "apgd-t":
            atk = ta.APGDT(centred, norm="L2", eps=Z_EPS, steps=s.steps,
                           seed=s.seed)
            atk.target_class = run + 2
            z = atk.attack_single_run(z0, y)[3]
        else:
            raise ValueError(f"attack {attack!r} has no per-sample ε")
    return centred.image(z.detach().to(x.dtype))


def _cw(model: nn.Module, x: Tensor, y: Tensor, c: float,
        settings: RadiusSettings) -> Tensor:
    # CW in centred variables with k = 2: every pixel can cross the whole box.
    ta = _torchattacks()
    centred = Centred(model, x, torch.full((x.shape[0],), 2.0, dtype=x.dtype,
                                           device=x.device))
    atk = ta.CW(centred, c=c, kappa=0.0, steps=settings.cw_steps, lr=0.01)
    z = atk(torch.full_like(x, 0.5), y)
    return centred.image(z.detach().to(x.dtype))


def _runs(attack: str, s: RadiusSettings, n_classes: int) -> int:
    if attack == "apgd-t":
        return min(s.targets, n_classes - 1)
    return s.restarts if attack in ("pgd-l2", "apgd") else 1


class _Closest:
    """Per sample, the closest verified adversarial point so far (``hi``)."""

    def __init__(self, x: Tensor, y: Tensor, model: nn.Module, batch_size: int):
        self.x, self.y, self.model, self.batch_size = x, y, model, batch_size
        n = x.shape[0]
        self.hi = torch.full((n,), float("inf"), dtype=torch.float64, device=x.device)
        self.x_adv = x.clone()
        self.attack = [NONE] * n

    def offer(self, idx: Tensor, x_adv: Tensor, name: str) -> Tensor:
        """Keep the points ``x_adv`` of samples ``idx`` that are misclassified and
        closer than ``hi``; returns the ``(len(idx),)`` bool mask of successes."""
        wrong = _predict(self.model, x_adv, self.batch_size) != self.y[idx]
        dist = perturbation_norm((x_adv - self.x[idx]).double(), "l2")  # (b,)
        better = wrong & (dist < self.hi[idx])
        for i in idx[better].tolist():
            self.attack[i] = name
        self.hi[idx[better]] = dist[better]
        self.x_adv[idx[better]] = x_adv[better]
        return wrong


@with_fixed_weights
def attack_radius(model: nn.Module, x: Tensor, y: Tensor,
                  settings: RadiusSettings | None = None,
                  progress: Callable[[int, int], None] | None = None,
                  ) -> RadiusResult:
    """Smallest adversarial ℓ2 radius per sample, worst case over attacks.

    Args:
        model: classifier on images in ``[0, 1]`` (switched to eval mode); all
            computations run in its dtype (float64 to match ``lipvit certify``).
        x: images ``(n, C, S, S)`` in ``[0, 1]``. y: labels ``(n,)``.
        settings: :class:`RadiusSettings` (defaults if ``None``).
        progress: called after CW and after each bisection step with
            ``(samples finished, step)``.

    Returns:
        :class:`RadiusResult`; ``radius`` is an **upper bound** of each sample's
        true robust radius (a verified adversarial point at that distance).
    """
    s = settings or RadiusSettings()
    if x.ndim != 4 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise ValueError(f"expected images (n, C, S, S) and labels (n,), got "
                         f"{tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[0] == 0:
        raise ValueError("no samples to attack")
    if float(x.min()) < 0 or float(x.max()) > 1:
        raise ValueError("images must lie in [0, 1] (models normalise inside)")
    start = time.perf_counter()
    model.eval()
    param = next(model.parameters())
    x, y = x.to(device=param.device, dtype=param.dtype), y.to(param.device)
    n = x.shape[0]
    max_radius = s.max_radius or float(x.shape[1:].numel() ** 0.5)  # box diagonal
    pred = _predict(model, x, s.batch_size)
    correct = pred == y  # (n,)
    first = first_order_limit(model, x, y, s.batch_size)  # (n,)
    closest = _Closest(x, y, model, s.batch_size)
    closest.hi[~correct] = 0.0
    for i in (~correct).nonzero()[:, 0].tolist():
        closest.attack[i] = CLEAN
    lo = torch.zeros(n, dtype=torch.float64, device=x.device)
    probes = torch.zeros(n, dtype=torch.long, device=x.device)
    n_classes = _num_classes(model, x)
    todo = correct.nonzero()[:, 0]

    def batches(idx: Tensor):
        for i in range(0, idx.numel(), s.batch_size):
            yield idx[i:i + s.batch_size]

    if "cw" in s.attacks:
        for c in s.cw_c:
            for b in batches(todo):
                closest.offer(b, _cw(model, x[b], y[b], c, s), "cw")
    eps_attacks = [a for a in s.attacks if a != "cw"]

    def open_mask() -> Tensor:
        hi = closest.hi
        wide = torch.isinf(hi) | (hi - lo > s.rtol * hi)
        return correct & wide & (lo < max_radius)

    if progress is not None:
        progress(int((~open_mask()).sum()), 0)
    for step in range(1, MAX_PROBES + 1):
        active = open_mask() if eps_attacks else torch.zeros_like(correct)
        idx = active.nonzero()[:, 0]
        if not idx.numel():
            break
        hi, lo_i = closest.hi[idx], lo[idx]
        grow = torch.where(lo_i > 0, 2 * lo_i,
                           first[idx].clamp(min=1e-6 * max_radius))
        probe = torch.where(torch.isinf(hi), grow, (lo_i + hi) / 2).clamp(
            max=max_radius)  # (b,)
        broken = torch.zeros(idx.numel(), dtype=torch.bool, device=x.device)
        for name in eps_attacks:
            for run in range(_runs(name, s, n_classes)):
                for pos in batches(torch.arange(idx.numel(), device=x.device)):
                    b = idx[pos]
                    eps = probe[pos].to(x.dtype)
                    x_adv = perturb_per_sample(model, x[b], y[b], eps, name, s, run)
                    broken[pos] |= closest.offer(b, x_adv, name)
        lo[idx[~broken]] = probe[~broken]
        lo.copy_(torch.minimum(lo, closest.hi))
        probes[idx] += 1
        if progress is not None:
            progress(int((~open_mask()).sum()), step)

    verified = _verify(model, x, y, closest, s.batch_size)
    return RadiusResult(
        labels=y.cpu().numpy(), predictions=pred.cpu().numpy(),
        radius=closest.hi.cpu().numpy(), attack=list(closest.attack),
        x_adv=closest.x_adv.detach(), verified=verified,
        bracket_low=lo.cpu().numpy(), first_order=first.cpu().numpy(),
        probes=probes.cpu().numpy(), seconds=time.perf_counter() - start,
        settings={**asdict(s), "max_radius": max_radius},
    )


def _verify(model: nn.Module, x: Tensor, y: Tensor, closest: _Closest,
            batch_size: int) -> np.ndarray:
    """Re-check every kept point: misclassified (or the clean image of a
    misclassified sample), in the box, at exactly the reported distance."""
    pred = _predict(model, closest.x_adv, batch_size)
    flat = closest.x_adv.reshape(x.shape[0], -1)  # (n, C·S·S)
    in_box = (flat.amin(dim=1) >= 0) & (flat.amax(dim=1) <= 1) if flat.numel() \
        else torch.ones(0, dtype=torch.bool)
    dist = perturbation_norm((closest.x_adv - x).double(), "l2")
    found = torch.isfinite(closest.hi)
    ok = (pred != y) & in_box & (dist == torch.where(found, closest.hi, dist))
    return (ok | ~found).cpu().numpy()


def summary(result: RadiusResult) -> dict[str, Any]:
    """Medians over the correctly classified samples with a radius found, and the
    count of samples each attack gave the closest point for."""
    ok = result.correct & np.isfinite(result.radius)
    wins = {a: int(sum(1 for i, w in enumerate(result.attack) if w == a and ok[i]))
            for a in result.settings.get("attacks", RADIUS_ATTACKS)}
    return {
        "n": result.n,
        "clean_accuracy": float(result.correct.mean()) if result.n else None,
        "n_radius": int(ok.sum()),
        "n_not_found": int((result.correct & ~np.isfinite(result.radius)).sum()),
        "median_radius": float(np.median(result.radius[ok])) if ok.any() else None,
        "median_first_order": float(np.median(result.first_order[ok]))
        if ok.any() else None,
        "closest_by_attack": wins,
        "all_verified": bool(result.verified.all()),
        "seconds_per_sample": result.seconds / max(result.n, 1),
    }
