"""A structured, matrix-free bound on an attention sub-block's Jacobian norm.

The taylor certificate's budget recursion needs ``λ ≥ ‖I + J_a J_N‖``, the
clean-point Jacobian of ``s ↦ s + attn(N(s))`` (docs/taylor.md §8). Its
product bound ``1 + ‖J_a‖ ‖J_N‖`` is 1.4–1.7× the exact norm on a
Fashion-MNIST lipschitz model and 15–140× on standard ones, and the exact norm
needs the ``(N·D) × (N·D)`` Jacobian. Here the norm's Jacobian is a scaling
of a projection: a LayerProject's removes at most ``N`` known directions, a
LayerNorm's removes each token's mean and (nearly) its centred direction and
scales the features by ``γ``. The value path is then a Kronecker-structured
residual map on the complement of known directions, and its norm follows
from the structured ζ certificate (:mod:`lipvit.certify.lofast.structured`) and
``r × r`` eigenproblems (docs/taylor.md §8, "Projected sub-blocks"; ours);
the softmax path through the norm by rows or, where it matters, by the
weighted factorisation of :mod:`lipvit.certify.taylor.softmax_norm`.

Notation: ``Γ`` an ``N × D`` token matrix, ``K Γ = Σ_h P_h Γ W_vo[h]`` the
value path, ``S`` the softmax path, ``J_N`` the norm's Jacobian: for a
LayerProject on token ``t`` (or on the whole matrix in Frobenius mode)
``c (I − x̂x̂ᵀ)`` with ``c = R/‖x‖`` where ``‖x‖ > R``, the identity elsewhere.
Pure functions of tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import torch
import torch.autograd.forward_ad as fwAD
from lipvit.certify.attention import bound_weights, value_output
from lipvit.certify.local import layernorm_local_lipschitz
from lipvit.certify.lofast.layer import (
    LoFASTTerms,
    certified_lambda_max,
    zeta_from_attention,
)
from lipvit.certify.memory import memory_budget
from lipvit.certify.taylor.forward import Record, explicit_attention
from lipvit.certify.taylor.remainders import (
    logit_row_variance_gains,
    logit_variance_gain,
    logit_variance_gain_all,
    softmax_path,
    softmax_row_gains,
)
from lipvit.certify.taylor.softmax_norm import softmax_norm_bound
from torch import Tensor

from lipvit.layers import LayerProject
from lipvit.model import ViT
from lipvit.spectral import gram_norm, ritz_lambda_max, top_root

WEIGHTED_SHARE = 0.1
"""The softmax path's share of the sub-block bound above which
:func:`subblock_bound` also computes its weighted bound (about 0.5 s per
sample and block at Fashion-MNIST size)."""

_SLACK = 1e-10
"""Relative margin on the ``r × r`` part (float64 rounding of ``K'ᵀU`` and its
projection, far below ``1e-10`` at these sizes)."""


def projection_structure(X: Tensor, radius: float, mode: str) -> tuple[Tensor, Tensor]:
    """``J_N = D_c (I − U Uᵀ)`` of a LayerProject at ``X`` ``(B, N, D)``.

    Returns:
        ``c`` ``(B, N)``: each token's scale (``R/‖x‖`` where projected, else 1;
        one value for all tokens in Frobenius mode);
        ``U`` ``(B, r, N, D)``: orthonormal directions removed (``r = 1``,
        ``x̂ = X/‖X‖_F`` in Frobenius mode; ``r = N``, ``e_t ⊗ x̂_t`` in token
        mode), zero where nothing is projected.
    """
    B, N, D = X.shape
    if mode == "frobenius":
        n = torch.linalg.vector_norm(X, dim=(1, 2))  # (B,)
        proj = n > radius
        c = torch.where(proj, radius / n, torch.ones_like(n))[:, None].expand(B, N)
        U = torch.where(proj[:, None, None], X / n[:, None, None], torch.zeros_like(X))
        return c, U[:, None]  # (B, 1, N, D)
    n = torch.linalg.vector_norm(X, dim=-1)  # (B, N)
    proj = n > radius
    c = torch.where(proj, radius / n, torch.ones_like(n))
    x_hat = torch.where(proj[..., None], X / n[..., None], torch.zeros_like(X))
    U = torch.diag_embed(x_hat.transpose(1, 2)).permute(0, 2, 3, 1)  # (B, N, N, D)
    return c, U


def layernorm_structure(X: Tensor, ln) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``J_N = D_c (I − U Λ Uᵀ) diag(γ)`` of a LayerNorm ``ln`` at ``X`` ``(B, N, D)``.

    On token ``t`` (``x_c`` the centred token, ``s = (‖x_c‖²/D + η)^½``) the
    Jacobian is ``(1/s) diag(γ)(I − 11ᵀ/D − ρ ûûᵀ)``, ``û = x_c/‖x_c‖``,
    ``ρ = ‖x_c‖²/(‖x_c‖² + Dη)`` (the map of
    :class:`~lipvit.certify.taylor.linearized.Linearized`; ``û ⊥ 1``). Returns
    ``c = 1/s`` ``(B, N)``; ``γ`` ``(D,)`` (ones without an affine weight);
    ``U`` ``(B, 2N, N, D)``: ``e_t ⊗ 1/√D`` then ``e_t ⊗ û_t`` (zero where
    ``x_c = 0``); ``kept = 1 − Λ`` ``(B, 2N)``: 0 on the mean directions,
    ``1 − ρ_t`` on ``û_t``. ``diag(γ)`` commutes into the value path's weights.
    """
    B, N, D = X.shape
    x_c = X - X.mean(-1, keepdim=True)
    n2 = x_c.square().sum(-1)  # (B, N) = ‖x_c‖²
    c = (n2 / D + ln.eps).rsqrt()
    norm = n2.sqrt()
    u = torch.where(norm[..., None] > 0, x_c / norm.clamp_min(1e-300)[..., None], 0.0)
    vecs = torch.cat([torch.full_like(X, D**-0.5), u], 1)  # (B, 2N, D): j's vector
    U = X.new_zeros(B, 2 * N, N, D)
    j = torch.arange(2 * N, device=X.device)
    U[:, j, j % N] = vecs  # direction j lives on token j mod N
    kept = torch.cat([torch.zeros_like(n2), ln.eps * D / (n2 + ln.eps * D)], 1)
    gamma = ln.weight if ln.weight is not None else torch.ones_like(X[0, 0])
    return c, gamma, U, kept


