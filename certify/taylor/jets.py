"""Second-order Taylor models ("jets") of activations in the image (docs/taylor.md §12).

A :class:`Jet` of an activation tensor ``z(x̄ + δ)`` of shape ``S``, for image
moves ``δ ∈ ℝⁿ`` with ``‖δ‖₂ ≤ ε``, is

    z(x̄ + δ) = c + L δ + ½ δᵀ Q δ + e(δ),    |e(δ)| ≤ r(ε)  elementwise,

``c`` ``(*S)``, ``L`` ``(*S, n)``, ``Q`` ``(*S, n, n)`` symmetric: the exact
second-order Taylor polynomial, and ``r`` a **sound** bound on the rest for
every ε (eq. 12.1). The operations below map jets to jets: affine maps, sums,
bilinear contractions (products, attention's ``q kᵀ`` and ``P v``) and
elementwise functions with a bounded third derivative (``exp``, ``1/x``,
``(v + η)^{-1/2}``, the exact GELU); each keeps the polynomial exact and
bounds what it drops (eqs. 12.2–12.4).

Each operation's rest splits as ``e = D[e_parents] + s``: ``D`` its clean
Jacobian (the linear part) and ``s`` what it adds (0 for the affine ones),
both bounded by the operation's rule. Unrolled over the graph, a node's rest
is exactly ``Σ_w J_{v←w} s_w`` with ``J_{v←w}`` the clean derivative of node
``v`` in node ``w`` (eq. 12.5): :class:`BackSubstitution` computes the ``J``
by autograd through the centres ``c`` (each operation computes ``c`` with the
graph kept; ``L`` and ``Q`` without).

The polynomial does not depend on ε: it is computed once, and what the bounds
need of it (the centre, ``ℓ = ‖L_u‖₂`` and ``κ = ‖Q_u‖₂`` per element ``u``)
is kept in the :class:`Node` graph, which evaluates them at any ε afterwards
without the ``(*S, n, n)`` tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from lipvit.certify.crown.relaxations import gelu_grad
from torch import Tensor

from lipvit.spectral import eigh, eigvalsh

Bounds = tuple[Tensor, Tensor | None]
"""``(r, s)``: bounds on a node's whole rest and on its own part ``s``
(``None``: ``s = 0``, an affine operation)."""


class Node:
    """One jet's rest: ``rule(eps, *parents' r) -> (r, s)`` (:data:`Bounds`),
    and its centre ``c`` with its autograd graph (:class:`BackSubstitution`)."""

    __slots__ = ("c", "linear", "parents", "rule")

    def __init__(self, c: Tensor, parents: tuple[Node, ...],
                 rule: Callable[..., Bounds], linear: bool):
        self.c, self.parents, self.rule, self.linear = c, parents, rule, linear


@dataclass
class Jet:
    """``c + Lδ + ½δᵀQδ`` with the rest's :class:`Node` (module docstring)."""

    c: Tensor  # (*S), with its autograd graph
    L: Tensor  # (*S, n)
    Q: Tensor  # (*S, n, n)
    node: Node
    _norms: tuple[Tensor, Tensor] | None = field(default=None, repr=False)

    @property
    def shape(self) -> torch.Size:
        return self.c.shape

    @property
    def centre(self) -> Tensor:
        """``c`` without its graph."""
        return self.c.detach()

    def norms(self) -> tuple[Tensor, Tensor]:
        """``(ℓ, κ)``: ``‖L_u‖₂`` and the spectral norm ``‖Q_u‖₂`` per element."""
        if self._norms is None:
            self._norms = (torch.linalg.vector_norm(self.L, dim=-1),
                           symmetric_norm(self.Q))
        return self._norms


def _jet(c: Tensor, L: Tensor, Q: Tensor, parents: tuple[Jet, ...],
         rule: Callable[..., Bounds], linear: bool = True) -> Jet:
    """A jet whose node's ``rule`` returns ``s = None`` when ``linear``."""
    return Jet(c, L, Q, Node(c, tuple(p.node for p in parents), rule, linear))


