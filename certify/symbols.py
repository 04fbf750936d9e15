"""Symbols: remainders with a fixed column, propagated exactly (ReLU flips, and
LayerProject's radial part, :func:`propagate_radial`).

docs/taylor.md §5. At ε, unit ``i`` (token ``t``) of block ``k`` has clean
pre-activation ``z_i`` and ``|Δz_i| ≤ δ_i``. Its remainder
``r_i = relu(z_i + Δz_i) − relu(z_i) − relu′(z_i) Δz_i`` (autograd's
``relu′(0) = 0``) satisfies

    0 ≤ r_i ≤ ρ_i = (δ_i − |z_i|)₊

(relu is convex, so it lies above its tangent; the gap is largest at the far
end of ``[z_i − δ_i, z_i + δ_i]``). Units with ``ρ_i = 0`` have no remainder;
each other unit's ``r_i`` is a *symbol*, an unknown in ``[0, ρ_i]``. Through
the linearised network at the clean point, symbol ``i`` moves every later site
input ``u`` by ``G_{u,i} r_i``, where ``G_{u,i}`` — the response at ``u`` to a
unit injection at the SLL's activation, i.e. the column ``−2 W T⁻¹ e_i`` at
token ``t`` entering the stream — is computed exactly by forward-mode AD, one
tangent per symbol. Hence, with the exact per-coefficient interval bound,

* a later pre-activation: ``Σ_i G_{z,i} r_i ∈ [−Σ_i G⁻_{z,i} ρ_i, Σ_i G⁺_{z,i} ρ_i]``
  (exact over the box; ``G⁺``, ``G⁻`` the positive and negative parts);
* a later stream state, whole or one token, with ``r_i = ρ_i/2 + v_i``,
  ``|v_i| ≤ ρ_i/2``: ``‖Σ_i G_{s,i} r_i‖ ≤ ‖|c| + h‖`` with the exact centre
  ``c = Σ_i G_{s,i} ρ_i/2`` and the spread ``h = Σ_i |G_{s,i}| ρ_i/2``, per
  coordinate (each coordinate's largest move over the box; never above the
  triangle sum ``Σ_i ‖G_{s,i}‖ ρ_i``);
* a class margin with site gradient ``g``: ``Σ_i g_i r_i ≤ Σ_i g_i⁺ ρ_i``.

:class:`Carried` accumulates the first two for every later site input, in
place, block after block (:func:`propagate`). All of it is this project's own
(the zonotope idea of DeepZ, Singh et al. 2018, with one ``ℓ2`` ball for the
image and exact coefficients from the clean Jacobian).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as fwAD
from lipvit.certify.sites import Record, forward_blocks
from torch import Tensor

from lipvit.model import ViT
from lipvit.spectral import spectral_norm


@dataclass
class Carried:
    """What the symbols so far do to every later site input (module docstring).

    With ``r_i = ρ_i/2 + v_i``, ``|v_i| ≤ ρ_i/2``, a site input moves by the
    exact *centre* ``Σ_i G_{u,i} ρ_i/2`` plus the *spread*: each coordinate by
    at most ``Σ_i |G_{u,i}| ρ_i/2``, so the whole move is at most
    ``‖|centre| + spread‖`` (exact per coordinate over the box, never more than
    the triangle sum ``Σ_i ‖G_{u,i}‖ ρ_i``); a scalar pre-activation moves by
    ``Σ_i G_{z,i} r_i ∈ [−Σ_i G⁻ρ_i, Σ_i G⁺ρ_i]`` (exact over the box).

    Attributes:
        centre: per stream state ``s_0 … s_{2K}``, ``(B, N, D)``.
        spread: per stream state, ``(B, N, D)``: ``Σ_i |G_{s,i}| ρ_i/2``.
        attn_centre: per block, ``(B, N, D)``: at the attention's input.
        attn_spread: per block, ``(B, N, D)``.
        up, down: per block, ``(B, N, m)``: ``Σ_i G⁺ρ_i`` and ``Σ_i G⁻ρ_i`` at
            each pre-activation.
    """

    centre: list[Tensor]
    spread: list[Tensor]
    attn_centre: list[Tensor]
    attn_spread: list[Tensor]
    up: list[Tensor]
    down: list[Tensor]

    @classmethod
    def zeros(cls, clean: Record) -> Carried:
        """No symbols yet, shaped like the clean :class:`Record` of a batch."""
        return cls(
            centre=[torch.zeros_like(s) for s in clean.stream],
            spread=[torch.zeros_like(s) for s in clean.stream],
            attn_centre=[torch.zeros_like(p) for p in clean.attn_in],
            attn_spread=[torch.zeros_like(p) for p in clean.attn_in],
            up=[torch.zeros_like(a) for a in clean.act_in],
            down=[torch.zeros_like(a) for a in clean.act_in],
        )

    def stream(self, m: int) -> Tensor:
        """``(B,)``: bound on the symbols' change of stream state ``m`` (Frobenius)."""
        return _norm(_reach(self.centre[m], self.spread[m]).flatten(1))

    def stream_token(self, m: int) -> Tensor:
        """``(B, N)``: the same per token."""
        return _norm(_reach(self.centre[m], self.spread[m]))

    def attn_in(self, k: int) -> Tensor:
        """``(B,)``: the same at block ``k``'s attention input."""
        return _norm(_reach(self.attn_centre[k], self.attn_spread[k]).flatten(1))

    def cls(self) -> Tensor:
        """``(B,)``: the same at the last stream state's class token."""
        return self.stream_token(len(self.centre) - 1)[:, 0]