def projected_subblock_norm(
    P: Tensor, W_v: Tensor, W_o: Tensor, c: Tensor, U: Tensor, softmax: Tensor,
    kept: Tensor | None = None,
) -> Tensor:
    """Upper bound ``(B,)`` on ``‖I + (K + S) J_N‖``, ``J_N = D_c (I − UΛUᵀ)``.

    With ``K' = K D_c`` (the attention matrices' columns scaled by ``c``:
    still Kronecker) and ``A = I + K'``, ``I + K' (I − UUᵀ) = A (I − UUᵀ) +
    UUᵀ``. A unit ``w = Us + w_⊥`` maps to ``A w_⊥ + U s``, so

        ‖·w‖² = ‖A w_⊥‖² + 2 sᵀ Uᵀ A w_⊥ + ‖s‖² ≤ a² ‖w_⊥‖² + 2 b ‖s‖ ‖w_⊥‖ + ‖s‖²

    with ``a ≥ ‖A‖`` (the residual ζ certificate of ``P D_c``) and ``b =
    ‖(I − UUᵀ) K'ᵀ U‖`` (``Uᵀ A w_⊥ = ((I − UUᵀ) Aᵀ U)ᵀ w_⊥``, and ``Aᵀ U =
    U + K'ᵀ U``): at most ``λ_max([[a², b], [b, 1]])``. Where ``J_N`` keeps a
    fraction ``1 − Λ`` of the directions ``U`` (a LayerNorm's ``û_t``,
    :func:`layernorm_structure`), ``I − UΛUᵀ = (I − UUᵀ) + U(I − Λ)Uᵀ`` adds
    ``K' U (I − Λ) s``, at most ``‖K' U (I − Λ)‖ ‖s‖`` (an ``r × r`` Gram
    matrix). The softmax path adds at most ``‖S J_N‖``.

    Args:
        P: attention matrices ``(B, H, N, N)``, float64.
        W_v: ``(H, D, d)``; W_o: ``(H, d, D)``.
        c, U: :func:`projection_structure` or :func:`layernorm_structure`.
        softmax: ``(B,)``, a bound on the softmax path's ``‖S J_N‖``.
        kept: ``(B, r)``, ``1 − Λ``; ``None``: every direction removed.
    """
    Pc = P * c[:, None, None, :]  # (B, H, N, N): P_h D_c
    a = zeta_from_attention(Pc, W_v, W_o, residual=True)
    W_vo = value_output(W_v, W_o)  # (H, D, D)
    V = torch.einsum("bhsn,brsd,hed->brne", Pc, U, W_vo)  # (B, r, N, D): K'ᵀ U
    coef = torch.einsum("brnd,bqnd->brq", U, V)  # (B, r, r): Uᵀ K'ᵀ U
    V_perp = V - torch.einsum("brq,brnd->bqnd", coef, U)  # (I − UUᵀ) K'ᵀ U
    b = _top(V_perp)
    a2 = a.square()
    half = (a2 - 1) / 2
    lam2 = (a2 + 1) / 2 + torch.sqrt(half.square() + b.square())
    lam = lam2.sqrt() * (1 + _SLACK) + softmax
    if kept is None:
        return lam
    KU = torch.einsum("bhns,brsd,hde->brne", Pc, U, W_vo)  # (B, r, N, D): K' U
    return lam + _top(KU * kept[..., None, None])


