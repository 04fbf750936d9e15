"""Streamed, memory-bounded norms of the Jacobians from the image (docs/taylor.md §11).

:func:`lipvit.certify.sites.jacobian_norms` needs, per sample, the norm of
the clean point's Jacobian ``J_{u←x}`` from the image (``n`` dimensions) to
every stream state, attention input and pre-activation, whole, per token and
per unit. Stacking the ``n`` tangents of every site input costs
``n × activations`` memory (17 GB for one CIFAR image at 3×128); here the
tangents are pushed through :class:`lipvit.certify.linearized.Linearized` a
few at a time and reduced as they come:

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
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from lipvit.certify import jet_vit
from lipvit.certify.linearized import CACHE_BYTES, Linearized
from torch import Tensor

from lipvit.errors import LipvitError
from lipvit.model import ViT
from lipvit.spectral import eigvalsh

DEFAULT_MAX_MEMORY = 4 * 2**30
"""Default bytes held at once (4 GiB, or a sixth of the machine's memory when
that is less): enough for ``cifar-lofast-6x384``, whose per-token Gram
matrices alone take 1 GB."""


REFINE = 0.05
"""Patch blocks whose Frobenius norm is at least this fraction of the largest
get their exact spectral norm; the others keep the Frobenius norm (an upper
bound), which changes ``‖Q‖`` little and saves most of the eigenvalue work."""


FLUSH = 128
"""Image tangents held and reduced at a time where the budget allows (whole
patches): each sample of a batch holds its own, so fewer lets more samples
share a push; more saves little (one reduction per site per flush)."""


class MemoryBudgetError(LipvitError):
    """The memory budget cannot hold even the smallest chunk of work."""


def physical_memory() -> int | None:
    """Bytes of physical memory, ``None`` where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_max_memory() -> int:
    """:data:`DEFAULT_MAX_MEMORY`, or a sixth of the physical memory if smaller."""
    total = physical_memory()
    return DEFAULT_MAX_MEMORY if total is None else min(DEFAULT_MAX_MEMORY, total // 6)


def memory_budget(max_memory: int | None) -> int:
    """``max_memory`` bytes, or :func:`default_max_memory` where ``None``."""
    return default_max_memory() if max_memory is None else max_memory


def parse_memory(text: str) -> int:
    """``"512M"``, ``"2G"``, ``"2GiB"`` or a byte count → bytes; a one-line
    error otherwise."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = (s[:-1], s[-1]) if s and s[-1] in units else (s, "")
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise LipvitError(f"--max-memory: cannot read {text!r} (e.g. 512M, 2G)"
                          ) from None
    if not math.isfinite(value) or value <= 0:
        raise LipvitError(f"--max-memory must be a positive size, got {text!r}")
    return int(value)


def gram_norm(T: Tensor) -> Tensor:
    """``‖J‖`` from tangents ``T = J E`` ``(..., n, M)`` (``E`` the identity): exact,
    ``√λ_max`` of the smaller Gram matrix (``T Tᵀ`` or ``Tᵀ T``, the same
    ``λ_max``) by eigvalsh, rounded up by a relative ``1e-12``."""
    if T.shape[-2] <= T.shape[-1]:
        return top_root(T @ T.transpose(-1, -2))
    return top_root(T.transpose(-1, -2) @ T)


def top_root(gram: Tensor) -> Tensor:
    """``√λ_max`` of symmetric PSD matrices ``(..., k, k)``, rounded up."""
    lam = eigvalsh(gram)[..., -1].clamp_min(0)
    return (lam * (1 + 1e-12) + 1e-300).sqrt()


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
    if n <= exact_max and fixed + n * (held + logit) + push * work <= budget:
        return Plan(True, n, push)
    groups = min((budget - fixed - push * work) // (group * held),
                 max(1, FLUSH // group))
    return Plan(False, int(groups) * group, int(push))


def sample_bytes(model: ViT, how: Plan) -> int:
    """Bytes one sample's tangents and reductions take under ``how`` (a batch's
    take as many times its samples)."""
    fixed, held, work, logit = _bytes(model)
    return fixed + how.flush * (held + (logit if how.exact else 0)) + how.push * work


def min_memory(model: ViT) -> int:
    """Bytes below which :func:`plan` refuses: the per-token Gram matrices, one
    patch of held tangents and one tangent's push."""
    fixed, held, work, _ = _bytes(model)
    return fixed + _sizes(model)[-1] * held + work


def jets_need(model: ViT) -> int:
    """Bytes of the smallest budget that holds one sample's second-order
    Taylor models (:func:`~lipvit.certify.jet_vit.jet_bytes`, an estimate from
    above) beside :func:`min_memory`."""
    return jet_vit.jet_bytes(model) + min_memory(model)