def symmetric_norm(Q: Tensor) -> Tensor:
    """Spectral norm of each symmetric ``(n, n)`` matrix of ``Q`` ``(*S, n, n)``
    (its largest eigenvalue in magnitude), raised by a float64 backward-error
    margin so that it is an upper bound."""
    if Q.numel() == 0:
        return Q.new_zeros(Q.shape[:-2])
    lam = eigvalsh(Q.reshape(-1, *Q.shape[-2:]))
    return lam.abs().amax(-1).reshape(Q.shape[:-2]) * (1 + 1e-12) + 1e-300


def polynomial_range(lin: Tensor, quad: Tensor, eps: Tensor) -> Tensor:
    """``ℓε + ½κε² ≥ |Lδ + ½δᵀQδ|`` over ``‖δ‖ ≤ ε`` (eq. 12.2)."""
    return lin * eps + 0.5 * quad * eps**2


def input_jet(c: Tensor, L: Tensor) -> Jet:
    """An affine function ``c + Lδ`` of the image: exact, no rest. ``c`` is
    made a leaf of the centres' graph."""
    c = c.detach().requires_grad_()
    Q = L.new_zeros(*c.shape, L.shape[-1], L.shape[-1])
    zero = c.new_zeros(c.shape)
    return _jet(c, L, Q, (), lambda eps: (zero, None))


def affine(j: Jet, W: Tensor, b: Tensor | None = None) -> Jet:
    """``x W + b`` along the last axis of ``S`` (``W`` ``(D_in, D_out)``); the
    rest maps through ``|W|`` (each output element is a sum)."""
    W = W.detach()
    c = j.c @ W if b is None else j.c @ W + b.detach()
    with torch.no_grad():
        L = torch.einsum("...dn,de->...en", j.L, W)
        Q = torch.einsum("...dnm,de->...enm", j.Q, W)
    A = W.abs()
    return _jet(c, L, Q, (j,), lambda eps, r: (r @ A, None))


def scale(j: Jet, s: Tensor | float) -> Jet:
    """``s ⊙ x`` with a constant ``s`` broadcasting over ``S``."""
    s = torch.as_tensor(s, dtype=j.c.dtype, device=j.c.device).detach()
    a = s.abs()
    return _jet(j.c * s, j.L * s[..., None], j.Q * s[..., None, None], (j,),
                lambda eps, r: (r * a, None))


def add(a: Jet, b: Jet) -> Jet:
    """``a + b`` (same shape)."""
    return _jet(a.c + b.c, a.L + b.L, a.Q + b.Q, (a, b),
                lambda eps, ra, rb: (ra + rb, None))


def reduce_sum(j: Jet, dim: int) -> Jet:
    """Sum over axis ``dim`` (negative, counted within ``S``) of ``S``."""
    if dim >= 0:
        raise ValueError("dim must be negative (an axis of S counted from its end)")
    return _jet(j.c.sum(dim), j.L.sum(dim - 1), j.Q.sum(dim - 2), (j,),
                lambda eps, r: (r.sum(dim), None))


def restructure(j: Jet, f: Callable[[Tensor, int], Tensor]) -> Jet:
    """A reshape / permute / index of ``S``: ``f(t, k)`` applies it to a tensor
    of shape ``(*S, …)`` with ``k`` trailing axes to keep."""
    return _jet(f(j.c, 0), f(j.L, 1), f(j.Q, 2), (j,),
                lambda eps, r: (f(r, 0), None))


