"""Randomized smoothing: a probabilistic certificate of the *smoothed* classifier.

Cohen, Rosenfeld & Kolter, "Certified Adversarial Robustness via Randomized
Smoothing", ICML 2019. The smoothed classifier of a base classifier ``f`` is

    g(x) = argmax_c P(f(x + δ) = c),   δ ~ N(0, σ² I)            (Cohen eq. 1)

and Theorem 1 says that if ``P(f(x + δ) = c_A) ≥ p_A ≥ 1/2`` then ``g(x') =
c_A`` for every ``‖x' − x‖₂ < σ Φ⁻¹(p_A)``. ``p_A`` is not known: CERTIFY (§3.2,
its pseudocode) selects ``ĉ_A`` from ``n0`` noisy copies, counts ``n_A`` hits
of it among ``n`` fresh copies and takes the one-sided Clopper–Pearson lower
bound ``p̲_A`` at level ``1 − α``; below ``1/2`` it abstains. With probability
at least ``1 − α`` over its noise, a class it returns is ``g(x)`` and ``g`` is
constant on the ball of radius ``σ Φ⁻¹(p̲_A)`` (Cohen Prop. 2 and §3.2).

What this is and is not. The guarantee is **probabilistic** (each point fails
with probability up to ``α``, independently of the others) and it holds for
``g``, **not** for the network ``f`` itself, whose own radius may be far
smaller. It is therefore never mixed with the deterministic certificates of
the other methods: records say ``guarantee = "probabilistic"`` and
``exact = false``.

=========  ==============  ===================================================
symbol     variable        source
=========  ==============  ===================================================
σ          ``sigma``       noise standard deviation, pixels in [0, 1] (eq. 1)
n0         ``n0``          selection draws (CERTIFY)
n          ``n_noise``     estimation draws (CERTIFY)
α          ``alpha``       failure probability per point (CERTIFY)
ĉ_A        ``selected``    the class most often hit in the selection draws
n_A        ``counts[ĉ_A]`` estimation draws classified ĉ_A
p̲_A        ``p_lower``     Clopper–Pearson lower bound, level 1 − α
R          ``radius``      σ Φ⁻¹(p̲_A), Theorem 1 with p̄_B = 1 − p̲_A
=========  ==============  ===================================================

The base classifier ``f`` is the model in float32 (a float32 checkpoint's
weights round-trip exactly through the float64 copy the other methods use),
argmax of the logits, evaluated under :func:`torch.inference_mode` on the
model's device, ``batch_size`` noisy copies per forward pass. Given the
points' test-set indices (``lipvit certify`` always passes them), every
point's noise comes from its own generator, seeded by ``(seed, index)``: a
point's result is reproducible and does not depend on which other points, or
which ``torchrun`` rank, share its run. Without indices, each call draws fresh
noise (:func:`call_seed`: a seed taken from torch's global generator), so two
calls, or two batches, never share their noise. Nothing is clipped to
``[0, 1]``, as in Cohen et al.

Shapes: ``B`` points, ``K`` classes, images ``(B, C, S, S)``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import Tensor, nn

GUARANTEE = "probabilistic"
"""The ``guarantee`` of a ``smoothing`` result row: a certificate of the smoothed
classifier that holds with probability ``≥ 1 − α`` per point."""


def _real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_noise(sigma: float, alpha: float) -> None:
    """Refuse (``ValueError``, one line) a noise σ that is not finite and
    positive, or a failure probability α outside ``(0, 1)``."""
    if not (_real(sigma) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"smoothing: sigma must be finite and > 0, got {sigma}")
    if not (_real(alpha) and 0 < alpha < 1):
        raise ValueError(f"smoothing: alpha must lie in (0, 1), got {alpha}")


@dataclass(frozen=True)
class SmoothingConfig:
    """Settings of CERTIFY (Cohen et al. 2019, §3.2), validated here.

    Attributes:
        sigma: noise standard deviation σ, pixels in ``[0, 1]``.
        n0: selection draws.
        n_noise: estimation draws ``n``.
        alpha: failure probability per point, in ``(0, 1)``.
        batch_size: noisy copies per forward pass.
        seed: seeds each point's noise together with its test-set index
            (or, without indices, with a draw of torch's global generator).
    """

    sigma: float
    n0: int = 100
    n_noise: int = 100_000
    alpha: float = 0.001
    batch_size: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        check_noise(self.sigma, self.alpha)
        for name, flag in (("n0", "--n0"), ("n_noise", "--n-noise"),
                           ("batch_size", "--batch-size"), ("seed", "--seed")):
            value = getattr(self, name)
            low = 0 if name == "seed" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"smoothing: {flag} must be an integer >= {low}, "
                                 f"got {value!r}")

    def describe(self) -> str:
        """The guarantee in words, for records and tables."""
        return (f"probabilistic: with probability >= 1 - alpha = {1 - self.alpha:g} "
                f"per point, for the smoothed classifier (Gaussian noise, sigma = "
                f"{self.sigma:g}), not for the network itself")


def clopper_pearson_lower(k: int, n: int, alpha: float) -> float:
    """One-sided Clopper–Pearson lower confidence bound of a binomial proportion.

    ``P(p ≥ bound) ≥ 1 − alpha`` for ``k`` successes in ``n`` trials: scipy's
    exact interval of the one-sided test (``binomtest(k, n, alternative=
    "greater").proportion_ci(1 − alpha, method="exact")``), which is
    ``Beta⁻¹(alpha; k, n − k + 1)`` (0 at ``k = 0``). Cohen et al.'s
    LowerConfBound.
    """
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"need 0 <= k <= n and n >= 1, got k={k}, n={n}")
    from scipy.stats import binomtest  # 0.7 s to import: not on every command's path

    ci = binomtest(int(k), int(n), alternative="greater").proportion_ci(
        confidence_level=1 - alpha, method="exact")
    return float(ci.low)


def smoothing_radius(p_lower: float, sigma: float) -> float:
    """``σ Φ⁻¹(p̲_A)``, Cohen Theorem 1 with ``p̄_B = 1 − p̲_A`` (scipy's
    ``norm.ppf``); 0 where ``p̲_A ≤ 1/2`` (CERTIFY abstains below 1/2)."""
    if not p_lower > 0.5:
        return 0.0
    from scipy.stats import norm  # as binomtest above

    return float(sigma * norm.ppf(p_lower))


def point_seed(seed: int, index: int) -> int:
    """The seed of one point's noise generator, from the run's seed and the
    point's test-set index (a NumPy ``SeedSequence`` mixes the two)."""
    state = np.random.SeedSequence([int(seed), int(index)]).generate_state(
        1, dtype=np.uint64)
    return int(state[0])


def call_seed(seed: int) -> int:
    """The seed of one call's noise generator when no indices are given: the
    run's ``seed`` mixed (NumPy ``SeedSequence``) with 63 bits drawn from
    torch's global generator, which advances with every call. Calls (and
    batches) draw independent noise; ``torch.manual_seed`` makes a sequence of
    calls reproducible. The third entropy word keeps these seeds apart from
    :func:`point_seed`'s."""
    draw = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    state = np.random.SeedSequence([int(seed), draw, 1]).generate_state(
        1, dtype=np.uint64)
    return int(state[0])


def base_classifier(model: nn.Module) -> nn.Module:
    """The base classifier ``f``: a private float32 copy of ``model`` in eval
    mode, without gradients (``model`` untouched)."""
    return copy.deepcopy(model).float().eval().requires_grad_(False)


def sample_counts(f: nn.Module, x: Tensor, num: int, sigma: float,
                  num_classes: int, batch_size: int, generator: torch.Generator,
                  progress: Callable[[int], None] | None = None) -> Tensor:
    """``(K,)`` int64 counts of ``argmax f(x + δ_i)`` over ``num`` draws
    ``δ_i ~ N(0, σ² I)`` (Cohen's SampleUnderNoise), ``batch_size`` at a time.

    Args:
        f: the base classifier (:func:`base_classifier`), on ``x``'s device.
        x: one image ``(C, S, S)``.
        generator: the noise's generator, on ``x``'s device.
        progress: called with the number of draws after each batch.
    """
    counts = torch.zeros(num_classes, dtype=torch.int64, device=x.device)
    done = 0
    with torch.inference_mode():
        while done < num:
            b = min(batch_size, num - done)
            noisy = torch.randn((b, *x.shape), generator=generator, device=x.device,
                                dtype=x.dtype).mul_(sigma).add_(x)  # (b, C, S, S)
            counts += torch.bincount(f(noisy).argmax(dim=1), minlength=num_classes)
            done += b
            if progress is not None:
                progress(b)
    return counts.cpu()


@dataclass(frozen=True, eq=False)
class SmoothingCertificate:
    """CERTIFY's outcome for ``B`` points (Cohen et al. 2019, §3.2).

    Attributes:
        config: the settings.
        selected: ``(B,)`` the class ``ĉ_A`` chosen from the ``n0`` draws.
        prediction: ``(B,)`` ``ĉ_A``, or −1 where CERTIFY abstains
            (``p̲_A ≤ 1/2``).
        counts: ``(B, K)`` estimation draws per class (``n_noise`` per row).
        p_lower: ``(B,)`` ``p̲_A``, the Clopper–Pearson lower bound of
            ``counts[ĉ_A]`` out of ``n_noise`` at level ``1 − α``.
        radius: ``(B,)`` ``σ Φ⁻¹(p̲_A)`` of the predicted class (0 on
            abstention): with probability ``≥ 1 − α``, ``g`` predicts
            ``prediction`` on the open ball of this radius. Whether that class
            is the label is :meth:`certified`'s business.
    """

    config: SmoothingConfig
    selected: Tensor
    prediction: Tensor
    counts: Tensor
    p_lower: Tensor
    radius: Tensor

    def correct(self, y: Tensor) -> Tensor:
        """``(B,)`` bool: the smoothed classifier predicts the label ``y`` (an
        abstention, −1, is never correct)."""
        return self.prediction == y.cpu()

    def accuracy(self, y: Tensor) -> float:
        """The smoothed classifier's accuracy on these points: the fraction
        whose prediction is the label ``y``, abstentions counting as wrong
        (NaN for no points)."""
        return float(self.correct(y).double().mean())

    @property
    def abstain_rate(self) -> float:
        """The fraction of the points where CERTIFY abstains (prediction −1;
        NaN for no points)."""
        return float((self.prediction < 0).double().mean())

    def certified(self, y: Tensor, eps: float) -> Tensor:
        """``(B,)`` bool: the smoothed classifier predicts the label ``y`` and its
        radius exceeds ``eps`` (Theorem 1's ball is open). An abstention or a
        wrong prediction is not certified."""
        return (self.prediction == y.cpu()) & (self.radius > eps)

    def certified_radius(self, y: Tensor) -> Tensor:
        """``(B,)`` the radius where the prediction is the label, else 0 (as the
        other methods' radii: a wrong or abstained point is certified nowhere)."""
        return torch.where(self.prediction == y.cpu(), self.radius,
                           torch.zeros_like(self.radius))

    def records(self) -> list[dict]:
        """One ``{"prediction", "counts", "p_lower", "radius", "selected"}`` per
        point (plain Python values): enough to recompute ``p_lower`` and the
        radius (:func:`recompute`)."""
        return [{"prediction": int(self.prediction[i]),
                 "counts": self.counts[i].tolist(),
                 "p_lower": float(self.p_lower[i]),
                 "radius": float(self.radius[i]),
                 "selected": int(self.selected[i])}
                for i in range(len(self.prediction))]

    def to_record(self) -> dict:
        """Plain Python values, for a shard file; :meth:`from_record` reads it."""
        return {"config": asdict(self.config), "selected": self.selected.tolist(),
                "prediction": self.prediction.tolist(),
                "counts": self.counts.tolist(), "p_lower": self.p_lower.tolist(),
                "radius": self.radius.tolist()}

    @classmethod
    def from_record(cls, record: dict) -> SmoothingCertificate:
        return cls.cat([record])

    @classmethod
    def cat(cls, records: Sequence[dict]) -> SmoothingCertificate:
        """One certificate from the :meth:`to_record` of consecutive shards (all
        with the same settings)."""
        configs = {tuple(sorted(r["config"].items())) for r in records}
        if len(configs) != 1:
            raise ValueError("smoothing shards made with different settings")

        def cat(key: str, dtype: torch.dtype) -> Tensor:
            rows = [v for r in records for v in r[key]]
            return torch.tensor(rows, dtype=dtype)

        counts = cat("counts", torch.int64)
        return cls(config=SmoothingConfig(**records[0]["config"]),
                   selected=cat("selected", torch.int64),
                   prediction=cat("prediction", torch.int64),
                   counts=counts.reshape(len(counts), -1),
                   p_lower=cat("p_lower", torch.float64),
                   radius=cat("radius", torch.float64))


def recompute(sample: dict, config: SmoothingConfig) -> tuple[float, float]:
    """``(p_lower, radius)`` of one point from its record's counts: what a reader
    of the JSON can check (the estimation draws of the predicted class, or of
    the selected one on abstention)."""
    counts = sample["counts"]
    if sum(counts) != config.n_noise:
        raise ValueError(f"counts sum to {sum(counts)}, not n_noise = "
                         f"{config.n_noise}")
    c = sample["prediction"] if sample["prediction"] >= 0 else sample["selected"]
    p = clopper_pearson_lower(counts[c], config.n_noise, config.alpha)
    return p, smoothing_radius(p, config.sigma)


def certify_smoothed(model: nn.Module, x: Tensor, config: SmoothingConfig, *,
                     num_classes: int | None = None,
                     index: Sequence[int] | None = None,
                     progress: Callable[[float], None] | None = None,
                     ) -> SmoothingCertificate:
    """Cohen et al.'s CERTIFY for every image of ``x`` ``(B, C, S, S)`` in [0, 1].

    Args:
        model: the network; its float32 copy is the base classifier
            (:func:`base_classifier`), on its own device.
        config: :class:`SmoothingConfig`.
        num_classes: ``K`` (default: the model's ``config.num_classes``).
        index: ``(B,)`` the points' test-set indices, which seed each point's
            noise with ``config.seed`` (:func:`point_seed`): reproducible, and
            independent of the batch a point is in. ``None``: fresh noise for
            this call (one generator seeded by :func:`call_seed`, drawn in
            order through the points), independent of every other call's, so
            the same image twice, in one call or in two, gets different noise.
        progress: called with fractions of a point as the draws go.

    Returns:
        :class:`SmoothingCertificate` (CPU tensors).
    """
    f = base_classifier(model)
    device = next(f.parameters(), torch.empty(0)).device
    x = x.to(device=device, dtype=torch.float32)
    K = num_classes if num_classes is not None else model.config.num_classes
    shared = None  # index None: one generator for the whole call
    if index is None:
        shared = torch.Generator(device=device)
        shared.manual_seed(call_seed(config.seed))
    else:
        index = [int(i) for i in index]
        if len(index) != len(x):
            raise ValueError(f"{len(index)} indices for {len(x)} images")
    per_point = config.n0 + config.n_noise
    advance = None if progress is None else (lambda b: progress(b / per_point))
    selected, prediction, counts, p_lower, radius = [], [], [], [], []
    for i in range(len(x)):
        if shared is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(point_seed(config.seed, index[i]))
        else:
            gen = shared
        first = sample_counts(f, x[i], config.n0, config.sigma, K,
                              config.batch_size, gen, advance)
        c = int(first.argmax())  # ties: the smallest class
        est = sample_counts(f, x[i], config.n_noise, config.sigma, K,
                            config.batch_size, gen, advance)
        p = clopper_pearson_lower(int(est[c]), config.n_noise, config.alpha)
        r = smoothing_radius(p, config.sigma)
        selected.append(c)
        prediction.append(c if p > 0.5 else -1)
        counts.append(est)
        p_lower.append(p)
        radius.append(r)
    return SmoothingCertificate(
        config=config,
        selected=torch.tensor(selected, dtype=torch.int64),
        prediction=torch.tensor(prediction, dtype=torch.int64),
        counts=torch.stack(counts) if counts else torch.zeros(0, K, dtype=torch.int64),
        p_lower=torch.tensor(p_lower, dtype=torch.float64),
        radius=torch.tensor(radius, dtype=torch.float64))


def predict_smoothed(f: nn.Module, x: Tensor, sigma: float, n: int, alpha: float,
                     num_classes: int, batch_size: int,
                     generator: torch.Generator) -> int:
    """Cohen et al.'s PREDICT for one image ``x`` ``(C, S, S)``: the top class of
    ``n`` noisy draws, or −1 (abstain) unless a two-sided binomial test of its
    count against the runner-up's rejects a tie at level ``alpha`` (scipy's
    ``binomtest``); a returned class is ``g(x)`` with probability ``≥ 1 − α``
    (Cohen Prop. 1). ``f``: :func:`base_classifier`."""
    counts = sample_counts(f, x, n, sigma, num_classes, batch_size, generator)
    top2 = counts.topk(2)
    n_a, n_b = int(top2.values[0]), int(top2.values[1])
    from scipy.stats import binomtest  # as in clopper_pearson_lower

    if binomtest(n_a, n_a + n_b, 0.5).pvalue > alpha:
        return -1
    return int(top2.indices[0])
