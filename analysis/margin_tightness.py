"""How tight is the certificate that decides? Margin-drop bounds against targeted PGD.

A point is certified at ε when every wrong class ``j``'s margin
``m_j = f_y − f_j`` exceeds a bound on how far it can drop over the ball:

    drop_j(ε) = max_{‖x' − x‖₂ ≤ ε} m_j(x) − m_j(x').

Each certify method bounds ``drop_j`` its own way (registry
:data:`MARGIN_METHODS`): ``taylor`` per class (its exact first-order term plus
proven remainders, docs/taylor.md, ``TaylorBound.margin_drop``), ``lofast``,
``lofast-fast`` and ``specformer`` through the whole logit vector
(``|Δm_j| ≤ √2·‖Δf‖ ≤ √2·δ_out``, LoFAST Prop. 1, the same for every ``j``),
``crown`` by CROWN's linear bounds on each margin (``m_j(x) − lb_j``).
Targeted PGD on the same margin (:func:`lipvit.analysis.pgd.pgd_margin_drop`)
finds a **lower** bound of ``drop_j``: the true drop lies between the two, and
``bound / PGD`` bounds each certificate's slack from above.

The comparison runs over ``(sample, wrong class)`` pairs at the model's own
prediction ``y`` (the margins a certificate of that prediction must keep
positive): a :class:`~lipvit.analysis.tightness.Tightness` with
``target="margin"`` and ``B = n·(K − 1)`` columns.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch
from lipvit.analysis.pgd import pgd_margin_drop
from lipvit.analysis.tightness import (
    BoundMethod,
    PGDSettings,
    Progress,
    Tightness,
    _check_model,
    _methods,
    crown_available,
)
from lipvit.certify.eps import check_eps_list
from torch import Tensor

from lipvit.errors import UnsupportedModelError
from lipvit.model import ViT

MARGIN_METHODS: dict[str, BoundMethod] = {
    m.name: m
    for m in (
        BoundMethod("taylor", "taylor (each margin)", True,
                    "exact first-order term plus proven remainders, per wrong class"),
        BoundMethod("lofast", "LoFAST √2·δ_out (logit vector)", True,
                    "√2 times the composed bound on ‖Δlogits‖₂ (LoFAST Prop. 1)"),
        BoundMethod("lofast-fast", "LoFAST √2·δ_out (power-iteration estimate)",
                    False, "ζ and ‖M_h(X)‖ by power iteration: an estimate"),
        BoundMethod("specformer", "SpecFormer √2·δ_out (logit vector)", True,
                    "√2 times SpecFormer Thm 4.2 composed like LoFAST"),
        BoundMethod("crown", "CROWN (each margin)", True,
                    "m_j minus CROWN's lower bound of the margin (auto_LiRPA)"),
    )
}
DEFAULT_MARGIN_METHODS = ("taylor", "lofast", "specformer", "crown")


def _wrong(values: Tensor, y: Tensor) -> Tensor:
    """``(B, K)`` → ``(B·(K − 1),)``: the wrong-class columns, sample-major."""
    keep = torch.ones_like(values, dtype=torch.bool)
    keep[torch.arange(values.shape[0], device=values.device), y] = False
    return values[keep]


def margin_drop_bounds(model: ViT, x: Tensor, y: Tensor, eps: np.ndarray, name: str,
                       progress: Progress = None) -> Tensor:
    """``(E, B, K)`` upper bounds of every margin's drop by method ``name`` (0 at
    ``j = y``); ``crown`` raises :class:`UnsupportedModelError` where it cannot
    bound the model."""
    if progress:
        progress(f"{name} bound")
    if name == "taylor":
        from lipvit.certify.taylor.certificate import taylor_bound

        tb = taylor_bound(model, x, y)
        return torch.stack([tb.margin_drop(float(e)) for e in eps])
    if name == "crown":
        from lipvit.certify.crown.bounds import check_crown_support, crown_margin_bounds

        check_crown_support(model)
        with torch.no_grad():
            f = model(x)
        m = f.gather(1, y[:, None]) - f  # (B, K)
        rows = [m - crown_margin_bounds(model, x, y, float(e)).to(m.dtype)
                for e in eps]
        return torch.stack(rows).clamp_min(0)
    from lipvit.certify.lofast.network import network_bound

    nb = network_bound(model, x, name)
    K = model.config.num_classes
    drops = []
    for e in eps:
        d = math.sqrt(2) * nb.delta_out(float(e))[:, None].expand(-1, K).clone()
        d[torch.arange(x.shape[0], device=x.device), y] = 0.0
        drops.append(d)
    return torch.stack(drops)


def margin_tightness(
    model: ViT,
    x: Tensor,
    eps: Sequence[float],
    methods: Sequence[str] = DEFAULT_MARGIN_METHODS,
    *,
    pgd: PGDSettings | None = None,
    progress: Progress = None,
) -> Tightness:
    """Each method's bound on every wrong-class margin drop against targeted PGD.

    Args:
        model: a :class:`lipvit.ViT` (float64 recommended).
        x: test images ``(n, C, S, S)`` in ``[0, 1]`` (the ball is not clipped
            to the box, like the bounds); the margins are those of the model's
            prediction.
        eps: ℓ2 radii in image space.
        methods: names from :data:`MARGIN_METHODS`; ``crown`` is skipped with a
            note when auto_LiRPA is missing or cannot bound the model.
        pgd: settings of the targeted attack (steps, restarts, seed).

    Returns:
        :class:`Tightness` with ``target="margin"``: ``pgd`` and ``bounds``
        ``(E, n·(K − 1))``, one column per (sample, wrong class).
    """
    model = _check_model(model)
    eps_arr = check_eps_list(eps)
    names = _methods(methods, MARGIN_METHODS)
    pgd = pgd or PGDSettings()
    model.eval()
    x = x.to(model.pos_embed.dtype)
    with torch.no_grad():
        y = model(x).argmax(1)
    bounds: dict[str, np.ndarray] = {}
    seconds: dict[str, float] = {}
    notes: list[str] = []
    for name in names:
        if name == "crown" and not crown_available():
            notes.append("crown skipped: auto_LiRPA is not installed")
            continue
        t0 = time.perf_counter()
        try:
            drops = margin_drop_bounds(model, x, y, eps_arr, name, progress)
        except UnsupportedModelError as err:
            notes.append(f"{name} skipped: {err}")
            continue
        bounds[name] = torch.stack([_wrong(d, y) for d in drops]).cpu().numpy()
        seconds[name] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows = []
    for e in eps_arr:
        if progress:
            progress(f"pgd eps={e:g}")
        drop = pgd_margin_drop(model, x, y, float(e), steps=pgd.steps,
                               restarts=pgd.restarts, seed=pgd.seed)
        rows.append(_wrong(drop, y))
    seconds["pgd"] = time.perf_counter() - t0
    K = model.config.num_classes
    description = (
        f"wrong-class margin drop m_j(x) − m_j(x') over ‖x' − x‖₂ ≤ ε, m_j = f_y − f_j "
        f"at the predicted class y; {x.shape[0]} images × {K - 1} wrong classes "
        "(image space, pixels in [0, 1], ball not clipped to the box)"
    )
    return Tightness(
        "margin",
        description,
        eps_arr,
        torch.stack(rows).cpu().numpy(),
        bounds,
        {n: MARGIN_METHODS[n] for n in bounds},
        seconds,
        notes=tuple(notes),
        pgd_settings=pgd,
    )
