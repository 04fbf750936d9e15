"""Streamed, memory-bounded norms of the Jacobians from the image (docs/taylor.md §11).

:func:`lipvit.certify.taylor.jacobian_norms.jacobian_norms` needs, per sample, the norm
of the clean point's Jacobian ``J_{u←x}`` from the image (``n`` dimensions) to every
stream state, attention input and pre-activation, whole, per token and per unit.
Stacking the ``n`` tangents of every site input costs ``n × activations`` memory (17 GB
for one CIFAR image at 3×128); here the tangents are pushed through
:class:`lipvit.certify.taylor.linearized.Linearized` a few at a time and reduced as they
come:

* per token ``t``: ``J_t J_tᵀ = Σ_i (J e_i)_t (J e_i)_tᵀ`` (``D × D``), exact;
* per unit: ``‖∇_x z_i‖² = Σ_i (J e_i)_z²``, exact;
* whole matrices, small images (``n ≤ exact_max``): the tangents are kept and
  the norm is that of their ``n × n`` Gram matrix, exact;
* whole matrices, large images: **block bound**. Order the image's
  coordinates patch by patch (``g``) and the output by token (``t``); ``J`` is
  the block matrix ``[J_{t,g}]`` and, for ``x = (x_g)``,
  ``‖Jx‖² = Σ_t ‖Σ_g J_{t,g} x_g‖² ≤ Σ_t (Σ_g ‖J_{t,g}‖ ‖x_g‖)² = ‖Q ξ‖²``
  with ``Q_{t,g} = ‖J_{t,g}‖`` and ``ξ_g = ‖x_g‖``, ``‖ξ‖ = ‖x‖``; hence
  ``‖J‖ ≤ ‖Q‖``, with equality when ``J`` is block diagonal (the patch
  embedding) or its blocks share singular vectors. Each block norm is exact
  (a ``C p² × C p²`` Gram matrix), ``‖Q‖`` is an ``N × (N−1)`` problem, and the
  bound is also capped by ``(Σ_t ‖J_t‖²)^{1/2}``. The attention-logit, query
  and key norms are left to LoFAST's bound there (``+inf``).

Memory: the tangents held at once (``max_memory`` bytes, :func:`plan`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from lipvit.certify.memory import MemoryBudgetError, memory_budget
from lipvit.certify.taylor import margin_jets
from lipvit.certify.taylor.linearized import CACHE_BYTES, Linearized
from lipvit.certify.taylor.remainders import LogitVariance
from lipvit.certify.taylor.second_order import attention_hessian_norm
from lipvit.certify.taylor.subblock import dense_bytes
from torch import Tensor

from lipvit.model import ViT
from lipvit.spectral import gram_norm, top_root

REFINE = 0.05
"""Patch blocks whose Frobenius norm is at least this fraction of the largest
get their exact spectral norm; the others keep the Frobenius norm (an upper
bound), which changes ``‖Q‖`` little and saves most of the eigenvalue work."""


FLUSH = 128
"""Image tangents held and reduced at a time where the budget allows (whole
patches): each sample of a batch holds its own, so fewer lets more samples
share a push; more saves little (one reduction per site per flush)."""


KEPT_COPIES = 2
"""The exact mode's stored tangents count this many times in :func:`plan`:
its reductions concatenate each map's tangents (and permute the attention
logits') while the stored ones are still held (on Fashion-MNIST, ``n =
784``, counted once the mode's resident peak at ``--max-memory 1G`` was 2.3
GB)."""


@dataclass(frozen=True)
class Plan:
    """How :func:`norms_of_batch` walks the image's basis: ``exact`` keeps every
    tangent of the whole-matrix maps; otherwise ``flush`` tangents (whole
    patches) are held and reduced at a time; ``push`` at a time go through the
    network."""

    exact: bool
    flush: int
    push: int


def _sizes(model: ViT) -> tuple[int, int, int, int, int, int]:
    cfg = model.config
    N, D = cfg.num_patches + 1, cfg.embed_dim
    group = cfg.in_chans * cfg.patch_size**2  # coordinates per patch
    return N, D, cfg.num_heads, cfg.mlp_hidden, len(model.blocks), group


def plan(model: ViT, exact_max: int, max_memory: int | None) -> Plan:
    """Choose the chunks for ``max_memory`` bytes (default
    :func:`default_max_memory`); refuse a budget below one patch of tangents
    (:func:`min_memory`).

    Raises:
        MemoryBudgetError: one line, before any work.
    """
    budget = memory_budget(max_memory)
    fixed, held, work, logit = _bytes(model)
    need = min_memory(model)
    if need > budget:
        raise MemoryBudgetError(
            f"--max-memory {budget / 2**20:.1f} MiB is too small for this model: "
            f"one patch of tangents needs {need / 2**20:.1f} MiB"
        )
    N, _, H, _, _, group = _sizes(model)
    n = model.config.in_chans * model.config.image_size**2
    push = max(1, min(CACHE_BYTES // (8 * H * N * N), n,
                      (budget - fixed - group * held) // work))
    exact_bytes = fixed + n * KEPT_COPIES * (held + logit) + push * work
    if n <= exact_max and exact_bytes <= budget:
        return Plan(True, n, push)
    groups = min((budget - fixed - push * work) // (group * held),
                 max(1, FLUSH // group))
    return Plan(False, int(groups) * group, int(push))


def sample_bytes(model: ViT, how: Plan) -> int:
    """Bytes one sample's tangents and reductions take under ``how`` (a batch's
    take as many times its samples)."""
    fixed, held, work, logit = _bytes(model)
    kept = KEPT_COPIES * (held + logit) if how.exact else held
    return fixed + how.flush * kept + how.push * work


def min_memory(model: ViT) -> int:
    """Bytes below which :func:`plan` refuses: the per-token Gram matrices, one
    patch of held tangents and one tangent's push."""
    fixed, held, work, _ = _bytes(model)
    return fixed + _sizes(model)[-1] * held + work


