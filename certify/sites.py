"""The network as linear maps and nonlinear *sites* at the clean point (docs/taylor.md).

A block's sites are the norm before attention (``norm1``), the attention
(``attn``), the norm before the MLP (``norm2``) and the MLP's activation
(``act``); the final norm is the site ``(-1, "norm")``. :func:`forward` runs the
model with tensors added at the sites' outputs (zero: the model itself), which
gives, by autograd, the gradient of every class margin with respect to each
site (:func:`site_gradients`), and by forward-mode AD the **exact** norms of the
Jacobians from the image to every site input (:func:`jacobian_norms`).
:func:`forward_blocks` starts at any block, for perturbations injected inside
the network (:mod:`lipvit.certify.symbols`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from lipvit.certify.attention import attention, bound_weights
from lipvit.certify.tangents import (
    JacobianNorms,
    gram_norm,
    norms_of_batch,
)
from torch import Tensor

from lipvit.errors import UnsupportedModelError
from lipvit.layers import SLL, LayerProject
from lipvit.model import MLP, ViT

SITES = ("norm1", "attn", "norm2", "act")
"""Nonlinear sites of a block, in order; the final norm is the site ``"norm"``."""

Inject = dict[tuple[int, str], Tensor]


# --------------------------------------------------------------------------
# The forward pass with injections at the sites.
# --------------------------------------------------------------------------


def check_supported(model: ViT) -> None:
    """Refuse, with a one-line reason, a model the taylor method cannot bound."""
    if not isinstance(model, ViT):
        raise UnsupportedModelError(
            f"taylor needs a lipvit ViT, got {type(model).__name__}"
        )
    lipschitz = model.config.family == "lipschitz"
    for k, block in enumerate(model.blocks):
        bound_weights(block.attn)  # refuses query/key biases
        norms = (block.norm1, block.norm2)
        kinds = (LayerProject, LayerProject) if lipschitz else (torch.nn.LayerNorm,) * 2
        if not all(isinstance(n, t) for n, t in zip(norms, kinds, strict=True)):
            raise UnsupportedModelError(f"block {k}: unsupported normalisation layers")
        if lipschitz and block.norm2.mode != "token":
            raise UnsupportedModelError(f"block {k}: norm2 must project per token")
        if not isinstance(block.mlp, SLL if lipschitz else MLP):
            raise UnsupportedModelError(f"block {k}: unsupported feed-forward layer")
    if lipschitz and model.norm.mode != "token":
        raise UnsupportedModelError("the final LayerProject must project per token")


def _attention(attn, p: Tensor) -> Tensor:
    """``attn(p)`` with an explicit softmax (LoFAST eq. 6, ``H = 0``, plus biases)."""
    W = attn.head_weights()
    b = attn.head_biases()
    out = attention(p, *W, residual=False)  # (B, N, D)
    if b.b_v is not None:
        out = out + torch.einsum("hd,hdE->E", b.b_v, W.W_o)
    return out + b.b_o if b.b_o is not None else out


@dataclass
class Record:
    """Clean (or dual) values of a forward pass: residual stream and site inputs."""

    stream: list[Tensor]  # 2K + 1 tensors (B, N, D): s_0, s_1, …, s_{2K}
    attn_in: list[Tensor]  # (B, N, D): norm1's output, the attention's input
    act_in: list[Tensor]  # (B, N, m): the activation's pre-activations


def forward(
    model: ViT, x: Tensor, inject: Inject | None = None
) -> tuple[Tensor, Record]:
    """``model(x)`` with zero (or any) tensors added at every site's output.

    ``inject[(k, site)]`` is added to block ``k``'s ``site`` output and
    ``inject[(-1, "norm")]`` to the final norm's class-token output. Equal to
    ``model(x)`` without injections (tested). Returns logits ``(B, classes)``
    and a :class:`Record`.
    """
    return forward_blocks(model, model.embed(x), 0, inject)


def forward_blocks(
    model: ViT, X: Tensor, first: int, inject: Inject | None = None
) -> tuple[Tensor, Record]:
    """Blocks ``first, first+1, …`` of ``model``, the final norm and the head, on the
    stream state ``X`` ``(B, N, D)`` entering block ``first``; as :func:`forward`
    otherwise (the :class:`Record` starts at ``X``)."""
    inject = inject or {}

    def add(key: tuple[int, str], t: Tensor) -> Tensor:
        return t + inject[key] if key in inject else t

    lipschitz = model.config.family == "lipschitz"
    rec = Record([X], [], [])
    for k in range(first, len(model.blocks)):
        block = model.blocks[k]
        p = add((k, "norm1"), block.norm1(X))
        rec.attn_in.append(p)
        X = X + add((k, "attn"), _attention(block.attn, p))
        rec.stream.append(X)
        q = add((k, "norm2"), block.norm2(X))
        z = block.mlp.fc1(q)  # (B, N, m)
        rec.act_in.append(z)
        if lipschitz:
            u = add((k, "act"), torch.relu(z))
            X = q - 2.0 * (u / block.mlp.T()) @ block.mlp.fc1.weight
        else:
            X = X + block.mlp.fc2(add((k, "act"), F.gelu(z)))
        rec.stream.append(X)
    cls = add((-1, "norm"), model.norm(X[:, :1])[:, 0])  # (B, D): per-token norm
    return model.head(cls), rec


@dataclass
class MarginGradients:
    """Gradients of every margin ``f_j − f_y`` w.r.t. the image and each site, and
    the graph they came from (for :meth:`through_act`, :meth:`through_stream`).

    Attributes:
        x: ``(B, K, C, S, S)``: the image gradients.
        sites: ``{(k, site): (B, K, *site shape)}``.
        clean: the clean :class:`Record` (no graph).
        logits: the clean logits ``(B, K)``.
    """

    x: Tensor
    sites: Inject
    clean: Record
    logits: Tensor
    _xr: Tensor
    _inject: Inject
    _act_in: list[Tensor]
    _stream: list[Tensor]

    def through_act(self, k: int, v: Tensor) -> tuple[Tensor, Inject]:
        """``J_{z_k←x}ᵀ v`` and ``G_{z_k←φ}ᵀ v`` for every site ``φ`` before block
        ``k``'s activation: the clean linearised network's response, at the image
        and at those sites, to weights ``v`` ``(B, K, N, m)`` on block ``k``'s
        pre-activations (one backward pass through the kept graph)."""
        keys = [key for key in self._inject if 0 <= key[0] < k
                or (key[0] == k and key[1] != "act")]
        return self._back(self._act_in[k], keys, v)

    def through_stream(self, k: int, v: Tensor) -> tuple[Tensor, Inject]:
        """As :meth:`through_act`, for weights ``v`` ``(B, K, N, D)`` on block
        ``k``'s input ``s_{2k}``: the sites of the blocks before ``k``."""
        keys = [key for key in self._inject if 0 <= key[0] < k]
        return self._back(self._stream[2 * k], keys, v)

    def _back(self, out: Tensor, keys: list, v: Tensor) -> tuple[Tensor, Inject]:
        """``∂⟨v, out⟩`` w.r.t. the image and the sites ``keys``, by copy."""
        B, K = v.shape[:2]
        with torch.enable_grad():
            grads = torch.autograd.grad(
                out, [self._xr, *(self._inject[q] for q in keys)],
                grad_outputs=v.reshape(B * K, *v.shape[2:]), retain_graph=True,
            )
        sites = {q: g.reshape(B, K, *g.shape[1:]) for q, g in zip(keys, grads[1:],
                                                                  strict=True)}
        return grads[0].reshape(B, K, *grads[0].shape[1:]), sites


