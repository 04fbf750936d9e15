"""Spectra of a ViT: weight σ_max per head, block Jacobians, first-order deviation.

Three views of how much a trained ViT can amplify a perturbation:

1. **Weights** (SpecFormer Fig. 2a, docs/math.md §4): the exact σ_max (dense SVD) of
   every head's ``W_q[h]``, ``W_k[h]``, ``W_v[h]`` (the matrices MSVP
   penalises) and of ``W_v[h] W_o[h]`` (what LoFAST's ζ multiplies),
   :func:`weight_spectra`.
2. **Block Jacobians** (Cauchy-problem paper eq. 5, 15, 16, Fig. 3, Tables
   1-2; docs/math.md §7): every transformer block is a step
   ``x_k = x_{k−1} + F_k(x_{k−1})`` with the residual branch
   ``F_k(X) = block_k(X) − X`` (for the standard family
   ``attn(LN(x)) + mlp(LN(·))``; for the lipschitz family the SLL sub-layer has
   no outer residual, and ``F_k`` is still defined as block minus identity).
   :func:`jacobian_spectrum` gives, per block and sample, σ_max of the
   Jacobian ``J_{F_k}`` at the clean activation — exact (dense SVD) where the
   token matrix has at most :data:`lipvit.analysis.jacobian.EXACT_MAX_SIZE` entries,
   else a matrix-free power-iteration estimate from below (labelled) — and
   the upper bound ``sqrt(‖J‖_1 ‖J‖_∞)`` of σ_max(J) (eq. 16).
3. **First-order deviation** (:func:`first_order_deviation`): the paper's
   estimate ``‖Δx_T‖ ≲ ε_0 · exp(Σ_k σ_max(J_{F_k}))`` (eq. 15) at the output
   of the last block, where ``ε_0 = ε · ‖W_pe‖ / min(std)`` is the exact bound
   of the perturbation after normalisation and patch embedding for an image
   perturbation of ℓ2 norm ε. Beside it: the certified budget at the same
   place (:meth:`lipvit.certify.lofast.network.NetworkBound.trace` after the last
   block's last step: a sound upper bound of the deviation of the final token matrix,
   before the final norm and the head) and a PGD lower bound of that deviation. The
   first-order value is **neither** a bound nor an estimate from below: it linearises at
   the clean point (``‖I + J‖ ≤ 1 + ‖J‖ ≤ e^{‖J‖}``) and ignores curvature, which is
   what the comparison shows.

Shapes: ``B`` samples, ``L`` blocks, ``H`` heads, ``N`` tokens, ``D`` width.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from lipvit.analysis.jacobian import (
    EXACT_MAX_SIZE,
    block_jacobian_sigma,
    jacobian_l1_linf_estimate,
)
from lipvit.analysis.pgd import pgd_deviation
from lipvit.analysis.tightness import block_inputs, token_budgets
from lipvit.certify.eps import check_eps_list
from torch import Tensor

from lipvit.model import ViT
from lipvit.msvp import attention_modules
from lipvit.spectral import spectral_norm

MATRICES: tuple[str, ...] = ("W_q", "W_k", "W_v", "W_v W_o")
PENALISED: tuple[str, ...] = ("W_q", "W_k", "W_v")
JacobianMode = Literal["auto", "exact", "power"]
Progress = Callable[[str], None] | None


@torch.no_grad()
def weight_spectra(model: ViT) -> dict[str, np.ndarray]:
    """Exact σ_max of every head's matrices: name → ``(L, H)`` array.

    Names are :data:`MATRICES`; values from dense SVDs
    (:func:`lipvit.spectral.spectral_norm`) of the effective weights
    (:meth:`lipvit.model.Attention.head_weights`, caps applied), in float64.
    A model without query/key/value matrices (``attention="conv"``) gives
    ``(0, 0)`` arrays.
    """
    out: dict[str, list[np.ndarray]] = {m: [] for m in MATRICES}
    layers = attention_modules(model)
    if not layers:
        return {name: np.zeros((0, 0)) for name in MATRICES}
    for attn in layers:
        W_q, W_k, W_v, W_o = (W.detach().double() for W in attn.head_weights())
        for name, W in (
            ("W_q", W_q),
            ("W_k", W_k),
            ("W_v", W_v),
            ("W_v W_o", W_v @ W_o),
        ):
            out[name].append(spectral_norm(W).cpu().numpy())  # (H,)
    return {name: np.stack(rows) for name, rows in out.items()}  # (L, H)


def residual_branch(block: torch.nn.Module) -> Callable[[Tensor], Tensor]:
    """``F(X) = block(X) − X``: a block's residual branch, ``(B, N, D) → (B, N, D)``."""

    def F(X: Tensor) -> Tensor:
        return block(X) - X

    return F