def jets_fit(model: ViT, max_memory: int | None) -> bool:
    """Whether ``taylor`` builds the margins' second-order Taylor models: the
    model is one :func:`lipvit.certify.jet_vit.supports` and :func:`jets_need`
    is within ``max_memory`` bytes (default :func:`default_max_memory`). Where
    it is not, the certificate is the one without them (docs/taylor.md §12):
    the budget holds, the radii are smaller."""
    return jet_vit.supports(model) and jets_need(model) <= memory_budget(max_memory)


def taylor_batch(model: ViT, max_memory: int | None, exact_max: int) -> int:
    """Samples per :func:`lipvit.certify.taylor.taylor_bound` call within
    ``max_memory`` bytes: each sample keeps one autograd graph of the forward
    pass per class (the margins' gradients, back-substituted at every ε) and
    its symbols' accumulators, its second-order Taylor model
    (:func:`lipvit.certify.jet_vit.jet_bytes`) where one is built
    (:func:`jets_fit`), and its share of the batch's tangents
    (:func:`sample_bytes` of :func:`plan` with ``exact_max``: the batch's
    samples are pushed together)."""
    cfg = model.config
    N, D, H, m, K, _ = _sizes(model)
    graph = 8 * K * N * (8 * D + 4 * m + 3 * H * N)  # one forward pass, kept
    carried = 8 * (2 * (2 * K + 1) * N * D + 2 * K * N * D + 2 * K * N * m)
    per_sample = cfg.num_classes * graph + carried
    per_sample += sample_bytes(model, plan(model, exact_max, max_memory))
    if jets_fit(model, max_memory):
        per_sample += jet_vit.jet_bytes(model)
    return max(1, memory_budget(max_memory) // per_sample)


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


class LogitVariance(NamedTuple):
    """Variance gains of the image → attention-logit map of one block
    (docs/taylor.md §7, *through the image*): with ``U = J_{S←x}Γ`` the
    logits' first-order change (``(H, N, N)``) and ``Var_r`` the variance of
    row ``r`` of head ``h`` under the clean ``p_{h,r}``, per unit ``‖Γ‖²``:
    ``whole`` ``(…, H)`` ``max Σ_r Var_r``, ``row`` ``(…, H)`` ``max_r max
    Var_r``, and over all heads at once ``whole_all`` ``(…)`` ``max Σ_{h,r}
    Var_{h,r}`` and ``row_all`` ``(…)`` ``max_r max Σ_h Var_{h,r}``. Exact
    (eigvalsh, rounded up); ``+inf`` where not computed."""

    whole: Tensor
    row: Tensor
    whole_all: Tensor
    row_all: Tensor

    def block(self, k: int) -> LogitVariance:
        """Block ``k``'s gains of batched ``(B, K, …)`` fields."""
        return LogitVariance(*(f[:, k] for f in self))

    @staticmethod
    def stack(parts: list[LogitVariance], dim: int = 0) -> LogitVariance:
        """The fields of ``parts`` stacked along a new axis ``dim``."""
        return LogitVariance(*(torch.stack(f, dim) for f in zip(*parts, strict=True)))


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


@dataclass(frozen=True)
class JacobianNorms:
    """Norms of the clean point's Jacobians from the image, ``J_{u←x}``.

    Per token and per unit they are **exact** (float rounding aside, rounded
    up); whole-matrix norms are exact when the image has at most
    :data:`lipvit.certify.sites.EXACT_GRAM_MAX` dimensions (``exact`` true) and
    otherwise **upper bounds** from the patch-block matrix (module docstring).

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
            (:func:`lipvit.certify.second_order.attention_hessian_norm`);
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

    @staticmethod
    def cat(parts: list[JacobianNorms]) -> JacobianNorms:
        """The norms of consecutive batches ``parts`` as one batch."""
        first = parts[0]
        fields = {name: torch.cat([getattr(p, name) for p in parts])
                  for name in ("stream", "stream_token", "attn_in", "cls", "logits",
                               "queries", "keys", "logit_rows", "attn_hessian")}
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
    lin: Linearized | None = None,
) -> JacobianNorms:
    """:class:`JacobianNorms` of images ``x`` ``(B, C, S, S)`` (module docstring),
    every sample's tangents pushed together (one operation per step for the
    whole batch); ``lin``: their :class:`Linearized`, if built already. The
    plan is one sample's (:func:`plan`), whatever the batch, so that the
    norms do not depend on it; the batch is split where its tangents would
    exceed ``max_memory`` bytes at once."""
    how = plan(model, exact_max, max_memory)
    at_once = max(1, memory_budget(max_memory) // sample_bytes(model, how))
    if len(x) > at_once:
        return JacobianNorms.cat([norms_of_batch(model, x[i:i + at_once], exact_max,
                                                 max_memory)
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
        from lipvit.certify.second_order import attention_hessian_norm  # imports us
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