def site_gradients(model: ViT, x: Tensor, y: Tensor) -> MarginGradients:
    """Gradients of every margin ``f_j − f_y`` w.r.t. the image and each site.

    One backward pass for all samples and classes: each sample is repeated
    once per class (``K`` classes), and the graph is kept for
    :meth:`MarginGradients.through_act`.
    """
    B = x.shape[0]
    K = model.config.num_classes
    with torch.no_grad():
        logits0, clean = forward(model, x)
    shapes = {}
    for k in range(len(model.blocks)):
        shapes[(k, "norm1")] = shapes[(k, "attn")] = shapes[(k, "norm2")] = (
            clean.attn_in[k].shape[1:]
        )
        shapes[(k, "act")] = clean.act_in[k].shape[1:]
    shapes[(-1, "norm")] = clean.stream[-1].shape[2:]
    inject = {
        key: torch.zeros(
            (B * K, *s), dtype=x.dtype, device=x.device, requires_grad=True
        )
        for key, s in shapes.items()
    }
    xr = x.repeat_interleave(K, dim=0).requires_grad_(True)  # (B·K, C, S, S)
    with torch.enable_grad():
        logits, rec = forward(model, xr, inject)
        L = logits.reshape(B, K, K)  # copy (b, j) differentiates f_j − f_y
        j = torch.arange(K, device=x.device)
        total = (
            L[:, j, j]
            - L[:, j, :].gather(2, y[:, None, None].expand(B, K, 1)).squeeze(2)
        ).sum()
        grads = torch.autograd.grad(total, [xr, *inject.values()], retain_graph=True)
    g_sites = {
        key: g.reshape(B, K, *g.shape[1:])
        for key, g in zip(inject, grads[1:], strict=True)
    }
    return MarginGradients(grads[0].reshape(B, K, *x.shape[1:]), g_sites, clean,
                           logits0, xr, inject, rec.act_in, rec.stream)


