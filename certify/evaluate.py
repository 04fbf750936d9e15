"""Certify a set of samples with several methods and budgets: the library side of
``lipvit certify``. Each method runs through its :class:`lipvit.Certifier`
(:mod:`lipvit.certify.certifier`); the methods and their guarantees:
:mod:`lipvit.certify.methods`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from lipvit.certify.certification import float64_model, margin
from lipvit.certify.certifier import Certifier
from lipvit.certify.eps import check_eps_list
from lipvit.certify.methods import (
    ALL_METHODS,
    CASCADES,
    LIRPA_METHODS,
    check_method_names,
    check_methods,
    check_smoothing_settings,
    guarantee_of,
)
from lipvit.certify.smoothing import (
    SmoothingCertificate,
    SmoothingConfig,
)
from torch import Tensor

from lipvit.model import ViT

__all__ = ["ALL_METHODS", "QUANTITIES", "CertifyReport", "MethodResult",
           "certify_samples", "check_methods", "merge_records", "report_record"]

QUANTITIES = {
    "taylor": {
        "first_order": "exact: ||c_j^T J|| eps, autograd gradients in float64",
        "remainders": "upper bounds (docs/taylor.md); lipschitz models: the "
                      "smaller of the box and the back-substituted chord bound "
                      "of the ReLU units that can flip",
        "budgets": "upper bounds: min of the LoFAST chain and the first-order "
                   "recursion with exact Jacobian norms and the ReLU flip "
                   "symbols carried with exact coefficients",
        "certificate": "sound: every wrong-class margin exceeds its drop bound",
    },
    "global": {
        "constant": "upper bound: product of the maps' proven constants (exact "
                    "spectral norms, DFT bounds of the convolutions, the gated "
                    "attention's closed form; docs/math.md §9)",
        "certificate": "sound: every margin F_y - F_j exceeds eps L ||w_y - w_j||",
    },
    "ball": {
        "constant": "upper bound: the attention blocks' local constants over the "
                    "eps-ball (each capped by its global one; docs/math.md §10) "
                    "times the other maps' proven constants",
        "certificate": "sound: every margin F_y - F_j exceeds eps L(x, eps) "
                       "||w_y - w_j||",
    },
    "margin": {
        "first_order": "exact: eps ||grad_x (F_y - F_j)||, autograd gradients in "
                       "float64",
        "remainders": "upper bounds: each map's linearisation remainder along the "
                      "margin's exact gradient there, on the ball ball's radii give "
                      "its input (MaxMin pairs that can flip, attention's softmax "
                      "and projection; docs/math.md §11)",
        "cuts": "the least over the cuts of the chain of the norm bound from the "
                "cut on plus the remainders after it; the last cut is ball's bound",
        "certificate": "sound: every margin F_y - F_j exceeds its drop bound",
    },
    "smoothing": {
        "counts": "exact: estimation draws per class of the float32 network's "
                  "argmax under Gaussian noise (Monte Carlo, seeded per point)",
        "p_lower": "one-sided Clopper-Pearson lower bound of p_A at level "
                   "1 - alpha (scipy binomtest ... proportion_ci, exact)",
        "radius": "sigma * Phi^-1(p_lower) (Cohen et al. 2019, Theorem 1); 0 "
                  "on abstention (p_lower <= 1/2)",
        "certificate": "probabilistic: with probability >= 1 - alpha per point, "
                       "the smoothed classifier g(x) = argmax_c P(f(x + d) = c), "
                       "d ~ N(0, sigma^2 I), predicts the label on the open ball "
                       "of that radius; says nothing about the network f itself",
    },
}
"""What each method's numbers are, for the JSON (methods not named: see ``exact``)."""