def contract(spec: str, a: Jet, b: Jet) -> Jet:
    """The bilinear map ``torch.einsum(spec, a, b)`` on jets (eq. 12.3); ``spec``
    names the axes of ``S`` in lower case (``Y``, ``Z`` are taken).

    ``(a b)``'s polynomial is ``c_a c_b + c_a p_b + c_b p_a + (L_aδ)(L_bδ)``; of
    its rest ``c_b e_a + c_a e_b`` is the linear part and
    ``s = (L_aδ)(½δᵀQ_bδ) + (½δᵀQ_aδ)(L_bδ) + ¼(δᵀQ_aδ)(δᵀQ_bδ) + e_a(p_b + e_b)
    + e_b p_a`` is bounded term by term, summed over the contracted axes by the
    same einsum on the nonnegative bounds.
    """
    ins, out = spec.replace(" ", "").split("->")
    sa, sb = ins.split(",")
    c = torch.einsum(spec, a.c, b.c)
    ca, cb = a.centre, b.centre
    with torch.no_grad():
        L = (torch.einsum(f"{sa}Z,{sb}->{out}Z", a.L, cb)
             + torch.einsum(f"{sa},{sb}Z->{out}Z", ca, b.L))
        cross = torch.einsum(f"{sa}Y,{sb}Z->{out}YZ", a.L, b.L)
        Q = (torch.einsum(f"{sa}YZ,{sb}->{out}YZ", a.Q, cb)
             + torch.einsum(f"{sa},{sb}YZ->{out}YZ", ca, b.Q)
             + cross + cross.transpose(-1, -2))
    (la, ka), (lb, kb) = a.norms(), b.norms()
    ca, cb = ca.abs(), cb.abs()

    def rule(eps: Tensor, ra: Tensor, rb: Tensor) -> Bounds:
        def e(x: Tensor, y: Tensor) -> Tensor:
            return torch.einsum(spec, x, y)

        pa, pb = polynomial_range(la, ka, eps), polynomial_range(lb, kb, eps)
        s = (0.5 * eps**3 * (e(la, kb) + e(ka, lb)) + 0.25 * eps**4 * e(ka, kb)
             + e(ra, pb + rb) + e(pa, rb))
        return e(ra, cb) + e(ca, rb) + s, s

    return _jet(c, L, Q, (a, b), rule, linear=False)


class Smooth(NamedTuple):
    """An elementwise function for :func:`apply`: ``φ``, ``φ'``, ``φ''`` at the
    centre and ``m3(c, h) ≥ sup_{|t| ≤ h} |φ'''(c + t)|`` (``inf`` where the
    interval leaves the domain)."""

    f: Callable[[Tensor], Tensor]
    d1: Callable[[Tensor], Tensor]
    d2: Callable[[Tensor], Tensor]
    m3: Callable[[Tensor, Tensor], Tensor]


def apply(j: Jet, phi: Smooth) -> Jet:
    """``φ`` elementwise (eq. 12.4): the polynomial ``φ(c) + φ'(c)p + ½φ''(c)(Lδ)²``;
    of the rest, ``φ'(c)e`` is linear and ``s = ½φ''(c)(h² − (Lδ)²) +
    φ'''(ξ)h³/6`` (``h = p + e``, ``|h² − (Lδ)²| ≤ |h − Lδ| |h + Lδ|``)."""
    c = j.centre
    d1, d2 = phi.d1(c), phi.d2(c)
    with torch.no_grad():
        L = d1[..., None] * j.L
        Q = (d1[..., None, None] * j.Q
             + d2[..., None, None] * j.L[..., :, None] * j.L[..., None, :])
    lin, quad = j.norms()
    a1, a2 = d1.abs(), d2.abs()

    def rule(eps: Tensor, r: Tensor) -> Bounds:
        beyond = 0.5 * quad * eps**2 + r  # ≥ |h − Lδ|
        h = lin * eps + beyond  # ≥ |h|
        s = 0.5 * a2 * beyond * (2 * lin * eps + beyond) + phi.m3(c, h) * h**3 / 6
        return a1 * r + s, s

    return _jet(phi.f(j.c), L, Q, (j,), rule, linear=False)


def shift(j: Jet, b: Tensor) -> Jet:
    """``x + b``, ``b`` a constant broadcasting over ``S``: the same
    coefficients and rest (the same node)."""
    return Jet(j.c + b.detach(), j.L, j.Q, j.node, j._norms)


def topological(out: Node) -> list[Node]:
    """Every node ``out`` depends on, each once, parents before children."""
    order: list[Node] = []
    done: set[int] = set()
    stack: list[tuple[Node, bool]] = [(out, False)]
    while stack:
        v, expanded = stack.pop()
        if id(v) in done:
            continue
        if expanded:
            done.add(id(v))
            order.append(v)
            continue
        stack.append((v, True))
        stack.extend((p, False) for p in v.parents if id(p) not in done)
    return order