@dataclass(frozen=True)
class JacobianSpectrum:
    """Per block and sample: σ_max of ``J_{F_k}`` and ``sqrt(‖J‖_1‖J‖_∞)``.

    Attributes:
        sigma: ``(L, B)``; exact values if ``exact`` else power-iteration
            estimates from below.
        l1_linf: ``(L, B)`` upper bounds ``sqrt(‖J‖_1 ‖J‖_∞) ≥ σ_max(J)``.
        exact: how ``sigma`` was computed.
        method: the same in words.
        seconds: wall time of ``sigma`` and of ``l1_linf``.
    """

    sigma: np.ndarray
    l1_linf: np.ndarray
    exact: bool
    method: str
    seconds: dict[str, float]

    @property
    def sum_sigma(self) -> np.ndarray:
        """``Σ_k σ_max(J_{F_k})`` per sample, ``(B,)`` (the exponent of eq. 15)."""
        return self.sigma.sum(axis=0)

    def to_records(self, checkpoint: str, index: Sequence[int]) -> list[dict]:
        """Plain dicts ``checkpoint, block, index, sigma_max, sigma_exact,
        l1_linf``, one per block and sample (``index``: test-set indices)."""
        L, n = self.sigma.shape
        return [
            {
                "checkpoint": checkpoint,
                "block": k,
                "index": int(index[i]),
                "sigma_max": float(self.sigma[k, i]),
                "sigma_exact": self.exact,
                "l1_linf": float(self.l1_linf[k, i]),
            }
            for k in range(L)
            for i in range(n)
        ]


