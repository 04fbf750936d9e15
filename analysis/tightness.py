"""How tight are the deviation bounds? Upper bounds against a PGD lower bound.

The analogue of LoFAST's Figure 1 and Table 3: for a set of clean inputs and a
list of radii ε, every upper bound on the maximal deviation

    max_{‖X' − X‖_F ≤ ε} ‖F(X') − F(X)‖_F

is set beside the deviation projected gradient ascent actually finds
(:func:`lipvit.analysis.pgd.pgd_deviation`, a **lower** bound of the same maximum).
The true maximum lies between the two, so ``bound / PGD`` is an upper bound of
each bound's slack factor; a sound bound never falls below PGD (checked per
sample: :attr:`Tightness.violations`).

Two targets:

* **one attention layer** (:func:`layer_tightness`): ``F`` is the attention map
  ``F(Z) = H Z + Σ_h P_h(Z) Z W_v[h] W_o[h]`` (LoFAST eq. 6) of block ``k`` at
  its real clean input ``Z = norm1(X)`` (``X`` the block's input on real test
  images). Residual ``H`` "as in the model" (``residual="auto"``): the model
  computes ``X + attn(norm1(X))``, so the residual carries the perturbation of
  ``X`` while the attention sees that of ``norm1(X)``. Where ``norm1`` is not
  the identity (LayerNorm; LayerProject on inputs outside its ball, which is
  the usual case for the lipschitz family) the two do not share ``Γ`` and
  :func:`lipvit.certify.lofast.network.network_bound` bounds the attention with ``H =
  0`` on ``Z`` and adds the residual separately; that ``H = 0`` map is then the one
  compared here. Only when ``norm1`` is the identity on the whole ball does the model's
  block equal LoFAST's residual layer (``H = I``). ``residual=True`` forces ``H = I`` on
  the same ``Z``: LoFAST's Table 3 setting (a residual layer fed the projected input),
  which is not the model's own block when ``norm1`` projects.
* **the whole network** (:func:`network_tightness`): ``F`` maps the image (in
  ``[0, 1]``, perturbed in ℓ2 over the whole ball, no box) to the logits; the
  bounds are :meth:`lipvit.certify.lofast.network.NetworkBound.delta_out`.

Bounds (registry :data:`LAYER_METHODS`, :data:`NETWORK_METHODS`; docs/math.md §2, §3):

================  ============================================================
name              bound on one layer (``ε`` the Frobenius radius at ``Z``)
================  ============================================================
``naive``         ``δ1^naive + δ2^(2)``: eq. (12) + eq. (28)
``lofast-xi``     ``ζ ε + δ2^(2)``: eq. (15) + (28), ξ relaxation of ``‖M_h‖``
``lofast``        ``ζ ε + δ2^(1)``: Theorem 1, eq. (15) + (27)
``lofast-half``   ``ζ ε + δ2^(1)/2``: softmax is ½-Lipschitz (extension)
``lofast-local``  ``ζ ε + δ2^local``: local softmax constant (extension)
``specformer``    SpecFormer Thm 4.2, eq. (9), summed over heads × ‖W_o[h]‖
``crown``         auto_LiRPA CROWN bounds of every output coordinate over the
                  ℓ2 ball, turned into ``‖max(ub − F, F − lb)‖₂`` (optional)
================  ============================================================

For the network: ``lofast``, ``lofast-fast`` (power-iteration estimates of ζ
and ``‖M_h‖``: not a certificate, labelled so), ``specformer`` (per layer,
composed) and ``crown`` (logit bounds → ℓ2 as above).

Every number is computed in the dtype of the model (use float64: PGD and the
bounds then agree to ~1e-15 where they should). Shapes: ``B`` samples, ``E``
radii, ``N`` tokens, ``D`` width.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from lipvit.analysis.pgd import pgd_deviation
from lipvit.certify.attention import bound_weights
from lipvit.certify.eps import check_eps_list
from torch import Tensor, nn

from lipvit.errors import UnsupportedModelError
from lipvit.model import ViT

Residual = Literal["auto"] | bool
Progress = Callable[[str], None] | None


@dataclass(frozen=True)
class BoundMethod:
    """A bound in the tightness comparison: short name, legend label, soundness."""

    name: str
    label: str
    exact: bool
    note: str = ""


LAYER_METHODS: dict[str, BoundMethod] = {
    m.name: m
    for m in (
        BoundMethod(
            "naive",
            "naive δ1 + δ2 (eq. 12 + 28)",
            True,
            "naive sensitivity bound, eq. (12), plus δ2 with ξ, eq. (28)",
        ),
        BoundMethod(
            "lofast-xi",
            "LoFAST ζε + δ2 with ξ (eq. 28)",
            True,
            "key sensitivity ζ (exact) plus the cheap relaxation ξ of ‖M_h(X)‖",
        ),
        BoundMethod(
            "lofast",
            "LoFAST tight (Thm 1, eq. 27)",
            True,
            "key sensitivity ζ plus δ2 with ‖M_h(X)‖ of Lemma 2 (exact norms)",
        ),
        BoundMethod(
            "lofast-half",
            "LoFAST, ½-Lipschitz softmax",
            True,
            "extension: softmax is ½-Lipschitz, δ2 halves",
        ),
        BoundMethod(
            "lofast-local",
            "LoFAST, local softmax constant",
            True,
            "extension: local softmax constant and centred tokens",
        ),
        BoundMethod(
            "specformer",
            "SpecFormer Thm 4.2 (eq. 9)",
            True,
            "claimed upper bound; valid when (N+1)(‖X‖_F+ε)² ≥ 1",
        ),
        BoundMethod(
            "crown",
            "CROWN (auto_LiRPA) → ℓ2",
            True,
            "per-output CROWN bounds over the ℓ2 ball, combined into an ℓ2 bound",
        ),
    )
}

NETWORK_METHODS: dict[str, BoundMethod] = {
    m.name: m
    for m in (
        BoundMethod(
            "lofast",
            "LoFAST (composed, exact)",
            True,
            "lipvit.certify.lofast.network.network_bound, method lofast",
        ),
        BoundMethod(
            "lofast-fast",
            "LoFAST (power-iteration estimate)",
            False,
            "ζ and ‖M_h(X)‖ by power iteration: an estimate, not a certificate",
        ),
        BoundMethod(
            "specformer",
            "SpecFormer Thm 4.2 (composed)",
            True,
            "SpecFormer per attention layer, composed like LoFAST",
        ),
        BoundMethod(
            "crown",
            "CROWN (auto_LiRPA) → ℓ2",
            True,
            "CROWN lower/upper logit bounds combined into an ℓ2 bound",
        ),
    )
}

DEFAULT_LAYER_METHODS = (
    "naive",
    "lofast-xi",
    "lofast",
    "lofast-half",
    "lofast-local",
    "specformer",
    "crown",
)
DEFAULT_NETWORK_METHODS = ("lofast", "lofast-fast", "specformer", "crown")


@dataclass(frozen=True)
class PGDSettings:
    """Settings of the PGD lower bound (:func:`lipvit.analysis.pgd.pgd_deviation`)."""

    steps: int = 200
    restarts: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.restarts < 1:
            raise ValueError(f"PGD needs steps >= 1 and restarts >= 1, got {self}")


@dataclass(frozen=True)
class Tightness:
    """Bounds and PGD lower bounds of one target over samples and radii.

    Attributes:
        target: ``"layer"`` or ``"network"``.
        description: the map whose deviation is bounded, in words.
        eps: radii ``(E,)``.
        pgd: PGD deviations ``(E, B)`` (lower bounds of the true maximum).
        bounds: method name → upper bounds ``(E, B)``.
        methods: method name → :class:`BoundMethod` (label, soundness).
        seconds: method name (and ``"pgd"``) → wall time over all samples and radii.
        layer: block index of a layer target, else ``None``.
        residual: ``H = I`` (``True``) or ``H = 0`` for a layer target.
        notes: methods skipped and why, and other remarks.
        pgd_settings: the PGD settings used.
        traces: network target only: method → ``{"steps": names, "mean": (E, S+1),
            "mean_cls": (E, S+1)}``, the mean budgets of the whole token matrix
            and of the class token after each step of the composed bound
            (:meth:`lipvit.certify.lofast.network.NetworkBound.trace`; column 0 is the
            input), which show where the bound grows.
    """

    target: str
    description: str
    eps: np.ndarray
    pgd: np.ndarray
    bounds: dict[str, np.ndarray]
    methods: dict[str, BoundMethod]
    seconds: dict[str, float]
    layer: int | None = None
    residual: bool | None = None
    notes: tuple[str, ...] = ()
    pgd_settings: PGDSettings = field(default_factory=PGDSettings)
    traces: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(self.pgd.shape[1])

    def violations(self, rtol: float = 1e-7) -> dict[str, int]:
        """Per method, the number of (sample, ε) pairs where the bound is below PGD.

        A sound bound has none (``rtol`` absorbs float rounding). A violation of
        an estimate (``exact=False``) is possible; of a certificate, a bug.
        """
        return {
            m: int((b < self.pgd * (1 - rtol) - 1e-12).sum())
            for m, b in self.bounds.items()
        }

    def to_records(self) -> list[dict[str, Any]]:
        """One row per (method, ε): mean/min/max bound, PGD and their ratio.

        ``ratio`` is ``mean bound / mean PGD`` (the tightness factor of LoFAST's
        Table 3); ``ratio_median`` and ``ratio_max`` are over per-sample ratios.
        """
        out = []
        viol = {m: (b < self.pgd * (1 - 1e-7) - 1e-12) for m, b in self.bounds.items()}
        with np.errstate(divide="ignore", invalid="ignore"):
            for name, b in self.bounds.items():
                per_sample = b / self.pgd  # (E, B)
                for i, eps in enumerate(self.eps):
                    p = self.pgd[i]
                    out.append(
                        {
                            "method": name,
                            "label": self.methods[name].label,
                            "eps": float(eps),
                            "bound_mean": float(b[i].mean()),
                            "bound_median": float(np.median(b[i])),
                            "bound_min": float(b[i].min()),
                            "bound_max": float(b[i].max()),
                            "bound_std": float(b[i].std()),
                            "pgd_mean": float(p.mean()),
                            "pgd_median": float(np.median(p)),
                            "pgd_min": float(p.min()),
                            "pgd_max": float(p.max()),
                            "ratio": float(b[i].mean() / p.mean()),
                            "ratio_median": float(np.median(per_sample[i])),
                            "ratio_max": float(per_sample[i].max()),
                            "exact": self.methods[name].exact,
                            "violations": int(viol[name][i].sum()),
                        }
                    )
        return out


# ------------------------------------------------------------------ inputs


def _check_model(model: nn.Module) -> ViT:
    if not isinstance(model, ViT):
        raise TypeError(f"expected a lipvit ViT, got {type(model).__name__}")
    return model


@torch.no_grad()
def block_inputs(model: ViT, x: Tensor) -> list[Tensor]:
    """Clean inputs of every block, ``depth + 1`` tensors ``(B, N, D)``.

    Entry ``k`` is the residual stream entering block ``k``; the last entry is
    the output of the last block (before the final norm).
    """
    X = model.embed(x.to(model.pos_embed.dtype))  # (B, N, D)
    out = [X]
    for block in model.blocks:
        X = block(X)
        out.append(X)
    return out


def _check_layer_index(model: ViT, layer: int) -> None:
    depth = len(model.blocks)
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < depth:
        raise ValueError(
            f"layer must be a block index in 0..{depth - 1}, got {layer!r}"
        )


def norm1_is_identity(model: ViT, X: Tensor, layer: int, eps: float) -> bool:
    """Whether ``blocks[layer].norm1`` is the identity on every ε-ball around ``X``.

    True only for the lipschitz family when every sample's projected vector
    (whole token matrix, or every token) has norm ``≤ R − ε``: then
    ``norm1(X') = X'`` on the ball, and the block is LoFAST's residual layer.
    LayerNorm is never the identity.
    """
    block = model.blocks[layer]
    if model.config.family != "lipschitz":
        return False
    norm1 = block.norm1
    dims = (-1,) if norm1.mode == "token" else (-2, -1)
    norms = torch.linalg.vector_norm(X, dim=dims)  # (B, N) or (B,)
    return bool((norms + eps <= norm1.radius).all())


UNIFORM_SPREAD = 0.01
"""Largest spread ``max − min`` of a softmax row's logits below which attention is
called uniform (every probability within a factor ``e^0.01`` of ``1/N``)."""


def uniform_attention_note(Z: Tensor, W_q: Tensor, W_k: Tensor) -> str | None:
    """A note when the attention at the inputs ``Z`` ``(B, N, D)`` is uniform.

    There the softmax does not move, LoFAST's δ2 is about 0 and every LoFAST
    variant equals the exact ζε: a tightness of 1.00× is then degenerate and
    says nothing about how tight the δ2 terms are.
    """
    from lipvit.certify.attention import attention_logits, query_key

    with torch.no_grad():
        logits = attention_logits(Z.double(), W_q.double(), W_k.double())
    spread = float((logits.amax(-1) - logits.amin(-1)).max())
    if spread >= UNIFORM_SPREAD:
        return None
    qk = float(torch.linalg.matrix_norm(query_key(W_q, W_k).double(), ord=2).max())
    return (
        f"degenerate layer: the attention is uniform at these inputs (largest "
        f"logit spread {spread:.2g} < {UNIFORM_SPREAD}, max_h ‖W_q W_kᵀ‖ = "
        f"{qk:.2g}), so δ2 ≈ 0 and every LoFAST variant equals ζε; a ratio of "
        "1.00× here says nothing about the δ2 terms (see a model whose attention "
        "is not uniform, e.g. one trained with --msvp 0)"
    )


# ------------------------------------------------------------------ CROWN


def crown_available() -> bool:
    """Whether auto_LiRPA can be imported (the optional CROWN backend)."""
    from lipvit.certify.crown.lirpa_compat import auto_lirpa_available

    return auto_lirpa_available()


def box_to_l2(F0: Tensor, lb: Tensor, ub: Tensor) -> Tensor:
    """``‖max(ub − F0, F0 − lb)‖₂`` per sample: an ℓ2 bound from per-coordinate bounds.

    If every coordinate of ``F(X')`` lies in ``[lb, ub]`` and ``F0 = F(X)`` does
    too, ``|F(X')_j − F0_j| ≤ max(ub_j − F0_j, F0_j − lb_j)`` coordinate-wise,
    hence the ℓ2 norm. ``F0``, ``lb``, ``ub``: ``(B, m)``; returns ``(B,)``.
    """
    gap = torch.maximum(ub - F0, F0 - lb).clamp_min(0)  # (B, m)
    return torch.linalg.vector_norm(gap, dim=1)


class _LayerNet(nn.Module):
    """``vec(Z) ↦ vec(H Z + attn(Z))`` with verifier-friendly operators.

    Input and output are flat, ``(B, N·D)``, as
    :func:`lipvit.certify.crown.bounds.bound_module` takes them; an identity ``Linear``
    comes first because auto_LiRPA reads the ℓ2 radius at the first linear map of
    the input.
    """

    def __init__(
        self,
        attn: nn.Module,
        shape: tuple[int, int],
        residual: bool,
        dtype: torch.dtype,
    ):
        super().__init__()
        from lipvit.certify.crown.verifiable import VerifiableAttention

        n = shape[0] * shape[1]
        self.shape = shape
        self.enter = nn.Linear(n, n, bias=False, dtype=dtype)
        with torch.no_grad():
            self.enter.weight.copy_(torch.eye(n, dtype=dtype))
        self.enter.requires_grad_(False)
        self.attn = VerifiableAttention(attn).to(dtype)
        self.residual = residual

    def forward(self, z: Tensor) -> Tensor:
        Z = self.enter(z).reshape(z.shape[0], *self.shape)  # (B, N, D)
        out = self.attn(Z)  # (B, N, D)
        if self.residual:
            out = out + Z
        return out.reshape(out.shape[0], -1)  # (B, N·D)


def _crown_layer(block, Z: Tensor, residual: bool, eps: float) -> Tensor:
    from lipvit.certify.crown.bounds import bound_module

    B, N, D = Z.shape
    net = _LayerNet(block.attn, (N, D), residual, Z.dtype).to(Z.device)
    z = Z.reshape(B, N * D)  # (B, N·D)
    with torch.no_grad():
        F0 = net(z)
    lb, ub = bound_module(net, z, eps)
    return box_to_l2(F0, lb, ub)


def _crown_network(model: ViT, x: Tensor, eps: float) -> Tensor:
    from lipvit.certify.crown.bounds import crown_logit_bounds

    with torch.no_grad():
        F0 = model(x)
    lb, ub = crown_logit_bounds(model, x, eps)
    return box_to_l2(F0, lb.to(F0.dtype), ub.to(F0.dtype))


# ------------------------------------------------------------------ targets


def _methods(methods: Sequence[str], registry: dict[str, BoundMethod]) -> list[str]:
    names = list(dict.fromkeys(methods))
    if not names:
        raise ValueError("give at least one bound method")
    for name in names:
        if name not in registry:
            raise ValueError(
                f"unknown bound method {name!r}; choose from {', '.join(registry)}"
            )
    return names


def _pgd(
    fn: Callable[[Tensor], Tensor],
    X: Tensor,
    eps: np.ndarray,
    settings: PGDSettings,
    progress: Progress,
) -> tuple[np.ndarray, float]:
    t0 = time.perf_counter()
    rows = []
    for e in eps:
        if progress:
            progress(f"pgd eps={e:g}")
        rows.append(
            pgd_deviation(
                fn,
                X,
                float(e),
                steps=settings.steps,
                restarts=settings.restarts,
                seed=settings.seed,
            )
        )
    return torch.stack(rows).cpu().numpy(), time.perf_counter() - t0  # (E, B)


def layer_tightness(
    model: ViT,
    x: Tensor,
    layer: int,
    eps: Sequence[float],
    methods: Sequence[str] = DEFAULT_LAYER_METHODS,
    *,
    residual: Residual = "auto",
    pgd: PGDSettings | None = None,
    progress: Progress = None,
) -> Tightness:
    """Bounds versus PGD for the attention of block ``layer`` at real clean inputs.

    Args:
        model: a :class:`lipvit.ViT` (eval mode; float64 recommended).
        x: test images ``(B, C, S, S)`` in ``[0, 1]``; the clean attention
            input is ``Z = blocks[layer].norm1(X)`` with ``X`` the block input.
        layer: block index.
        eps: Frobenius radii at ``Z``.
        methods: names from :data:`LAYER_METHODS`; ``crown`` is skipped with a
            note when auto_LiRPA is not installed.
        residual: ``"auto"`` (as in the model, module docstring), ``True``
            (``H = I`` on ``Z``, LoFAST Table 3) or ``False`` (``H = 0``).
        pgd: settings of the lower bound.
        progress: called with a short text before each stage (for a progress
            display); the library never prints.

    Returns:
        :class:`Tightness` with ``target="layer"``.

    Raises:
        ValueError: bad layer, radii or method names.
        UnsupportedModelError: biased query/key maps.
    """
    from lipvit.certify.lofast.network import check_dot_attention

    model = _check_model(model)
    check_dot_attention(model, "the layer tightness comparison (every bound in it)")
    _check_layer_index(model, layer)
    eps_arr = check_eps_list(eps)
    names = _methods(methods, LAYER_METHODS)
    pgd = pgd or PGDSettings()
    model.eval()
    block = model.blocks[layer]
    W = bound_weights(block.attn)
    X = block_inputs(model, x)[layer]
    with torch.no_grad():
        Z = block.norm1(X)  # (B, N, D): the attention's real input
    notes: list[str] = []
    identity = norm1_is_identity(model, X, layer, float(eps_arr.max()))
    if residual == "auto":
        res = identity
        same = (
            "residual as in the model: norm1 is the identity on every ball, so the "
            "block is LoFAST's residual layer (H = I)"
        )
        split = (
            "residual as in the model: norm1 is not the identity on the ball, so the "
            "residual does not share the attention input's perturbation; the "
            "attention map itself (H = 0) is compared, as "
            "lipvit.certify.lofast.network bounds it"
        )
        notes.append(same if res else split)
    elif isinstance(residual, bool):
        res = residual
        if res and not identity:
            notes.append(
                "H = I forced on the attention input Z (LoFAST Table 3 setting); "
                "the model's own block adds the residual before norm1"
            )
    else:
        raise ValueError(f"residual must be 'auto', True or False, got {residual!r}")
    degenerate = uniform_attention_note(Z, W[0], W[1])
    if degenerate:
        notes.append(degenerate)
    norm1 = type(block.norm1).__name__
    description = (
        f"block {layer} attention F(Z) = {'Z + ' if res else ''}attn(Z) at "
        f"Z = norm1(X) ({norm1}), ‖Z' − Z‖_F ≤ ε"
    )

    bounds: dict[str, np.ndarray] = {}
    seconds: dict[str, float] = {}
    lofast_names = [
        n
        for n in names
        if n in ("naive", "lofast-xi", "lofast", "lofast-half", "lofast-local")
    ]
    if lofast_names:
        from lipvit.certify.lofast.layer import lofast_terms

        if progress:
            progress("lofast terms")
        t0 = time.perf_counter()
        terms = lofast_terms(Z, *W, residual=res, exact=True)
        per_eps = [terms.bound(float(e)) for e in eps_arr]
        seconds_all = time.perf_counter() - t0
        fields = {
            "lofast-xi": lambda b: b.total_fast,
            "lofast": lambda b: b.total,
            "lofast-half": lambda b: b.total_half,
            "lofast-local": lambda b: b.total_local,
            "naive": lambda b: b.delta_1_naive + b.delta_2_fast,
        }
        for name in lofast_names:
            bounds[name] = torch.stack([fields[name](b) for b in per_eps]).cpu().numpy()
            seconds[name] = seconds_all
    if "specformer" in names:
        from lipvit.certify.specformer import specformer_terms

        t0 = time.perf_counter()
        sf = specformer_terms(Z, *W, residual=res)
        bounds["specformer"] = (
            torch.stack([sf.delta(float(e)) for e in eps_arr]).cpu().numpy()
        )
        seconds["specformer"] = time.perf_counter() - t0
    if "crown" in names:
        if crown_available():
            if progress:
                progress("crown")
            t0 = time.perf_counter()
            bounds["crown"] = (
                torch.stack([_crown_layer(block, Z, res, float(e)) for e in eps_arr])
                .cpu()
                .numpy()
            )
            seconds["crown"] = time.perf_counter() - t0
        else:
            notes.append("crown skipped: auto_LiRPA is not installed")

    def fn(Zp: Tensor) -> Tensor:
        out = block.attn(Zp)
        return out + Zp if res else out

    pgd_values, seconds["pgd"] = _pgd(fn, Z, eps_arr, pgd, progress)
    kept = {n: bounds[n] for n in names if n in bounds}
    return Tightness(
        "layer",
        description,
        eps_arr,
        pgd_values,
        kept,
        {n: LAYER_METHODS[n] for n in kept},
        seconds,
        layer=layer,
        residual=res,
        notes=tuple(notes),
        pgd_settings=pgd,
    )


def token_budgets(trace: Tensor) -> tuple[Tensor, Tensor | None]:
    """Split :meth:`~lipvit.certify.lofast.network.NetworkBound.trace` into ``(all,
    cls)``.

    ``all`` ``(B, S+1)`` bounds the whole token matrix's perturbation after each
    step, ``cls`` ``(B, S+1)`` the class token's (``None`` for a chain that
    tracks one budget only, a ``(B, S+1)`` trace).
    """
    if trace.ndim == 3:
        return trace[..., 0], trace[..., 1]
    return trace, None


def _trace_means(nb, eps: np.ndarray) -> dict[str, Any]:
    """Mean budgets after every step of a composed bound, per ε: ``(E, S+1)`` each."""
    alls, clss = [], []
    for e in eps:
        a, c = token_budgets(nb.trace(float(e)))
        alls.append(a.mean(dim=0))
        clss.append(None if c is None else c.mean(dim=0))
    out = {
        "steps": ["input", *(st.name for st in nb.steps)],
        "mean": torch.stack(alls).cpu().numpy(),
    }
    if clss[0] is not None:
        out["mean_cls"] = torch.stack(clss).cpu().numpy()
    return out


def network_tightness(
    model: ViT,
    x: Tensor,
    eps: Sequence[float],
    methods: Sequence[str] = DEFAULT_NETWORK_METHODS,
    *,
    pgd: PGDSettings | None = None,
    progress: Progress = None,
) -> Tightness:
    """Bounds on ``‖logits(x') − logits(x)‖₂`` over ``‖x' − x‖₂ ≤ ε`` versus PGD.

    Args:
        model: a :class:`lipvit.ViT` (eval mode; float64 recommended).
        x: test images ``(B, C, S, S)`` in ``[0, 1]`` (the ball is not clipped
            to the box, like the bounds).
        eps: ℓ2 radii in image space.
        methods: names from :data:`NETWORK_METHODS`; ``crown`` is skipped with
            a note when auto_LiRPA is missing or cannot bound the model.
        pgd: settings of the lower bound.
        progress: as in :func:`layer_tightness`.

    Returns:
        :class:`Tightness` with ``target="network"``.
    """
    from lipvit.certify.lofast.network import network_bound

    model = _check_model(model)
    eps_arr = check_eps_list(eps)
    names = _methods(methods, NETWORK_METHODS)
    pgd = pgd or PGDSettings()
    model.eval()
    x = x.to(model.pos_embed.dtype)
    bounds: dict[str, np.ndarray] = {}
    seconds: dict[str, float] = {}
    notes: list[str] = []
    traces: dict[str, dict[str, Any]] = {}
    for name in names:
        t0 = time.perf_counter()
        if name == "crown":
            if not crown_available():
                notes.append("crown skipped: auto_LiRPA is not installed")
                continue
            from lipvit.certify.crown.bounds import check_crown_support

            try:
                check_crown_support(model)
            except UnsupportedModelError as err:
                notes.append(f"crown skipped: {err}")
                continue
            if progress:
                progress("crown")
            values = [_crown_network(model, x, float(e)) for e in eps_arr]
        else:
            if progress:
                progress(f"{name} bound")
            nb = network_bound(model, x, name)
            values = [nb.delta_out(float(e)) for e in eps_arr]
            traces[name] = _trace_means(nb, eps_arr)
        bounds[name] = torch.stack(values).cpu().numpy()
        seconds[name] = time.perf_counter() - t0
    pgd_values, seconds["pgd"] = _pgd(model, x, eps_arr, pgd, progress)
    description = (
        "whole network: ‖logits(x') − logits(x)‖₂ over ‖x' − x‖₂ ≤ ε "
        "(image space, pixels in [0, 1], ball not clipped to the box)"
    )
    return Tightness(
        "network",
        description,
        eps_arr,
        pgd_values,
        bounds,
        {n: NETWORK_METHODS[n] for n in bounds},
        seconds,
        notes=tuple(notes),
        pgd_settings=pgd,
        traces=traces,
    )


# ------------------------------------------------------------------ figure


def tightness_figure(
    result: Tightness, *, title: str | None = None, path: Any = None, pdf: bool = False
):
    """LoFAST Fig. 1 analogue of ``result``: mean bound per method (median for
    margin drops) with its min–max band over samples, the PGD lower bound
    dashed, log y, and the ratio panel.

    Returns a :class:`matplotlib.figure.Figure` (saved only when ``path`` is given).
    """
    from lipvit.analysis.plots import plot_tightness

    # Margin drops: a pair past a bound's reach (1e14) would set the mean alone.
    centre = np.median if result.target == "margin" else np.mean

    def band(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return centre(a, axis=1), a.min(axis=1), a.max(axis=1)

    bounds = {}
    for name, values in result.bounds.items():
        method = result.methods[name]
        estimate = not method.exact and "estimate" not in method.label
        bounds[method.label + (" (estimate)" if estimate else "")] = band(values)
    x_label = "ε (ℓ2 radius in image space, pixels in [0, 1])"
    if result.target == "layer":
        x_label = "ε (Frobenius radius at the attention input Z)"
        y_label = "deviation ‖F(Z′) − F(Z)‖ (Frobenius)"
    elif result.target == "margin":
        y_label = "wrong-class margin drop m_j(x) − m_j(x′)"
    else:
        y_label = "‖logits(x′) − logits(x)‖₂"
    if title is None:
        title = {
            "layer": f"block {result.layer} attention "
                     f"({'H = I' if result.residual else 'H = 0'}): bounds vs PGD "
                     f"(n = {result.n}; mean",
            "margin": f"margin drops vs targeted PGD ({result.n} pairs; median",
        }.get(result.target, f"whole network: bounds vs PGD (n = {result.n}; mean")
        title += ", min–max)"
    return plot_tightness(
        result.eps,
        bounds,
        band(result.pgd),
        x_label=x_label,
        y_label=y_label,
        title=title,
        path=path,
        pdf=pdf,
    )


def summary_table(
    result: Tightness, eps: Sequence[float] | None = None
) -> list[list[Any]]:
    """Rows ``[method, ε, mean bound, mean PGD, ratio]`` for printing."""
    wanted = None if eps is None else {float(e) for e in eps}
    return [
        [r["method"], r["eps"], r["bound_mean"], r["pgd_mean"], r["ratio"]]
        for r in result.to_records()
        if wanted is None or r["eps"] in wanted
    ]
