"""ReLU flip symbols: the SLL units that can change sign, propagated exactly.

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

* a later pre-activation: ``|Σ_i G_{z,i} r_i| ≤ Σ_i |G_{z,i}| ρ_i``;
* a later stream state, whole or one token: ``‖Σ_i G_{s,i} r_i‖ ≤ Σ_i ‖G_{s,i}‖ ρ_i``;
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
    """``Σ_i |G_{u,i}| ρ_i`` over the symbols so far, at every site input ``u``.

    Attributes:
        stream: per stream state ``s_0 … s_{2K}``, ``(B,)`` (Frobenius).
        stream_token: per stream state, ``(B, N)`` (each token).
        attn_in: per block, ``(B,)``: the attention's input (Frobenius).
        act_in: per block, ``(B, N, m)``: each pre-activation.
        cls: ``(B,)``: the last stream state's class token.
    """

    stream: list[Tensor]
    stream_token: list[Tensor]
    attn_in: list[Tensor]
    act_in: list[Tensor]
    cls: Tensor

    @classmethod
    def zeros(cls, clean: Record) -> Carried:
        """No symbols yet, shaped like the clean :class:`Record` of a batch."""
        X = clean.stream[0]  # (B, N, D)
        B, N = X.shape[:2]
        z = X.new_zeros(B)
        return cls(
            stream=[z.clone() for _ in clean.stream],
            stream_token=[X.new_zeros(B, N) for _ in clean.stream],
            attn_in=[z.clone() for _ in clean.attn_in],
            act_in=[torch.zeros_like(a) for a in clean.act_in],
            cls=z.clone(),
        )


def flip_range(z: Tensor, delta: Tensor) -> Tensor:
    """``ρ = (δ − |z|)₊``: each unit's remainder lies in ``[0, ρ]`` (module docstring).

    ``δ`` is rounded up by a relative ``1e-12`` so that a unit whose budget
    reaches zero within float rounding counts as one that can flip.
    """
    return (delta * (1 + 1e-12) - z.abs()).clamp_min(0)


def propagate(
    model: ViT, clean: Record, k: int, rho: Tensor, carried: Carried,
    max_symbols: int = 256, chunk: int = 512,
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
    score = (rho * torch.linalg.vector_norm(column, dim=1)).flatten(1)  # (B, N·m)
    top = score.topk(min(max_symbols, score.shape[1]), dim=1).indices
    chosen = torch.zeros_like(score, dtype=torch.bool).scatter_(1, top, True)
    chosen = chosen.reshape(rho.shape) & (rho > 0)
    tail = torch.where(chosen, torch.zeros_like(rho), rho)  # (B, N, m)
    tau = torch.minimum(
        (tail * torch.linalg.vector_norm(column, dim=1)).sum(-1),
        spectral_norm(column) * torch.linalg.vector_norm(tail, dim=-1),
    )  # (B, N)
    X0 = clean.stream[2 * k + 2]  # (B, N, D): block k's output
    first = 2 * k + 2  # index of X0 among the stream states
    idx = chosen.nonzero()  # (S, 3): sample, token, unit
    for rows in idx.split(chunk) if len(idx) else ():
        b, t, i = rows.unbind(1)
        r = rho[b, t, i]  # (S,)
        T0 = torch.zeros_like(X0[b])  # (S, N, D)
        T0[torch.arange(len(rows)), t] = column[i]
        with torch.no_grad(), fwAD.dual_level():
            _, rec = forward_blocks(model, fwAD.make_dual(X0[b], T0), k + 1)
            stream = [fwAD.unpack_dual(s).tangent for s in rec.stream]
            attn_in = [fwAD.unpack_dual(p).tangent for p in rec.attn_in]
            act_in = [fwAD.unpack_dual(a).tangent for a in rec.act_in]
        for m, S in enumerate(stream, start=first):
            tok = torch.linalg.vector_norm(S, dim=-1) * r[:, None]  # (S, N)
            carried.stream_token[m].index_add_(0, b, tok)
            carried.stream[m].index_add_(0, b, torch.linalg.vector_norm(
                S.flatten(1), dim=1) * r)
        for kk, P in enumerate(attn_in, start=k + 1):
            carried.attn_in[kk].index_add_(0, b, torch.linalg.vector_norm(
                P.flatten(1), dim=1) * r)
        for kk, Z in enumerate(act_in, start=k + 1):
            carried.act_in[kk].index_add_(0, b, Z.abs() * r[:, None, None])
        cls = torch.linalg.vector_norm(stream[-1][:, 0], dim=-1) * r  # (S,)
        carried.cls.index_add_(0, b, cls)
    return torch.linalg.vector_norm(tau, dim=-1)