def _top(W: Tensor) -> Tensor:
    """``‖[W_1 … W_r]‖`` ``(B,)`` of ``r`` token matrices ``(B, r, N, D)`` as
    columns, from their ``r × r`` Gram matrix, rounded up."""
    flat = W.flatten(2)  # (B, r, N·D)
    return top_root(flat @ flat.transpose(1, 2)) * (1 + _SLACK)


def with_softmax_gains(block, attn_in: Tensor, terms: LoFASTTerms
                       ) -> LoFASTTerms:
    """``terms`` of ``block``'s attention at its clean input ``attn_in``
    ``(B, N, D)`` with the softmax path's row gains and the logit variance
    gains set (:func:`~lipvit.certify.taylor.remainders.softmax_row_gains`,
    :func:`~lipvit.certify.taylor.remainders.logit_variance_gain`,
    :func:`~lipvit.certify.taylor.remainders.logit_row_variance_gains`)."""
    W_q, W_k, W_v, W_o = bound_weights(block.attn)
    V = torch.einsum("bnD,hDE->bhnE", attn_in, value_output(W_v, W_o))  # (B, H, N, D)
    P = torch.softmax(terms.logits, dim=-1)  # (B, H, N, N)
    var_row, var_row_all = logit_row_variance_gains(attn_in, W_q, W_k, P)
    return replace(terms, row_gain=softmax_row_gains(P, V),
                   var_gain=logit_variance_gain(attn_in, W_q, W_k, P), var_row=var_row,
                   var_all=logit_variance_gain_all(attn_in, W_q, W_k, P),
                   var_row_all=var_row_all)