def jacobian_spectrum(
    model: ViT,
    x: Tensor,
    mode: JacobianMode = "auto",
    chunk: int = 32,
    progress: Progress = None,
) -> JacobianSpectrum:
    """σ_max of every block's residual-branch Jacobian at the clean activations.

    Args:
        model: a :class:`lipvit.ViT` in eval mode (float64 recommended).
        x: images ``(B, C, S, S)`` in ``[0, 1]``.
        mode: ``"exact"`` (dense Jacobian and SVD; refused above
            :data:`lipvit.analysis.jacobian.EXACT_MAX_SIZE` entries per token matrix),
            ``"power"`` (JVP/VJP power iteration, an estimate from below) or
            ``"auto"`` (exact where the size allows).
        chunk: samples per dense-Jacobian batch (memory ``chunk · (N·D)²``).
        progress: called with a short text per block.

    Returns:
        :class:`JacobianSpectrum`.
    """
    if mode not in ("auto", "exact", "power"):
        raise ValueError(f"mode must be 'auto', 'exact' or 'power', got {mode!r}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    inputs = block_inputs(model, x)
    size = inputs[0][0].numel()
    exact = mode == "exact" or (mode == "auto" and size <= EXACT_MAX_SIZE)
    sig, est = [], []
    t_sigma = t_est = 0.0
    for k, block in enumerate(model.blocks):
        if progress:
            progress(f"block {k} Jacobian")
        F = residual_branch(block)
        X = inputs[k]
        t0 = time.perf_counter()
        sig.append(
            torch.cat(
                [
                    block_jacobian_sigma(F, X[i : i + chunk], exact=exact)
                    for i in range(0, X.shape[0], chunk)
                ]
            )
        )
        t_sigma += time.perf_counter() - t0
        t0 = time.perf_counter()
        est.append(
            torch.cat(
                [
                    jacobian_l1_linf_estimate(F, X[i : i + chunk])
                    for i in range(0, X.shape[0], chunk)
                ]
            )
        )
        t_est += time.perf_counter() - t0
    method = (
        "exact (dense Jacobian, SVD)"
        if exact
        else "power iteration (JVP/VJP), an estimate from below"
    )
    return JacobianSpectrum(
        torch.stack(sig).cpu().numpy(),
        torch.stack(est).cpu().numpy(),
        exact,
        method,
        {"sigma": t_sigma, "l1_linf": t_est},
    )


def embed_gain(model: ViT) -> float:
    """Exact ℓ2 gain of image → first-block tokens: ``‖W_pe‖ / min(std)``.

    Normalisation is a diagonal scaling, the patch embedding acts on disjoint
    patches (operator norm ``‖W_pe‖``), class token and positions add constants.
    """
    W = model.patch_embed.proj.weight.detach().double()
    return float(spectral_norm(W)) / float(model.std.min())


@dataclass(frozen=True)
class FirstOrder:
    """Deviation of the last block's output for an image perturbation of norm ε.

    Attributes:
        eps: radii ``(E,)`` in image space.
        first_order: ``ε · gain · exp(Σ_k σ_k)`` per sample, ``(E, B)``: an
            estimate (Cauchy paper eq. 15), not a bound.
        product: ``ε · gain · Π_k (1 + σ_k)``, ``(E, B)``: the same first-order
            estimate for discrete residual steps (``‖I + J‖ ≤ 1 + ‖J‖``, which
            ``e^{‖J‖}`` bounds again); ``≤ first_order``, also not a bound.
        certified: the sound budget of
        :func:`lipvit.certify.lofast.network.network_bound`
            after the last block, ``(E, B)``.
        pgd: PGD lower bound of the same deviation, ``(E, B)``.
        gain: :func:`embed_gain`.
        method: the certified bound's attention method.
        exact_sigma: whether the σ_k are exact.
    """

    eps: np.ndarray
    first_order: np.ndarray
    product: np.ndarray
    certified: np.ndarray
    pgd: np.ndarray
    gain: float
    method: str
    exact_sigma: bool

    def to_records(self, checkpoint: str) -> list[dict]:
        """Plain dicts per ε: mean first-order estimate, certified budget, PGD
        deviation and their ratios."""
        return [
            {
                "checkpoint": checkpoint,
                "eps": float(e),
                "first_order_mean": float(self.first_order[i].mean()),
                "product_mean": float(self.product[i].mean()),
                "certified_mean": float(self.certified[i].mean()),
                "pgd_mean": float(self.pgd[i].mean()),
                "first_order_over_pgd": float(
                    self.first_order[i].mean() / self.pgd[i].mean()
                ),
                "certified_over_pgd": float(
                    self.certified[i].mean() / self.pgd[i].mean()
                ),
                "method": self.method,
            }
            for i, e in enumerate(self.eps)
        ]


def first_order_deviation(
    model: ViT,
    x: Tensor,
    eps: Sequence[float],
    jac: JacobianSpectrum,
    *,
    method: str = "lofast",
    pgd_steps: int = 50,
    pgd_restarts: int = 2,
    seed: int = 0,
    progress: Progress = None,
) -> FirstOrder:
    """First-order estimate, certified bound and PGD deviation after the last block.

    The compared quantity is ``max ‖T(x') − T(x)‖_F`` over ``‖x' − x‖₂ ≤ ε``,
    ``T`` the map from the image to the last block's output tokens (before the
    final norm and the head: where eq. 15's ``Δx(T)`` lives). See the module
    docstring for the three values.

    Args:
        model, x: as in :func:`jacobian_spectrum`; ``jac`` computed on the same
            ``x``.
        eps: ℓ2 radii in image space.
        method: attention bound of the certified chain (``"lofast"``,
            ``"lofast-fast"`` or ``"specformer"``).
        pgd_steps, pgd_restarts, seed: the PGD lower bound.
    """
    from lipvit.certify.lofast.network import network_bound

    values = check_eps_list(eps)
    x = x.to(model.pos_embed.dtype)
    if jac.sigma.shape != (len(model.blocks), x.shape[0]):
        raise ValueError("jac was computed for another model or batch")
    gain = embed_gain(model)
    growth = np.exp(jac.sum_sigma)  # (B,)
    first = values[:, None] * gain * growth[None, :]  # (E, B)
    product = values[:, None] * gain * np.prod(1 + jac.sigma, axis=0)[None, :]
    if progress:
        progress("certified budget")
    nb = network_bound(model, x, method)
    last = max(i for i, s in enumerate(nb.steps) if s.name.startswith("block"))
    cert = np.stack(
        [
            token_budgets(nb.trace(float(e)))[0][:, last + 1].cpu().numpy()
            for e in values
        ]
    )

    def tokens(xp: Tensor) -> Tensor:
        X = model.embed(xp)
        for block in model.blocks:
            X = block(X)
        return X

    pgd = []
    for e in values:
        if progress:
            progress(f"pgd eps={e:g}")
        pgd.append(
            pgd_deviation(
                tokens, x, float(e), steps=pgd_steps, restarts=pgd_restarts, seed=seed
            )
            .cpu()
            .numpy()
        )
    return FirstOrder(
        values, first, product, cert, np.stack(pgd), gain, method, jac.exact
    )


@dataclass(frozen=True)
class Spectrum:
    """All spectra of one checkpoint (see the module docstring)."""

    weights: dict[str, np.ndarray]
    jacobian: JacobianSpectrum
    deviation: FirstOrder | None

    def weight_records(self, checkpoint: str) -> list[dict]:
        """Plain dicts ``checkpoint, block, head, matrix, sigma_max`` (exact σ_max)."""
        return [
            {
                "checkpoint": checkpoint,
                "block": layer,
                "head": head,
                "matrix": matrix,
                "sigma_max": float(values[layer, head]),
            }
            for matrix, values in self.weights.items()
            for layer in range(values.shape[0])
            for head in range(values.shape[1])
        ]

    def deviation_records(self, checkpoint: str) -> list[dict]:
        """:meth:`FirstOrder.to_records` of :attr:`deviation` (none without it)."""
        return [] if self.deviation is None else self.deviation.to_records(checkpoint)


def spectrum(
    model: ViT,
    x: Tensor,
    eps: Sequence[float] = (),
    *,
    jacobian: JacobianMode = "auto",
    method: str = "lofast",
    pgd_steps: int = 50,
    pgd_restarts: int = 2,
    progress: Progress = None,
) -> Spectrum:
    """:func:`weight_spectra`, :func:`jacobian_spectrum` and (when ``eps`` is given)
    :func:`first_order_deviation` of ``model`` at images ``x``."""
    model.eval()
    jac = jacobian_spectrum(model, x, jacobian, progress=progress)
    dev = (
        first_order_deviation(
            model,
            x,
            eps,
            jac,
            method=method,
            pgd_steps=pgd_steps,
            pgd_restarts=pgd_restarts,
            progress=progress,
        )
        if len(eps)
        else None
    )
    return Spectrum(weight_spectra(model), jac, dev)


def compare_weights(
    spectra: dict[str, dict[str, np.ndarray]],
    reference: str,
    matrices: Sequence[str] = PENALISED,
) -> list[dict]:
    """Per layer and matrix: max-over-heads σ_max of each checkpoint and whether it
    is lower than ``reference``'s (e.g. MSVP versus vanilla).

    Args:
        spectra: checkpoint label → :func:`weight_spectra` output.
        reference: the label every other checkpoint is compared with.

    Returns:
        Rows ``{"layer", "matrix", "<label>": σ, ..., "lower_than_<reference>:
        <label>": bool}``; ``lower`` means the largest head σ_max of that
        layer and matrix is strictly below the reference's.
    """
    if reference not in spectra:
        raise ValueError(f"unknown reference checkpoint {reference!r}")
    L = next(iter(spectra.values()))[matrices[0]].shape[0]
    rows = []
    for layer in range(L):
        for matrix in matrices:
            row: dict = {"layer": layer, "matrix": matrix}
            ref = float(spectra[reference][matrix][layer].max())
            for label, s in spectra.items():
                row[label] = float(s[matrix][layer].max())
            for label, s in spectra.items():
                if label != reference:
                    row[f"lower: {label}"] = bool(float(s[matrix][layer].max()) < ref)
            rows.append(row)
    return rows
