"""CROWN bounds of a :class:`lipvit.ViT` over an ℓ2 ball, through auto_LiRPA (optional).

CROWN (Zhang et al., NeurIPS 2018) propagates linear lower and upper bounds of
every node backwards to the input and concretises them over the perturbation
set; auto_LiRPA (Xu et al., NeurIPS 2020) does this on general graphs. Here the
set is the ℓ2 ball ``{x' : ‖x' − x‖_2 ≤ ε}`` in image space (``x`` in
``[0, 1]``, flattened per sample), so a linear bound ``a·x' + c`` concretises
to ``a·x + c ± ε‖a‖_2`` (Hölder). The ball is **not** intersected with the
``[0, 1]`` box: bounds over the ball hold on its intersection with the box too,
so they are sound, just not as tight as they could be near the box's faces.

Margins are bounded directly with a specification matrix ``C`` (row ``j`` is
``e_y − e_j``). Certification is docs/math.md §1 with CROWN in place of δ: certified
iff the clean point is classified ``y`` and every ``logit_y − logit_j``
(``j ≠ y``) has a positive lower bound over the ball.

Soundness. The model is rewritten by
:func:`lipvit.certify.crown.verifiable.to_verifiable` (same function, float64) and
bounded by auto_LiRPA 0.3 with three safeguards, because parts of auto_LiRPA 0.3 are
unsound and lipvit only trusts what it has reviewed and tests against sampling and PGD:

- every node with a perturbed output must be of a reviewed operator type
  (:data:`REVIEWED_OPS`), else :class:`UnsupportedModelError`. Left out on
  purpose: ``Sqrt`` (its upper relaxation uses the slope ``−½x^{−3/2}`` instead
  of ``½x^{−1/2}``: not an upper bound), ``Reciprocal``, ``Softmax``. A
  ``Div`` is accepted only as a softmax ``exp(s) / Σ exp(s)``: with a constant
  operand auto_LiRPA multiplies by ``1/const`` whichever side the constant is
  on, its interval rule ``[x_l/y_u, x_u/y_l]`` needs ``x ≥ 0``, and a
  ``Div`` by a ``Sqrt`` node is replaced by an ad-hoc LayerNorm formula.
- LayerProject's factor ``ψ_R(s) = min(1, R/√s)`` is one operator with our own
  relaxation (:func:`project_scale_relaxation`), so no square root is bounded;
  so are the standard family's LayerNorm scale ``1/√(v + η)`` and exact GELU
  (:mod:`lipvit.certify.crown.relaxations`).
  Softmax outputs are clipped to ``[0, 1]`` (auto_LiRPA's reference bounds).
- the softmax ``Div`` is relaxed through ``1/y`` on the denominator's bounds,
  valid only if they are > 0; samples where they are not, or where any
  intermediate bound is not finite, get vacuous bounds (``∓inf``), after
  recomputing the other samples of the batch alone (auto_LiRPA replaces a NaN
  bias by 0 for the whole batch).
- auto_LiRPA's ``MatMul`` relaxation is replaced by :func:`matmul_mccormick_backward`
  (the same numbers, computed without huge temporaries; tested equal).

Bounds are then sound up to floating-point rounding in auto_LiRPA's float64
arithmetic.

alpha-CROWN (``method="alpha-CROWN"``; Xu et al., ICLR 2021) is auto_LiRPA's
``CROWN-Optimized`` mode: the lower slope ``α ∈ [0, 1]`` of every unstable
ReLU, one per ReLU unit, margin and sample, is tuned by auto_LiRPA's own Adam
loop (:data:`ALPHA_ITERATIONS` steps) to raise the margins' bounds; any
``α ∈ [0, 1]`` gives a valid relaxation, so every step's bound is sound and
auto_LiRPA keeps the best per margin. lipvit first runs plain CROWN with the
safeguards above and then optimises only the final (margin) bound, with every
intermediate bound fixed to CROWN's checked ones: the checks stay valid for the
bound that is returned, the slopes start from CROWN's, and the result is
never looser than CROWN's (lipvit keeps the larger of the two). Only ReLU has
optimisable slopes in auto_LiRPA 0.3; the other operators, lipvit's
``BoundProjectScale`` and ``BoundMatMulFast`` included, keep their fixed
relaxations. (Optimising the intermediate bounds as well would cost a whole
CROWN pass, with autograd, per step.)

Shape letters: ``B`` batch, ``C`` channels, ``S`` image side, ``K`` classes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import logging
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from lipvit.certify.crown import lirpa_compat
from lipvit.certify.crown.relaxations import (
    gelu,
    gelu_range,
    gelu_relaxation,
    rsqrt,
    rsqrt_relaxation,
)
from lipvit.certify.crown.verifiable import (
    GELU_OP,
    PROJECT_SCALE_OP,
    RSQRT_OP,
    project_scale,
    to_verifiable,
)
from lipvit.certify.eps import check_eps
from lipvit.certify.lofast.network import check_dot_attention
from torch import Tensor, nn

from lipvit.errors import UnsupportedModelError
from lipvit.model import ViT

METHODS = ("CROWN", "IBP", "alpha-CROWN")
#: auto_LiRPA options: dense ("matrix") bound matrices (its default "patches"
#: mode is meant for convolutions and fails on this graph); one slope per ReLU
#: unit for alpha-CROWN (its "sparse features" slopes only handle inputs of
#: shape (B, n) or (B, C, H, W), not the tokens' (B, N, D)).
BOUND_OPTS = {"conv_mode": "matrix", "sparse_features_alpha": False}
#: alpha-CROWN: Adam steps on the ReLU slopes (auto_LiRPA's default). The step
#: count is the cost: each is one backward pass of the margins (with autograd).
ALPHA_ITERATIONS = 20
#: alpha-CROWN: Adam's learning rate for the slopes (auto_LiRPA's default).
ALPHA_LR = 0.5
#: auto_LiRPA operator classes allowed on perturbed nodes (relaxations reviewed).
REVIEWED_OPS = frozenset({
    "BoundInput", "BoundLinear", "BoundMatMul", "BoundAdd", "BoundSub", "BoundMul",
    "BoundDiv", "BoundExp", "BoundPow", "BoundRelu", "BoundReduceSum",
    "BoundReduceMean", "BoundReshape", "BoundTranspose", "BoundGather",
    "BoundUnsqueeze", "BoundSqueeze", "BoundFlatten", "BoundProjectScale",
    "BoundMatMulFast", "BoundRSqrt", "BoundGELU",
})
#: Absolute slack added to the intercepts of ψ_R's relaxation (ψ_R ∈ (0, 1]).
RELAXATION_SLACK = 1e-12


def project_scale_relaxation(
    lower: Tensor, upper: Tensor, radius: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Linear bounds ``k_l s + b_l ≤ ψ_R(s) ≤ k_u s + b_u`` on ``s ∈ [lower, upper]``.

    ``ψ_R(s) = min(1, R/√s)`` (1 for ``s ≤ R²``) is non-increasing, constant on
    ``s ≤ R²`` and convex on ``s ≥ R²``. With ``a = max(l, R²)``:

    - upper: the chord through ``(a, ψ(a))`` and ``(u, ψ(u))`` — above ψ on
      ``[a, u]`` by convexity, and at least ``ψ(a) = 1`` left of ``a`` because
      its slope is ≤ 0. If ``u ≤ a`` the constant ``ψ(l)``.
    - lower: if ``l ≥ R²`` the tangent at the midpoint (convexity). Otherwise
      the line through ``(u, ψ(u))`` of slope ``−min(κ, |ψ'(u)|)``, ``κ`` the
      slope magnitude of the chord from ``(l, 1)``: when ``κ ≤ |ψ'(u)|`` it is
      that chord, which lies below ψ on ``[R², u]`` because ψ is convex there
      and falls at least as steeply as it at ``u``, and below 1 left of ``R²``;
      when ``κ > |ψ'(u)|`` it is the tangent at ``u``, below ψ on ``[R², u]``
      and below ``1`` at ``l`` (hence on ``[l, R²]``).

    Degenerate intervals (``u − l`` tiny) get the constants ``ψ(u) ≤ ψ ≤ ψ(l)``.
    Intercepts are widened by :data:`RELAXATION_SLACK`.

    Args:
        lower, upper: bounds of ``s``, same shape, ``lower ≤ upper`` (any sign).
        radius: ``R > 0``.

    Returns:
        ``(k_l, b_l, k_u, b_u)``, each of the shape of ``lower``.
    """
    R2 = radius * radius
    lo, up = lower, torch.maximum(upper, lower)
    psi_l, psi_u = project_scale(lo, radius), project_scale(up, radius)
    tiny = 1e-12 * (1.0 + up.abs())
    degenerate = (up - lo) <= tiny
    # Upper: chord from a = max(lo, R²) to up.
    a = torch.clamp(lo, min=R2)
    psi_a = project_scale(a, radius)
    span = (up - a).clamp_min(1e-300)
    chord = (psi_u - psi_a) / span
    flat_up = (up - a) <= tiny
    k_u = torch.where(flat_up | degenerate, torch.zeros_like(lo), chord)
    b_u = torch.where(flat_up | degenerate, psi_l, psi_a - chord * a)
    # Lower.
    def dpsi(s: Tensor) -> Tensor:  # ψ'(s) on s ≥ R²
        return -0.5 * radius * s.clamp_min(R2).pow(-1.5)
    mid = 0.5 * (lo + up)
    k_mid = dpsi(mid)
    b_mid = project_scale(mid, radius) - k_mid * mid
    kappa = (1.0 - psi_u) / (up - lo).clamp_min(1e-300)
    slope = -torch.minimum(kappa, -dpsi(up))
    b_cross = psi_u - slope * up
    convex = lo >= R2
    k_l = torch.where(convex, k_mid, slope)
    b_l = torch.where(convex, b_mid, b_cross)
    const_one = up <= R2  # ψ ≡ 1 on [lo, up]
    k_l = torch.where(const_one | degenerate, torch.zeros_like(lo), k_l)
    b_l = torch.where(const_one, torch.ones_like(lo), b_l)
    b_l = torch.where(degenerate, psi_u, b_l)
    return k_l, b_l - RELAXATION_SLACK, k_u, b_u + RELAXATION_SLACK