def _reach(centre: Tensor, spread: Tensor) -> Tensor:
    """``|centre| + spread``: each coordinate's largest move over the box."""
    return centre.abs() + spread


def _norm(t: Tensor) -> Tensor:
    """Euclidean norm over the last dimension, rounded up by a relative 1e-12."""
    return torch.linalg.vector_norm(t, dim=-1) * (1 + 1e-12)


def flip_range(z: Tensor, delta: Tensor) -> Tensor:
    """``ρ = (δ − |z|)₊``: each unit's remainder lies in ``[0, ρ]`` (module docstring).

    ``δ`` bounds the pre-activation's move *towards* zero (``−Δz`` where
    ``z > 0``, ``Δz`` where ``z ≤ 0``): the remainder is ``(−Δz − z)₊`` or
    ``(Δz − |z|)₊`` and is 0 for a move away. It is rounded up by a relative
    ``1e-12`` so that a unit whose budget reaches zero within float rounding
    counts as one that can flip.
    """
    return (delta * (1 + 1e-12) - z.abs()).clamp_min(0)


def propagate(
    model: ViT, clean: Record, k: int, rho: Tensor, carried: Carried,
    max_symbols: int = 1024, chunk: int = 512,
) -> Tensor:
    """Add block ``k``'s symbols to ``carried``, in place; bound the rest.

    Per sample, the ``max_symbols`` units with the largest ``ρ_i ‖c_i‖``
    (``c_i = −2 W T⁻¹ e_i``, the unit's column into the stream) become symbols.
    The others (the *tail*) change the stream state after the block by
    ``R_t = Σ_i c_i r_i`` at each token ``t``, with
    ``‖R_t‖ ≤ τ_t = min(Σ_i ‖c_i‖ ρ_i, ‖2 W T⁻¹‖ ‖ρ_t‖)``; the returned
    ``‖τ‖₂`` bounds ``‖R‖_F`` and is carried by the caller like any other
    remainder.

    Args:
        model: the lipschitz-family ViT (SLL blocks), float64.
        clean: the clean :class:`Record` of the batch.
        k: the block whose activation's symbols these are.
        rho: ``(B, N, m)``: each unit's ``ρ_i`` (0 where it cannot flip).
        carried: updated for every site input after block ``k``'s activation.
        max_symbols: symbols per sample and block (cost: one forward-mode pass
            through the later blocks each).
        chunk: symbols per forward-mode pass (memory).

    Returns:
        ``(B,)``: the bound ``‖τ‖₂`` on the tail's change of the stream.
    """
    sll = model.blocks[k].mlp
    column = -2.0 * sll.fc1.weight / sll.T()[:, None]  # (m, D): c_i = −2 W T⁻¹ e_i
    c_norm = torch.linalg.vector_norm(column, dim=1)  # (m,): ‖c_i‖
    score = (rho * c_norm).flatten(1)  # (B, N·m)
    top = score.topk(min(max_symbols, score.shape[1]), dim=1).indices
    chosen = torch.zeros_like(score, dtype=torch.bool).scatter_(1, top, True)
    chosen = chosen.reshape(rho.shape) & (rho > 0)
    tail = torch.where(chosen, torch.zeros_like(rho), rho)  # (B, N, m)
    tau = torch.minimum(
        (tail * c_norm).sum(-1),
        spectral_norm(column) * torch.linalg.vector_norm(tail, dim=-1),
    )  # (B, N)
    X0 = clean.stream[2 * k + 2]  # (B, N, D): block k's output
    idx = chosen.nonzero()  # (S, 3): sample, token, unit
    for rows in idx.split(chunk) if len(idx) else ():
        b, t, i = rows.unbind(1)
        T0 = torch.zeros_like(X0[b])  # (S, N, D)
        T0[torch.arange(len(rows)), t] = column[i]
        with torch.no_grad(), fwAD.dual_level():
            _, rec = forward_blocks(model, fwAD.make_dual(X0[b], T0), k + 1)
            _carry(carried, rec, b, rho[b, t, i], 2 * k + 2, k + 1)
    return torch.linalg.vector_norm(tau, dim=-1)


