"""``lipvit.Certifier``: certification in the shape the field's tools have
(auto_LiRPA wraps a model once; Cohen et al.'s ``Smooth(...).certify`` returns
a prediction and a radius): build it once per model, then ask for tensors.

    cert = lipvit.Certifier(model, method="ball")
    out = cert.certify(x, y, [0.25, 0.5])   # out.certified (n, 2), out.radius (n,)

Every method of :data:`lipvit.certify.evaluate.ALL_METHODS` is reachable.
``ball``, ``margin`` and ``global`` keep the model's proven constants between
calls; the others run :func:`lipvit.certify.evaluate.certify_samples` on the
float64 copy made once here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .ball.network import BallCertificate
from .certification import float64_model
from .eps import check_eps_list
from .evaluate import ALL_METHODS, certify_samples, check_methods
from .follow.network import MarginCertificate
from .global_bound import global_constant, global_radius, proven_chain


class Certified(NamedTuple):
    """What :meth:`Certifier.certify` returns for ``n`` points and ``E`` radii.

    ``prediction`` ``(n,)`` the network's class (``smoothing``: the smoothed
    classifier's, −1 where it abstains); ``certified`` ``(n, E)`` bool, point
    ``i`` proven at ``eps[e]`` (and correctly classified); ``radius`` ``(n,)``
    the certified radius (0 where none); ``eps`` ``(E,)``. ``smoothing`` only:
    ``counts`` ``(n, classes)`` its estimation draws per class and
    ``p_lower`` ``(n,)`` the lower confidence bound of the top class."""

    prediction: Tensor
    certified: Tensor
    radius: Tensor
    eps: Tensor
    counts: Tensor | None = None
    p_lower: Tensor | None = None


class Certifier:
    """A model's certifier for one method (module docstring).

    Args:
        model: a lipvit model (ViT, hybrid ViT, CaiT) on the images' device.
        method: a name from :data:`~lipvit.certify.evaluate.ALL_METHODS`;
            ``None`` picks the default of the model's architecture (what
            ``lipvit certify`` picks without ``--method``).
        **settings: passed to :func:`~lipvit.certify.evaluate.certify_samples`
            for the methods that run through it (``max_memory``,
            ``smoothing=SmoothingConfig(...)``, ``batch_size``, ...).

    Raises:
        UnsupportedModelError: the method cannot bound this architecture.
        ValueError: an unknown method.
    """

    def __init__(self, model: nn.Module, method: str | None = None, **settings: Any):
        if method is None:
            from lipvit.commands.certify import default_method

            method, _ = default_method(model)
        if method not in ALL_METHODS:
            raise ValueError(f"unknown method {method!r}; choose from "
                             f"{', '.join(ALL_METHODS)}")
        check_methods(model, [method])
        self.method, self.settings = method, settings
        self.model = model if method == "smoothing" else float64_model(model)
        self._chain = self._global = None
        with torch.no_grad():
            if method in ("ball", "margin"):
                self._chain = proven_chain(self.model)
            elif method == "global":
                self._global = global_constant(self.model)

    def certify(self, x: Tensor, y: Tensor, eps: float | Sequence[float],
                index: Sequence[int] | None = None) -> Certified:
        """Certify images ``x`` ``(n, C, S, S)`` in [0, 1] with labels ``y``
        ``(n,)`` at each radius of ``eps`` (a float or a list); ``index``
        (the test-set indices) seeds ``smoothing``'s noise per point,
        reproducibly; without it each call draws fresh noise."""
        eps_list = [float(e) for e in check_eps_list(
            [eps] if isinstance(eps, int | float) else list(eps))]
        grid = torch.tensor(eps_list, dtype=torch.float64)
        if self._chain is not None or self._global is not None:
            return self._proven(x.to(torch.float64), y, eps_list, grid)
        report = certify_samples(self.model, x, y, [self.method], eps_list,
                                 radius=True, index=index, **self.settings)
        certified = torch.stack([report.certified[f"{self.method}@{e}"]
                                 for e in eps_list], dim=1)
        smoothed = report.smoothing
        return Certified(
            smoothed.prediction if smoothed is not None else report.predictions,
            certified, report.radii[self.method], grid,
            smoothed.counts if smoothed is not None else None,
            smoothed.p_lower if smoothed is not None else None)

    @torch.no_grad()
    def _proven(self, x: Tensor, y: Tensor, eps_list: list[float], grid: Tensor
                ) -> Certified:
        logits = self.model(x)
        if self._global is not None:
            radius = global_radius(logits, y, self._global)
            certified = radius[:, None] >= grid.to(radius.device)
        else:
            make = BallCertificate if self.method == "ball" else MarginCertificate
            cert = make(self._chain, self.model, x, y)
            columns = [cert.certified(e) for e in eps_list]
            radius = cert.radius(certified_at=list(zip(eps_list, columns,
                                                       strict=True)))
            certified = torch.stack(columns, dim=1)
        return Certified(logits.argmax(dim=1), certified, radius, grid)
