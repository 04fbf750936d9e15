"""The certification gap: certified radius against attack radius, per sample.

Joins the per-sample records of ``lipvit certify --radius --json`` (certified
radii per method: lower bounds of the true robust radius, or estimates for
methods marked ``exact: false``) with those of ``lipvit attack --radius
--json`` (the verified distance of the closest adversarial point: an upper
bound; and the first-order limit: an estimate) by sample index. For a sound
method ``certified ≤ true radius ≤ attack radius`` on every sample; the ratio
``certified / attack`` measures how much of the true radius a certificate
reaches (1 would be exact).

A ``smoothing`` radius (randomized smoothing, rows with ``guarantee =
"probabilistic"``) is the *smoothed* classifier's, with probability ``1 − α``;
the attack radius is the network's, so it may lie above it without any
contradiction: such methods are labelled and never counted as violations.

Medians are taken over the correctly classified samples with an adversarial
point found (``0 < attack < ∞``), uncertified samples counting with radius 0;
:func:`summary_rows` also gives them over the certified samples alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lipvit.errors import LipvitError


@dataclass(frozen=True, eq=False)
class Gap:
    """Joined per-sample arrays, ordered by sample index (``n`` samples)."""

    index: np.ndarray  # (n,) positions in the test split
    attack: np.ndarray  # (n,) attack radius (upper bound; 0 misclassified, inf none)
    first_order: np.ndarray  # (n,) first-order limit (estimate)
    certified: dict[str, np.ndarray]  # method -> (n,) certified radius
    estimates: frozenset[str]  # methods whose radii are estimates, not bounds
    # methods whose radii are the smoothed classifier's, with probability 1 - α
    probabilistic: frozenset[str] = frozenset()

    @property
    def usable(self) -> np.ndarray:
        """``(n,)`` bool: correctly classified with an adversarial point found."""
        return np.isfinite(self.attack) & (self.attack > 0)


@dataclass(frozen=True)
class GapRow:
    """Medians of one method over a set of samples (see the module note)."""

    method: str
    points: str  # "correct" or "certified"
    n: int
    median_certified: float | None
    median_attack: float | None
    median_ratio: float | None
    median_first_order: float | None
    estimate: bool
    probabilistic: bool = False

    @property
    def label(self) -> str:
        """The method as tables name it: ``(estimate)`` or ``(probabilistic:
        smoothed classifier)`` added where it is not a deterministic bound."""
        if self.probabilistic:
            return f"{self.method} (probabilistic: smoothed classifier)"
        return self.method + (" (estimate)" if self.estimate else "")


def _samples(data: Any, name: str, needs: tuple[str, ...]) -> dict[int, Mapping]:
    samples = data.get("samples") if isinstance(data, Mapping) else None
    if not isinstance(samples, list) or not samples or not all(
            isinstance(s, Mapping) and all(k in s for k in needs) for s in samples):
        raise LipvitError(f"{name}: no per-sample records with {', '.join(needs)}")
    by_index = {int(s["index"]): s for s in samples}
    if len(by_index) != len(samples):
        raise LipvitError(f"{name}: a sample index appears twice")
    return by_index


def _radius(value: Any, what: str) -> float:
    # JSON null is an infinite attack radius (none found); NaN and < 0 are errors.
    r = float("inf") if value is None else float(value)
    if np.isnan(r) or r < 0:
        raise LipvitError(f"{what} is {value}: radii must be >= 0")
    return r


def join(certify: Any, attack: Any, certify_name: str = "certify results",
         attack_name: str = "attack results",
         methods: list[str] | None = None) -> Gap:
    """Match ``certify --radius --json`` and ``attack --radius --json`` by index.

    Args:
        certify, attack: the parsed JSON files.
        certify_name, attack_name: how errors name them.
        methods: certification methods to keep (default: every method with
            per-sample radii).

    Raises:
        LipvitError: a file without per-sample radii, different sample sets,
            a label or prediction that differs, a negative or NaN radius, or
            an unknown method.
    """
    cert = _samples(certify, certify_name, ("index", "label", "prediction", "radii"))
    att = _samples(attack, attack_name,
                   ("index", "label", "prediction", "radius", "first_order_limit"))
    if set(cert) != set(att):
        only_c, only_a = sorted(set(cert) - set(att)), sorted(set(att) - set(cert))
        raise LipvitError(
            f"{certify_name} and {attack_name} hold different samples (only in the "
            f"first: {only_c[:5]}, only in the second: {only_a[:5]}); run both "
            "with the same --n")
    index = np.array(sorted(cert))
    for i in index:
        for key in ("label", "prediction"):
            if cert[i][key] != att[i][key]:
                raise LipvitError(
                    f"sample {i}: {key} {cert[i][key]} in {certify_name} but "
                    f"{att[i][key]} in {attack_name} (not the same model or data?)")
    available = list(dict.fromkeys(m for i in index for m in cert[i]["radii"]))
    methods = methods or available
    for m in methods:
        if m not in available or any(m not in cert[i]["radii"] for i in index):
            raise LipvitError(f"{certify_name}: no radii of method {m!r} on every "
                              f"sample (methods: {', '.join(available)})")
    results = certify.get("results") or []
    probabilistic = frozenset(r.get("method") for r in results
                              if isinstance(r, Mapping)
                              and r.get("guarantee") == "probabilistic")
    estimates = frozenset(r.get("method") for r in results
                          if isinstance(r, Mapping) and r.get("exact") is False
                          ) - probabilistic
    return Gap(
        index=index,
        attack=np.array([_radius(att[i]["radius"], f"attack radius of sample {i}")
                         for i in index]),
        first_order=np.array([float(att[i]["first_order_limit"] or 0.0)
                              for i in index]),
        certified={m: np.array([_radius(cert[i]["radii"][m],
                                        f"{m} radius of sample {i}") for i in index])
                   for m in methods},
        estimates=estimates & set(methods),
        probabilistic=probabilistic & set(methods),
    )


def _median(values: np.ndarray) -> float | None:
    return float(np.median(values)) if values.size else None


def median_ratio(certified: np.ndarray, attack: np.ndarray) -> float | None:
    """Median of ``certified / attack`` over samples with ``0 < attack < ∞``."""
    certified, attack = np.asarray(certified, float), np.asarray(attack, float)
    ok = np.isfinite(attack) & (attack > 0)
    return _median(certified[ok] / attack[ok])


def summary_rows(gap: Gap) -> list[GapRow]:
    """Per method: medians over the usable samples, then over the certified ones."""
    rows = []
    for m, cert in gap.certified.items():
        for points, keep in (("correct", gap.usable), ("certified",
                                                       gap.usable & (cert > 0))):
            rows.append(GapRow(
                method=m, points=points, n=int(keep.sum()),
                median_certified=_median(cert[keep]),
                median_attack=_median(gap.attack[keep]),
                median_ratio=median_ratio(cert[keep], gap.attack[keep]),
                median_first_order=_median(gap.first_order[keep]),
                estimate=m in gap.estimates,
                probabilistic=m in gap.probabilistic))
    return rows


def violations(gap: Gap) -> dict[str, int]:
    """Per sound method, the samples whose certified radius exceeds the attack
    radius (impossible for a sound certificate; float rounding aside). Neither
    estimates nor probabilistic radii (another classifier's) are counted."""
    return {m: int((cert > gap.attack * (1 + 1e-9)).sum())
            for m, cert in gap.certified.items()
            if m not in gap.estimates | gap.probabilistic}
