"""Certify a set of samples with several methods and budgets: the library side of
``lipvit certify``.

Methods: ``lofast`` (exact ζ and ‖M_h‖, every number an upper bound),
``lofast-fast`` (power-iteration estimates: **not** a certificate),
``specformer`` (SpecFormer Thm 4.2 per attention layer), ``crown``
(auto_LiRPA CROWN on the whole network), ``alpha-crown`` (CROWN, then
auto_LiRPA's optimised ReLU slopes for the margins), ``cascade`` (``lofast`` first,
CROWN only on the correctly classified samples ``lofast`` left uncertified),
``taylor`` (first-order-exact margins with certified remainders,
:mod:`lipvit.certify.taylor.certificate`, docs/taylor.md), ``cascade-taylor``
(``taylor`` first, CROWN on the rest), ``global`` (the hybrid ViT's proven
global constant) and ``smoothing`` (Cohen et al.'s randomized smoothing,
:mod:`lipvit.certify.smoothing`: a **probabilistic** certificate of the smoothed
classifier, not of the network; its rows say ``guarantee = "probabilistic"``).

Every result row carries a ``guarantee``: ``"deterministic"`` (a proof for the
network itself on the whole ball), ``"estimate"`` (``lofast-fast``: no
guarantee) or ``"probabilistic"`` (``smoothing``). """

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from lipvit.certify.ball.network import BallCertificate
from lipvit.certify.certification import (
    certified_margin,
    certified_radius,
    float64_model,
    is_certified,
    margin,
)
from lipvit.certify.eps import check_eps_list
from lipvit.certify.follow.network import MarginCertificate
from lipvit.certify.global_bound import (
    check_global,
    global_constant,
    global_radius,
    proven_chain,
)
from lipvit.certify.lofast.network import METHODS as BOUND_METHODS
from lipvit.certify.lofast.network import network_bound
from lipvit.certify.smoothing import (
    GUARANTEE,
    SmoothingCertificate,
    SmoothingConfig,
    certify_smoothed,
)
from lipvit.certify.taylor.certificate import taylor_bound
from lipvit.certify.taylor.jacobian_norms import taylor_batch
from torch import Tensor
from torch.nn.utils import parametrize

from lipvit.errors import UnsupportedModelError
from lipvit.model import ViT

ALL_METHODS: tuple[str, ...] = (*BOUND_METHODS, "taylor", "crown", "alpha-crown",
                                "cascade", "cascade-taylor", "global", "ball",
                                "margin", "smoothing")
PROVEN_METHODS = ("global", "ball", "margin")
"""The methods of the architectures whose every map has a proven constant."""
ANY_ARCH = frozenset({*PROVEN_METHODS, "smoothing"})
"""The methods that do not bound lipvit's ViT architecture layer by layer
(``global``, ``ball``, ``margin``: the hybrid ViT's and CaiT's constants; ``smoothing``:
any classifier)."""
CASCADES = {"cascade": "lofast", "cascade-taylor": "taylor"}
"""Each cascade: its first method; CROWN runs on what that left uncertified."""
LIRPA_METHODS = {"crown": "CROWN", "alpha-crown": "alpha-CROWN"}
"""The auto_LiRPA methods: each name's bound method in
:mod:`lipvit.certify.crown.bounds`."""
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


def guarantee_of(method: str) -> str:
    """The kind of guarantee a method's rows give (see the module note)."""
    if method == "smoothing":
        return GUARANTEE
    return "estimate" if method == "lofast-fast" else "deterministic"


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


def _check(model, methods: Sequence[str], eps_list: Sequence[float],
           smoothing: SmoothingConfig | None = None) -> None:
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise ValueError(
            f"unknown method {unknown[0]!r}; choose from {', '.join(ALL_METHODS)}"
        )
    if not methods:
        raise ValueError("give at least one method")
    check_methods(model, methods)
    check_eps_list(eps_list)
    if "smoothing" in methods and not isinstance(smoothing, SmoothingConfig):
        raise ValueError("smoothing needs its settings: pass smoothing="
                         "SmoothingConfig(sigma=...)")


