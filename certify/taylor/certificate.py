"""First-order-exact network certificates: the ``taylor`` method (docs/taylor.md).

For a wrong class ``j`` and ``c_j = e_j − e_y``, every ``‖x' − x‖₂ ≤ ε`` obeys

    c_jᵀ(f(x') − f(x)) ≤ ‖c_jᵀ J‖ ε + Σ_sites ‖c_jᵀ G_site‖ · ρ_site(β_site)

(docs/taylor.md §1): the network is a graph of linear maps and a few
nonlinear *sites* (the norm before attention, the attention, the norm before
the MLP, the MLP's activation, the final norm); each site ``φ`` maps its
clean input ``u`` plus a perturbation to ``φ(u) + Dφ(u)Δu + r``, so the
output's change is the linearised network's response to the input
perturbation plus its responses to every site's remainder ``r``. ``J`` (image
to logits) and ``G_site`` (an additive injection at the site's output to the
logits) are the clean point's exact Jacobians; ``c_jᵀJ`` and ``c_jᵀG_site``
are gradients of the margin ``f_j − f_y`` with respect to the image and to a
zero tensor added at the site's output, one backward pass per class, batched.
``ρ_site`` (:mod:`lipvit.certify.taylor.remainders`) bounds the remainder (or its
weighted sum over tokens and units) when the site's input moves by at most ``β_site``; a
standard model's attention also takes the smaller of that and its remainder to second
order through the image (:mod:`lipvit.certify.taylor.second_order`), whole and per
output token.

Perturbation budgets β (docs/taylor.md §8). On the residual stream
``s_0`` (block 0's input), ``s_1`` (block 0's middle), …, ``s_{2K}``:

* **chain**: the LoFAST composition of
:func:`lipvit.certify.lofast.network.network_bound`
  (``NetworkBound.trace``: whole matrix and class token);
* **recursion**: ``Γ_m = J_{m←x} Γ_x + Σ_{k≤m} J_{m:k} R_k`` gives
  ``β_m ≤ ‖J_{m←x}‖ ε + Σ_{k≤m} (Π_{i=k+1..m} λ_i) ρ^sub_k(β_{k−1})`` with
  ``‖J_{m←x}‖`` exact (the ``n × n`` Gram matrix of ``n`` JVPs, ``n`` the image
  dimension; eigvalsh), ``λ_i`` a sound bound on sub-block ``i``'s Jacobian
  norm at the clean point and ``ρ^sub_k`` its remainder's norm. In a
  lipschitz model the ReLU units that can flip are carried exactly instead,
  as *symbols* (:mod:`lipvit.certify.taylor.symbols`, docs/taylor.md §5):
  ``β_m`` gains the norm of their box's per-coordinate reach and each later
  unit's budget ``Σ_i |G_{z,i}| ρ_i``, with exact coefficients;
* **Lipschitz**: from the sub-block's input budget alone, ``β_mid ≤ λβ +
  ‖J_a‖‖r_N‖ + ‖r_a‖`` (attention) and ``β_out ≤ β_mid`` (``SLL∘P₂``,
  1-Lipschitz per token) or ``λ_t β_t + R_t`` (a standard MLP), whole and per
  token (:func:`_after_attention`, :func:`_capped`).

A Frobenius projection's remainder takes its share by direction
(docs/taylor.md §3): ``s(−gᵀx̂)₊ + l |g_⊥ᵀΓ|``, with ``|x̂ᵀΓ|`` (in ``s`` and
``l``) and ``|g_⊥ᵀΓ|`` bounded as linear functionals of the block's input,
like the margins (:func:`_stream_bound`).

Each ``β_m`` is the minimum of the three (all sound); the class token's budget
also takes the chain's class-token budget. Every quantity is float64. The first
order ``‖c_jᵀJ‖`` is **exact** (autograd, float rounding aside); every
remainder, β and ``λ`` is an **upper bound**; the certificate is sound. A
relative allowance of :data:`ROUNDING` covers float rounding.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
from lipvit.certify.certification import certified_radius, falsi_radius, float64_model
from lipvit.certify.eps import eps_per_sample
from lipvit.certify.local import (
    gelu_mlp_local_lipschitz,
    layer_project_local_lipschitz,
    layernorm_local_lipschitz,
)
from lipvit.certify.lofast.layer import LoFASTTerms
from lipvit.certify.lofast.network import NetworkBound, network_bound
from lipvit.certify.taylor import margin_jets
from lipvit.certify.taylor.forward import SITES, Record, check_supported, forward
from lipvit.certify.taylor.jacobian_norms import (
    JacobianNorms,
    jacobian_norms,
    jets_fit,
    resident_bytes,
)
from lipvit.certify.taylor.linearized import Linearized
from lipvit.certify.taylor.remainders import (
    ImagePart,
    RadialSplit,
    TokenRemainder,
    attention_jacobian_norm,
    attention_remainder,
    attention_row_norms,
    attention_row_remainders,
    gelu_curvature,
    image_times,
    layer_project_directional,
    layer_project_remainder,
    layer_project_split,
    layernorm_curvature,
)
from lipvit.certify.taylor.second_order import (
    quadratic_coefficient,
    second_order_remainder,
)
from lipvit.certify.taylor.sites import MarginGradients, site_gradients
from lipvit.certify.taylor.subblock import (
    SubBlockNorms,
    subblock_bound,
    subblock_norms,
    with_softmax_gains,
)
from lipvit.certify.taylor.symbols import (
    Carried,
    default_max_symbols,
    flip_range,
    propagate,
    propagate_radial,
)
from torch import Tensor

from lipvit.layers import LayerProject
from lipvit.model import ViT
from lipvit.spectral import spectral_norm

__all__ = ["ROUNDING", "TaylorBound", "forward", "taylor_bound"]

ROUNDING = 1e-9
"""Relative allowance added to every margin-drop bound for float64 rounding."""

# --------------------------------------------------------------------------
# Per-block remainder terms.
# --------------------------------------------------------------------------


class Budget(NamedTuple):
    """Perturbation bounds on a stream state: Frobenius ``all`` ``(B,)``, per
    token ``token`` ``(B, N)``, and ``acc`` ``(B,)``, a bound on the part of the
    perturbation that is neither ``J_{s←x} Γ`` nor the symbols' (the other
    sites' propagated remainders), and ``acc_token`` ``(B, N)`` the same per
    token. After a standard feed-forward sub-block, ``split = (a, R)``: that
    part is ``J_ff v + ρ`` with ``‖v‖ ≤ a`` (the sub-block input's) and ``‖ρ‖ ≤
    R`` (its own remainders), for the next LayerNorm's exact composite norm."""

    all: Tensor
    token: Tensor
    acc: Tensor
    acc_token: Tensor
    split: tuple[Tensor, Tensor] | None = None


class AttentionGains(NamedTuple):
    """Clean-point Jacobian bounds of a block's attention sub-block ``s ↦ s +
    attn(N(s))`` (docs/taylor.md §8): ``J_a`` ``(B,)`` of the bare attention,
    ``lam`` ``(B,)`` of the sub-block, ``rows`` ``(B, N)`` per output token of the
    bare attention, ``L_N`` ``(B,)`` of the norm ``N``."""

    J_a: Tensor
    lam: Tensor
    rows: Tensor
    L_N: Tensor


def _attention_gains(
    terms, L_N: Tensor, exact: SubBlockNorms | None, k: int, structured: Tensor,
) -> AttentionGains:
    """:class:`AttentionGains` of block ``k``: the product bounds, or the exact
    norms where :func:`subblock_norms` ran and ``structured`` (a bound on the
    sub-block's norm, :func:`~lipvit.certify.taylor.subblock.subblock_bound`) where
    they are smaller."""
    J_a = _tighter(attention_jacobian_norm(terms), exact, "bare", k)
    lam = torch.minimum(_tighter(1 + J_a * L_N, exact, "attn", k), structured)
    rows = torch.minimum(attention_row_norms(terms), J_a[:, None])
    return AttentionGains(J_a, lam, rows, L_N)


def _after_attention(
    e: Tensor, jn: JacobianNorms, sym: Carried, m: int, b: Budget,
    a: AttentionGains, r_N: Tensor, r_a: Tensor, chain: Tensor, r_whole: Tensor,
    b_p: Tensor, r_a_tok: Tensor | None = None,
) -> Budget:
    """Stream state ``m``'s budget after the attention sub-block, docs/taylor.md §8.

    The other remainders grow to ``λ acc + r_a + ‖J_a‖ ‖r_N‖`` (``r_N`` the
    norm's remainder, ``r_a`` the attention's); token ``t`` keeps its own
    ``acc_t`` (the residual) and receives at most ``‖(J_a)_t‖`` times the
    attention input's other perturbations ``‖J_N‖ acc + ‖r_N‖``, plus its
    row of the remainder (``r_a_tok`` ``(B, N)``, or ``r_a``).

    Lipschitz recursion, from the input's budget alone:
    ``Γ_mid = (I + J_a J_N)Γ + J_a r + r_a`` gives ``λβ + ‖J_a‖‖r‖ + ‖r_a‖``
    (``‖r‖ ≤ r_whole``, the norm's whole remainder, symbols included), and token
    ``t`` moves by ``Γ_t + (J_a ΔP)_t + (r_a)_t``, at most
    ``β_t + ‖(J_a)_t‖ β_p + ‖r_a‖`` (``β_p`` the attention input's budget).
    """
    acc = a.lam * b.acc + r_a + a.J_a * r_N
    into = a.L_N * b.acc + r_N  # (B,)
    r_t = r_a[:, None] if r_a_tok is None else r_a_tok
    acc_token = b.acc_token + a.rows * into[:, None] + r_t
    budget = _budget(e, jn, sym, m, acc, chain, acc_token)
    return _capped(budget, a.lam * b.all + a.J_a * r_whole + r_a,
                   b.token + a.rows * b_p[:, None] + r_t)


def _capped(b: Budget, whole: Tensor, token: Tensor) -> Budget:
    """``b`` with its whole and per-token budgets capped by other sound bounds
    (each token's kept at most the whole)."""
    whole = torch.minimum(b.all, whole)
    token = torch.minimum(torch.minimum(b.token, token), whole[:, None])
    return b._replace(all=whole, token=token)


def _logit_radius(
    terms, jn: JacobianNorms, k: int, e: Tensor, rest: Tensor, b_p: Tensor,
    quad: Tensor | None = None,
) -> Tensor:
    """``‖ΔS_h‖_F ≤ ‖J_{S_h←x}‖ε + (‖M_h(X)‖ rest + ‖A_h‖ β_p²)/√d`` ``(B, H)``
    (docs/taylor.md §7): the attention input moves by ``J_{p←x}Γ`` plus at most
    ``rest``, and ``M_h[J_{p←x}Γ]/√d = J_{S_h←x}Γ`` is exact. ``quad``: a
    tighter bound on ``‖ΔA_hΔᵀ‖_F`` than ``‖A_h‖β_p²``, if any."""
    qq = terms.qk_norm * b_p[:, None] ** 2
    if quad is not None:
        qq = torch.minimum(qq, quad)
    first = image_times(jn.logits[:, k], e)  # +inf where not computed (large images)
    return first + (terms.m_norm * rest[:, None] + qq) / math.sqrt(terms.head_dim)


def _image_part(w_q: Tensor, w_k: Tensor, jn: JacobianNorms, k: int, e: Tensor,
                rest: Tensor) -> ImagePart:
    """Block ``k``'s attention input as ``J_{p←x}Γ + R`` (``‖R‖ ≤ rest``),
    docs/taylor.md §7: ``‖ΔW_q[h]‖_F ≤ ‖J_{Q_h←x}‖ε + ‖W_q[h]‖ rest`` and the
    same for the keys, so ``‖ΔA_hΔᵀ‖_F ≤ ‖ΔW_q‖_F ‖ΔW_k‖_F`` and row ``t``'s
    ``‖Δ_tA_hΔᵀ‖ ≤ ‖W_q[h]‖ ‖Δ_t‖ ‖ΔW_k‖_F``; ``w_q``, ``w_k`` ``(H,)``: the
    heads' ``‖W_q[h]‖``, ``‖W_k[h]‖``."""
    a_q = image_times(jn.queries[:, k], e) + w_q * rest[:, None]  # (B, H)
    a_k = image_times(jn.keys[:, k], e) + w_k * rest[:, None]
    quad, row = (torch.nan_to_num(t, nan=math.inf) for t in (a_q * a_k, w_q * a_k))
    return ImagePart(e, rest, jn.variance.block(k), quad, row,  # 0·∞ is no bound
                     jn.logit_rows[:, k])


def _budget(
    e: Tensor, jn: JacobianNorms, sym: Carried, m: int, acc: Tensor, chain: Tensor,
    acc_token: Tensor | None = None,
) -> Budget:
    """Stream state ``m``'s budget: the recursion ``‖J‖ε + Σ|G|ρ + acc`` (image,
    symbols, other remainders), or the chain. ``acc_token`` ``(B, N)``:
    optional per-token bounds on the other remainders; ``acc`` bounds every
    token's too."""
    whole = torch.minimum(jn.stream[:, m] * e + sym.stream(m) + acc, chain)
    acc_t = acc[:, None].expand(-1, jn.stream_token.shape[-1])
    if acc_token is not None:
        acc_t = torch.minimum(acc_token, acc_t)
    token = torch.minimum(
        jn.stream_token[:, m] * e[:, None] + sym.stream_token(m) + acc_t,
        whole[:, None],
    )
    return Budget(whole, token, acc, acc_t)


def _projected_norms(t: Tensor, mode: str) -> Tensor:
    """Norm of each vector a LayerProject of ``mode`` projects: over the last
    dimension (``"token"``) or the last two, kept as a size-1 dimension
    (``"frobenius"``). ``(B, N, D) → (B, N)`` or ``(B, 1)``; a margin gradient
    ``(B, K, N, D) → (B, K, N)`` or ``(B, K, 1)``."""
    if mode == "token":
        return torch.linalg.vector_norm(t, dim=-1)
    return torch.linalg.vector_norm(t, dim=(-2, -1))[..., None]


def _radial_share(g: Tensor, X: Tensor, mode: str, s: Tensor) -> Tensor:
    """``Σ_t s_t (−g_tᵀx̂_t)₊`` ``(B, K)``: a margin's share of the radial symbols
    ``−σ_t x̂_t``, ``σ_t ∈ [0, s_t]`` (exact over the box, docs/taylor.md §3);
    ``g`` ``(B, K, N, D)`` the margins' gradients at the projection's output,
    ``X`` ``(B, N, D)`` its clean input, ``s`` ``(B, T)``."""
    dots = (g * X[:, None]).sum(-1)  # (B, K, N): g_tᵀx_t
    if mode != "token":
        dots = dots.sum(-1, keepdim=True)  # (B, K, 1): ⟨g, X⟩
    x_norm = _projected_norms(X, mode)[:, None]  # (B, 1, T)
    return (s[:, None] * (-dots / x_norm).clamp_min(0)).sum(-1)


def _directional_share(
    g: Tensor, X: Tensor, turn: RadialSplit, beta: Tensor, dirs: Directions,
    deep: bool,
) -> Tensor:
    """A margin's share ``s (−gᵀx̂)₊ + l |g_⊥ᵀΓ|`` ``(B, K)`` of a Frobenius
    projection's remainder split by :func:`layer_project_directional` (``turn``):
    ``g`` ``(B, K, N, D)`` the margins' gradients at its output, ``X``
    ``(B, N, D)`` its clean input, ``β`` ``(B,)``; ``|g_⊥ᵀΓ|`` is bounded by
    ``‖g_⊥‖β`` and, when ``deep``, by ``dirs.perp``."""
    x_hat = (X / torch.linalg.vector_norm(X, dim=(1, 2), keepdim=True))[:, None]
    g_x = (g * x_hat).sum((-2, -1))  # (B, K)
    g_perp = g - g_x[..., None, None] * x_hat
    w = torch.linalg.vector_norm(g_perp, dim=(-2, -1)) * beta[:, None]
    if deep:
        w = torch.minimum(w, dirs.perp(g_perp))
    share = turn.s * (-g_x).clamp_min(0) + turn.rest.lin * w
    return torch.where(turn.rest.lin.isinf(), math.inf, share)  # not outside


def _smaller_rest(a: RadialSplit, b: RadialSplit, caps: Tensor) -> RadialSplit:
    """Per vector, the split of the two whose rest ``‖r'‖`` is smaller at ``caps``."""
    pick = b.rest.at(caps) < a.rest.at(caps)  # (B, T)
    rest = TokenRemainder(torch.where(pick, b.rest.quad, a.rest.quad),
                          torch.where(pick, b.rest.lin, a.rest.lin))
    return RadialSplit(torch.where(pick, b.s, a.s), rest)


def _attn_share(g: Tensor, r_a: Tensor) -> Tensor:
    """``‖g‖_F ‖r_a‖`` ``(B, K)``: a margin's share of the attention's remainder."""
    return torch.linalg.vector_norm(g, dim=(-2, -1)) * r_a[:, None]


class Chord(NamedTuple):
    """A lipschitz block's ReLU units at one ε: clean pre-activations ``z``,
    bounds ``up``, ``down`` on their moves up and down and ``ρ``, each
    ``(B, N, m)`` (docs/taylor.md §5); ``rest_up``, ``rest_down``: the parts of
    ``up``, ``down`` beyond the first-order reach ``‖∇_x z_i‖ε`` before the
    Lipschitz cap (the earlier symbols' ``Σ G^±ρ`` and the propagated
    remainders), so that ``Δz_i − ∇_x z_iᵀΓ ∈ [−rest_down_i, rest_up_i]``."""

    z: Tensor
    up: Tensor
    down: Tensor
    rho: Tensor
    rest_up: Tensor
    rest_down: Tensor


class BlockStep(NamedTuple):
    """A block's result at one ε: budgets, the site shares ``{site: (B, K)}`` as
    a function of the margins' site gradients ``{site: (B, K, …)}`` and of
    ``deep`` (whether a Frobenius projection bounds ``|g_⊥ᵀΓ|`` as a stream
    functional, :func:`_directional_share`) and, for a lipschitz block, its
    :class:`Chord`."""

    mid: Budget
    out: Budget
    shares: Callable[[dict[str, Tensor], bool], dict[str, Tensor]]
    chord: Chord | None


class Directions(NamedTuple):
    """Bounds on linear functionals of a Frobenius ``norm1``'s input
    perturbation ``Γ`` (:func:`_stream_bound`): ``radial`` ``(B,)`` on
    ``|x̂ᵀΓ|``, and ``perp`` maps weights ``v`` ``(B, K, N, D)`` to bounds
    ``(B, K)`` on ``|vᵀΓ|``."""

    radial: Tensor
    perp: Callable[[Tensor], Tensor]


class _Block:
    """A block's remainder step: called at ε ``(B,)`` with ``(input budget, chain
    bound of the middle, of the output, symbols, directions)`` it gives the
    block's :class:`BlockStep` (a lipschitz block adds its ReLU symbols to the
    :class:`Carried`). Its clean-point data ``at`` (a NamedTuple of ``(B, …)``
    tensors), its attention's ``terms`` and the batch's clean record, Jacobian
    norms and linearised network are all it reads of the samples, so
    :meth:`take` restricts it to some of them."""

    at: NamedTuple
    terms: LoFASTTerms
    clean: Record
    jn: JacobianNorms
    lin: Linearized

    def take(self, index: Tensor, clean: Record, jn: JacobianNorms, lin: Linearized
             ) -> _Block:
        """The block at the samples ``index`` ``(b,)`` of the batch, with their
        ``clean`` record, Jacobian norms ``jn`` and linearisation ``lin``."""
        sub = copy.copy(self)
        sub.at, sub.terms = _take_rows(self.at, index), self.terms.take(index)
        sub.clean, sub.jn, sub.lin = clean, jn, lin
        return sub


def _take_rows(data: NamedTuple, index: Tensor) -> NamedTuple:
    """``data`` with every tensor, also in nested NamedTuples, restricted to the
    rows ``index`` (``None`` stays ``None``)."""
    return type(data)(*(
        t[index] if isinstance(t, Tensor) else None if t is None
        else _take_rows(t, index) for t in data))


def _unknown(exact: SubBlockNorms | None, k: int) -> bool:
    """Whether block ``k``'s exact attention sub-block norm is missing (above
    :data:`~lipvit.certify.taylor.subblock.EXACT_MAX`), so that its structured bound
    counts."""
    return exact is None or not bool(torch.isfinite(exact.attn[:, k]).all())


def _tighter(bound: Tensor, exact: SubBlockNorms | None, name: str, k: int) -> Tensor:
    """``bound`` or, where :func:`subblock_norms` ran, the smaller of it and the
    exact clean-point norm ``exact.<name>`` of block ``k`` (both sound)."""
    if exact is None:
        return bound
    return torch.minimum(bound, getattr(exact, name)[:, k])


class _LipschitzClean(NamedTuple):
    """A lipschitz block's clean-point data: its input ``X`` and middle stream
    state ``X_mid`` ``(B, N, D)``, pre-activations ``z`` ``(B, N, m)``, the norms
    of what ``P₁`` and ``P₂`` project (``n1`` ``(B, N)`` or ``(B, 1)``, ``n_mid``
    ``(B, N)``), their Jacobian norms ``L1_0`` ``(B,)`` and ``L2_0`` ``(B, N)``
    (per token) and the attention's :class:`AttentionGains`."""

    X: Tensor
    X_mid: Tensor
    z: Tensor
    n1: Tensor
    n_mid: Tensor
    L1_0: Tensor
    L2_0: Tensor
    gains: AttentionGains


class _LipschitzBlock(_Block):
    """Sites of ``X + attn(P₁(X))`` and ``SLL(P₂(·))`` (docs/taylor.md §3, §5, §7);
    the ReLU units that can flip become symbols
    (:mod:`lipvit.certify.taylor.symbols`)."""

    def __init__(self, model: ViT, k: int, clean: Record, terms: LoFASTTerms,
                 jn: JacobianNorms, exact: SubBlockNorms | None, max_symbols: int,
                 lin: Linearized):
        block = model.blocks[k]
        self.model, self.k, self.max_symbols = model, k, max_symbols
        self.P1, self.P2 = block.norm1, block.norm2
        self.w_norm = torch.linalg.vector_norm(block.mlp.fc1.weight, dim=1)  # (m,)
        X, X_mid = clean.stream[2 * k], clean.stream[2 * k + 1]
        zero = torch.zeros(X.shape[0], dtype=X.dtype, device=X.device)
        L1_0 = layer_project_local_lipschitz(X, self.P1.radius, zero, self.P1.mode)
        L2_0 = layer_project_local_lipschitz(
            X_mid, self.P2.radius, zero, "token", per_token=True
        )
        structured = subblock_bound(block, X, terms, weighted=_unknown(exact, k))
        self.at = _LipschitzClean(
            X, X_mid, clean.act_in[k], _projected_norms(X, self.P1.mode),
            _projected_norms(X_mid, "token"), L1_0, L2_0,
            _attention_gains(terms, L1_0, exact, k, structured))
        self.terms, self.clean, self.jn, self.lin = terms, clean, jn, lin

    def __call__(
        self, e: Tensor, b: Budget, chain_mid: Tensor, chain_out: Tensor, sym: Carried,
        dirs: Directions | None,
    ) -> BlockStep:
        X, X_mid, z, n1, n_mid, L1_0, L2_0, gains = self.at
        P1, P2, w_norm, k, terms, jn = (self.P1, self.P2, self.w_norm, self.k,
                                        self.terms, self.jn)
        lin, clean, m_mid = self.lin, self.clean, 2 * self.k + 1
        caps1 = b.token if P1.mode == "token" else b.all[:, None]
        split1 = layer_project_split(n1, P1.radius, caps1)  # r = −σx̂ + r' (§3)
        if dirs is not None:  # r = −τx̂ + cΓ_⊥ (§3)
            turn = layer_project_directional(n1, P1.radius, caps1, dirs.radial[:, None])
            split1 = _smaller_rest(split1, turn, caps1)
        propagate_radial(lin, clean, k, "norm1", split1.s, sym)
        r1 = split1.rest
        r1_norm = r1.norm(b.all)
        # The attention's input moves by J_{p←x}Γ + (symbols) + J_P₁(acc) + r_P₁.
        L1 = layer_project_local_lipschitz(X, P1.radius, b.all, P1.mode)
        rest = sym.attn_in(k) + L1_0 * b.acc + r1_norm  # all but J_{p←x}Γ
        b_p = torch.minimum(L1 * b.all, jn.attn_in[:, k] * e + rest)
        r_a = attention_remainder(terms, b_p, _logit_radius(terms, jn, k, e, rest, b_p))
        r1_whole = r1_norm + torch.linalg.vector_norm(split1.s, dim=-1)  # + radial
        mid = _after_attention(e, jn, sym, m_mid, b, gains, r1_norm, r_a, chain_mid,
                               r1_whole, b_p)
        split2 = layer_project_split(n_mid, P2.radius, mid.token)
        propagate_radial(lin, clean, k, "norm2", split2.s, sym)
        r2 = split2.rest
        r2_t = r2.at(mid.token)  # (B, N)
        # Each unit's move up (down): ≤ ‖∇z_ti‖ε + Σ G⁺ρ (Σ G⁻ρ)
        #                             + ‖w_i‖(‖J_P₂,t‖ acc + ρ_P₂,t).
        prop = L2_0 * mid.acc_token + r2_t  # (B, N)
        L2 = layer_project_local_lipschitz(
            X_mid, P2.radius, mid.token.amax(-1), "token", per_token=True
        )
        rest = prop[..., None] * w_norm  # (B, N, m)
        first = jn.act_in[k] * e[:, None, None]
        cap = (L2 * mid.token)[..., None] * w_norm
        up = torch.minimum(first + rest + sym.up[k], cap)
        down = torch.minimum(first + rest + sym.down[k], cap)
        rho = flip_range(z, torch.where(z > 0, down, up))  # r_i ∈ [0, ρ_i] (§5)
        tail = propagate(self.model, lin, k, rho, sym, self.max_symbols)
        # P₂'s remainder passes the linearised SLL (norm ≤ 1); the ReLU's are
        # symbols, but for the tail (bounded in norm).
        acc_out = mid.acc + torch.linalg.vector_norm(r2_t, dim=-1) + tail
        out = _budget(e, jn, sym, m_mid + 1, acc_out, chain_out,
                      mid.acc_token + r2_t + tail[:, None])
        out = _capped(out, mid.all, mid.token)  # SLL∘P₂ is 1-Lipschitz per token

        def norm1_share(g: Tensor, deep: bool) -> Tensor:
            share = (r1.weighted(_projected_norms(g, P1.mode), b.all, caps1)
                     + _radial_share(g, X, P1.mode, split1.s))
            if dirs is None:
                return share
            return torch.minimum(share, _directional_share(g, X, turn, b.all, dirs,
                                                           deep))

        def shares(g: dict[str, Tensor], deep: bool) -> dict[str, Tensor]:
            return {
                "norm1": norm1_share(g["norm1"], deep),
                "attn": _attn_share(g["attn"], r_a),
                "norm2": r2.weighted(_projected_norms(g["norm2"], "token"), mid.all,
                                     mid.token) + _radial_share(g["norm2"], X_mid,
                                                                "token", split2.s),
                # r ≥ 0, so only g⁺ counts
                "act": (g["act"].clamp_min(0) * rho[:, None]).sum((-2, -1)),
            }

        return BlockStep(mid, out, shares,
                         Chord(z, up, down, rho, rest + sym.up[k], rest + sym.down[k]))


def _layernorm_parts(ln, X: Tensor) -> tuple[Tensor, Tensor, float]:
    """Centred token norms ``(B, N)``, ``γ`` ``(D,)`` and ``κ = D η`` of a LayerNorm."""
    D = X.shape[-1]
    gamma = ln.weight if ln.weight is not None else torch.ones(D, dtype=X.dtype)
    c_norm = torch.linalg.vector_norm(X - X.mean(-1, keepdim=True), dim=-1)
    return c_norm, gamma, D * ln.eps


def _layernorm_remainder(ln, X: Tensor, caps: Tensor) -> TokenRemainder:
    """LayerNorm's per-token remainder ``‖γ‖_∞ √D ½ψ_max b²``, docs/taylor.md §4."""
    c_norm, gamma, kappa = _layernorm_parts(ln, X)
    scale = gamma.abs().amax() * math.sqrt(X.shape[-1])
    q = scale * layernorm_curvature(c_norm, kappa, caps)
    return TokenRemainder(q, torch.zeros_like(q))


def _layernorm_weights(g: Tensor, ln) -> Tensor:
    """``√D ‖γ ⊙ g_t‖ / (‖γ‖_∞ √D)`` per token ``(B, K, N)``: the weight of a margin
    on LayerNorm's remainder, relative to :func:`_layernorm_remainder`'s scale
    (``gᵀ(γ ⊙ √D r_φ) ≤ √D ‖γ ⊙ g‖ ‖r_φ‖``)."""
    if ln.weight is None:
        return torch.linalg.vector_norm(g, dim=-1)
    gamma = ln.weight
    return torch.linalg.vector_norm(g * gamma, dim=-1) / gamma.abs().amax()


class _StandardClean(NamedTuple):
    """A standard block's clean-point data: ``X``, ``X_mid``, ``z``, ``L1_0``,
    ``L2_0`` and ``gains`` as in :class:`_LipschitzClean` (LayerNorms'),
    ``q2`` ``(B,)`` the attention's second-order coefficient, ``lam_t``
    ``(B, N)`` each token's feed-forward sub-block norm, ``ffn`` ``(B, N)`` the
    MLP's, ``gain`` ``(B, N, m)`` each pre-activation's w.r.t. its token of
    ``X_mid`` and ``into`` ``(B, N)`` the previous feed-forward sub-block
    composed with this block's LayerNorm (``None`` in block 0 or without exact
    norms)."""

    X: Tensor
    X_mid: Tensor
    z: Tensor
    L1_0: Tensor
    L2_0: Tensor
    gains: AttentionGains
    q2: Tensor
    lam_t: Tensor
    ffn: Tensor
    gain: Tensor
    into: Tensor | None


class _StandardBlock(_Block):
    """Sites of ``X + attn(LN₁(X))``, ``X+mlp(LN₂(X))``, docs/taylor.md §4, §6, §7.
    No symbols: every GELU unit has a remainder, bounded per unit."""

    def __init__(self, model: ViT, k: int, clean: Record, terms: LoFASTTerms,
                 jn: JacobianNorms, exact: SubBlockNorms | None, lin: Linearized):
        block = model.blocks[k]
        self.k = k
        self.ln1, self.ln2 = ln1, ln2 = block.norm1, block.norm2
        X, X_mid = clean.stream[2 * k], clean.stream[2 * k + 1]
        zero = torch.zeros(X.shape[0], dtype=X.dtype, device=X.device)
        L1_0 = layernorm_local_lipschitz(X, ln1.weight, ln1.eps, zero)  # (B,) ‖J_LN₁‖
        L2_0 = layernorm_local_lipschitz(X_mid, ln2.weight, ln2.eps, zero,
                                         per_token=True)
        structured = subblock_bound(block, X, terms, weighted=_unknown(exact, k))
        self.w_q, self.w_k = (spectral_norm(W) for W in block.attn.head_weights()[:2])
        W1 = block.mlp.fc1.weight  # (m, D)
        self.w1_norm = torch.linalg.vector_norm(W1, dim=1)  # (m,)
        self.W2_norm = spectral_norm(block.mlp.fc2.weight)
        mlp_lip = gelu_mlp_local_lipschitz(W1, block.mlp.fc2.weight)  # ≥ ‖W₂ diag W₁‖
        lam_t = 1 + mlp_lip * L2_0  # (B, N): each token's sub-block Jacobian norm
        ffn = mlp_lip.expand(L2_0.shape)  # (B, N)
        # ‖∇_{s_t} z_ti‖ ≤ ‖w_i‖ ‖J_LN₂,t‖, or exact
        gain = L2_0[..., None] * self.w1_norm  # (B, N, m)
        into = None
        if exact is not None:
            lam_t = torch.minimum(lam_t, exact.mlp[:, k])
            ffn = torch.minimum(exact.ffn[k], mlp_lip)
            gain = torch.minimum(gain, exact.unit[k])
            into = exact.into[k - 1] if k > 0 else None
        self.at = _StandardClean(
            X, X_mid, clean.act_in[k], L1_0, L2_0,
            _attention_gains(terms, L1_0, exact, k, structured),
            quadratic_coefficient(terms),  # ‖½D²a[x,x]‖ ≤ q2 ‖x‖², second order
            lam_t, ffn, gain, into)
        self.terms, self.clean, self.jn, self.lin = terms, clean, jn, lin

    def __call__(
        self, e: Tensor, b: Budget, chain_mid: Tensor, chain_out: Tensor, sym: Carried,
        dirs: Directions | None,
    ) -> BlockStep:
        X, X_mid, z, L1_0, L2_0, gains, q2, lam_t, ffn, gain, into_prev = self.at
        ln1, ln2, k, terms, jn = self.ln1, self.ln2, self.k, self.terms, self.jn
        w_q, w_k, w1_norm, W2_norm = self.w_q, self.w_k, self.w1_norm, self.W2_norm
        m_mid = 2 * k + 1
        r1 = _layernorm_remainder(ln1, X, b.token)
        r1_norm = torch.minimum(
            r1.norm(b.all), torch.linalg.vector_norm(r1.at(b.token), dim=-1)
        )
        L1 = layernorm_local_lipschitz(X, ln1.weight, ln1.eps, b.all)
        into = L1_0 * b.acc  # LN₁'s image of the other part, or through the
        if b.split is not None and into_prev is not None:  # previous sub-block
            a, R_prev = b.split  # exactly
            into = torch.minimum(into, into_prev.amax(-1) * a + L1_0 * R_prev)
        rest = into + r1_norm  # all but J_{p←x}Γ
        b_p = torch.minimum(L1 * b.all, jn.attn_in[:, k] * e + rest)
        image = _image_part(w_q, w_k, jn, k, e, rest)
        logit_radius = _logit_radius(terms, jn, k, e, rest, b_p, image.quad)
        # token t of LN₁'s output moves by at most its local constant × b_t
        L1_t = layernorm_local_lipschitz(X, ln1.weight, ln1.eps, b.token.amax(-1),
                                         per_token=True)  # (B, N)
        b_tok = torch.minimum(b_p[:, None],
                              torch.where(b.token == 0, 0.0, b.token * L1_t))
        r_first = attention_remainder(terms, b_p, logit_radius, image)
        r_a = torch.minimum(  # to first order, or to second through the image
            r_first, second_order_remainder(
                terms, b_p, image, jn.attn_hessian[:, k], q2, jn.attn_in[:, k] * e,
                b_tok.amax(-1), logit_radius))
        r_a_tok = torch.minimum(attention_row_remainders(
            terms, b_p, b_tok, logit_radius, image, whole=r_first), r_a[:, None])
        mid = _after_attention(e, jn, sym, m_mid, b, gains, r1_norm, r_a, chain_mid,
                               r1_norm, b_p, r_a_tok)
        r2 = _layernorm_remainder(ln2, X_mid, mid.token)
        delta = (jn.act_in[k] * e[:, None, None] + gain * mid.acc_token[..., None]
                 + r2.at(mid.token)[..., None] * w1_norm)  # (B, N, m)
        L2 = layernorm_local_lipschitz(
            X_mid, ln2.weight, ln2.eps, mid.token.amax(-1), per_token=True
        )
        delta = torch.minimum(delta, (L2 * mid.token)[..., None] * w1_norm)
        r_gelu = 0.5 * gelu_curvature(z, delta) * delta**2  # (B, N, m) per unit
        R_t = (W2_norm * torch.linalg.vector_norm(r_gelu, dim=-1)
               + ffn * r2.at(mid.token))  # (B, N)
        # The sub-block is token-wise: token t's other remainders are at most
        # λ_t acc + R_t, and all of them ‖(λ_t acc + R_t)_t‖ ≤ max λ_t acc + ‖R‖.
        acc_t = lam_t * mid.acc_token + R_t  # (B, N)
        R = torch.linalg.vector_norm(R_t, dim=-1)
        acc_out = lam_t.amax(-1) * mid.acc + R
        out = _budget(e, jn, sym, m_mid + 1, acc_out, chain_out, acc_t)
        # Lipschitz recursion: token t moves by at most λ_t β_t + R_t.
        lip_t = lam_t * mid.token + R_t  # (B, N)
        lip = torch.minimum(torch.linalg.vector_norm(lip_t, dim=-1),
                            lam_t.amax(-1) * mid.all + R)
        out = _capped(out, lip, lip_t)._replace(split=(mid.acc, R))

        def shares(g: dict[str, Tensor], deep: bool) -> dict[str, Tensor]:
            return {
                "norm1": r1.weighted(_layernorm_weights(g["norm1"], ln1), b.all,
                                     b.token),
                "attn": _attn_share(g["attn"], r_a),
                "norm2": r2.weighted(_layernorm_weights(g["norm2"], ln2), mid.all,
                                     mid.token),
                "act": (g["act"].abs() * r_gelu[:, None]).sum((-2, -1)),
            }

        return BlockStep(mid, out, shares, None)


# --------------------------------------------------------------------------
# The network bound.
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class TaylorBound:
    """The taylor certificate of a batch ``x`` with labels ``y`` (docs/taylor.md).

    Attributes:
        margins: ``f_y − f_j`` ``(B, K)`` (``+inf`` at ``j = y``).
        grad_norm: ``‖c_jᵀ J‖`` ``(B, K)``, **exact** (0 at ``j = y``).
        jacobians: :class:`JacobianNorms` from the image, **exact**.
        remainders: ``ε ↦ {name: (B, K)}``: the remainder part of the margin-drop
            bound, each a bound on its own: ``"box"`` (every site's share, the
            ReLU units' by ``g⁺ρ``) and, for a lipschitz model, ``"chord"``
            (ReLU chords back-substituted, docs/taylor.md §5; it may be below
            zero: the first-order term changes too).
        walk: ``ε ↦ ({site: (B, K)}, [Budget], β_cls)``: the remainder part
            site by site, the stream budgets and the class token's budget
            (**upper bounds**).
        delta_out: LoFAST's ``δ_out`` (``ε ↦ (B,)``); ``√2 δ_out`` caps every
            margin drop, so ``taylor`` certifies whatever ``lofast`` does.
        functional: ``(ε, k, v) ↦ (B,)``: an **upper bound** on ``|⟨v, Γ_{2k}⟩|``
            over the ε-ball, ``Γ_{2k}`` the change of block ``k``'s input and
            ``v`` ``(B, N, D)`` (docs/taylor.md §3, direction-aware share).
        chords: ``ε ↦ [Chord]``: each lipschitz block's ReLU units at ε (their
            move intervals and ``ρ``, docs/taylor.md §5); empty for a standard
            model.
        take: ``index ↦ TaylorBound``: the certificate of the samples ``index``
            ``(b,)`` (distinct, in order) alone, computed on them only, with
            the same values (a sample's bounds do not depend on its batch).
    """

    margins: Tensor
    grad_norm: Tensor
    jacobians: JacobianNorms
    remainders: Callable[[Tensor], dict[str, Tensor]]
    walk: Callable[[Tensor], tuple[dict[str, Tensor], list, Tensor]]
    delta_out: Callable[[Tensor], Tensor]
    functional: Callable[[Tensor, int, Tensor], Tensor]
    chords: Callable[[Tensor], list[Chord]]
    take: Callable[[Tensor], TaylorBound]

    def _eps(self, eps: float | Tensor) -> Tensor:
        m = self.margins
        return eps_per_sample(eps, m.shape[0], m.dtype, m.device)

    def remainder(self, eps: float | Tensor) -> Tensor:
        """The smallest of :attr:`remainders` at ε, ``(B, K)``."""
        parts = list(self.remainders(self._eps(eps)).values())
        return torch.stack(parts).amin(0)

    def margin_drop(self, eps: float | Tensor) -> Tensor:
        """Upper bound on ``c_jᵀ(f(x') − f(x))`` over the ε-ball, ``(B, K)``."""
        e = self._eps(eps)
        bound = self.grad_norm * e[:, None] + self.remainder(e)
        # |c_jᵀΔf| ≤ ‖c_j‖ ‖Δf‖ ≤ √2 δ_out: never worse than LoFAST's Prop. 1.
        bound = torch.minimum(bound, math.sqrt(2) * self.delta_out(e)[:, None])
        return torch.where(
            self.margins.isinf(), torch.zeros_like(bound), bound * (1 + ROUNDING)
        )

    def slack(self, eps: float | Tensor) -> Tensor:
        """``min_j (log margin_j − log drop_j(ε))`` ``(B,)``: positive exactly
        where every wrong class's margin exceeds its drop bound (``log`` is
        monotone; NaN for a misclassified point). Detached: a search keeps
        many of them, and a graph each would hold every probe's tensors."""
        with torch.no_grad():
            return (self.margins.log() - self.margin_drop(eps).log()).amin(1)

    def certified(self, eps: float | Tensor) -> Tensor:
        """``(B,)`` bool: every wrong class's margin exceeds its drop bound."""
        return self.slack(eps) > 0

    def first_order_radius(self) -> Tensor:
        """``min_j margin_j/‖c_jᵀJ‖``: the linearised boundary's distance (an
        **estimate**, the limit of the certified radius as remainders vanish)."""
        return (self.margins / self.grad_norm.clamp_min(1e-300)).amin(1).clamp_min(0)

    def radius(self, rtol: float = 1e-3, tol: float = 0.0, max_radius: float = 10.0,
               probed=()) -> Tensor:
        """Certified radius, ``(B,)``: the largest probed ε whose :meth:`slack`
        is positive (the sound, lower end), by
        :func:`lipvit.certify.certification.falsi_radius` (the drops grow like
        a power of ε, so the slack is nearly linear in ``log ε``); ``probed``:
        ``(ε, slack)`` pairs already computed. ``rtol``, ``tol``,
        ``max_radius`` as in :func:`~lipvit.certify.certification.bisect_radius`.

        The search runs between LoFAST's radius (``√2 δ_out`` caps every drop,
        so the point is certified there) and the larger of it and the
        first-order limit (the bound is at least ``‖c_jᵀJ‖ε``, so no larger ε
        passes the Taylor part), capped at ``max_radius``; its first probe is
        :data:`RADIUS_GUESS` times the upper end. Each probe computes the
        samples still searching only (:attr:`take`).
        """
        positive = (self.margins > 0).all(dim=1)
        lofast = certified_radius(self.margins.amin(1), self.delta_out, rtol=rtol,
                                  tol=tol, max_radius=max_radius)
        hi = (torch.maximum(self.first_order_radius(), lofast) * (1 + 1e-6)
              ).clamp(max=max_radius)
        # A tenth of the tolerance (half a probe more on average): the radius is
        # then rarely below what bisection to ``rtol`` finds.
        return falsi_radius(self.slack, positive, (lofast, hi), rtol=rtol / 10,
                            tol=tol / 10, guess=hi * RADIUS_GUESS, probed=probed,
                            restrict=lambda index: self.take(index).slack)


RADIUS_GUESS = 0.25
"""First probe of :meth:`TaylorBound.radius`, as a fraction of the first-order
limit: on the Fashion-MNIST lipschitz model the median certified radius is
0.24 times the median first-order limit (docs/taylor.md §9); probes above
the radius cost most (every unit that can flip is a symbol), so the guess errs
low."""


def taylor_bound(
    model: ViT, x: Tensor, y: Tensor, max_symbols: int | None = None,
    max_memory: int | None = None,
) -> TaylorBound:
    """The taylor certificate of ``model`` at images ``x`` ``(B, C, S, S)``, labels y.

    Works on a private float64 copy of the model: the returned bound's methods
    evaluate lazily, and a later change to ``model`` (training, ``.cuda()``,
    ``.eval()``) must not reach them, nor does this set ``model``'s mode.
    ``max_symbols``: ReLU symbols per sample and block of a lipschitz model
    (:func:`lipvit.certify.taylor.symbols.propagate`; more is tighter and slower;
    default :func:`~lipvit.certify.taylor.symbols.default_max_symbols` of the image
    dimension).
    ``max_memory``: bytes of tangents held at once by the Jacobian norms
    (:func:`lipvit.certify.taylor.jacobian_norms.plan`; default
    :func:`~lipvit.certify.memory.default_max_memory`); the second-order
    Taylor models are built only where they fit in it
    (:func:`~lipvit.certify.taylor.jacobian_norms.jets_fit`).

    Raises:
        UnsupportedModelError: a layer the method cannot bound (one-line reason).
    """
    check_supported(model)
    if max_symbols is None:
        max_symbols = default_max_symbols(x[0].numel())
    elif max_symbols < 0:
        raise ValueError(f"max_symbols must be >= 0, got {max_symbols}")
    point = _CleanPoint(float64_model(model),  # the bound's own copy: see above
                        x.to(torch.float64), y, max_symbols, max_memory)
    return _certificate(point)


def _certificate(point: _CleanPoint) -> TaylorBound:
    """The :class:`TaylorBound` of ``point``'s samples."""
    return TaylorBound(
        point.margins,
        point.masked(point.grad_norm),
        point.jn,
        point.remainders,
        point.walk,
        point.chain.delta_out,
        point.functional,
        point.chords,
        lambda index: _certificate(point.take(index)),
    )


class _ChainRows(NamedTuple):
    """The samples ``rows`` ``(b,)`` of a batch's LoFAST chain ``chain``: their
    budgets at ε ``(b,)`` (the chain runs on the whole batch, the other samples
    at ε = 0: its steps are small elementwise maps)."""

    chain: NetworkBound
    rows: Tensor

    def trace(self, e: Tensor) -> Tensor:
        """``chain.trace`` of the samples ``rows``, ``(b, steps + 1, 2)``."""
        full = e.new_zeros(self.chain.logits.shape[0]).index_copy(0, self.rows, e)
        return self.chain.trace(full)[self.rows]

    def delta_out(self, e: Tensor) -> Tensor:
        """``chain.delta_out`` of the samples ``rows``, ``(b,)``."""
        return self.trace(e)[:, -1, 1]


class _CleanPoint:
    """What the certificate computes once at the clean points (the margins,
    their gradients at every site, the Jacobian norms from the image, each
    block's remainder step), and its stages at an ε ``(B,)``, one method
    each: :meth:`run` (the budgets, block after block), :meth:`box` (every
    site's share), :meth:`remainders` (the remainder parts: box, chords,
    second-order models), :meth:`walk`, :meth:`functional`, :meth:`chords`."""

    @torch.no_grad()
    def __init__(self, model: ViT, x: Tensor, y: Tensor, max_symbols: int,
                 max_memory: int | None):
        y = y.to(x.device)
        self.model, self.x, self.y = model, x, y
        self.chain = network_bound(model, x, "lofast")
        self.grads = site_gradients(model, x, y)
        clean, logits = self.grads.clean, self.grads.logits
        self.lin = lin = Linearized(model, x)  # the clean points, the batch at once
        self.jn = jacobian_norms(model, x, max_memory=max_memory, lin=lin,
                                 held=len(x) * resident_bytes(model, max_memory))
        exact = subblock_norms(model, clean, max_memory=max_memory)
        B, K = logits.shape
        self.wrong = torch.ones(B, K, dtype=torch.bool, device=x.device)
        self.wrong[torch.arange(B), y] = False
        margins = logits.gather(1, y[:, None]) - logits  # (B, K)
        self.margins = torch.where(self.wrong, margins,
                                   torch.full_like(margins, math.inf))
        self.grad_norm = torch.linalg.vector_norm(self.grads.x.flatten(2), dim=-1)
        make = (
            partial(_LipschitzBlock, max_symbols=max_symbols, lin=lin)
            if model.config.family == "lipschitz"
            else partial(_StandardBlock, lin=lin)
        )
        terms = [with_softmax_gains(block, clean.attn_in[k], t) for k, (block, t)
                 in enumerate(zip(model.blocks, self.chain.attention_terms,
                                  strict=True))]
        self.blocks: list[_Block] = [make(model, k, clean, t, self.jn, exact)
                                     for k, t in enumerate(terms)]
        # The margins' second-order Taylor models (§12), where they apply:
        # built at the first remainder query (walks and functionals need none).
        self.with_jets, self.jets = jets_fit(model, max_memory), []
        self.final = _final_site(model, clean.stream[-1][:, 0],
                                 self.grads.sites[(-1, "norm")])
        # Blocks whose Frobenius norm1 projects some sample (§3, direction-aware).
        self.frobenius = [
            k for k, block in enumerate(model.blocks)
            if isinstance(block.norm1, LayerProject) and block.norm1.mode != "token"
            and bool((_projected_norms(clean.stream[2 * k], "frobenius")
                      >= block.norm1.radius).any())]

    def take(self, index: Tensor) -> _CleanPoint:
        """The clean points of the samples ``index`` ``(b,)`` (distinct, in order)
        alone: their margins, gradients (and a graph of their own), Jacobian
        norms, linearisation, blocks and LoFAST chain, so that every stage at
        an ε ``(b,)`` costs what they do and gives each sample what the whole
        batch gives it (tests/test_batched.py); itself where ``index`` is
        every sample."""
        if len(index) == len(self.x):
            return self
        sub = copy.copy(self)
        sub.x, sub.y = self.x[index], self.y[index]
        sub.chain = (_ChainRows(self.chain.chain, self.chain.rows[index])
                     if isinstance(self.chain, _ChainRows)
                     else _ChainRows(self.chain, index))
        sub.grads, sub.jn, sub.lin = (self.grads.take(index), self.jn.take(index),
                                      self.lin.take(index))
        sub.wrong, sub.margins, sub.grad_norm = (
            self.wrong[index], self.margins[index], self.grad_norm[index])
        clean = sub.grads.clean
        sub.blocks = [b.take(index, clean, sub.jn, sub.lin) for b in self.blocks]
        sub.jets = [self.jets[i] for i in index.tolist()] if self.jets else []
        sub.final = _final_site(self.model, clean.stream[-1][:, 0],
                                sub.grads.sites[(-1, "norm")])
        return sub

    def run(self, e: Tensor) -> tuple[list[BlockStep], list[Budget], Tensor]:
        """Every block's step, the stream budgets and the class token's budget."""
        jn = self.jn
        trace = self.chain.trace(e)  # (B, steps+1, 2): rows 2.. are the stream states
        sym = Carried.zeros(self.grads.clean)
        budget = _budget(e, jn, sym, 0, torch.zeros_like(e), trace[:, 2, 0])
        budgets, steps = [budget], []
        for k, step in enumerate(self.blocks):
            dirs = (_directions(e, list(steps), self.grads, k)
                    if k in self.frobenius else None)
            res = step(e, budget, trace[:, 3 + 2 * k, 0], trace[:, 4 + 2 * k, 0], sym,
                       dirs)
            budgets += [res.mid, res.out]
            budget = res.out
            steps.append(res)
        cls = torch.minimum(jn.cls * e + sym.cls() + budget.acc_token[:, 0],
                            budget.token[:, 0])
        return steps, budgets, torch.minimum(cls, trace[:, 2 + 2 * len(steps), 1])

    def masked(self, t: Tensor) -> Tensor:
        """``t`` ``(B, K)`` with the true classes' entries zero."""
        return torch.where(self.wrong, t, torch.zeros_like(t))

    def box(self, steps: list[BlockStep], cls: Tensor) -> dict[str, Tensor]:
        """Every site's share with the clean margin gradients (``|g_⊥ᵀΓ|`` by
        norm: the chord bound, which the certificate also takes, bounds it as a
        functional)."""
        g = self.grads.sites
        sites = {f"block{k}.{n}": v for k, res in enumerate(steps)
                 for n, v in res.shares(_block_sites(g, k), False).items()}
        return {**sites, "norm": self.final(cls)}

    def walk(self, e: Tensor) -> tuple[dict[str, Tensor], list[Budget], Tensor]:
        """Site shares, stream budgets and the class token's budget at ε ``(B,)``."""
        steps, budgets, cls = self.run(e)
        shares = {n: self.masked(v) for n, v in self.box(steps, cls).items()}
        return shares, budgets, cls

    def remainders(self, e: Tensor) -> dict[str, Tensor]:
        """The remainder parts at ε ``(B,)``, each a bound on its own ``(B, K)``:
        ``box``, ``jet`` (a standard model's second-order models, where they
        fit) and ``chord`` (a lipschitz model's ReLU chords)."""
        steps, _, cls = self.run(e)
        out = {"box": sum(self.box(steps, cls).values())}
        first = self.grad_norm * e[:, None]
        if self.with_jets:
            if not self.jets:
                self.jets.extend(margin_jets.JetMargins(self.model, xb, int(yb))
                                 for xb, yb in zip(self.x, self.y, strict=True))
            drops = torch.stack([m.drop(eb) for m, eb in zip(self.jets, e,
                                                            strict=True)])
            out["jet"] = drops - first  # (B, K)
        if steps[0].chord is not None:
            weights = Weights(self.grads.x, self.grads.sites)
            out["chord"] = (_chord_bound(e, steps, weights, self.grads, deep=True)
                            + self.final(cls) - first)
        return {name: self.masked(v) for name, v in out.items()}

    def functional(self, e: Tensor, k: int, v: Tensor) -> Tensor:
        """An upper bound ``(B,)`` on ``|⟨v, Γ_{2k}⟩|`` at ε ``(B,)``."""
        steps, _, _ = self.run(e)
        v = v.to(self.x)[:, None].expand(-1, self.margins.shape[1], -1, -1)  # a copy
        return _stream_bound(e, steps[:k], self.grads, k, v)[:, 0]  # per class

    def chords(self, e: Tensor) -> list[Chord]:
        """Each lipschitz block's ReLU units at ε ``(B,)``."""
        return [res.chord for res in self.run(e)[0] if res.chord is not None]


def _block_sites(g: dict[tuple[int, str], Tensor], k: int) -> dict[str, Tensor]:
    """Block ``k``'s entries of a ``{(block, site): gradient}`` map, by site."""
    return {s: g[(k, s)] for s in SITES}


class Weights(NamedTuple):
    """Weights of a linear objective on the image ``x`` ``(B, K, C, S, S)`` and
    on the sites ``{(block, site): (B, K, …)}``: the margins' gradients, or a
    stream functional's (:meth:`MarginGradients.through_stream`)."""

    x: Tensor
    sites: dict[tuple[int, str], Tensor]


def _directions(
    e: Tensor, steps: list[BlockStep], grads: MarginGradients, k: int
) -> Directions:
    """:class:`Directions` of block ``k``'s input at ε, ``steps`` the blocks
    before it (docs/taylor.md §3, direction-aware share)."""
    X = grads.clean.stream[2 * k]  # (B, N, D)
    x_hat = X / torch.linalg.vector_norm(X, dim=(1, 2), keepdim=True)
    K = grads.x.shape[1]
    signs = 1.0 - 2.0 * (torch.arange(K, device=X.device) % 2)  # +x̂, −x̂, +x̂, …
    v = x_hat[:, None] * signs[:, None, None]  # (B, K, N, D), K ≥ 2
    radial = _linear_bound(e, steps, Weights(*grads.through_stream(k, v)), grads)
    return Directions(radial.amax(1), partial(_stream_bound, e, steps, grads, k))


def _stream_bound(
    e: Tensor, steps: list[BlockStep], grads: MarginGradients, k: int, v: Tensor
) -> Tensor:
    """Bound ``(B, K)`` on ``|vᵀΓ_{2k}|`` over the ε-ball, ``Γ_{2k}`` block ``k``'s
    input perturbation and ``v`` ``(B, K, N, D)``: ``vᵀΓ_{2k}`` is linear in the
    image and the earlier sites' remainders, with weights from one backward
    pass; each sign is bounded like a margin (:func:`_linear_bound`)."""
    return torch.maximum(*(
        _linear_bound(e, steps, Weights(*grads.through_stream(k, s * v)), grads)
        for s in (1, -1)
    ))


def _linear_bound(
    e: Tensor, steps: list[BlockStep], w: Weights, grads: MarginGradients
) -> Tensor:
    """Upper bound ``(B, K)`` on a linear objective ``w`` of the image and of the
    sites of ``steps`` (no later site) over the ε-ball: the smaller of the box
    (every site's share) and the chord bound (:func:`_chord_bound`).
    The shares bound their own ``|g_⊥ᵀΓ|`` by norm (no recursion)."""
    box = torch.linalg.vector_norm(w.x.flatten(2), dim=-1) * e[:, None]
    for k, res in enumerate(steps):
        box = box + sum(res.shares(_block_sites(w.sites, k), False).values())
    if not steps or steps[0].chord is None:
        return box
    return torch.minimum(box, _chord_bound(e, steps, w, grads, deep=False))


def _chord_bound(
    e: Tensor, steps: list[BlockStep], w: Weights, grads: MarginGradients,
    deep: bool,
) -> Tensor:
    """The margin-drop bound with ReLU chords back-substituted, docs/taylor.md §5.

    On ``Δz_i ∈ [−down_i, up_i]`` the convex remainder lies below its chord,
    ``r_i ≤ a_i Δz_i + b_i``; for ``g_i > 0`` this bounds ``g_i r_i`` (for
    ``g_i ≤ 0``, ``g_i r_i ≤ 0``). ``Σ_i g_i⁺ a_i Δz_i`` is linear in the image
    and in the earlier sites' remainders (``Δz = J_{z←x}Γ + Σ_φ G_{z←φ} r_φ``,
    exact), so its weights are added to theirs by one backward pass per block,
    last block first; what remains is ``‖g′_x‖ε``, the other sites' shares with
    the new weights ``g′``, the chord constants and (added by the caller) the
    final norm's share. ``(B, K)``, without the final norm. The objective is
    ``w`` (the margins, or a stream functional), ``grads`` holds the graph.
    """
    g = dict(w.sites)
    g_x = w.x
    total = 0.0
    for k in reversed(range(len(steps))):
        chord = steps[k].chord
        z, up, down, rho = chord.z, chord.up, chord.down, chord.rho
        width = (up + down).clamp_min(1e-300)
        slope = torch.where(z > 0, -rho, rho) / width  # (B, N, m): a_i
        const = rho * torch.where(z > 0, up, down) / width  # b_i
        g_pos = g[(k, "act")].clamp_min(0)  # (B, K, N, m)
        total = total + (g_pos * const[:, None]).sum((-2, -1))
        dx, dsites = grads.through_act(k, g_pos * slope[:, None])
        g_x = g_x + dx
        g.update({key: g[key] + d for key, d in dsites.items()})
    for k, res in enumerate(steps):
        shares = res.shares(_block_sites(g, k), deep)
        total = total + shares["norm1"] + shares["attn"] + shares["norm2"]
    return total + torch.linalg.vector_norm(g_x.flatten(2), dim=-1) * e[:, None]


def _final_site(model: ViT, cls: Tensor, g: Tensor) -> Callable[[Tensor], Tensor]:
    """``β_cls ↦ (B, K)``: the final norm's weighted remainder on the class token."""
    norm = model.norm
    if isinstance(norm, LayerProject):
        norms = torch.linalg.vector_norm(cls, dim=-1)[:, None]  # (B, 1)
        w = torch.linalg.vector_norm(g, dim=-1)[..., None]  # (B, K, 1)
        return lambda b: layer_project_remainder(norms, norm.radius, b).weighted(w, b)
    w = _layernorm_weights(g[:, :, None], norm)  # (B, K, 1)
    return lambda b: _layernorm_remainder(norm, cls[:, None], b).weighted(w, b)