class BackSubstitution:
    """Rest bounds tightened by eq. 12.5 at chosen nodes (``targets``).

    A target ``v``'s rest is ``e_v = Σ_w J_{v←w} s_w`` over the non-linear
    nodes ``w`` upstream (``J_{v←v} = I``), ``J`` the clean derivatives: so
    ``|e_v| ≤ Σ_w |J_{v←w}| s̄_w``, which does not compound the interval
    bounds of the operations in between. :meth:`bounds` evaluates every node
    in order, each from its parents' (tightened) bounds, and takes the smaller
    of the two at each target. The ``|J|`` are computed here, once, by
    autograd through the centres (one batched backward pass per target).
    """

    def __init__(self, out: Node, targets: list[Node]):
        self.order = topological(out)
        position = {id(v): i for i, v in enumerate(self.order)}
        own = [v for v in self.order if not v.linear and v.c.requires_grad]
        self.jacobians: dict[int, list[tuple[Node, Tensor]]] = {}
        for v in targets:
            ups = [w for w in own if position[id(w)] < position[id(v)]]
            if not ups or not v.c.requires_grad:
                continue
            n = v.c.numel()
            basis = torch.eye(n, dtype=v.c.dtype, device=v.c.device)
            basis = basis.reshape(n, *v.c.shape)  # one cotangent per element
            grads = torch.autograd.grad(v.c, [w.c for w in ups], grad_outputs=basis,
                                        is_grads_batched=True, retain_graph=True,
                                        allow_unused=True)
            self.jacobians[id(v)] = [(w, g.abs().reshape(n, -1))  # (|S_v|, |S_w|)
                                     for w, g in zip(ups, grads, strict=True)
                                     if g is not None]

    def nbytes(self) -> int:
        """Bytes held by the ``|J|``."""
        return sum(J.numel() * J.element_size() for js in self.jacobians.values()
                   for _, J in js)

    def bounds(self, eps: Tensor) -> dict[int, Bounds]:
        """``{id(v): (r_v, s_v)}`` for every node at ε."""
        memo: dict[int, Bounds] = {}
        for v in self.order:
            r, s = v.rule(eps, *(memo[id(p)][0] for p in v.parents))
            if id(v) in self.jacobians:
                back = sum(J @ memo[id(w)][1].reshape(-1)
                           for w, J in self.jacobians[id(v)])
                back = back.reshape(r.shape) + (0 if s is None else s)
                r = torch.minimum(r, back)
            memo[id(v)] = (r, s)
        return memo


def _finite_where(ok: Tensor, value: Tensor) -> Tensor:
    return torch.where(ok, value, torch.full_like(value, math.inf))


EXP = Smooth(torch.exp, torch.exp, torch.exp, lambda c, h: torch.exp(c + h))
"""``exp``: ``φ''' = exp`` is increasing."""

RECIPROCAL = Smooth(
    torch.reciprocal,
    lambda c: -c**-2,
    lambda c: 2 * c**-3,
    lambda c, h: _finite_where(c - h > 0, 6 * (c - h).clamp_min(1e-300) ** -4),
)
"""``1/x`` on ``x > 0``: ``|φ'''| = 6/x⁴`` decreases."""


def inverse_sqrt(eta: float) -> Smooth:
    """``(v + η)^{-1/2}`` on ``v > −η`` (LayerNorm's scale):
    ``|φ'''| = (15/8)(v + η)^{-7/2}`` decreases."""
    def u(v: Tensor) -> Tensor:
        return v + eta

    return Smooth(
        lambda v: u(v).rsqrt(),
        lambda v: -0.5 * u(v) ** -1.5,
        lambda v: 0.75 * u(v) ** -2.5,
        lambda v, h: _finite_where(u(v) - h > 0,
                                   1.875 * (u(v) - h).clamp_min(1e-300) ** -3.5),
    )


_SQRT_2PI = math.sqrt(2 * math.pi)
GELU_CRITICAL = (math.sqrt((7 - math.sqrt(33)) / 2), math.sqrt((7 + math.sqrt(33)) / 2))
"""The zeros of ``d/dx [x(x² − 4)ϕ(x)]`` on ``x > 0`` (``x⁴ − 7x² + 4 = 0``):
where ``|GELU'''|`` has its local maxima."""