def check_methods(model, methods: Sequence[str]) -> None:
    """Refuse, in one line (:class:`UnsupportedModelError`), a method that cannot
    bound ``model``'s architecture: ``global`` and ``ball`` need proven
    constants (the hybrid ViT, CaiT), ``smoothing`` takes any classifier, and
    every other method bounds :class:`ViT` only."""
    if any(m in PROVEN_METHODS for m in methods):
        check_global(model)
    arch = getattr(model.config, "arch", "vit")
    if arch != "vit":
        other = [m for m in methods if m not in ANY_ARCH]
        if other:
            raise UnsupportedModelError(
                f"{other[0]} bounds lipvit's ViT architecture; this model "
                f"(arch {arch!r}) is certified by its proven constants: use "
                "--method ball or global"
            )


def _batches(n: int, batch_size: int):
    for start in range(0, n, batch_size):
        yield slice(start, min(start + batch_size, n))


def _taylor(model, x, y, eps_list, radius, radius_tol, max_memory, max_symbols, add,
            certified, radii) -> None:
    """``taylor`` on one batch, a memory-sized part at a time
    (:func:`lipvit.certify.taylor.jacobian_norms.taylor_batch`); appends one entry per ε
    (and radius) for the whole batch, as the other methods do."""
    oks: dict[float, list[Tensor]] = {eps: [] for eps in eps_list}
    rs = []
    for part in _batches(len(x), taylor_batch(model, max_memory)):
        t0 = time.perf_counter()
        tb = taylor_bound(model, x[part], y[part], max_memory=max_memory,
                          max_symbols=max_symbols)
        add("taylor", time.perf_counter() - t0)
        probed = []
        for eps in eps_list:
            t0 = time.perf_counter()
            slack = tb.slack(eps)
            add(f"taylor@{eps}", time.perf_counter() - t0)
            oks[eps].append(slack > 0)
            probed.append((eps, slack))
        if radius:
            rs.append(tb.radius(rtol=radius_tol, probed=probed))
    for eps in eps_list:
        certified.setdefault(f"taylor@{eps}", []).append(torch.cat(oks[eps]))
    if radius:
        radii.setdefault("taylor", []).append(torch.cat(rs))