def token_jacobians(norm, X: Tensor) -> Tensor:
    """Block-diagonal ``J_k`` ``(B, N, D, D)`` with ``‖S J_N‖ ≤ ‖S diag(J_k)‖``
    for the norm ``norm`` at ``X`` ``(B, N, D)``: a LayerNorm's token Jacobians
    ``c_t diag(γ)(I − 11ᵀ/D − ρ_t û_tû_tᵀ)`` (:func:`layernorm_structure`), a
    token-mode LayerProject's ``c_t(I − x̂_tx̂_tᵀ)``, and ``c I`` for one in
    Frobenius mode (``J_N = c(I − x̂x̂ᵀ)``, ``‖S J_N‖ ≤ c‖S‖``)."""
    B, N, D = X.shape
    eye = torch.eye(D, dtype=X.dtype, device=X.device)
    if isinstance(norm, LayerProject):
        c, U = projection_structure(X, norm.radius, norm.mode)
        if norm.mode == "frobenius":
            return c[..., None, None] * eye
        x_hat = U.diagonal(dim1=1, dim2=2).transpose(1, 2)  # (B, N, D): U[:, t, t]
        return c[..., None, None] * (eye - x_hat[..., :, None] * x_hat[..., None, :])
    c, gamma, U, kept = layernorm_structure(X, norm)
    t = torch.arange(N, device=X.device)
    u = U[:, N + t, t]  # (B, N, D): û_t
    rho = 1 - kept[:, N:]  # (B, N)
    Pi = eye - 1 / D - rho[..., None, None] * u[..., :, None] * u[..., None, :]
    return c[..., None, None] * gamma.detach()[:, None] * Pi


class SubBlockBound(NamedTuple):
    """The two parts of :func:`subblock_bound` ``(B,)`` each: ``value``, the
    residual value path's bound ``‖I + K J_N‖`` (:func:`projected_subblock_norm`
    without the softmax path), and ``softmax``, the softmax path's ``‖S J_N‖``;
    the sub-block's bound is their sum (the triangle inequality)."""

    value: Tensor
    softmax: Tensor


def subblock_bound(block, X: Tensor, terms: LoFASTTerms,
                   weighted: bool = True) -> Tensor:
    """Upper bound ``(B,)`` on ``‖I + J_a J_N‖`` of ``block``'s attention
    sub-block at its clean input ``X`` ``(B, N, D)`` (a LayerProject or a
    LayerNorm ``norm1``): the sum of :func:`subblock_parts`."""
    parts = subblock_parts(block, X, terms, weighted)
    return parts.value + parts.softmax


def subblock_parts(block, X: Tensor, terms: LoFASTTerms,
                   weighted: bool = True) -> SubBlockBound:
    """The value and softmax paths' bounds of :func:`subblock_bound`,
    :func:`projected_subblock_norm`; ``terms``: the bare
    attention's at ``norm1(X)`` (with :func:`with_softmax_gains`'s row gains
    for the tighter softmax path). ``weighted``: where the softmax path's
    bound is more than :data:`WEIGHTED_SHARE` of the value path's, also bound
    it by :func:`~lipvit.certify.taylor.softmax_norm.softmax_norm_bound` (where
    smaller)."""
    norm = block.norm1
    W_q, W_k, W_v, W_o = bound_weights(block.attn)
    P = torch.softmax(terms.logits, dim=-1)
    if isinstance(norm, LayerProject):
        c, U = projection_structure(X, norm.radius, norm.mode)
        softmax = softmax_path(terms) * c.amax(-1)  # ‖J_N‖ = max c
        value = projected_subblock_norm(P, W_v, W_o, c, U, torch.zeros_like(softmax))
    else:
        c, gamma, U, kept = layernorm_structure(X, norm)
        zero = torch.zeros_like(c[:, 0])
        L_N = layernorm_local_lipschitz(X, norm.weight, norm.eps, zero)
        softmax = softmax_path(terms) * L_N
        value = projected_subblock_norm(P, gamma[:, None] * W_v, W_o, c, U,
                                       torch.zeros_like(softmax), kept)
    # Only the samples that need it: a sample's bound never depends on its batch.
    need = (softmax > WEIGHTED_SHARE * value).nonzero()[:, 0] if weighted else []
    if len(need):
        X_n = X[need]
        weighted_bound = softmax_norm_bound(norm(X_n).detach(), W_q, W_k, W_v, W_o,
                                            P[need], token_jacobians(norm, X_n))
        softmax = softmax.index_put((need,), torch.fmin(softmax[need], weighted_bound))
    return SubBlockBound(value, softmax)