def _project_scale_interval(lower: Tensor, upper: Tensor, radius: float
                            ) -> tuple[Tensor, Tensor]:
    return project_scale(upper, radius), project_scale(lower, radius)  # non-increasing


def _rsqrt_interval(lower: Tensor, upper: Tensor, eta: float) -> tuple[Tensor, Tensor]:
    return rsqrt(upper, eta), rsqrt(lower, eta)  # non-increasing


#: lipvit's own operators: ONNX name -> (auto_LiRPA class name, its float
#: attribute, function, interval bounds, linear relaxation).
CUSTOM_OPS = {
    PROJECT_SCALE_OP: ("BoundProjectScale", "radius", project_scale,
                       _project_scale_interval, project_scale_relaxation),
    RSQRT_OP: ("BoundRSqrt", "eta", rsqrt, _rsqrt_interval, rsqrt_relaxation),
    GELU_OP: ("BoundGELU", None, lambda x, _: gelu(x),
              lambda lo, up, _: gelu_range(lo, up),
              lambda lo, up, _: gelu_relaxation(lo, up)),
}


@functools.cache
def _bound_custom_class(op: str) -> type:
    """auto_LiRPA operator class for one of :data:`CUSTOM_OPS` (ψ_R of LayerProject,
    LayerNorm's ``1/√(v + η)``, the exact GELU), bounded by its own relaxation.

    Built on first use, after
    :func:`lipvit.certify.crown.lirpa_compat.import_auto_lirpa`. """
    ops = importlib.import_module("auto_LiRPA.operators")
    name, attr_name, fn, interval, relaxation = CUSTOM_OPS[op]

    class BoundCustom(ops.BoundActivation):
        def __init__(self, attr: dict, inputs: list, output_index: int, options: Any):
            super().__init__(attr, inputs, output_index, options)
            self.param = None if attr_name is None else float(attr[attr_name])

        def forward(self, x: Tensor) -> Tensor:
            return fn(x, self.param)

        def interval_propagate(self, *v: Any) -> tuple[Tensor, Tensor]:
            return interval(v[0][0], v[0][1], self.param)

        def bound_relax(self, x: Any) -> None:
            k_l, b_l, k_u, b_u = relaxation(x.lower, x.upper, self.param)
            zero = torch.zeros_like(k_l)
            self.add_linear_relaxation(mask=None, type="lower", k=k_l, x0=zero, y0=b_l)
            self.add_linear_relaxation(mask=None, type="upper", k=k_u, x0=zero, y0=b_u)

    BoundCustom.__name__ = BoundCustom.__qualname__ = name
    return BoundCustom