EXACT_GRAM_MAX = 256
"""Largest image dimension ``n`` for which :func:`jacobian_norms` computes the
whole-matrix norms exactly, from the ``n × n`` Gram matrices of the stored
tangents (memory ``n × activations``, cost ``n² × activations``); above it
they are bounded by the patch-block matrix."""


def jacobian_norms(
    model: ViT, x: Tensor, exact_max: int | None = None,
    max_memory: int | None = None, lin=None,
) -> JacobianNorms:
    """:class:`JacobianNorms` of ``model`` at images ``x`` ``(B, C, S, S)``.

    The image's ``n`` basis tangents are pushed through the linearised network
    (:class:`lipvit.certify.linearized.Linearized`, the clean pass once for the
    batch, every sample's tangents in one push) a few at a time, patch by
    patch (``exact_max``: default :data:`EXACT_GRAM_MAX`), and every quantity
    is *accumulated* (:func:`lipvit.certify.tangents.norms_of_batch`):
    per-token ``D × D`` Gram matrices, per-unit squared norms, and either the
    stored tangents of the whole-matrix maps (``n ≤ exact_max``: their
    ``n × n`` Gram matrices, exact) or the norms of their patch blocks
    (bounded by the block matrix's norm). Memory: ``max_memory`` bytes of
    tangents (:func:`lipvit.certify.tangents.plan`). ``lin``: the batch's
    :class:`~lipvit.certify.linearized.Linearized`, if built already.
    """
    exact_max = EXACT_GRAM_MAX if exact_max is None else exact_max
    return norms_of_batch(model, x, exact_max, max_memory, lin)


# --------------------------------------------------------------------------
# Exact sub-block Jacobian norms (the explicitly exact small-size mode).
# --------------------------------------------------------------------------

EXACT_MAX = 1024
"""Largest token-matrix size ``N·D`` for which :func:`subblock_norms` forms a
whole attention sub-block's ``(N·D) × (N·D)`` Jacobian (its cost grows as
``(N·D)²`` per sample: about 0.25 s per sample at ``N·D = 544`` on one CPU
core, 2.4 s at 1088); above it the certificate uses the product bounds for
these two maps."""


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


def _dense_norm(fn, X: Tensor, chunk: int = 8) -> Tensor:
    """``‖Dfn(X_b)‖`` ``(B,)`` of a map of token matrices ``(B, N, D) → (B, N, D)``:
    the whole ``(N·D) × (N·D)`` Jacobian (forward mode), ``chunk`` samples at a
    time, and its norm by :func:`gram_norm`."""
    n = X[0].numel()
    jac = torch.func.vmap(torch.func.jacfwd(lambda s: fn(s[None])[0]))
    with torch.no_grad():
        return torch.cat([gram_norm(jac(Xc).reshape(-1, n, n))
                          for Xc in X.split(chunk)])


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
    model: ViT, clean: Record, max_size: int | None = None
) -> SubBlockNorms:
    """:class:`SubBlockNorms` at the clean point, by forward-mode AD. The
    token-wise maps' norms (``mlp``, ``unit``, ``ffn``: ``D`` tangents per
    token) are computed at every size; the whole attention maps' (``attn``,
    ``bare``) only when ``N·D ≤ max_size`` (default :data:`EXACT_MAX`: their
    ``(N·D) × (N·D)`` Jacobians are formed) and are ``+inf`` otherwise (the
    certificate then keeps its product bounds)."""
    X0 = clean.stream[0]
    whole = X0[0].numel() <= (EXACT_MAX if max_size is None else max_size)
    inf = torch.full(X0.shape[:1], math.inf, dtype=X0.dtype, device=X0.device)
    attn, bare, mlp, unit, ffn, into = [], [], [], [], [], []
    for k, block in enumerate(model.blocks):
        X, X_mid = clean.stream[2 * k], clean.stream[2 * k + 1]
        attn.append(_dense_norm(
            lambda s, b=block: s + _attention(b.attn, b.norm1(s)), X) if whole else inf)
        bare.append(_dense_norm(partial(_attention, block.attn), clean.attn_in[k])
                    if whole else inf)
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