# --------------------------------------------------------------------------
# Exact sub-block Jacobian norms (the explicitly exact small-size mode).
# --------------------------------------------------------------------------

EXACT_MAX = 4096
"""Largest token-matrix size ``N·D`` for which :func:`subblock_norms` forms a
whole attention sub-block's ``(N·D) × (N·D)`` Jacobian (its cost grows as
``(N·D)²`` per sample in memory and ``(N·D)³`` in time: about 0.25 s per
sample at ``N·D = 544`` on one CPU core, 2.4 s at 1088, 14 s at 3200 — the
Fashion-MNIST ``fmnist-3x64`` preset); above it the certificate uses the
structured and product bounds for these two maps."""

EXACT_MAX_LIPSCHITZ = 1024
""":data:`EXACT_MAX` of the lipschitz family: its attention sub-blocks'
structured product bounds are as good as their exact norms where measured
(the digits-small lipschitz model, ``N·D = 1088``: the same certified
accuracies and median radius to four digits, at 1.8× the time), while the
standard family's radii grow 3.6–5.5× with the exact norms (docs/taylor.md
§11)."""

PUSH_BYTES = 2**30
"""Most bytes of forward-mode temporaries :func:`_transposed_jacobian` allows
itself at once (it pushes as many basis tangents together as fit); a quarter
of ``--max-memory`` where that is less (:func:`push_bytes`). Each push is a
few hundred operations: at ``fmnist-3x64`` (``N·D = 3200``) 1 GiB takes 6
pushes a Jacobian where 256 MiB took 21 (about 9,000 operations a sample for
the three blocks' sub-block norms instead of 23,000), in slightly less
time."""