def matmul_mccormick_backward(
    last_A: Tensor | None, x_l: Tensor, y_pos: Tensor, y_neg: Tensor
) -> tuple[Tensor | None, Tensor | None, Tensor | float]:
    """Back-substitute ``last_A`` through ``Z = X Yᵀ`` relaxed by McCormick planes.

    ``Z[n, m] = Σ_k X[n, k] Y[m, k]`` with ``X ∈ [x_l, x_u]``, ``Y ∈ [y_l, y_u]``
    elementwise. auto_LiRPA 0.3 relaxes each product with the planes
    ``XY ≥ y_l X + x_l Y − x_l y_l`` and ``XY ≤ y_u X + x_l Y − x_l y_u`` (from
    ``(X − x_l)(Y − y_l) ≥ 0`` and ``(X − x_l)(Y − y_u) ≤ 0``) and, for a lower
    bound, uses the first where the coefficient is positive and the second
    where it is negative (the reverse for an upper bound: pass ``y_pos = y_u``,
    ``y_neg = y_l``). This computes the same sums as auto_LiRPA's
    ``BoundLinear.bound_backward_with_weight`` with matrix products instead of
    materialising ``(S, B, …, N, M, d)`` tensors.

    Args:
        last_A: ``(S, *lead, N, M)`` coefficients of ``Z`` (``S`` specs), or None.
        x_l: ``(*lead, N, d)``.
        y_pos, y_neg: ``(*lead, M, d)``: the ``Y`` bound paired with positive and
            with negative coefficients (``y_l, y_u`` for a lower bound).

    Returns:
        ``(A_X (S, *lead, N, d), A_Y (S, *lead, M, d), bias (S, B))``.
    """
    if last_A is None:
        return None, None, 0.0
    pos, neg = last_A.clamp(min=0), last_A.clamp(max=0)
    A_x = pos.matmul(y_pos) + neg.matmul(y_neg)
    A_y = last_A.transpose(-1, -2).matmul(x_l)  # both planes have x_l on Y
    bias = -(pos * x_l.matmul(y_pos.transpose(-1, -2))
             + neg * x_l.matmul(y_neg.transpose(-1, -2)))  # (S, *lead, N, M)
    return A_x, A_y, bias.flatten(2).sum(2)