def jets_need(model: ViT) -> int:
    """Bytes of the smallest budget that holds one sample's second-order
    Taylor models (:func:`~lipvit.certify.taylor.margin_jets.jet_bytes`, an estimate
    from above) beside :func:`min_memory`."""
    return margin_jets.jet_bytes(model) + min_memory(model)


def jets_fit(model: ViT, max_memory: int | None) -> bool:
    """Whether ``taylor`` builds the margins' second-order Taylor models: the
    model is one :func:`lipvit.certify.taylor.margin_jets.supports` and
    :func:`jets_need` is within ``max_memory`` bytes (default
    :func:`default_max_memory`). Where it is not, the certificate is the one without
    them (docs/taylor.md §12): the budget holds, the radii are smaller."""
    return margin_jets.supports(model) and jets_need(model) <= memory_budget(max_memory)


def resident_bytes(model: ViT, max_memory: int | None) -> int:
    """Bytes each sample of a :func:`lipvit.certify.taylor.certificate.taylor_bound`
    call holds beside the Jacobian norms' tangents: one autograd graph of the
    forward pass per class (the margins' gradients, back-substituted at every
    ε; the radius search's graph of the samples still searching takes the
    batch's place) and as much again while a back-substitution runs through
    it, its symbols' accumulators and one push of its symbols' tangents
    (:func:`~lipvit.certify.taylor.linearized.push_size` of them), and its
    second-order Taylor model
    (:func:`lipvit.certify.taylor.margin_jets.jet_bytes`) where one is built
    (:func:`jets_fit`)."""
    N, D, H, m, K, _ = _sizes(model)
    graph = 8 * K * N * (8 * D + 4 * m + 3 * H * N)  # one forward pass, kept
    carried = 8 * (2 * (2 * K + 1) * N * D + 2 * K * N * D + 2 * K * N * m)
    push = max(1, CACHE_BYTES // (8 * H * N * N))  # push_size's symbols
    per_sample = (2 * model.config.num_classes * graph + carried
                  + push * _bytes(model)[2])
    if jets_fit(model, max_memory):
        per_sample += margin_jets.jet_bytes(model)
    return per_sample


def taylor_batch(model: ViT, max_memory: int | None, exact_max: int | None = None
                 ) -> int:
    """Samples per :func:`lipvit.certify.taylor.certificate.taylor_bound` call within
    ``max_memory`` bytes: :func:`resident_bytes` each, beside one sample's
    tangents of the Jacobian norms (:func:`sample_bytes` of :func:`plan` with
    ``exact_max``, default :data:`EXACT_GRAM_MAX`; :func:`norms_of_batch`
    takes the batch in parts that fit beside what it holds) or the exact
    sub-block norms' working memory
    (:func:`~lipvit.certify.taylor.subblock.dense_bytes`, one sample at a
    time), whichever is larger: they run one after the other."""
    exact_max = EXACT_GRAM_MAX if exact_max is None else exact_max
    apart = max(sample_bytes(model, plan(model, exact_max, max_memory)),
                dense_bytes(model, max_memory))
    return max(1, (memory_budget(max_memory) - apart)
               // resident_bytes(model, max_memory))


def _bytes(model: ViT) -> tuple[int, int, int, int]:
    """Float64 bytes: the per-token Gram matrices of every stream state; one
    tangent held at every site input; one tangent's push temporaries; one
    tangent's attention logits, queries and keys (kept in the exact mode)."""
    N, D, H, m, K, _ = _sizes(model)
    fixed = 8 * (2 * K + 1) * N * D * D
    held = 8 * ((3 * K + 1) * N * D + K * N * m)
    work = 8 * (6 * H * N * N + 8 * N * max(D, m))
    return fixed, held, work, 8 * K * (H * N * N + 2 * N * D)


def patch_order(model: ViT) -> Tensor:
    """The image's coordinate indices ``(n,)`` ordered patch by patch, in the
    patch embedding's own order (each patch's ``C p²`` coordinates together)."""
    cfg = model.config
    S = cfg.image_size
    idx = torch.arange(cfg.in_chans * S * S, dtype=torch.float64)
    patches = model.patch_embed.patches(idx.reshape(1, cfg.in_chans, S, S))
    return patches.reshape(-1).round().long()


PER_HEAD = ("logits", "queries", "keys")
"""The site kinds whose whole-matrix norms are per head (exact mode only)."""


def logit_variance(T: Tensor, P: Tensor) -> LogitVariance:
    """:class:`LogitVariance` from the logit tangents ``T = J_{S←x}E`` ``(…, n, H,
    N, N)`` of the image's ``n`` basis vectors and the clean probabilities
    ``P`` ``(…, H, N, N)`` (``…``: optional batch axes). ``Var_p(u) = ‖F u‖²``
    with ``F = (I − qqᵀ)diag(q)``, ``q = √p``, so each gain is the top
    eigenvalue of the Gram matrix of the tangents ``F T`` over the rows (and
    heads) it sums."""
    q = P.sqrt().unsqueeze(-4)  # (…, 1, H, N, N)
    y = T * q
    W = y - q * (y * q).sum(-1, keepdim=True)  # (…, n, H, N, N): F_{h,r} per row
    whole = gram_norm(W.flatten(-2).transpose(-3, -2)) ** 2  # (…, H, n, N·N) → (…, H)
    row = (gram_norm(W.movedim(-4, -2)) ** 2).amax(-1)  # (…, H, N, n, N) → (…, H)
    whole_all = gram_norm(W.flatten(-3)) ** 2  # (…, n, H·N·N) → (…)
    row_all = (gram_norm(W.movedim(-2, -4).flatten(-2)) ** 2).amax(-1)  # (…, N, n, H·N)
    return LogitVariance(whole, row, whole_all, row_all)


_BATCHED = ("stream", "stream_token", "attn_in", "cls", "logits", "queries", "keys",
            "logit_rows", "attn_hessian")
""":class:`JacobianNorms`' tensor fields, each ``(B, …)``."""


@dataclass(frozen=True)
class JacobianNorms:
    """Norms of the clean point's Jacobians from the image, ``J_{u←x}``.

    Per token and per unit they are **exact** (float rounding aside, rounded
    up); whole-matrix norms are exact when the image has at most
    :data:`lipvit.certify.taylor.jacobian_norms.EXACT_GRAM_MAX` dimensions (``exact``
    true) and otherwise **upper bounds** from the patch-block matrix (module docstring).

    Attributes:
        stream: whole stream states ``(B, 2K+1)``.
        stream_token: every token of every stream state ``(B, 2K+1, N)``.
        attn_in: the attention inputs ``(B, K)`` (blocks).
        act_in: per block ``(B, N, m)``: ``‖∇_x z_{t,i}‖`` of each pre-activation.
        cls: the last stream state's class token ``(B,)``.
        logits: per block and head ``(B, K, H)``: the attention logits
            ``S_h = p A_h pᵀ/√d`` (``p`` the attention's input); ``+inf`` where
            not ``exact`` (the certificate then uses LoFAST's logit bound).
        queries, keys: per block and head ``(B, K, H)``: ``p W_q[h]`` and
            ``p W_k[h]``; ``+inf`` where not ``exact``.
        logit_rows: per block and head ``(B, K, H)``: the largest over rows
            ``r`` of the image → row ``r`` of ``S_h`` map's norm; ``+inf`` where
            not ``exact``.
        variance: per block ``(B, K, …)``, the logits' variance gains
            (:class:`LogitVariance`); ``+inf`` where not ``exact``.
        attn_hessian: per block ``(B, K)``: ``σ`` with ``‖½D²a[J_{p←x}Γ,
            J_{p←x}Γ]‖ ≤ σ‖Γ‖²`` for the bare attention ``a``
            (:func:`lipvit.certify.taylor.second_order.attention_hessian_norm`);
            ``+inf`` where not ``exact``, too large, or in the lipschitz family
            (whose certificate does not use it).
        exact: whether the whole-matrix norms are exact.
    """

    stream: Tensor
    stream_token: Tensor
    attn_in: Tensor
    act_in: list[Tensor]
    cls: Tensor
    logits: Tensor
    queries: Tensor
    keys: Tensor
    logit_rows: Tensor
    variance: LogitVariance
    attn_hessian: Tensor
    exact: bool = True

    def take(self, index: Tensor) -> JacobianNorms:
        """The norms of the samples ``index`` ``(b,)`` of the batch."""
        return JacobianNorms(
            **{name: getattr(self, name)[index] for name in _BATCHED},
            act_in=[t[index] for t in self.act_in],
            variance=LogitVariance(*(t[index] for t in self.variance)),
            exact=self.exact,
        )

    @staticmethod
    def cat(parts: list[JacobianNorms]) -> JacobianNorms:
        """The norms of consecutive batches ``parts`` as one batch."""
        first = parts[0]
        fields = {name: torch.cat([getattr(p, name) for p in parts])
                  for name in _BATCHED}
        return JacobianNorms(
            **fields,
            act_in=[torch.cat([p.act_in[k] for p in parts])
                    for k in range(len(first.act_in))],
            variance=LogitVariance(*(torch.cat(f) for f in zip(
                *(p.variance for p in parts), strict=True))),
            exact=all(p.exact for p in parts),
        )


@dataclass
class _Reduce:
    """Running reductions of a batch's tangents (module docstring), every
    entry with the batch axis first."""

    exact: bool
    group: int
    token_gram: dict[int, Tensor] = field(default_factory=dict)  # m → (B, N, D, D)
    unit_sq: dict[int, Tensor] = field(default_factory=dict)  # k → (B, N, m)
    kept: dict[tuple[str, int], list[Tensor]] = field(default_factory=dict)
    blocks: dict[tuple[str, int], list[Tensor]] = field(default_factory=dict)

    def add(self, kind: str, i: int, T: Tensor) -> None:
        """Reduce ``T`` ``(B, F, …)``, the tangents of ``F`` basis vectors (whole
        patches) at site input ``(kind, i)``."""
        if kind == "act_in":
            sq = (T * T).sum(1)
            self.unit_sq[i] = self.unit_sq[i] + sq if i in self.unit_sq else sq
            return
        if kind == "stream":
            Tt = T.transpose(1, 2)  # (B, N, F, D)
            gram = Tt.transpose(-1, -2) @ Tt  # (B, N, D, D): Σ_i (J e_i)_t (J e_i)_tᵀ
            self.token_gram[i] = self.token_gram[i] + gram if i in self.token_gram \
                else gram
        if self.exact:
            self.kept.setdefault((kind, i), []).append(T)
        elif kind not in PER_HEAD:
            self.blocks.setdefault((kind, i), []).append(self._block_norms(T))

    def _block_norms(self, T: Tensor) -> Tensor:
        """Upper bounds on ``‖J_{t,g}‖`` ``(B, N, G_F)`` of the ``G_F`` patches in
        ``T`` ``(B, F, N, D)``: the Frobenius norm, and the exact norm (eigvalsh)
        for the blocks within :data:`REFINE` of the sample's largest (``‖Q‖``
        is monotone in its entries, so any upper bound per block keeps it an
        upper bound)."""
        B, F, N, D = T.shape
        Tg = T.reshape(B, F // self.group, self.group, N, D).transpose(2, 3)
        Q = torch.linalg.vector_norm(Tg, dim=(-2, -1)) * (1 + 1e-12)  # (B, G_F, N)
        big = Q >= REFINE * Q.amax(dim=(1, 2), keepdim=True)
        blocks = Tg[big]  # (b, group, D): every sample's at once
        gram = blocks @ blocks.transpose(-1, -2) if self.group <= D else \
            blocks.transpose(-1, -2) @ blocks
        Q[big] = torch.minimum(Q[big], top_root(gram))
        return Q.transpose(1, 2)

    def whole(self, kind: str, i: int) -> Tensor:
        """``‖J‖`` ``(B,)`` (``(B, H)`` per head) of the whole map at ``(kind, i)``:
        exact or the block bound."""
        if self.exact:
            T = torch.cat(self.kept[(kind, i)], dim=1)  # (B, n, …)
            if kind in PER_HEAD:  # (B, n, H, …) → per head
                return gram_norm(T.flatten(3).transpose(1, 2))  # (B, H)
            return gram_norm(T.flatten(2))
        Q = torch.cat(self.blocks[(kind, i)], dim=2)  # (B, N, G)
        small = Q @ Q.mT if Q.shape[1] <= Q.shape[2] else Q.mT @ Q
        return top_root(small)


def norms_of_batch(
    model: ViT, x: Tensor, exact_max: int, max_memory: int | None,
    lin: Linearized | None = None, held: int = 0,
) -> JacobianNorms:
    """:class:`JacobianNorms` of images ``x`` ``(B, C, S, S)`` (module docstring),
    every sample's tangents pushed together (one operation per step for the
    whole batch); ``lin``: their :class:`Linearized`, if built already. The
    plan is one sample's (:func:`plan`), whatever the batch, so that the
    norms do not depend on it; the batch is split where its tangents would
    exceed ``max_memory`` bytes at once beside the ``held`` bytes the caller
    holds (at least one sample a part)."""
    how = plan(model, exact_max, max_memory)
    at_once = max(1, (memory_budget(max_memory) - held) // sample_bytes(model, how))
    if len(x) > at_once:
        return JacobianNorms.cat([
            norms_of_batch(model, x[i:i + at_once], exact_max, max_memory,
                           None if lin is None else lin.take(
                               torch.arange(i, min(i + at_once, len(x)),
                                            device=x.device)), held)
            for i in range(0, len(x), at_once)])
    lin = lin or Linearized(model, x)
    order = patch_order(model).to(x.device)
    n, K, B = order.numel(), len(model.blocks), len(x)
    _, _, H, _, _, group = _sizes(model)
    red = _Reduce(how.exact, group)
    eye = torch.zeros(how.flush, n, dtype=x.dtype, device=x.device)
    with torch.no_grad():
        for start in range(0, n, how.flush):
            rows = order[start:start + how.flush]
            E = eye[: len(rows)].zero_()
            E[torch.arange(len(rows), device=E.device), rows] = 1.0
            parts: dict[tuple[str, int], list[Tensor]] = {}

            def keep(kind: str, i: int, T: Tensor, parts=parts) -> None:
                parts.setdefault((kind, i), []).append(T)

            for E_c in E.split(how.push):
                lin.push(lin.embed(E_c.reshape(-1, *x.shape[1:])), 0, keep,
                         logits=how.exact)
            for (kind, i), Ts in parts.items():
                red.add(kind, i, torch.cat(Ts, dim=1))
    token = torch.stack([top_root(red.token_gram[m]) for m in range(2 * K + 1)],
                        dim=1)  # (B, 2K+1, N)
    frob = torch.linalg.vector_norm(token, dim=-1)  # (Σ_t ‖J_t‖²)^{1/2} ≥ ‖J‖
    stream = torch.stack([red.whole("stream", m) for m in range(2 * K + 1)], dim=1)
    inf = torch.full((B, K, H), math.inf, dtype=x.dtype, device=x.device)
    if how.exact:
        logits, queries, keys = (torch.stack([red.whole(kind, k) for k in range(K)],
                                             dim=1) for kind in PER_HEAD)  # (B, K, H)
        T_S = [torch.cat(red.kept[("logits", k)], dim=1) for k in range(K)]
        logit_rows = torch.stack([  # (B, n, H, N, N) → (B, H, N, n, N): per head, row
            gram_norm(T.permute(0, 2, 3, 1, 4)).amax(-1) for T in T_S], dim=1)
        variance = LogitVariance.stack([
            logit_variance(T, b.P) for T, b in zip(T_S, lin.blocks, strict=True)], 1)
        hessian = inf[..., 0] if lin.lipschitz else torch.stack([  # standard only
            torch.stack([attention_hessian_norm(lin.blocks[k].sample(b), T[b])
                         for b in range(B)])  # n² pairs each: one sample at a time
            for k, T in enumerate(torch.cat(red.kept[("attn_in", k)], dim=1)
                                  for k in range(K))], dim=1)
    else:
        logits = queries = keys = logit_rows = inf
        hessian = inf[..., 0]
        variance = LogitVariance(inf, inf, inf[..., 0], inf[..., 0])
    return JacobianNorms(
        stream=torch.minimum(stream, frob),
        stream_token=token,
        attn_in=torch.stack([red.whole("attn_in", k) for k in range(K)], dim=1),
        act_in=[red.unit_sq[k].sqrt() * (1 + 1e-12) for k in range(K)],
        cls=token[:, -1, 0],
        logits=logits,
        queries=queries,
        keys=keys,
        logit_rows=logit_rows,
        variance=variance,
        attn_hessian=hessian,
        exact=how.exact,
    )


EXACT_GRAM_MAX = 1024
"""Largest image dimension ``n`` for which :func:`jacobian_norms` computes the
whole-matrix norms exactly, from the ``n × n`` Gram matrices of the stored
tangents (memory ``n × activations``, cost ``n² × activations``); above it
they are bounded by the patch-block matrix."""


def jacobian_norms(
    model: ViT, x: Tensor, exact_max: int | None = None,
    max_memory: int | None = None, lin=None, held: int = 0,
) -> JacobianNorms:
    """:class:`JacobianNorms` of ``model`` at images ``x`` ``(B, C, S, S)``.

    The image's ``n`` basis tangents are pushed through the linearised network
    (:class:`lipvit.certify.taylor.linearized.Linearized`, the clean pass once for the
    batch, every sample's tangents in one push) a few at a time, patch by
    patch (``exact_max``: default :data:`EXACT_GRAM_MAX`), and every quantity
    is *accumulated* (:func:`lipvit.certify.taylor.jacobian_norms.norms_of_batch`):
    per-token ``D × D`` Gram matrices, per-unit squared norms, and either the
    stored tangents of the whole-matrix maps (``n ≤ exact_max``: their
    ``n × n`` Gram matrices, exact) or the norms of their patch blocks
    (bounded by the block matrix's norm). Memory: ``max_memory`` bytes of
    tangents (:func:`lipvit.certify.taylor.jacobian_norms.plan`) beside the
    ``held`` bytes the caller holds. ``lin``: the batch's
    :class:`~lipvit.certify.taylor.linearized.Linearized`, if built already.
    """
    exact_max = EXACT_GRAM_MAX if exact_max is None else exact_max
    return norms_of_batch(model, x, exact_max, max_memory, lin, held)