def push_bytes(max_memory: int | None) -> int:
    """Bytes of forward-mode temporaries :func:`_transposed_jacobian` allows
    itself within ``max_memory`` (default
    :func:`~lipvit.certify.memory.default_max_memory`): a quarter of it, at
    most :data:`PUSH_BYTES`."""
    return min(PUSH_BYTES, memory_budget(max_memory) // 4)


def dense_bytes(model: ViT, max_memory: int | None = None) -> int:
    """Bytes :func:`subblock_norms` holds at once beyond the clean pass (one
    sample at a time): the basis, two ``(N·D) × (N·D)`` Jacobians and a Gram
    matrix, and the forward-mode temporaries of one push (at most
    :func:`push_bytes`); 0 above :data:`EXACT_MAX`."""
    N = model.config.num_patches + 1
    n = N * model.config.embed_dim
    every = n * _tangent_bytes(model.config.num_heads, N, n)  # every tangent at once
    return 8 * 4 * n * n + min(push_bytes(max_memory), every) if n <= EXACT_MAX else 0


def _tangent_bytes(heads: int, N: int, n: int) -> int:
    """Forward-mode temporaries of one basis tangent through an attention of
    ``heads`` heads on ``N`` tokens (``n = N·D``): sixteen float64 tensors of
    ``heads·N² + n`` entries."""
    return 8 * 16 * (heads * N**2 + n)


@dataclass(frozen=True)
class SubBlockNorms:
    """Exact spectral norms of the clean point's sub-block Jacobians, rounded up
    (docs/taylor.md §8): each is a valid ``λ`` of the budget recursion
    (``+inf`` where not computed: :func:`subblock_norms`).

    Attributes:
        attn: ``(B, K)``: ``‖D(s ↦ s + attn(norm1(s)))‖`` at ``s_{2k}``.
        bare: ``(B, K)``: ``‖D attn‖`` at the attention's input ``p_k``.
        mlp: ``(B, K, N)``: the feed-forward sub-block's (``s + mlp(norm2(s))``,
            or ``SLL(P₂(s))``) at ``s_{2k+1}``, per token (it is token-wise: its
            norm is the largest token's ``D × D`` Jacobian norm).
        unit: per block ``(B, N, m)``: ``‖∇_{s_t} z_{t,i}‖``, each
            pre-activation's gradient norm w.r.t. its own token of ``s_{2k+1}``.
        ffn: per block ``(B, N)``: ``‖D mlp‖`` per token at norm2's output
            (standard family: ``‖W₂ diag(GELU′(z_t)) W₁‖``).
        into: per block but the last ``(B, N)``: the feed-forward sub-block
            composed with the next block's LayerNorm, ``‖D(s ↦ norm1_{k+1}(s +
            mlp(norm2(s))))‖`` per token at ``s_{2k+1}`` (standard family, both
            token-wise; ``+inf`` for a lipschitz model).
    """

    attn: Tensor
    bare: Tensor
    mlp: Tensor
    unit: list[Tensor]
    ffn: list[Tensor]
    into: list[Tensor]


def _transposed_jacobian(fn, X: Tensor, heads: int, push: int) -> Tensor:
    """``J(X)ᵀ`` ``(n, n')`` of a map of token matrices (batches ``(B, N, D)``
    in and out) at one token matrix ``X`` ``(N, D)`` (``n = N·D`` inputs,
    ``n'`` outputs): row ``i`` is the output tangent of the basis tangent
    ``e_i`` (forward mode, as many tangents at a time as ``push`` bytes
    hold, :func:`_tangent_bytes` each: an attention's)."""
    n = X.numel()
    per_tangent = _tangent_bytes(heads, X.shape[0], n)
    E = torch.eye(n, dtype=X.dtype, device=X.device).reshape(n, *X.shape)

    def row(t: Tensor) -> Tensor:
        return torch.func.jvp(lambda s: fn(s[None])[0], (X,), (t,))[1].reshape(-1)

    chunk = max(1, min(n, push // per_tangent))
    with torch.no_grad():
        return torch.func.vmap(row, chunk_size=chunk)(E)


def _attention_norms(block, X: Tensor, P: Tensor, token_wise: bool, push: int
                     ) -> tuple[Tensor, Tensor]:
    """``(‖D(s ↦ s + attn(norm1(s)))(X)‖, ‖D attn(P)‖)`` for one sample, ``X``
    its block input ``(N, D)`` and ``P = norm1(X)``, both rounded up
    (:func:`_certified_norm`). The bare attention's Jacobian is formed once and the
    sub-block's follows from it, ``(I + J_a J_N)ᵀ = I + J_Nᵀ J_aᵀ``, with
    ``J_N`` block diagonal (``D × D`` per token) where ``norm1`` is token-wise
    (a LayerNorm, a per-token LayerProject) and dense otherwise; ``push``:
    bytes of forward-mode temporaries (:func:`push_bytes`)."""
    H = block.attn.num_heads
    T_a = _transposed_jacobian(partial(explicit_attention, block.attn), P, H,
                               push)  # (n, n)
    if token_wise:
        N, D = X.shape
        T_N = _token_tangents(block.norm1, X[None])[0]  # (N, D, D): J_N,tᵀ per token
        T_w = torch.einsum("tde,tef->tdf", T_N, T_a.reshape(N, D, -1))
        T_w = T_w.reshape(N * D, -1) + torch.eye(N * D, dtype=X.dtype, device=X.device)
    else:  # a Frobenius LayerProject: J_N dense, a cheap map to push
        T_w = _transposed_jacobian(block.norm1, X, H, push) @ T_a
        T_w = T_w + torch.eye(X.numel(), dtype=X.dtype, device=X.device)
    return _certified_norm(T_w), _certified_norm(T_a)


def _certified_norm(T: Tensor) -> Tensor:
    """``‖T‖`` of an ``(n, n')`` tangent matrix, rounded up: ``λ_max`` of
    ``T Tᵀ`` proven by a Cholesky certificate just above the subspace-iteration
    estimate (:func:`lipvit.certify.lofast.layer.certified_lambda_max`, within
    a relative ``10⁻⁶`` of it, else eigvalsh plus the rounding margin): one
    factorisation instead of the whole spectrum, 2× faster at ``n = 1088``."""
    G = T @ T.T
    lam = certified_lambda_max(G, float(ritz_lambda_max(G)), 1e-10, tau_max=1e-6,
                               scale=float(T.pow(2).sum()), inner=T.shape[1])
    return torch.tensor(lam, dtype=T.dtype, device=T.device).sqrt()


def _token_tangents(fn, X: Tensor) -> Tensor:
    """Per-token Jacobians of a token-wise map: ``(B, N, D, out)``, row ``d`` the
    output tangent of ``e_d`` (at every token at once: the tokens do not mix)."""
    B, N, D = X.shape
    E = torch.eye(D, dtype=X.dtype, device=X.device)[:, None].expand(D, N, D)
    with torch.no_grad(), fwAD.dual_level():
        Y = fn(fwAD.make_dual(X.repeat_interleave(D, 0), E.repeat(B, 1, 1)))
        T = fwAD.unpack_dual(Y).tangent  # (B·D, N, out)
    return T.reshape(B, D, N, -1).transpose(1, 2)


def subblock_norms(
    model: ViT, clean: Record, max_size: int | None = None,
    max_memory: int | None = None,
) -> SubBlockNorms:
    """:class:`SubBlockNorms` at the clean point, by forward-mode AD. The
    token-wise maps' norms (``mlp``, ``unit``, ``ffn``: ``D`` tangents per
    token) are computed at every size; the whole attention maps' (``attn``,
    ``bare``) only when ``N·D ≤ max_size`` (default :data:`EXACT_MAX`;
    :data:`EXACT_MAX_LIPSCHITZ` in the lipschitz family: their
    ``(N·D) × (N·D)`` Jacobians are formed, their basis tangents pushed
    within :func:`push_bytes` of ``max_memory``) and are ``+inf`` otherwise
    (the certificate then keeps its product bounds)."""
    X0 = clean.stream[0]
    if max_size is None:
        max_size = (EXACT_MAX if model.config.family == "standard"
                    else EXACT_MAX_LIPSCHITZ)
    whole = X0[0].numel() <= max_size
    token_wise = (model.config.family == "standard"
                  or model.config.attn_project == "token")
    inf = torch.full(X0.shape[:1], math.inf, dtype=X0.dtype, device=X0.device)
    attn, bare, mlp, unit, ffn, into = [], [], [], [], [], []
    for k, block in enumerate(model.blocks):
        X, X_mid = clean.stream[2 * k], clean.stream[2 * k + 1]
        if whole:
            pairs = [_attention_norms(block, Xb, Pb, token_wise,
                                      push_bytes(max_memory))
                     for Xb, Pb in zip(X, clean.attn_in[k], strict=True)]
            attn.append(torch.stack([a for a, _ in pairs]))
            bare.append(torch.stack([b for _, b in pairs]))
        else:
            attn.append(inf)
            bare.append(inf)
        if model.config.family == "lipschitz":
            ff = lambda s, b=block: b.mlp(b.norm2(s))  # noqa: E731
        else:
            ff = lambda s, b=block: s + b.mlp(b.norm2(s))  # noqa: E731
        mlp.append(gram_norm(_token_tangents(ff, X_mid)))  # (B, N)
        T_z = _token_tangents(lambda s, b=block: b.mlp.fc1(b.norm2(s)), X_mid)
        unit.append(torch.linalg.vector_norm(T_z, dim=2) * (1 + 1e-12))  # (B, N, m)
        ffn.append(gram_norm(_token_tangents(block.mlp, block.norm2(X_mid))))
        if k + 1 == len(model.blocks):
            continue
        if model.config.family == "lipschitz":
            into.append(torch.full_like(mlp[-1], math.inf))
        else:
            nxt = lambda s, f=ff, n=model.blocks[k + 1].norm1: n(f(s))  # noqa: E731
            into.append(gram_norm(_token_tangents(nxt, X_mid)))
    return SubBlockNorms(torch.stack(attn, 1), torch.stack(bare, 1),
                         torch.stack(mlp, 1), unit, ffn, into)