def _proven(method, chain, model, x, y, eps_list, radius, radius_tol, add,
            certified, radii) -> None:
    """``ball`` or ``margin`` on one batch: one entry per ε (and radius) for
    the batch."""
    t0 = time.perf_counter()
    make = BallCertificate if method == "ball" else MarginCertificate
    cert = make(chain, model, x, y)
    add(method, time.perf_counter() - t0)
    decided = []
    for eps in eps_list:
        t0 = time.perf_counter()
        ok = cert.certified(eps)
        add(f"{method}@{eps}", time.perf_counter() - t0)
        certified.setdefault(f"{method}@{eps}", []).append(ok)
        decided.append((eps, ok))
    if radius:
        t0 = time.perf_counter()
        radii.setdefault(method, []).append(
            cert.radius(rtol=radius_tol, certified_at=decided))
        add(f"{method}-radius", time.perf_counter() - t0)


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
    """Certify images ``x`` ``(n, C, S, S)`` in [0, 1] with labels ``y`` ``(n,)``.

    Args:
        model: a :class:`lipvit.model.ViT` in eval mode, on the device of ``x``.
        methods: names from :data:`ALL_METHODS`.
        eps_list: ℓ2 budgets in image space.
        radius: also compute per-sample certified radii for the bound methods.
        radius_tol: *relative* bisection tolerance of the radii (the lower end,
            a certified value, is reported); a radius is consistent with the
            per-ε results: ``≥ ε`` exactly where the point is certified at ε.
        batch_size: samples per batch.
        progress: optional callable ``(n_done) -> None``, called as the work
            goes: after each method of a batch with that method's share of the
            batch (fractions of samples), and after every CROWN sample.
        max_memory: bytes ``taylor`` may hold (its tangents, and its samples
            at a time: :func:`lipvit.certify.taylor.jacobian_norms.taylor_batch`);
            default :func:`lipvit.certify.memory.default_max_memory`.
        max_symbols: ``taylor``'s ReLU symbols per sample and block (lipschitz
            family); default :func:`lipvit.certify.taylor.symbols.default_max_symbols`.
        smoothing: the settings of ``smoothing`` (required with it), whose
            ``batch_size`` is its noisy copies per forward pass.
        index: ``(n,)`` the samples' test-set indices, which seed
            ``smoothing``'s noise per point (reproducible, whatever the
            batches or shards); ``None``: fresh noise for this call
            (:func:`lipvit.certify.smoothing.certify_smoothed`).

    Returns:
        A :class:`CertifyReport`; ``seconds_per_sample`` of a (method, ε) row is
        the wall time that method needs for that ε alone, from scratch.
        Everything is computed in float64 (a float64 copy of a lower-precision
        model); certificates use margins rounded down and bounds rounded up
        (:mod:`lipvit.certify.certification`). ``smoothing`` alone runs the
        model in float32 (:mod:`lipvit.certify.smoothing`).
    """
    _check(model, methods, eps_list, smoothing)
    network = model  # smoothing's base classifier is its float32 copy
    model = float64_model(model)  # in eval mode
    x = x.to(torch.float64)
    n = x.shape[0]
    times: dict[
        str, float
    ] = {}  # "<method>@<eps>" -> seconds, and "<method>" build time
    certified: dict[str, list[Tensor]] = {}
    radii: dict[str, list[Tensor]] = {}
    logits_all, margins_all = [], []

    def add(key: str, seconds: float) -> None:
        times[key] = times.get(key, 0.0) + seconds

    bound_methods = [
        m
        for m in BOUND_METHODS
        if m in methods or (m == "lofast" and "cascade" in methods)
    ]
    use_taylor = "taylor" in methods or "cascade-taylor" in methods
    crown_runs = len(eps_list) * (sum(m in methods for m in LIRPA_METHODS)
                                  + sum(c in methods for c in CASCADES))
    # of a sample, per unit of work
    share = 1.0 / (len(bound_methods) + use_taylor + crown_runs
                   + sum(m in methods for m in (*PROVEN_METHODS, "smoothing")))

    def advance(samples: float) -> None:
        if progress is not None:
            progress(samples * share)

    # Outside the cache below: torch's parametrization cache keys a weight by the
    # module it was registered on, which every deepcopy shares, so the float32
    # base classifier and the float64 model would read each other's weights.
    smoothed = None
    if "smoothing" in methods:
        t0 = time.perf_counter()
        smoothed = certify_smoothed(network, x, smoothing,
                                    num_classes=model.config.num_classes,
                                    index=index, progress=advance)
        add("smoothing", time.perf_counter() - t0)
        for eps in eps_list:
            ok = smoothed.certified(y, eps).to(y.device)
            certified[f"smoothing@{eps}"] = [ok]
            add(f"smoothing@{eps}", 0.0)
        if radius:
            radii["smoothing"] = [smoothed.certified_radius(y).to(x.device)]

    # Capped weights (convolution caps, spectral caps) computed once for the run.
    with parametrize.cached():
        gc = chain = None  # the proven constants, computed once
        if "global" in methods:
            t0 = time.perf_counter()
            gc = global_constant(model)
            add("global", time.perf_counter() - t0)
        local = [m for m in ("ball", "margin") if m in methods]
        if local:
            t0 = time.perf_counter()
            with torch.no_grad():
                chain = proven_chain(model)
            add(local[0], time.perf_counter() - t0)

        crown = None  # one bounded model for the whole run
        if crown_runs:
            from lipvit.certify.crown.bounds import crown_model

            crown = crown_model(model, x.device)

        for sl in _batches(n, batch_size):
            xb, yb = x[sl], y[sl]
            with torch.no_grad():
                logits = model(xb)
            m = margin(logits, yb)
            m_cert = certified_margin(logits, yb)  # rounded down
            logits_all.append(logits)
            margins_all.append(m)
            if gc is not None:
                t0 = time.perf_counter()
                r = global_radius(logits, yb, gc)
                add("global", time.perf_counter() - t0)
                for eps in eps_list:
                    # r is itself a certified radius (rounded down): ε ≤ r certifies.
                    certified.setdefault(f"global@{eps}", []).append(r >= eps)
                    add(f"global@{eps}", 0.0)
                radii.setdefault("global", []).append(r)
                advance(sl.stop - sl.start)
            for method in local:
                with torch.no_grad():
                    _proven(method, chain, model, xb, yb, eps_list, radius,
                            radius_tol, add, certified, radii)
                advance(sl.stop - sl.start)
            if use_taylor:
                _taylor(model, xb, yb, eps_list, radius, radius_tol, max_memory,
                        max_symbols, add, certified, radii)
                advance(sl.stop - sl.start)
            for method in bound_methods:
                t0 = time.perf_counter()
                bound = network_bound(model, xb, method)
                add(method, time.perf_counter() - t0)
                decided = []
                for eps in eps_list:
                    t0 = time.perf_counter()
                    ok = is_certified(m_cert, bound.delta_out(eps))
                    add(f"{method}@{eps}", time.perf_counter() - t0)
                    certified.setdefault(f"{method}@{eps}", []).append(ok)
                    decided.append((eps, ok))
                if radius:
                    radii.setdefault(method, []).append(
                        certified_radius(m_cert, bound.delta_out, rtol=radius_tol,
                                         certified_at=decided)
                    )
                advance(sl.stop - sl.start)
            for eps in eps_list:
                for name, lirpa_method in LIRPA_METHODS.items():
                    if name not in methods:
                        continue
                    t0 = time.perf_counter()
                    ok = _crown_each(model, crown, xb, yb, eps, advance, lirpa_method)
                    add(f"{name}@{eps}", time.perf_counter() - t0)
                    certified.setdefault(f"{name}@{eps}", []).append(ok)
                for cascade, first in CASCADES.items():
                    if cascade not in methods:
                        continue
                    ok = certified[f"{first}@{eps}"][-1].clone()
                    rest = (~ok) & (m_cert > 0)
                    advance(float((~rest).sum()))  # decided by the first method
                    t0 = time.perf_counter()
                    if rest.any():
                        ok[rest] = _crown_each(model, crown, xb[rest], yb[rest], eps,
                                               advance)
                    add(f"{cascade}@{eps}", time.perf_counter() - t0)
                    certified.setdefault(f"{cascade}@{eps}", []).append(ok)

    cert = {k: torch.cat(v) for k, v in certified.items()}
    results = []
    for method in methods:
        for eps in eps_list:
            key = f"{method}@{eps}"
            seconds = times[key]
            if method in (*BOUND_METHODS, "taylor", *PROVEN_METHODS, "smoothing"):
                seconds += times[method]
            elif method in CASCADES:
                first = CASCADES[method]
                seconds += times[first] + times[f"{first}@{eps}"]
            settings = {} if method != "smoothing" else {
                k: getattr(smoothing, k) for k in SMOOTHING_KEYS}
            results.append(
                MethodResult(
                    method,
                    float(eps),
                    float(cert[key].float().mean()),
                    seconds / n,
                    guarantee_of(method) == "deterministic",
                    guarantee_of(method),
                    **settings,
                )
            )
    logits = torch.cat(logits_all)
    return CertifyReport(
        n=n,
        labels=y,
        predictions=logits.argmax(1),
        margins=torch.cat(margins_all),
        results=results,
        certified=cert,
        radii={k: torch.cat(v) for k, v in radii.items() if k in methods},
        smoothing=smoothed,
    )


def _crown_each(model: ViT, crown, x: Tensor, y: Tensor, eps: float,
                advance, method: str = "CROWN") -> Tensor:
    """CROWN (or alpha-CROWN: ``method``) certificates one sample at a time
    (CROWN takes minutes per sample on a CPU: progress advances per sample),
    all with the one bounded model of ``crown`` (a
    :class:`lipvit.certify.crown.bounds.CrownModel`)."""
    from lipvit.certify.crown.bounds import crown_certify

    out = []
    for i in range(x.shape[0]):  # on the chosen device
        out.append(crown_certify(model, x[i:i + 1], y[i:i + 1], eps, method=method,
                                 prepared=crown))
        advance(1)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool)


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