@functools.cache
def _fast_matmul_class() -> type:
    """auto_LiRPA's ``BoundMatMul`` with :func:`matmul_mccormick_backward`.

    Same relaxation and same numbers as auto_LiRPA 0.3 (tested), 10-100× less
    time and memory on attention products, where auto_LiRPA materialises one
    tensor of size ``S·B·H·N·M·d``. Other cases (identity ``last_A``, a
    broadcast weight) fall back to auto_LiRPA's code.
    """
    ops = importlib.import_module("auto_LiRPA.operators")

    class BoundMatMulFast(ops.BoundMatMul):
        def bound_backward_with_weight(self, last_lA, last_uA, input_lb, input_ub,
                                       x, y):
            x_l, y_l, y_u = input_lb[0], input_lb[1], input_ub[1]
            # An identity specification (auto_LiRPA's eyeC), as auto_LiRPA
            # itself expands it: (S, 1, *node) broadcast over the batch.
            last_lA, last_uA = (
                torch.eye(A.shape[0], device=A.device, dtype=x_l.dtype)
                .view(A.shape[0], 1, *A.shape[2:]).expand(A.shape)
                if type(A).__name__ == "eyeC" else A
                for A in (last_lA, last_uA))
            lead = tuple(x_l.shape[:-2])
            N, M = x_l.shape[-2], y_l.shape[-2]
            fast = tuple(y_l.shape[:-2]) == lead and all(
                isinstance(A, Tensor) and tuple(A.shape[1:]) == (*lead, N, M)
                for A in (last_lA, last_uA) if A is not None)
            if not fast:
                return super().bound_backward_with_weight(
                    last_lA, last_uA, input_lb, input_ub, x, y)
            lA_x, lA_y, lbias = matmul_mccormick_backward(last_lA, x_l, y_l, y_u)
            uA_x, uA_y, ubias = matmul_mccormick_backward(last_uA, x_l, y_u, y_l)
            return [(lA_x, uA_x), (lA_y, uA_y)], lbias, ubias

    return BoundMatMulFast