@dataclass(frozen=True)
class MethodResult:
    """Certified accuracy of one method at one ε.

    ``exact`` is true for a deterministic certificate of the network;
    ``guarantee`` says which kind a row is (``"deterministic"``,
    ``"estimate"``, ``"probabilistic"``). ``smoothing`` rows also carry its
    settings ``sigma``, ``alpha``, ``n0``, ``n_noise`` (None elsewhere).
    """

    method: str
    eps: float
    certified_accuracy: float
    seconds_per_sample: float
    exact: bool
    guarantee: str = "deterministic"
    sigma: float | None = None
    alpha: float | None = None
    n0: int | None = None
    n_noise: int | None = None

    def to_dict(self) -> dict:
        """Plain dict; the smoothing settings only where they are set."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if v is not None or k not in SMOOTHING_KEYS}


SMOOTHING_KEYS = ("sigma", "alpha", "n0", "n_noise")


@dataclass(frozen=True)
class CertifyReport:
    """Everything ``lipvit certify`` prints and writes.

    ``certified`` maps ``"<method>@<eps>"`` to a ``(n,)`` bool tensor;
    ``radii`` maps each bound method to ``(n,)`` certified radii (when asked);
    ``smoothing`` holds the per-point outcome of ``smoothing`` (its radii in
    ``radii`` are 0 where the smoothed prediction is not the label).

    Two classifiers, two accuracies: :attr:`clean_accuracy` is the **network's**
    (``predictions``, the float64 forward pass on the clean images), whatever
    the methods; with ``smoothing``, :attr:`smoothed_accuracy` and
    :attr:`abstain_rate` are the **smoothed classifier's** (its CERTIFY
    predictions), the accuracy its certified accuracies are bounded by.
    """

    n: int
    labels: Tensor
    predictions: Tensor
    margins: Tensor
    results: list[MethodResult]
    certified: dict[str, Tensor]
    radii: dict[str, Tensor] = field(default_factory=dict)
    smoothing: SmoothingCertificate | None = None

    @property
    def clean_accuracy(self) -> float:
        """The network's accuracy on the clean points (not the smoothed
        classifier's: :attr:`smoothed_accuracy`)."""
        return float((self.predictions == self.labels).float().mean())

    @property
    def smoothed_accuracy(self) -> float | None:
        """With ``smoothing``: the smoothed classifier's accuracy, the fraction
        of the ``n`` points where CERTIFY predicts the label (abstentions count
        as wrong); else None."""
        if self.smoothing is None:
            return None
        return self.smoothing.accuracy(self.labels)

    @property
    def abstain_rate(self) -> float | None:
        """With ``smoothing``: the fraction of the ``n`` points where CERTIFY
        abstains; else None."""
        return None if self.smoothing is None else self.smoothing.abstain_rate

    def to_records(self) -> list[dict]:
        """One plain dict per (method, ε): the rows of ``lipvit certify``'s CSV.
        ``clean_accuracy`` is the network's on every row; ``smoothing`` rows
        also carry ``smoothed_accuracy`` and ``abstain_rate`` (the smoothed
        classifier's)."""
        rows = []
        for r in self.results:
            row = r.to_dict()
            row["clean_accuracy"] = self.clean_accuracy
            if r.method == "smoothing" and self.smoothing is not None:
                row["smoothed_accuracy"] = self.smoothed_accuracy
                row["abstain_rate"] = self.abstain_rate
            rows.append({k: row[k] for k in ("method", "eps", "clean_accuracy",
                                             "smoothed_accuracy", "abstain_rate",
                                             *row) if k in row})
        return rows

    def sample_records(self, index: Sequence[int]) -> list[dict]:
        """One plain dict per sample (``index``: its test-set index): label,
        prediction, margin, certified radius (the first method's), whether
        each ``"<method>@<eps>"`` certifies it and, with ``smoothing``, its
        outcome (``"smoothing": {"prediction", "counts", "p_lower", "radius",
        "selected"}``; ``prediction`` −1 is an abstention)."""
        primary = next(iter(self.radii), None)
        smoothed = None if self.smoothing is None else self.smoothing.records()
        out = []
        for i in range(self.n):
            record = {
                "index": int(index[i]),
                "label": int(self.labels[i]),
                "prediction": int(self.predictions[i]),
                "margin": float(self.margins[i]),
                "radius": float(self.radii[primary][i]) if primary else None,
                "certified": {k: bool(v[i]) for k, v in self.certified.items()},
            }
            if self.radii:
                record["radii"] = {m: float(r[i]) for m, r in self.radii.items()}
            if smoothed is not None:
                record["smoothing"] = smoothed[i]
            out.append(record)
        return out