def propagate_radial(
    model: ViT, clean: Record, k: int, site: str, s: Tensor, carried: Carried,
    chunk: int = 512,
) -> None:
    """Add block ``k``'s LayerProject radial symbols to ``carried``, in place.

    The projection at ``site`` (``"norm1"`` or ``"norm2"``) leaves a remainder
    ``−σ x̂ + r'`` per projected vector, ``σ ∈ [0, s]``
    (:func:`lipvit.certify.remainders.layer_project_split`); each ``σ`` with
    ``s > 0`` is a symbol whose column is ``−x̂`` at the site's output (the
    whole token matrix for a Frobenius projection, one token otherwise).

    Args:
        model: the lipschitz-family ViT, float64.
        clean: the clean :class:`Record` of the batch.
        k: the block.
        site: ``"norm1"`` or ``"norm2"``.
        s: ``(B, T)``: each vector's range (``T = 1`` Frobenius, ``N`` per token).
        carried: updated for every site input from the site's output on.
        chunk: symbols per forward-mode pass.
    """
    X_in = clean.stream[2 * k]  # (B, N, D): block k's input
    X = X_in if site == "norm1" else clean.stream[2 * k + 1]  # the projected input
    idx = (s > 0).nonzero()  # (S, 2): sample, vector
    for rows in idx.split(chunk) if len(idx) else ():
        b, t = rows.unbind(1)
        if s.shape[1] == 1:  # the whole token matrix
            T = -X[b] / torch.linalg.vector_norm(X[b], dim=(1, 2), keepdim=True)
        else:
            T = torch.zeros_like(X[b])  # (S, N, D)
            x_t = X[b, t]  # (S, D)
            T[torch.arange(len(rows)), t] = -x_t / torch.linalg.vector_norm(
                x_t, dim=-1, keepdim=True)
        with torch.no_grad(), fwAD.dual_level():
            inject = {(k, site): fwAD.make_dual(torch.zeros_like(T), T)}
            _, rec = forward_blocks(model, X_in[b], k, inject)
            _carry(carried, rec, b, s[b, t], 2 * k, k)


def _carry(carried: Carried, rec: Record, b: Tensor, r: Tensor, first_stream: int,
           first_block: int) -> None:
    """Add symbols ``r_i ∈ [0, ρ_i]`` (``r`` holds the ``ρ_i``, ``(S,)``, of samples
    ``b``) to ``carried`` from a dual :class:`Record` of their columns' forward
    pass, which starts at stream state ``first_stream`` and block
    ``first_block``; values before the injection carry no tangent."""
    h = r / 2  # (S,): ρ_i/2

    def tangents(values: list[Tensor], start: int):
        for m, v in enumerate(values, start=start):
            T = fwAD.unpack_dual(v).tangent
            if T is not None:
                yield m, T

    for m, S in tangents(rec.stream, first_stream):
        carried.centre[m].index_add_(0, b, S * h[:, None, None])
        carried.spread[m].index_add_(0, b, S.abs() * h[:, None, None])
    for kk, P in tangents(rec.attn_in, first_block):
        carried.attn_centre[kk].index_add_(0, b, P * h[:, None, None])
        carried.attn_spread[kk].index_add_(0, b, P.abs() * h[:, None, None])
    for kk, Z in tangents(rec.act_in, first_block):
        carried.up[kk].index_add_(0, b, Z.clamp_min(0) * r[:, None, None])
        carried.down[kk].index_add_(0, b, (-Z).clamp_min(0) * r[:, None, None])
