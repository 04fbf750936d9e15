"""Empirical robustness: robust accuracy under torchattacks attacks.

Every attack is used through torchattacks' uniform call shape
``Attack(model, eps=...)(images, labels)`` on images in ``[0, 1]`` (lipvit
models normalise inside). An attack only *finds* adversarial points, so a robust
accuracy here is an **upper bound** of the true robust accuracy (an empirical
ceiling for certified accuracy), never a certificate.

Registry (``ATTACKS``; *norms*: the threat models an attack runs in):

=============  ======  =================================================================
name           norms   what runs
=============  ======  =================================================================
``fgsm``       linf    ``torchattacks.FGSM`` (Goodfellow et al. 2015), one signed step
``pgd``        linf    ``torchattacks.PGD`` (Madry et al. 2018), ``steps`` signed steps
``pgd-l2``     l2      ``torchattacks.PGDL2``, ``steps`` normalised-gradient steps
``cw``         l2 linf ``torchattacks.CW`` (Carlini & Wagner 2017, ℓ2, fixed ``c``)
``cw-pgd``     linf    :class:`CWLinf`: PGD on the CW margin loss ("CW-20" of the
                       adversarial-training tables, Mo et al. 2022 code)
``autoattack`` linf l2 ``torchattacks.AutoAttack`` version ``standard`` with the
                       original iteration counts of Croce & Hein (2020)
=============  ======  =================================================================

Admissibility. Every adversarial point is checked against the threat model:
``x' ∈ [0, 1]`` and ``‖x' − x‖_p ≤ ε`` (up to rounding, see :func:`admissible`). A point
outside the ball does **not** count as a success; such points are counted in
``AttackResult.rejected``. This is how ``cw`` is treated: torchattacks' CW
minimises ``‖δ‖_2² + c·margin`` with no ε ball, so a CW success counts only if
its perturbation norm (ℓ2, or ℓ∞ under ``norm="linf"``) is ``≤ ε``. CW works
in tanh space, where pixels exactly at 0 or 1 cannot move: on images with
saturated pixels (digits) it is a weak attack; ``pgd-l2`` is the reference ℓ2
attack. For every other attack a rejected point would be a bug and is reported.

Per sample: a misclassified clean point counts as broken by every attack and is
not attacked; ``restarts`` repeats a randomised attack with seeds ``seed + r``
and a sample survives only if it survives every restart.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from lipvit.certify.certification import margin as certification_margin
from lipvit.certify.eps import check_eps
from torch import Tensor, nn
from torch.nn.utils import parametrize

from lipvit.errors import LipvitError

Norm = Literal["linf", "l2"]
NORMS: tuple[str, ...] = ("linf", "l2")

# Keys accepted in ``**settings`` (anything else is a typo and an error).
DEFAULT_SETTINGS: dict[str, Any] = {
    "steps": 20,  # iterations of pgd, pgd-l2, cw-pgd; 100 for cw unless given
    "alpha": None,  # step size; None: 2.5 ε / steps (Madry et al. 2018)
    "random_start": True,
    "restarts": 1,
    "c": 1.0,  # cw: weight of the margin term
    "kappa": 0.0,  # cw: confidence
    "lr": 0.01,  # cw: Adam learning rate
    "seed": 0,
    "batch_size": 256,
}
CW_DEFAULT_STEPS = 100

# Original AutoAttack "standard" settings (Croce & Hein 2020, fra31/auto-attack):
# APGD-CE, APGD-T and FAB-T with 100 iterations, one restart, 9 target classes;
# Square with 5000 queries. torchattacks' AutoAttack builds its parts with 10
# iterations; ``_autoattack`` restores these counts.
AUTOATTACK_STEPS = 100
AUTOATTACK_SQUARE_QUERIES = 5000
AUTOATTACK_TARGET_CLASSES = 9


def _torchattacks():
    """Import torchattacks, or explain in one line how to install it."""
    try:
        return importlib.import_module("torchattacks")
    except ImportError:
        raise LipvitError(
            "torchattacks is not installed: pip install --no-deps torchattacks==3.5.1 "
            "(its metadata pins torchvision and requests~=2.25.1, which it does not "
            "need; it imports numpy, scipy and tqdm)") from None


@functools.cache
def _cw_linf_class() -> type:
    # Defined on first use so that importing this module does not import
    # torchattacks (it takes seconds and is optional for the rest of lipvit).
    ta = _torchattacks()

    class CWLinf(ta.attack.Attack):
        r"""PGD on the Carlini–Wagner margin loss in an ℓ∞ ball ("CW-k").

        The "CW-20" column of SpecFormer's adversarial-training tables (which
        follow Mo et al. 2022, whose code runs this attack) is not the ℓ2 CW
        optimisation but ``k`` signed-gradient ascent steps on the margin
        ``max_{j≠y} z_j − z_y`` projected onto ``‖δ‖_∞ ≤ ε`` and ``[0, 1]``, from a
        uniform random start. Unlike that code the margin is not clipped (a clip
        stops the gradient on confidently classified points).

        Arguments:
            model: classifier on images in ``[0, 1]``.
            eps: ℓ∞ radius. alpha: step size. steps: iterations.
            random_start: start at a uniform point of the ball.
        """

        def __init__(self, model: nn.Module, eps: float = 8 / 255,
                     alpha: float = 2 / 255, steps: int = 20,
                     random_start: bool = True):
            super().__init__("CWLinf", model)
            self.eps, self.alpha, self.steps = eps, alpha, steps
            self.random_start = random_start
            self.supported_mode = ["default"]

        def forward(self, images: Tensor, labels: Tensor) -> Tensor:
            images = images.clone().detach().to(self.device)
            labels = labels.clone().detach().to(self.device)
            adv = images.clone()
            if self.random_start:
                noise = torch.empty_like(adv).uniform_(-self.eps, self.eps)
                adv = (adv + noise).clamp(0, 1)
            for _ in range(self.steps):
                adv.requires_grad_(True)
                loss = margin(self.get_logits(adv), labels).sum()
                (grad,) = torch.autograd.grad(loss, adv)
                adv = adv.detach() + self.alpha * grad.sign()
                adv = (images + (adv - images).clamp(-self.eps, self.eps)).clamp(0, 1)
            return adv.detach()

    return CWLinf


def __getattr__(name: str) -> Any:
    if name == "CWLinf":  # the class of the ``cw-pgd`` attack, built lazily
        return _cw_linf_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def margin(logits: Tensor, labels: Tensor) -> Tensor:
    """CW margin ``max_{j≠y} z_j − z_y`` per sample ``(B,)``; > 0: misclassified.

    The negated certification margin :func:`lipvit.certify.certification.margin`.
    """
    return -certification_margin(logits, labels)


@dataclass(frozen=True)
class AttackSpec:
    """One registry entry: the norms it attacks in and how to build it."""

    name: str
    norms: tuple[str, ...]
    build: Callable[[nn.Module, float, str, Mapping[str, Any]], Any]
    randomised: bool
    description: str


def _alpha(eps: float, s: Mapping[str, Any]) -> float:
    return s["alpha"] if s["alpha"] is not None else 2.5 * eps / max(s["steps"], 1)


def _autoattack(model: nn.Module, eps: float, norm: str, s: Mapping[str, Any]):
    ta = _torchattacks()
    n_classes = int(s["n_classes"])
    atk = ta.AutoAttack(
        model, norm={"linf": "Linf", "l2": "L2"}[norm], eps=eps, version="standard",
        n_classes=n_classes, seed=s["seed"])
    # (apgd-ce, apgd-t, fab-t, square) inside a MultiAttack, each with 10 steps:
    # restore the original counts (fewer targets only with fewer than 10 classes).
    targets = min(AUTOATTACK_TARGET_CLASSES, n_classes - 1)
    for part in atk._autoattack.attacks:
        if isinstance(part, ta.Square):
            part.n_queries = AUTOATTACK_SQUARE_QUERIES
        else:
            part.steps = AUTOATTACK_STEPS
        if isinstance(part, ta.APGDT | ta.FAB):
            part.n_target_classes = targets
        part.n_restarts = 1
    return atk


ATTACKS: dict[str, AttackSpec] = {
    spec.name: spec for spec in (
        AttackSpec("fgsm", ("linf",), lambda m, e, n, s: _torchattacks().FGSM(m, eps=e),
                   False, "FGSM, one signed-gradient step (Goodfellow et al. 2015)"),
        AttackSpec("pgd", ("linf",),
                   lambda m, e, n, s: _torchattacks().PGD(
                       m, eps=e, alpha=_alpha(e, s), steps=s["steps"],
                       random_start=s["random_start"]),
                   True, "PGD, ℓ∞, cross-entropy (Madry et al. 2018)"),
        AttackSpec("pgd-l2", ("l2",),
                   lambda m, e, n, s: _torchattacks().PGDL2(
                       m, eps=e, alpha=_alpha(e, s), steps=s["steps"],
                       random_start=s["random_start"]),
                   True, "PGD, ℓ2, cross-entropy"),
        AttackSpec("apgd", ("linf", "l2"),
                   lambda m, e, n, s: _torchattacks().APGD(
                       m, norm={"linf": "Linf", "l2": "L2"}[n], eps=e,
                       steps=s["steps"], n_restarts=1, seed=s["seed"]),
                   False, "APGD, cross-entropy, step size adapted (Croce & Hein 2020)"),
        AttackSpec("cw", ("l2", "linf"),
                   lambda m, e, n, s: _torchattacks().CW(
                       m, c=s["c"], kappa=s["kappa"], steps=s["cw_steps"], lr=s["lr"]),
                   False, "Carlini–Wagner ℓ2; success only if ‖δ‖ ≤ ε"),
        AttackSpec("cw-pgd", ("linf",),
                   lambda m, e, n, s: _cw_linf_class()(
                       m, eps=e, alpha=_alpha(e, s), steps=s["steps"],
                       random_start=s["random_start"]),
                   True, "PGD on the CW margin loss, ℓ∞ (CW-k of Mo et al. 2022)"),
        AttackSpec("autoattack", ("linf", "l2"), _autoattack, False,
                   "AutoAttack standard, original counts (Croce & Hein 2020)"),
    )
}


@dataclass(frozen=True)
class AttackPreset:
    """Attack settings of a published table."""

    attacks: tuple[str, ...]
    eps: float
    norm: Norm
    settings: Mapping[str, Any]
    description: str


# SpecFormer §6.1: "FGSM and PGD-2 attacks for standard training, with an attack
# radius of 2/255. For adversarial training, CW-20 and PGD-20, radius 8/255; we
# also evaluate AutoAttack." Step sizes are not stated; SpecFormer follows the
# training strategy of Mo et al. (2022), whose code uses α = 2/255 and a random
# start, which we take for both presets.
ATTACK_PRESETS: dict[str, AttackPreset] = {
    "specformer-st": AttackPreset(
        ("fgsm", "pgd"), 2 / 255, "linf", {"steps": 2, "alpha": 2 / 255},
        "SpecFormer standard training: FGSM, PGD-2 (α=2/255), ε=2/255, ℓ∞"),
    "specformer-at": AttackPreset(
        ("pgd", "cw-pgd", "autoattack"), 8 / 255, "linf",
        {"steps": 20, "alpha": 2 / 255},
        "SpecFormer adversarial training: PGD-20, CW-20 (α=2/255), AutoAttack, "
        "ε=8/255, ℓ∞"),
}


#: The per-sample worst case over the attacks run (a row of every result).
WORST = "worst-case"


@dataclass(frozen=True, eq=False)
class AttackResult:
    """Robust accuracy of one model at one ε under several attacks.

    Arrays are per sample, in the order of the inputs (``n`` samples).

    Attributes:
        eps: radius ε. norm: ``"linf"`` or ``"l2"``.
        attacks: attack names, in the order run.
        labels: ``(n,)`` true labels. clean_prediction: ``(n,)``.
        clean_correct: ``(n,)`` bool, clean point classified correctly.
        correct: attack → ``(n,)`` bool, still correct after that attack.
        worst_case: ``(n,)`` bool, correct under every attack (per-sample
            worst case over attacks).
        rejected: attack → number of returned points outside the threat model,
            summed over restarts (not counted as successes; expected for
            ``cw``, which has no ε ball, a bug for any other attack).
        seconds: attack → wall time spent in it.
        settings: the settings used (defaults filled in).
    """

    eps: float
    norm: str
    attacks: tuple[str, ...]
    labels: np.ndarray
    clean_prediction: np.ndarray
    clean_correct: np.ndarray
    correct: Mapping[str, np.ndarray]
    worst_case: np.ndarray
    rejected: Mapping[str, int]
    seconds: Mapping[str, float]
    settings: Mapping[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(self.labels.shape[0])

    @property
    def clean_accuracy(self) -> float:
        return float(self.clean_correct.mean())

    @property
    def robust_accuracy(self) -> dict[str, float]:
        """Attack → fraction of samples still correct (an upper bound of the truth)."""
        return {name: float(c.mean()) for name, c in self.correct.items()}

    @property
    def worst_case_accuracy(self) -> float:
        return float(self.worst_case.mean())

    def to_records(self) -> list[dict[str, Any]]:
        """One plain dict per attack and one for the :data:`WORST` case: robust
        accuracy, seconds per sample and rejected points at this ε."""
        n = max(self.n, 1)
        rows = [{"attack": name, "norm": self.norm, "eps": self.eps,
                 "robust_accuracy": acc, "n": self.n,
                 "seconds_per_sample": self.seconds[name] / n,
                 "rejected": self.rejected[name]}
                for name, acc in self.robust_accuracy.items()]
        rows.append({"attack": WORST, "norm": self.norm, "eps": self.eps,
                     "robust_accuracy": self.worst_case_accuracy, "n": self.n,
                     "seconds_per_sample": sum(self.seconds.values()) / n,
                     "rejected": sum(self.rejected.values())})
        return rows


def sample_records(results: Sequence[AttackResult],
                   index: Sequence[int]) -> list[dict[str, Any]]:
    """One plain dict per sample of ``results`` (the same samples at several ε):
    its test-set ``index``, label, clean prediction and whether it is still
    correct after each attack at each ε (``"<attack>@<eps>"``, :data:`WORST`
    included)."""
    first = results[0]
    samples = []
    for i in range(first.n):
        correct = {f"{a}@{r.eps}": bool(r.correct[a][i])
                   for r in results for a in r.attacks}
        correct.update({f"{WORST}@{r.eps}": bool(r.worst_case[i]) for r in results})
        samples.append({"index": int(index[i]), "label": int(first.labels[i]),
                        "prediction": int(first.clean_prediction[i]),
                        "correct": correct})
    return samples


def resolve_settings(attacks: Sequence[str], norm: str,
                     **settings: Any) -> dict[str, Any]:
    """Validate attack names, norm and settings; fill in defaults.

    Raises:
        ValueError: unknown attack, an attack that does not attack in ``norm``,
            an unknown setting key, or a bad value.
    """
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
    if not attacks:
        raise ValueError("give at least one attack")
    for name in attacks:
        if name not in ATTACKS:
            raise ValueError(
                f"unknown attack {name!r}; choose from {', '.join(ATTACKS)}")
        if norm not in ATTACKS[name].norms:
            fits = [a for a, s in ATTACKS.items() if norm in s.norms]
            raise ValueError(f"attack {name!r} does not attack in {norm}; "
                             f"{norm} attacks: {', '.join(fits)}")
    if len(set(attacks)) != len(attacks):
        raise ValueError(f"attack listed twice: {list(attacks)}")
    allowed = set(DEFAULT_SETTINGS) | {"cw_steps", "n_classes"}
    unknown = set(settings) - allowed
    if unknown:
        raise ValueError(f"unknown attack settings {sorted(unknown)}; "
                         f"known: {', '.join(sorted(allowed))}")
    s = {**DEFAULT_SETTINGS, **{k: v for k, v in settings.items() if v is not None}}
    s.setdefault("cw_steps", settings.get("steps") or CW_DEFAULT_STEPS)
    for key in ("steps", "cw_steps", "restarts", "batch_size"):
        if not isinstance(s[key], int | np.integer) or s[key] < 1:
            raise ValueError(f"{key} must be a positive integer, got {s[key]!r}")
    if s["alpha"] is not None and not (np.isfinite(s["alpha"]) and s["alpha"] > 0):
        raise ValueError(f"alpha must be a positive number, got {s['alpha']}")
    return s


def build_attack(name: str, model: nn.Module, eps: float, norm: str = "linf",
                 **settings: Any) -> Any:
    """Construct registered attack ``name`` for ``model`` at radius ``eps``.

    ``settings`` as in :func:`robust_accuracy`; ``n_classes`` is needed by
    ``autoattack``.
    """
    eps = check_eps(eps)
    s = resolve_settings([name], norm, **settings)
    if name == "autoattack" and "n_classes" not in s:
        raise ValueError("autoattack needs n_classes")
    return ATTACKS[name].build(model, eps, norm, s)


def perturbation_norm(delta: Tensor, norm: str) -> Tensor:
    """Per-sample ``‖δ‖_∞`` or ``‖δ‖_2`` of the flattened perturbation, ``(B,)``."""
    flat = delta.reshape(delta.shape[0], -1)  # (B, C·S·S)
    if norm == "linf":
        return flat.abs().amax(dim=1)
    return torch.linalg.vector_norm(flat, dim=1)


def admissible(x: Tensor, x_adv: Tensor, eps: float, norm: str) -> Tensor:
    """``(B,)`` bool: ``x_adv ∈ [0, 1]`` and ``‖x_adv − x‖ ≤ ε``, up to rounding.

    Tolerance: ``1e-5 ε`` plus float32 rounding of the pixels (``1e-6`` per
    pixel, ``1e-6 √dim`` for ℓ2).
    """
    flat = x_adv.reshape(x_adv.shape[0], -1)  # (B, C·S·S)
    tol = 1e-5 * eps + 1e-6 * (flat.shape[1] ** 0.5 if norm == "l2" else 1.0)
    dist = perturbation_norm((x_adv - x).double(), norm)
    in_box = (flat.amin(dim=1) >= -1e-6) & (flat.amax(dim=1) <= 1 + 1e-6)
    return (dist <= eps + tol) & in_box


@contextmanager
def fixed_weights(model: nn.Module) -> Iterator[None]:
    """For an attack's duration, ``model``'s parametrised weights computed once
    (:func:`torch.nn.utils.parametrize.cached`: a lipschitz model's spectral
    and orthogonal parametrisations are otherwise recomputed at every forward
    pass: 1.5× PGD's time on 60 points of the Fashion-MNIST CaiT, about 6× on
    6) and its parameters out of autograd (attacks differentiate the images
    only); restored after."""
    grads = [q for q in model.parameters() if q.requires_grad]
    for q in grads:
        q.requires_grad_(False)
    try:
        with parametrize.cached():
            yield
    finally:
        for q in grads:
            q.requires_grad_(True)


def with_fixed_weights(fn: Callable) -> Callable:
    """``fn(model, ...)`` run under :func:`fixed_weights` of its model."""
    @functools.wraps(fn)
    def run(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with fixed_weights(model):
            return fn(model, *args, **kwargs)
    return run


def _predict(model: nn.Module, x: Tensor, batch_size: int) -> Tensor:
    with torch.no_grad():
        return torch.cat([model(x[i:i + batch_size]).argmax(dim=1)
                          for i in range(0, x.shape[0], batch_size)])


def _fork_rng(device: torch.device):
    devices = [device] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices)


@with_fixed_weights
def perturb(model: nn.Module, x: Tensor, y: Tensor, attack: str, eps: float,
            norm: str = "linf", **settings: Any) -> Tensor:
    """Adversarial images ``(B, C, S, S)`` from one attack, batched and seeded.

    Runs on every input (correctly classified or not). The global RNG state is
    untouched (a forked RNG seeded with ``settings["seed"]``). Points are *not*
    filtered for admissibility here; see :func:`admissible`.
    """
    eps = check_eps(eps)
    s = resolve_settings([attack], norm, **settings)
    model.eval()
    device = next(model.parameters()).device
    x, y = x.to(device), y.to(device)
    if attack == "autoattack":
        s.setdefault("n_classes", _num_classes(model, x))
    atk = ATTACKS[attack].build(model, eps, norm, s)
    out = []
    with _fork_rng(device):
        torch.manual_seed(s["seed"])
        for i in range(0, x.shape[0], s["batch_size"]):
            out.append(atk(x[i:i + s["batch_size"]], y[i:i + s["batch_size"]]).detach())
    return torch.cat(out) if out else x.clone()


def _num_classes(model: nn.Module, x: Tensor) -> int:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "num_classes"):
        return int(cfg.num_classes)
    with torch.no_grad():
        return int(model(x[:1]).shape[1])


@with_fixed_weights
def robust_accuracy(model: nn.Module, x: Tensor, y: Tensor, attacks: Sequence[str],
                    eps: float, norm: Norm = "linf", progress: bool = False,
                    **settings: Any) -> AttackResult:
    """Robust accuracy per attack and per-sample worst case over attacks.

    Args:
        model: classifier on images in ``[0, 1]`` (switched to eval mode).
        x: images ``(n, C, S, S)`` in ``[0, 1]``. y: labels ``(n,)``.
        attacks: names from :data:`ATTACKS`, all attacking in ``norm``.
        eps: radius ε ≥ 0 of the ``norm`` ball.
        norm: ``"linf"`` or ``"l2"`` threat model.
        progress: a tqdm bar over attacks and restarts.
        **settings: ``steps`` (pgd, pgd-l2, cw-pgd; also cw unless ``cw_steps``),
            ``alpha`` (step size, default ``2.5 ε / steps``), ``random_start``,
            ``restarts`` (randomised attacks), ``c``, ``kappa``, ``lr`` (cw),
            ``seed``, ``batch_size``, ``n_classes`` (autoattack; default from
            the model). AutoAttack ignores ``steps``: it keeps the original
            counts.

    Returns:
        :class:`AttackResult`. Robust accuracies are upper bounds of the true
        robust accuracy; ``worst_case ≤`` every attack's, ``≤`` clean accuracy.
    """
    eps = check_eps(eps)
    s = resolve_settings(list(attacks), norm, **settings)
    if x.ndim != 4 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise ValueError(f"expected images (n, C, S, S) and labels (n,), got "
                         f"{tuple(x.shape)} and {tuple(y.shape)}")
    if x.numel() and (float(x.min()) < 0 or float(x.max()) > 1):
        raise ValueError("images must lie in [0, 1] (models normalise inside)")
    model.eval()
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    x, y = x.to(device=device, dtype=dtype), y.to(device)
    pred = _predict(model, x, s["batch_size"])
    clean = pred == y  # (n,)
    idx = clean.nonzero()[:, 0]  # only correctly classified points are attacked
    if "autoattack" in attacks and x.shape[0]:
        s.setdefault("n_classes", _num_classes(model, x))

    correct: dict[str, np.ndarray] = {}
    rejected: dict[str, int] = {}
    seconds: dict[str, float] = {}
    jobs = [(a, r) for a in attacks
            for r in range(s["restarts"] if ATTACKS[a].randomised else 1)]
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(jobs), desc=f"attacks ε={eps:.4g}", leave=False,
                   disable=None)  # quiet where stderr is not a terminal
    for name in attacks:
        survived = clean.clone()
        n_rejected = 0
        start = time.perf_counter()
        for a, r in jobs:
            if a != name:
                continue
            if idx.numel():
                x_adv = perturb(model, x[idx], y[idx], name, eps, norm,
                                **{**s, "seed": s["seed"] + r})
                ok = admissible(x[idx], x_adv, eps, norm)
                broken = (_predict(model, x_adv, s["batch_size"]) != y[idx]) & ok
                survived[idx[broken]] = False
                n_rejected += int((~ok).sum())
            if bar is not None:
                bar.update(1)
        seconds[name] = time.perf_counter() - start
        correct[name] = survived.cpu().numpy()
        rejected[name] = n_rejected
    if bar is not None:
        bar.close()
    worst = np.logical_and.reduce([clean.cpu().numpy(), *correct.values()])
    return AttackResult(
        eps=eps, norm=norm, attacks=tuple(attacks), labels=y.cpu().numpy(),
        clean_prediction=pred.cpu().numpy(), clean_correct=clean.cpu().numpy(),
        correct=correct, worst_case=worst, rejected=rejected, seconds=seconds,
        settings=s,
    )
