"""``lipvit.Certifier``: certification in the shape the field's tools have
(auto_LiRPA wraps a model once; Cohen et al.'s ``Smooth(...).certify`` returns
a prediction and a radius): build it once per model, then ask for tensors.

    cert = lipvit.Certifier(model, method="ball")
    out = cert.certify(x, y, [0.25, 0.5])   # out.certified (n, 2), out.radius (n,)

Every method of :data:`lipvit.certify.methods.ALL_METHODS` is computed here;
:func:`lipvit.certify.evaluate.certify_samples` (and so ``lipvit certify``)
runs one :class:`Certifier` per method. What a model allows is computed once,
at construction: the float64 copy, the proven constants of ``global``,
``ball`` and ``margin``, CROWN's bounded model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .ball.network import BallCertificate
from .certification import (
    certified_margin,
    certified_radius,
    float64_model,
    is_certified,
)
from .eps import check_eps_list
from .follow.network import MarginCertificate
from .global_bound import global_constant, global_radius, proven_chain
from .lofast.network import METHODS as BOUND_METHODS
from .lofast.network import network_bound
from .methods import (
    CASCADES,
    LIRPA_METHODS,
    RADIUS_METHODS,
    check_method_names,
    check_methods,
    check_smoothing_settings,
    default_method,
)
from .smoothing import SmoothingCertificate, SmoothingConfig, certify_smoothed
from .taylor.certificate import taylor_bound
from .taylor.jacobian_norms import taylor_batch


class Certified(NamedTuple):
    """What :meth:`Certifier.certify` returns for ``n`` points and ``E`` radii.

    ``prediction`` ``(n,)`` the network's class (``smoothing``: the smoothed
    classifier's, −1 where it abstains); ``certified`` ``(n, E)`` bool, point
    ``i`` proven at ``eps[e]`` (and correctly classified); ``radius`` ``(n,)``
    the certified radius (0 where none; None for CROWN and the cascades, which
    decide one ε at a time, or when not asked); ``eps`` ``(E,)``;
    ``seconds`` ``(E,)`` the wall time of this call for each ε alone: the
    work the radii share plus that ε's own (the radius search excluded).
    ``smoothing`` only: ``counts`` ``(n, classes)`` its estimation draws per
    class, ``p_lower`` ``(n,)`` the lower confidence bound of the top class
    and ``smoothed``, CERTIFY's whole outcome."""

    prediction: Tensor
    certified: Tensor
    radius: Tensor | None
    eps: Tensor
    seconds: Tensor
    counts: Tensor | None = None
    p_lower: Tensor | None = None
    smoothed: SmoothingCertificate | None = None


class _Run:
    """One :meth:`Certifier.certify` call's accumulators: per-ε columns and
    seconds, radii, the work the ε share."""

    def __init__(self, eps: list[float]):
        self.eps = eps
        self.columns: list[list[Tensor]] = [[] for _ in eps]
        self.radii: list[Tensor] = []
        self.shared = 0.0
        self.own = [0.0] * len(eps)

    def timed(self, fn: Callable[[], Any], e: int | None = None) -> Any:
        """``fn()``, its seconds charged to ε number ``e`` (None: shared)."""
        t0 = time.perf_counter()
        out = fn()
        if e is None:
            self.shared += time.perf_counter() - t0
        else:
            self.own[e] += time.perf_counter() - t0
        return out