class _Collect(logging.Handler):
    """Keeps the messages of the records it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _captured(logger_name: str) -> Iterator[list[str]]:
    """Collect a logger's messages instead of letting them reach stderr.

    auto_LiRPA logs errors (e.g. the unsupported operators) before raising.
    """
    logger = logging.getLogger(logger_name)
    handler = _Collect()
    previous = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.propagate = previous


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily set torch's default dtype.

    auto_LiRPA 0.3 creates some tensors (identity matrices, relaxation
    coefficients) with the default dtype; without this a float64 graph mixes in
    float32 tensors and fails. Not thread-safe (the default dtype is global).
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(
            f"unknown bound method {method!r}; choose from {', '.join(METHODS)}"
        )


def _check_images(model: ViT, x: Tensor) -> None:
    cfg = model.config
    expected = (cfg.in_chans, cfg.image_size, cfg.image_size)
    if not isinstance(x, Tensor) or x.ndim != 4 or tuple(x.shape[1:]) != expected:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        dims = ", ".join(map(str, expected))
        raise ValueError(f"images must have shape (B, {dims}), got {shape}")
    if x.shape[0] == 0:
        raise ValueError("images must hold at least one sample")


def _check_labels(model: ViT, x: Tensor, y: Tensor) -> None:
    K = model.config.num_classes
    if not isinstance(y, Tensor) or y.shape != (x.shape[0],) or y.is_floating_point():
        raise ValueError(f"labels must be an integer tensor of shape ({x.shape[0]},)")
    if bool(((y < 0) | (y >= K)).any()):
        raise ValueError(f"labels must lie in [0, {K - 1}]")


def check_crown_support(model: ViT) -> None:
    """Refuse, with a one-line reason, a model lipvit's CROWN backend cannot bound.

    Both families are bounded (the standard family's GELU and LayerNorm through
    :mod:`lipvit.certify.crown.relaxations`); attention other than dot-product is not.

    Raises:
        TypeError: not a :class:`lipvit.ViT`.
        UnsupportedModelError: an attention variant lipvit's CROWN wrapper has
            no verifiable form of.
    """
    if not isinstance(model, ViT):
        raise TypeError(f"expected a lipvit.ViT, got {type(model).__name__}")
    check_dot_attention(model, "lipvit's CROWN wrapper")


def _per_sample(t: Any, batch: int) -> Tensor | None:
    """``t`` as ``(B, -1)`` if it is a tensor with a batch dimension, else None."""
    if isinstance(t, Tensor) and t.ndim >= 1 and t.shape[0] == batch:
        return t.detach().reshape(batch, -1)
    return None


def _invalid_samples(bounded: nn.Module, batch: int) -> Tensor:
    """``(B,)`` bool: samples whose intermediate bounds are unusable.

    Non-finite bounds anywhere, or a ``Div`` whose denominator's lower bound is
    not positive (its relaxation goes through ``1/y`` on ``[y_l, y_u]``).
    """
    bad = torch.zeros(batch, dtype=torch.bool)
    for node in bounded.modules():
        for name in ("lower", "upper"):
            t = _per_sample(getattr(node, name, None), batch)
            if t is not None:
                bad |= ~torch.isfinite(t).all(dim=1).cpu()
        if type(node).__name__ == "BoundDiv":
            den = _per_sample(getattr(node.inputs[1], "lower", None), batch)
            if den is None:
                bad[:] = True  # a constant denominator: never expected here
                continue
            bad |= ~(den > 0).all(dim=1).cpu()
    return bad


def _is_softmax_div(node: nn.Module) -> bool:
    """Whether ``node`` is ``e / Σe`` with ``e = exp(·)`` (a softmax)."""
    if type(node).__name__ != "BoundDiv" or len(node.inputs) != 2:
        return False
    num, den = node.inputs
    return (type(num).__name__ == "BoundExp" and type(den).__name__ == "BoundReduceSum"
            and den.inputs[0] is num)


def _softmax_reference_bounds(bounded: nn.Module, x: Tensor
                              ) -> dict[str, tuple[Tensor, Tensor]]:
    """``[0, 1]`` for every softmax output ``e / Σe`` (``e = exp(·)``) in the graph.

    auto_LiRPA keeps the tighter of these and its own intermediate bounds; the
    entries of a softmax lie in ``[0, 1]`` whatever the input, so this is sound.
    """
    reference = {}
    for node in bounded.modules():
        if _is_softmax_div(node):
            shape = (x.shape[0], *node.output_shape[1:])
            zeros = torch.zeros(shape, dtype=x.dtype, device=x.device)
            reference[node.name] = (zeros, torch.ones_like(zeros))
    return reference


def _check_reviewed(bounded: nn.Module) -> None:
    """Refuse a graph with a perturbed node of an operator not in REVIEWED_OPS."""
    if not any(getattr(node, "perturbed", False) for node in bounded.modules()):
        raise AssertionError("no perturbed node: the input was not marked")
    for node in bounded.modules():
        name = type(node).__name__
        if name.startswith("Bound") and getattr(node, "perturbed", False):
            if name not in REVIEWED_OPS and name != "BoundedModule":
                raise UnsupportedModelError(
                    f"auto_LiRPA operator {name} is not on lipvit's list of reviewed "
                    "(sound) relaxations"
                )
            if name == "BoundDiv" and not _is_softmax_div(node):
                raise UnsupportedModelError(
                    "auto_LiRPA 0.3 bounds a division soundly only as a softmax "
                    "exp(s) / sum(exp(s))"
                )


def bound_module(
    net: nn.Module,
    x: Tensor,
    eps: float,
    C: Tensor | None = None,
    method: str = "CROWN",
    bound_upper: bool = True,
    chunk_size: int | None = 2,
    cache: dict[int, nn.Module] | None = None,
    stop_when_positive: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Bounds of ``C · net(x')`` over ``‖x' − x‖_2 ≤ ε`` (per sample) by auto_LiRPA.

    The generic engine under :func:`crown_margin_bounds`; ``net`` must be
    written with reviewed operators (see the module docstring) and must apply a
    ``Linear`` to its input before anything else (auto_LiRPA reads an ℓ2
    radius only there).

    Args:
        net: a module mapping ``x`` ``(B, n)`` to ``(B, K)``, with at least one
            parameter; it is bounded in ``x``'s dtype on ``x``'s device.
        x: centres of the balls, ``(B, n)``.
        eps: radius ε ≥ 0.
        C: specification ``(B, M, K)``; bounds of ``C[b] net(x')[b]``. ``None``
            bounds the outputs themselves.
        method: ``"CROWN"`` (backward bounds everywhere), ``"alpha-CROWN"``
            (CROWN, then optimised ReLU slopes for the final bounds; see the
            module docstring) or ``"IBP"`` (interval arithmetic; fast, much
            looser).
        bound_upper: also compute upper bounds (else the second result is None).
        chunk_size: samples bounded together (None: all). auto_LiRPA's cost
            per sample grows with the batch on a CPU (cache), so small chunks
            are fastest; results do not depend on it.
        cache: auto_LiRPA's bounded copies of ``net`` by batch size, filled
            and reused (building one costs as much as bounding a sample):
            pass the same dict for every call on the same ``net``.
        stop_when_positive: alpha-CROWN only: stop optimising once every lower
            bound of a chunk is > 0 (rows of ``C`` that are all zero aside),
            which is all a certificate needs; the bounds are then sound but
            not fully optimised. The answer to "is every bound > 0?" is the
            same as without it.

    Returns:
        ``(lb, ub)``, each ``(B, M)`` (or ``(B, K)``), detached: bounds sound up
        to floating-point rounding; ``-inf``/``+inf`` for samples whose
        intermediate bounds were unusable.

    Raises:
        LipvitError: auto_LiRPA is not installed.
        UnsupportedModelError: an operator in ``net`` has no (reviewed) bound.
    """
    _check_method(method)
    eps = check_eps(eps)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"x must be flat and non-empty, (B, n); got {tuple(x.shape)}")
    if C is not None and (C.ndim != 3 or C.shape[0] != x.shape[0]):
        shape = tuple(C.shape)
        raise ValueError(f"C must have shape ({x.shape[0]}, M, K), got {shape}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lirpa = lirpa_compat.import_auto_lirpa()
    x = x.detach()
    step = x.shape[0] if chunk_size is None else chunk_size
    cache = {} if cache is None else cache
    parts = [_bound_batch(lirpa, net, x[i:i + step], eps,
                          None if C is None else C[i:i + step], method, bound_upper,
                          cache, stop_when_positive)
             for i in range(0, x.shape[0], step)]
    lb = torch.cat([p[0] for p in parts])
    return lb, torch.cat([p[1] for p in parts]) if bound_upper else None


def _bounded(lirpa: Any, net: nn.Module, x: Tensor, log: list[str]) -> nn.Module:
    """auto_LiRPA's bounded copy of ``net`` for batches shaped like ``x``, checked."""
    custom = {op: _bound_custom_class(op) for op in CUSTOM_OPS}
    custom["onnx::MatMul"] = _fast_matmul_class()
    # A perturbed placeholder input marks the perturbed nodes at once (the
    # radius is given again with every batch).
    ptb = lirpa.PerturbationLpNorm(norm=2, eps=0.0)
    try:
        placeholder = lirpa.BoundedTensor(torch.zeros_like(x), ptb)
        bounded = lirpa.BoundedModule(net, placeholder, bound_opts=BOUND_OPTS,
                                      device=x.device, custom_ops=custom)
    except NotImplementedError as exc:
        ops = sorted({m.split(",")[0][6:] for m in log if m.startswith("Name: ")})
        what = f"no bound for {', '.join(ops)}" if ops else str(exc).splitlines()[0]
        raise UnsupportedModelError(f"auto_LiRPA cannot bound this model: {what}"
                                    ) from exc
    _check_reviewed(bounded)
    for p in bounded.parameters():  # alpha-CROWN differentiates the slopes only
        p.requires_grad_(False)
    return bounded


def _fixed_bounds(bounded: nn.Module) -> dict[str, tuple[Tensor, Tensor]]:
    """The bounds of every perturbed node but the final one, after a CROWN pass
    (auto_LiRPA's ``intermediate_layer_bounds``: the nodes it must not recompute)."""
    fixed = {}
    for node in bounded.modules():
        lower, upper = getattr(node, "lower", None), getattr(node, "upper", None)
        if (node is not bounded and getattr(node, "perturbed", False)
                and node.name != bounded.final_name
                and isinstance(lower, Tensor) and isinstance(upper, Tensor)):
            fixed[node.name] = (lower.detach(), upper.detach())
    return fixed


def _never(bounds: Tensor) -> bool:
    """auto_LiRPA's default stop criterion: optimise every step."""
    return False


def _optimised_bound(bounded: nn.Module, inputs: tuple, C: Tensor | None,
                     fixed: dict[str, tuple[Tensor, Tensor]], lower: bool,
                     stop: Any) -> Tensor:
    """auto_LiRPA's ``CROWN-Optimized`` lower (or upper) bound with the bounds
    ``fixed`` of every other node, its ReLU slopes starting from CROWN's; the
    best over its steps, per entry (every step's bound is sound)."""
    bounded.set_bound_opts({"optimize_bound_args": {
        "iteration": ALPHA_ITERATIONS, "lr_alpha": ALPHA_LR,
        "enable_alpha_crown": True, "enable_beta_crown": False,
        # Slopes start from the CROWN pass just below, not from a new full one.
        "init_alpha": False, "stop_criterion_func": stop}})
    # The final node's CROWN pass alone (every other bound is fixed): its ReLU
    # slopes become the starting point, so step 0 gives CROWN's bound.
    bounded.init_slope(inputs, c=C, bound_lower=lower, bound_upper=not lower,
                       intermediate_layer_bounds=fixed)
    # auto_LiRPA prints when it stops early; its loop needs autograd.
    with torch.enable_grad(), contextlib.redirect_stdout(io.StringIO()):
        lb, ub = bounded.compute_bounds(
            x=inputs, C=C, method="CROWN-Optimized", bound_lower=lower,
            bound_upper=not lower, intermediate_layer_bounds=fixed)
    return (lb if lower else ub).detach()


def _optimise_slopes(lirpa: Any, bounded: nn.Module, x: Tensor, eps: float,
                     C: Tensor | None, lb: Tensor, ub: Tensor | None,
                     stop_when_positive: bool) -> tuple[Tensor, Tensor | None]:
    """alpha-CROWN on a batch that CROWN has just bounded (``lb``, ``ub``) with
    checked intermediate bounds, which stay fixed: once for the lower and once
    for the upper bounds. Returns the tighter of CROWN's and alpha-CROWN's
    bounds, entry by entry (both are sound)."""
    fixed = _fixed_bounds(bounded)
    inputs = (lirpa.BoundedTensor(x, lirpa.PerturbationLpNorm(norm=2, eps=eps)),)
    stop = _never
    if stop_when_positive and C is not None:
        trivial = (C == 0).all(dim=2)  # (B, M): the margin y − y

        def stop(bounds: Tensor) -> Tensor:  # (B, 1), as auto_LiRPA's losses
            return ((bounds > 0) | trivial).all(dim=1, keepdim=True)
    lb = torch.maximum(lb, _optimised_bound(bounded, inputs, C, fixed, True, stop))
    if ub is not None:
        ub = torch.minimum(ub, _optimised_bound(bounded, inputs, C, fixed, False,
                                                _never))
    return lb, ub


def _bound_batch(lirpa: Any, net: nn.Module, x: Tensor, eps: float, C: Tensor | None,
                 method: str, bound_upper: bool, cache: dict[int, nn.Module],
                 stop_when_positive: bool = False) -> tuple[Tensor, Tensor | None]:
    """:func:`bound_module` on one batch (arguments already validated)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_default_dtype(x.dtype))
        stack.enter_context(torch.no_grad())  # no autograd graph: it holds every A
        log = stack.enter_context(_captured("auto_LiRPA.utils"))  # its one logger
        stack.enter_context(warnings.catch_warnings())
        # auto_LiRPA warns about dense identity matrices (a performance note).
        warnings.filterwarnings("ignore", module=r"auto_LiRPA\..*")
        ptb = lirpa.PerturbationLpNorm(norm=2, eps=eps)
        if x.shape[0] not in cache:
            cache[x.shape[0]] = _bounded(lirpa, net, x, log)
        bounded = cache[x.shape[0]]
        try:
            lb, ub = bounded.compute_bounds(
                x=(lirpa.BoundedTensor(x, ptb),), C=C,
                method="CROWN" if method == "alpha-CROWN" else method,
                bound_upper=bound_upper,
                reference_bounds=_softmax_reference_bounds(bounded, x))
        except AssertionError:
            # auto_LiRPA asserts positive denominators in interval arithmetic
            # (a softmax sum underflowing to 0): bound the batch in halves.
            return _split(lirpa, net, x, eps, C, method, bound_upper, cache,
                          stop_when_positive)
        bad = _invalid_samples(bounded, x.shape[0]).to(x.device)
        if method == "alpha-CROWN" and not bool(bad.any()):
            # The intermediate bounds just checked stay fixed while it runs.
            lb, ub = _optimise_slopes(lirpa, bounded, x, eps, C, lb, ub,
                                      stop_when_positive)
    lb = lb.detach()
    ub = None if ub is None else ub.detach()
    if bool(bad.any()) and not bool(bad.all()):
        # auto_LiRPA zeroes a NaN bias for the whole batch: redo the good samples.
        good = ~bad
        sub_C = None if C is None else C[good]
        sub_lb, sub_ub = _bound_batch(lirpa, net, x[good], eps, sub_C, method,
                                      bound_upper, cache, stop_when_positive)
        lb, ub = lb.clone(), None if ub is None else ub.clone()
        lb[good] = sub_lb
        if ub is not None:
            ub[good] = sub_ub
    lb = torch.where(bad[:, None] | torch.isnan(lb), -math.inf, lb)
    if ub is not None:
        ub = torch.where(bad[:, None] | torch.isnan(ub), math.inf, ub)
    return lb, ub


def _split(lirpa: Any, net: nn.Module, x: Tensor, eps: float, C: Tensor | None,
           method: str, bound_upper: bool, cache: dict[int, nn.Module],
           stop_when_positive: bool = False) -> tuple[Tensor, Tensor | None]:
    """:func:`_bound_batch` on two halves of the batch; vacuous for one sample."""
    B = x.shape[0]
    if B == 1:
        with torch.no_grad():
            M = net(x).shape[1] if C is None else C.shape[1]
        lb = torch.full((1, M), -math.inf, dtype=x.dtype, device=x.device)
        return lb, -lb if bound_upper else None
    h = B // 2
    parts = [_bound_batch(lirpa, net, x[i:j], eps, None if C is None else C[i:j],
                          method, bound_upper, cache, stop_when_positive)
             for i, j in ((0, h), (h, B))]
    lb = torch.cat([p[0] for p in parts])
    return lb, torch.cat([p[1] for p in parts]) if bound_upper else None


@dataclass(eq=False)
class CrownModel:
    """The verifiable twin ``net`` of a model, in ``dtype`` on ``device``, and
    auto_LiRPA's bounded copies of it by batch size (``cache``): built once per
    run and reused for every sample and ε (a bounded copy costs about as much
    to build as bounding one sample)."""

    net: nn.Module
    device: torch.device
    dtype: torch.dtype
    cache: dict[int, nn.Module] = field(default_factory=dict)


def crown_model(model: ViT, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float64) -> CrownModel:
    """A :class:`CrownModel` of ``model`` (see :func:`check_crown_support`)."""
    check_crown_support(model)
    return CrownModel(to_verifiable(model, dtype).to(device), torch.device(device),
                      dtype)


def _prepare(model: ViT, x: Tensor, device: str | torch.device, dtype: torch.dtype,
             prepared: CrownModel | None) -> tuple[CrownModel, Tensor]:
    """``prepared`` (or a new :class:`CrownModel`) and flat ``x`` in its dtype and
    on its device."""
    prepared = prepared or crown_model(model, device, dtype)
    _check_images(model, x)
    flat = x.detach().reshape(x.shape[0], -1)  # (B, C·S·S)
    return prepared, flat.to(device=prepared.device, dtype=prepared.dtype)


def margin_spec(y: Tensor, num_classes: int,
                dtype: torch.dtype = torch.float64) -> Tensor:
    """Specification ``C`` ``(B, K, K)`` with rows ``C[b, j] = e_{y_b} − e_j``.

    Row ``y_b`` is zero (the trivial margin ``logit_y − logit_y = 0``).
    """
    eye = torch.eye(num_classes, dtype=dtype, device=y.device)
    return eye[y][:, None, :] - eye[None, :, :]  # (B, K, K)


def crown_margin_bounds(
    model: ViT,
    x: Tensor,
    y: Tensor,
    eps: float,
    method: str = "CROWN",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float64,
    chunk_size: int | None = 2,
    prepared: CrownModel | None = None,
    stop_when_positive: bool = False,
) -> Tensor:
    """Lower bounds of ``logit_y − logit_j`` over the ℓ2 ball of radius ε around ``x``.

    Args:
        model: a lipschitz-family :class:`lipvit.ViT` (see
            :func:`check_crown_support`).
        x: images in ``[0, 1]``, ``(B, C, S, S)``.
        y: labels ``(B,)``.
        eps: ℓ2 radius ε ≥ 0 in image space (the ball is not clipped to the box).
        method: ``"CROWN"``, ``"alpha-CROWN"`` or ``"IBP"`` (see
            :func:`bound_module`).
        device: where auto_LiRPA runs.
        dtype: arithmetic of the model copy and the bounds (float64 by default).
        chunk_size: samples bounded together (see :func:`bound_module`).
        prepared: :func:`crown_model` of ``model``, reused across calls
            (``device`` and ``dtype`` are then its own).
        stop_when_positive: alpha-CROWN stops optimising a chunk once all
            its margin bounds are > 0 (see :func:`bound_module`).

    Returns:
        ``(B, K)`` on ``x``'s device: entry ``[b, j]`` is a lower bound (sound
        up to rounding) of ``logit_{y_b}(x') − logit_j(x')`` for every ``x'`` in
        the ball, ``-inf`` where none could be computed; entry ``[b, y_b]`` is 0.
    """
    prepared, xd = _prepare(model, x, device, dtype, prepared)
    _check_labels(model, x, y)
    yd = y.to(prepared.device)
    C = margin_spec(yd, model.config.num_classes, prepared.dtype)
    lb, _ = bound_module(prepared.net, xd, eps, C=C, method=method, bound_upper=False,
                         chunk_size=chunk_size, cache=prepared.cache,
                         stop_when_positive=stop_when_positive)
    lb = lb.clone()
    lb[torch.arange(x.shape[0], device=lb.device), yd] = 0.0  # y − y
    return lb.to(x.device)


def crown_logit_bounds(
    model: ViT,
    x: Tensor,
    eps: float,
    method: str = "CROWN",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float64,
    chunk_size: int | None = 2,
) -> tuple[Tensor, Tensor]:
    """Lower and upper bounds ``(B, K)`` of every logit over the ℓ2 ball around ``x``.

    Arguments as in :func:`crown_margin_bounds`. Returns ``(lb, ub)`` on ``x``'s
    device, sound up to rounding (``∓inf`` where none could be computed).
    """
    prepared, xd = _prepare(model, x, device, dtype, None)
    lb, ub = bound_module(prepared.net, xd, eps, method=method, chunk_size=chunk_size)
    return lb.to(x.device), ub.to(x.device)


def crown_certify(
    model: ViT,
    x: Tensor,
    y: Tensor,
    eps: float,
    method: str = "CROWN",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float64,
    chunk_size: int | None = 2,
    prepared: CrownModel | None = None,
) -> Tensor:
    """``(B,)`` bool: classified ``y`` at ``x`` and every margin lower bound > 0.

    A ``True`` sample is classified ``y`` everywhere in the ℓ2 ball of radius
    ε (up to floating-point rounding). Arguments as in :func:`crown_margin_bounds`
    (alpha-CROWN stops optimising once every margin bound is positive).
    """
    lb = crown_margin_bounds(model, x, y, eps, method=method, device=device,
                             dtype=dtype, chunk_size=chunk_size, prepared=prepared,
                             stop_when_positive=True)
    y_dev = y.to(lb.device)
    others = torch.ones_like(lb, dtype=torch.bool)
    others[torch.arange(lb.shape[0], device=lb.device), y_dev] = False
    margins_positive = torch.where(others, lb > 0, True).all(dim=1)
    with torch.no_grad():
        pred = model(x).argmax(dim=1).to(lb.device)
    return margins_positive & (pred == y_dev)