def certify_samples(
    model: ViT,
    x: Tensor,
    y: Tensor,
    methods: Sequence[str],
    eps_list: Sequence[float],
    *,
    radius: bool = False,
    radius_tol: float = 1e-3,
    batch_size: int = 64,
    progress=None,
    max_memory: int | None = None,
    max_symbols: int | None = None,
    smoothing: SmoothingConfig | None = None,
    index: Sequence[int] | None = None,
) -> CertifyReport:
    """Certify images ``x`` ``(n, C, S, S)`` in [0, 1] with labels ``y`` ``(n,)``
    by each of ``methods``, one :class:`lipvit.Certifier` each.

    Args:
        model: a lipvit model in eval mode, on the device of ``x``.
        methods: names from :data:`ALL_METHODS`.
        eps_list: ℓ2 budgets in image space.
        radius: also compute per-sample certified radii (the methods that
            have them: not CROWN nor the cascades).
        radius_tol, batch_size, max_memory, max_symbols, smoothing: as in
            :class:`lipvit.Certifier` (``smoothing`` required with it).
        progress: optional callable ``(n_done) -> None``, called as the work
            goes, in fractions of samples: each method's share is
            ``1 / len(methods)`` of a sample.
        index: ``(n,)`` the samples' test-set indices, which seed
            ``smoothing``'s noise per point (reproducible, whatever the
            batches or shards); ``None``: fresh noise for this call
            (:func:`lipvit.certify.smoothing.certify_smoothed`).

    Returns:
        A :class:`CertifyReport`; ``seconds_per_sample`` of a (method, ε) row is
        the wall time that method needs for that ε alone, from scratch (its
        certifier's construction included). Everything is computed in float64
        (a float64 copy of a lower-precision model); certificates use margins
        rounded down and bounds rounded up
        (:mod:`lipvit.certify.certification`). ``smoothing`` alone runs the
        model in float32 (:mod:`lipvit.certify.smoothing`).
    """
    check_method_names(methods)
    check_methods(model, methods)
    eps_list = [float(e) for e in check_eps_list(eps_list)]
    check_smoothing_settings(methods, smoothing)  # before any method's work
    n = x.shape[0]
    network = float64_model(model)  # its logits, CROWN's bounded model

    def advance(samples: float) -> None:
        if progress is not None:
            progress(samples / len(methods))

    crown = None  # one bounded model for every CROWN method of the run
    if any(m in LIRPA_METHODS or m in CASCADES for m in methods):
        from lipvit.certify.crown.bounds import crown_model

        crown = crown_model(network, x.device)
    certified: dict[str, Tensor] = {}
    radii: dict[str, Tensor] = {}
    results: list[MethodResult] = []
    smoothed = None
    for method in methods:
        cert = Certifier(model, method, radius_tol=radius_tol, batch_size=batch_size,
                         max_memory=max_memory, max_symbols=max_symbols,
                         smoothing=smoothing, progress=advance, crown=crown)
        out = cert.certify(x, y, eps_list, index=index, radius=radius)
        for e, eps in enumerate(eps_list):
            certified[f"{method}@{eps}"] = out.certified[:, e]
        if out.radius is not None:
            radii[method] = out.radius
        if method == "smoothing":
            smoothed = out.smoothed
        settings = {} if method != "smoothing" else {
            k: getattr(smoothing, k) for k in SMOOTHING_KEYS}
        results.extend(
            MethodResult(method, eps, float(out.certified[:, e].float().mean()),
                         (cert.setup_seconds + float(out.seconds[e])) / n,
                         guarantee_of(method) == "deterministic",
                         guarantee_of(method), **settings)
            for e, eps in enumerate(eps_list))
    # the network's predictions and margins, whatever the methods
    with torch.no_grad():
        logits = torch.cat([network(x[s:s + batch_size].to(torch.float64))
                            for s in range(0, n, batch_size)])
    return CertifyReport(
        n=n,
        labels=y,
        predictions=logits.argmax(1),
        margins=margin(logits, y),
        results=results,
        certified=certified,
        radii=radii,
        smoothing=smoothed,
    )


def report_record(report: CertifyReport) -> dict:
    """``report`` as plain Python values (lists, floats, bools), for a shard file
    or for sending to another process; :func:`merge_records` reads it back."""
    return {
        "n": report.n,
        "labels": report.labels.tolist(),
        "predictions": report.predictions.tolist(),
        "margins": report.margins.tolist(),
        "results": [r.to_dict() for r in report.results],
        "certified": {k: v.tolist() for k, v in report.certified.items()},
        "radii": {k: v.tolist() for k, v in report.radii.items()},
        "smoothing": None if report.smoothing is None else report.smoothing.to_record(),
    }


def merge_records(records: Sequence[dict]) -> CertifyReport:
    """One report from the :func:`report_record` of consecutive shards of samples.

    Per-sample values are concatenated in shard order (empty shards are
    skipped) and every certified accuracy is recomputed from them, exactly as a
    single run on all samples computes it. ``seconds_per_sample`` is the mean
    over all samples of each shard's own timing (the work time summed over the
    shards, per sample; not the wall time of the parallel run).
    """
    parts = [r for r in records if r["n"] > 0]
    if not parts:
        raise ValueError("no samples in any shard")
    n = sum(r["n"] for r in parts)

    def cat(key: str, dtype: torch.dtype, sub: str | None = None) -> Tensor:
        return torch.tensor([v for r in parts
                             for v in (r[key] if sub is None else r[key][sub])],
                            dtype=dtype)

    certified = {k: cat("certified", torch.bool, k) for k in parts[0]["certified"]}
    results = []
    for i, first in enumerate(parts[0]["results"]):
        key = f"{first['method']}@{first['eps']}"
        seconds = sum(r["results"][i]["seconds_per_sample"] * r["n"] for r in parts)
        results.append(dataclasses.replace(
            MethodResult(**first),
            certified_accuracy=float(certified[key].float().mean()),
            seconds_per_sample=seconds / n))
    return CertifyReport(
        n=n,
        labels=cat("labels", torch.int64),
        predictions=cat("predictions", torch.int64),
        margins=cat("margins", torch.float64),
        results=results,
        certified=certified,
        radii={k: cat("radii", torch.float64, k) for k in parts[0]["radii"]},
        smoothing=(SmoothingCertificate.cat([r["smoothing"] for r in parts])
                   if parts[0].get("smoothing") is not None else None),
    )