class Certifier:
    """A model's certifier for one method (module docstring).

    Args:
        model: a lipvit model (ViT, hybrid ViT, CaiT) on the images' device.
        method: a name from :data:`~lipvit.certify.methods.ALL_METHODS`;
            ``None`` picks the default of the model's architecture (what
            ``lipvit certify`` picks without ``--method``).
        radius_tol: *relative* bisection tolerance of the radii (the lower
            end, a certified value, is reported); a radius is consistent with
            the per-ε results: ``≥ ε`` exactly where the point is certified.
        batch_size: points per batch (``smoothing``: its ``SmoothingConfig``
            sets the noisy copies per forward pass).
        max_memory: bytes ``taylor`` may hold (its tangents, and its points
            at a time: :func:`lipvit.certify.taylor.jacobian_norms.taylor_batch`);
            default :func:`lipvit.certify.memory.default_max_memory`.
        max_symbols: ``taylor``'s ReLU symbols per point and block (lipschitz
            family); default :func:`lipvit.certify.taylor.symbols.default_max_symbols`.
        smoothing: the settings of ``smoothing`` (required with it).
        progress: optional callable ``(points) -> None``, called as the work
            goes (after each batch, and after every CROWN point).
        crown: CROWN's bounded model of this model to reuse
            (:func:`lipvit.certify.crown.bounds.crown_model`; CROWN, alpha-CROWN
            and the cascades), else built here.

    Raises:
        UnsupportedModelError: the method cannot bound this architecture.
        ValueError: an unknown method, or ``smoothing`` without its settings.
    """

    def __init__(self, model: nn.Module, method: str | None = None, *,
                 radius_tol: float = 1e-3, batch_size: int = 64,
                 max_memory: int | None = None, max_symbols: int | None = None,
                 smoothing: SmoothingConfig | None = None,
                 progress: Callable[[float], None] | None = None, crown=None):
        t0 = time.perf_counter()
        if method is None:
            method, _ = default_method(model)
        check_method_names([method])
        check_methods(model, [method])
        check_smoothing_settings([method], smoothing)
        self.method, self.radius_tol, self.batch_size = method, radius_tol, batch_size
        self.max_memory, self.max_symbols = max_memory, max_symbols
        self.smoothing, self.progress = smoothing, progress
        # smoothing's base classifier is the network's float32 copy
        self.model = model if method == "smoothing" else float64_model(model)
        self._chain = self._global = None
        self._crown = crown
        with torch.no_grad(), parametrize.cached():
            if method in ("ball", "margin"):
                self._chain = proven_chain(self.model)
            elif method == "global":
                self._global = global_constant(self.model)
        if self._crown is None and (method in LIRPA_METHODS or method in CASCADES):
            from lipvit.certify.crown.bounds import crown_model

            self._crown = crown_model(self.model, next(self.model.parameters()).device)
        self.setup_seconds = time.perf_counter() - t0
        """Wall seconds of the construction: what every call then reuses."""

    def certify(self, x: Tensor, y: Tensor, eps: float | Sequence[float],
                index: Sequence[int] | None = None, radius: bool = True
                ) -> Certified:
        """Certify images ``x`` ``(n, C, S, S)`` in [0, 1] with labels ``y``
        ``(n,)`` at each radius of ``eps`` (a float or a list); ``radius``:
        also each point's certified radius (where the method has one);
        ``index`` (the test-set indices) seeds ``smoothing``'s noise per
        point, reproducibly; without it each call draws fresh noise."""
        eps_list = [float(e) for e in check_eps_list(
            [eps] if isinstance(eps, int | float) else list(eps))]
        # global's radius is what decides every ε: it comes free
        radius = (radius or self.method == "global") and self.method in RADIUS_METHODS
        run = _Run(eps_list)
        if self.method == "smoothing":
            return self._smoothing(x, y, index, radius, run)
        predictions = []
        x = x.to(torch.float64)
        # Capped weights (convolution caps, spectral caps) computed once a call.
        with parametrize.cached():
            for start in range(0, len(x), self.batch_size):
                part = slice(start, start + self.batch_size)
                xb, yb = x[part], y[part]
                with torch.no_grad():
                    logits = self.model(xb)
                predictions.append(logits.argmax(dim=1))
                self._batch(xb, yb, logits, radius, run)
                if self.progress is not None and self.method not in (
                        *LIRPA_METHODS, *CASCADES):  # those report per point
                    self.progress(len(xb))
        return self._result(torch.cat(predictions), run, radius)

    # ------------------------------------------------------------ per method

    def _batch(self, x: Tensor, y: Tensor, logits: Tensor, radius: bool, run: _Run
               ) -> None:
        """One batch of the method into ``run``'s columns and radii."""
        method = self.method
        m_cert = certified_margin(logits, y)  # rounded down
        if method == "global":
            r = run.timed(lambda: global_radius(logits, y, self._global))
            # r is itself a certified radius (rounded down): ε ≤ r certifies.
            for e, eps in enumerate(run.eps):
                run.columns[e].append(r >= eps)
            run.radii.append(r)
        elif method in ("ball", "margin"):
            make = BallCertificate if method == "ball" else MarginCertificate
            with torch.no_grad():
                cert = run.timed(lambda: make(self._chain, self.model, x, y))
                self._decide(cert.certified, run, radius,
                             lambda decided: cert.radius(rtol=self.radius_tol,
                                                         certified_at=decided))
        elif method in ("taylor", "cascade-taylor"):
            self._taylor(x, y, radius, run)
        elif method in BOUND_METHODS or method == "cascade":
            name = "lofast" if method == "cascade" else method
            bound = run.timed(lambda: network_bound(self.model, x, name))
            self._decide(lambda eps: is_certified(m_cert, bound.delta_out(eps)),
                         run, radius and method != "cascade",
                         lambda decided: certified_radius(
                             m_cert, bound.delta_out, rtol=self.radius_tol,
                             certified_at=decided))
        if method in LIRPA_METHODS:
            for e, eps in enumerate(run.eps):
                run.columns[e].append(run.timed(
                    lambda eps=eps: self._crown_each(x, y, eps, LIRPA_METHODS[method],
                                                     len(run.eps)), e))
        elif method in CASCADES:
            for e, eps in enumerate(run.eps):
                ok = run.columns[e][-1]
                rest = (~ok) & (m_cert > 0)
                if self.progress is not None:
                    self.progress(float((~rest).sum()) / len(run.eps))
                if rest.any():
                    ok[rest] = run.timed(
                        lambda eps=eps, rest=rest: self._crown_each(
                            x[rest], y[rest], eps, "CROWN", len(run.eps)), e)

    @staticmethod
    def _decide(certified_at: Callable[[float], Tensor], run: _Run, radius: bool,
                search: Callable[[list], Tensor]) -> None:
        """Each ε's column by ``certified_at`` (timed per ε) and, with
        ``radius``, the radius search seeded with those decisions."""
        decided = []
        for e, eps in enumerate(run.eps):
            ok = run.timed(lambda eps=eps: certified_at(eps), e)
            run.columns[e].append(ok)
            decided.append((eps, ok))
        if radius:
            run.radii.append(search(decided))

    def _taylor(self, x: Tensor, y: Tensor, radius: bool, run: _Run) -> None:
        """``taylor`` on one batch, a memory-sized part at a time
        (:func:`lipvit.certify.taylor.jacobian_norms.taylor_batch`)."""
        oks: list[list[Tensor]] = [[] for _ in run.eps]
        rs = []
        size = taylor_batch(self.model, self.max_memory)
        for start in range(0, len(x), size):
            part = slice(start, start + size)
            tb = run.timed(lambda part=part: taylor_bound(
                self.model, x[part], y[part], max_memory=self.max_memory,
                max_symbols=self.max_symbols))
            probed = []
            for e, eps in enumerate(run.eps):
                slack = run.timed(lambda eps=eps, tb=tb: tb.slack(eps), e)
                oks[e].append(slack > 0)
                probed.append((eps, slack))
            if radius:
                rs.append(tb.radius(rtol=self.radius_tol, probed=probed))
        for e in range(len(run.eps)):
            run.columns[e].append(torch.cat(oks[e]))
        if radius:
            run.radii.append(torch.cat(rs))

    def _crown_each(self, x: Tensor, y: Tensor, eps: float, method: str,
                    per_point: int) -> Tensor:
        """CROWN (or alpha-CROWN: ``method``) certificates one point at a time
        (minutes per point on a CPU: progress advances per point, by
        ``1 / per_point``), all with the one bounded model of the
        construction."""
        from lipvit.certify.crown.bounds import crown_certify

        out = []
        for i in range(x.shape[0]):
            out.append(crown_certify(self.model, x[i:i + 1], y[i:i + 1], eps,
                                     method=method, prepared=self._crown))
            if self.progress is not None:
                self.progress(1 / per_point)
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool)

    def _smoothing(self, x: Tensor, y: Tensor, index, radius: bool, run: _Run
                   ) -> Certified:
        smoothed = run.timed(lambda: certify_smoothed(
            self.model, x, self.smoothing, num_classes=self.model.config.num_classes,
            index=index, progress=self.progress))
        for e, eps in enumerate(run.eps):
            run.columns[e].append(smoothed.certified(y, eps).to(y.device))
        if radius:
            run.radii.append(smoothed.certified_radius(y).to(x.device))
        out = self._result(smoothed.prediction, run, radius)
        return out._replace(counts=smoothed.counts, p_lower=smoothed.p_lower,
                            smoothed=smoothed)

    def _result(self, prediction: Tensor, run: _Run, radius: bool) -> Certified:
        certified = torch.stack([torch.cat(c) for c in run.columns], dim=1)
        return Certified(
            prediction, certified, torch.cat(run.radii) if radius else None,
            torch.tensor(run.eps, dtype=torch.float64),
            torch.tensor([run.shared + own for own in run.own], dtype=torch.float64))