def _pdf(x: Tensor) -> Tensor:
    return torch.exp(-0.5 * x**2) / _SQRT_2PI


def _gelu_d3(x: Tensor) -> Tensor:
    return x * _pdf(x) * (x**2 - 4)


_GELU_PEAKS = [(t, abs(t * (t * t - 4)) * math.exp(-0.5 * t * t) / _SQRT_2PI)
               for t in GELU_CRITICAL]


def _gelu_m3(c: Tensor, h: Tensor) -> Tensor:
    """``sup |x(x² − 4)ϕ(x)|`` on ``[c − h, c + h]``: at an end or at an interior
    critical point ``±t`` of :data:`GELU_CRITICAL` (``|φ'''|`` is even)."""
    lo, hi = c - h, c + h
    best = torch.maximum(_gelu_d3(lo).abs(), _gelu_d3(hi).abs())
    for t, peak in _GELU_PEAKS:
        inside = ((lo <= t) & (t <= hi)) | ((lo <= -t) & (-t <= hi))
        best = torch.where(inside, best.clamp_min(peak), best)
    return best * (1 + 1e-12)


GELU = Smooth(
    lambda x: torch.nn.functional.gelu(x),
    gelu_grad,
    lambda x: _pdf(x) * (2 - x**2),
    _gelu_m3,
)
"""The exact (erf) GELU ``xΦ(x)``: ``φ' = Φ + xϕ``, ``φ'' = (2 − x²)ϕ``,
``φ''' = x(x² − 4)ϕ``."""


class QuadraticForm:
    """``q(δ) = gᵀδ + ½δᵀQδ`` for a batch ``g`` ``(*, n)``, ``Q`` ``(*, n, n)``
    symmetric; :meth:`minimum` bounds its minimum over the ε-ball from below
    (eq. 12.7). The eigendecomposition is computed once, here."""

    def __init__(self, g: Tensor, Q: Tensor):
        lam, V = eigh(Q)
        top = lam.abs().amax(-1, keepdim=True)
        # float64 backward-error margin: lower eigenvalues only lower the bound
        self.lam = lam - 1e-12 * (top + 1)  # (*, n)
        self.gt2 = (V.mT @ g[..., None])[..., 0] ** 2  # (*, n): g in the eigenbasis
        self.floor = (-self.lam[..., 0]).clamp_min(0)  # μ above it: Q + μI ≻ 0
        self.scale = top[..., 0] + 1
        self.g_norm = self.gt2.sum(-1).sqrt()

    def minimum(self, eps: Tensor, steps: int = 60) -> Tensor:
        """A lower bound on ``min_{‖δ‖ ≤ ε} q(δ)`` (``eps`` broadcasting to ``(*)``).

        Lagrangian duality: for every ``μ ≥ 0`` with ``Q + μI ≻ 0``,
        ``q(δ) ≥ −½gᵀ(Q + μI)⁻¹g − ½με²`` on the ball; ``μ`` by bisection on
        ``‖(Q + μI)⁻¹g‖ = ε`` (the trust-region condition, where the bound
        equals the minimum). Every ``μ`` gives a bound: the bisection only
        tightens it.
        """
        lam, gt2, floor = self.lam, self.gt2, self.floor
        eps = torch.as_tensor(eps, dtype=lam.dtype, device=lam.device)
        eps = eps.expand(floor.shape).clamp_min(1e-300)
        lo = floor
        hi = floor + self.scale + self.g_norm / eps  # there ‖(Q + μI)⁻¹g‖ < ε
        for _ in range(steps):
            mid = 0.5 * (lo + hi)
            big = (gt2 / (lam + mid[..., None]) ** 2).sum(-1) > eps**2
            lo, hi = torch.where(big, mid, lo), torch.where(big, hi, mid)
        mu = torch.where(hi > floor, hi, floor + 1e-12 * self.scale)
        return -0.5 * (gt2 / (lam + mu[..., None])).sum(-1) - 0.5 * mu * eps**2
