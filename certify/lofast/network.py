"""End-to-end local sensitivity of a ViT: ``δ_out(x, ε) ≥ ‖logits(x') − logits(x)‖₂``.

The bound composes layer bounds along the network (LoFAST §5.2, docs/math.md §1, §5,
§6): ``ε_{k+1} = δ_k(X_k, ε_k)`` with ``X_k`` the clean input of layer ``k``.
Each layer bound is split into quantities of the clean activations alone (ζ,
‖M_h(X)‖, weight norms, token norms), computed once, and a cheap function of
the budget ``ε`` (shape ``(B,)``). Evaluating the whole chain for another ε is
therefore nearly free, which makes the certified radius by bisection cheap.

Layers and their bounds (``Γ`` the perturbation of a layer's input):

| layer                          | bound on the output perturbation            |
|--------------------------------|---------------------------------------------|
| normalisation (x − μ)/s        | ε / min(s) (exact operator norm)            |
| patch embedding                | ε ‖W_pe‖ (disjoint patches: exact)          |
| class token, positions         | ε (constants)                               |
| ``x + attn(P(x))``, lipschitz  | LoFAST with H = I when P is the identity on |
|                                | the whole ball, else ε + LoFAST_{H=0}(P(X), |
|                                | L_P ε) with L_P the local constant of P     |
| ``SLL(LayerProject(x))``       | L_P ε (SLL is 1-Lipschitz)                  |
| ``x + attn(LN(x))``, standard  | ε + LoFAST_{H=0}(LN(X), L_LN ε)             |
| ``x + mlp(LN(x))``, standard   | ε (1 + ‖W_2‖ max|GELU'| ‖W_1‖ L_LN)         |
| final norm, head               | class token only: ‖W_head‖ L ε              |

Two budgets travel along the chain: ``all`` bounds the Frobenius norm of the
whole token matrix's perturbation, ``cls`` that of the class token alone. Every
map except attention acts token by token (LayerProject per token, SLL,
LayerNorm, the MLP, the residual identity), so it never moves one token's
perturbation into another: the class token's budget grows only through
attention, by the attention's whole change ``‖A(X') − A(X)‖_F`` (a bound on its
class row). The head reads the class token only, so ``δ_out = ‖W_head‖ ·
cls``. At the embedding the class token is a constant: ``cls = 0``.

Where a projection or LayerNorm sits between the residual stream and the
attention, the residual carries ``Γ`` while the attention sees
``Γ' = P(X') − P(X)`` with ``‖Γ'‖ ≤ L ‖Γ‖``; the two are bounded separately
(triangle inequality), which is sound for any coupling of ``Γ`` and ``Γ'``.
Only when P is the identity on the whole ball (``Γ' = Γ``) does the residual
enter ζ itself (LoFAST eq. 15 with ``H = I``), which is tighter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from lipvit.certify.attention import bound_weights, value_output
from lipvit.certify.certification import float64_model
from lipvit.certify.eps import eps_per_sample
from lipvit.certify.local import (
    gelu_mlp_local_lipschitz,
    layer_project_is_identity,
    layer_project_local_lipschitz,
    layernorm_local_lipschitz,
    linear_norm,
)
from lipvit.certify.lofast.layer import LoFASTTerms, lofast_terms, zeta_cls
from lipvit.certify.specformer import specformer_terms
from torch import Tensor

from lipvit.errors import UnsupportedModelError
from lipvit.layers import LayerProject
from lipvit.model import ViT

Method = Literal["lofast", "lofast-fast", "specformer"]
DeltaFn = Callable[[Tensor], Tensor]  # (B,) budget in -> (B,) bound out
METHODS: tuple[str, ...] = ("lofast", "lofast-fast", "specformer")
POWER_ITERATIONS, POWER_TOL = 300, 1e-7
"""Power-iteration budget of ζ and ‖M_h(X)‖: the estimate of ``lofast-fast``, and
only the starting point of the Cholesky certificate of ``lofast`` (whose
soundness does not depend on it; a poorer start costs retries, not validity)."""
LOFAST_VARIANT = "local"
"""The LoFAST δ2 used: ``"local"``, the tightest proven one (softmax's local
constant, an extension of the paper tested against PGD in tests/test_lofast.py)."""


class Budget(NamedTuple):
    """Perturbation budgets ``(B,)``: whole token matrix (Frobenius) and class token."""

    all: Tensor
    cls: Tensor


@dataclass(frozen=True)
class LayerStep:
    """One step of the chain: a name and its bound ``Budget ↦ Budget``.

    Attention steps also keep LoFAST's ε-independent terms of their bare
    attention (``H = 0``) at its clean input (``None`` elsewhere, and for
    ``specformer``); the ``taylor`` method reuses them.
    """

    name: str
    delta: Callable[[Budget], Budget]
    terms: LoFASTTerms | None = None


@dataclass(frozen=True)
class NetworkBound:
    """The chain of layer bounds of a ViT at clean images ``x`` (batch ``B``).

    Attributes:
        steps: the layer bounds in order, from image to logits.
        logits: clean logits ``(B, classes)``.
        method: the attention bound used.
        exact: whether every number is a guaranteed upper bound (``False`` for
            ``lofast-fast``, whose ζ and ‖M_h‖ are power-iteration estimates).
    """

    steps: tuple[LayerStep, ...]
    logits: Tensor
    method: str
    exact: bool

    def trace(self, eps: float | Tensor) -> Tensor:
        """Budgets through the chain, ``(B, len(steps) + 1, 2)``: ``[..., 0]`` the
        whole token matrix (the image before the embedding), ``[..., 1]`` the
        class token (the logits after the head); the first row is ``(ε, 0)``."""
        L = self.logits
        eps_k = eps_per_sample(eps, L.shape[0], L.dtype, L.device)
        budget = Budget(eps_k, torch.zeros_like(eps_k))
        out = [torch.stack(budget, dim=-1)]
        for step in self.steps:
            budget = step.delta(budget)
            out.append(torch.stack(budget, dim=-1))
        return torch.stack(out, dim=1)

    @property
    def attention_terms(self) -> tuple[LoFASTTerms | None, ...]:
        """LoFAST terms of every block's bare attention at its clean input."""
        return tuple(s.terms for s in self.steps if s.name.endswith(".attention"))

    def delta_out(self, eps: float | Tensor) -> Tensor:
        """``δ_out(x, ε) ≥ ‖logits(x') − logits(x)‖₂`` for ``‖x' − x‖₂ ≤ ε``.

        Returns a ``(B,)`` tensor.
        """
        return self.trace(eps)[:, -1, 1]


class AttentionBound(NamedTuple):
    """Bounds ``ε ↦ (B,)`` of one attention layer's change at a clean input."""

    whole: DeltaFn  # ‖F(X') − F(X)‖_F
    cls: DeltaFn  # ‖[F(X') − F(X)]_0‖ (class row), H = 0 only
    terms: LoFASTTerms | None  # LoFAST's ε-independent parts (None: specformer)


def _attention_bound(X: Tensor, attn, residual: bool, method: str) -> AttentionBound:
    """Bounds of ``‖F(X') − F(X)‖`` over ``‖X' − X‖_F ≤ ε`` for one attention layer.

    The class-row bound is ``ζ_cls ε + δ2`` with LoFAST's δ2 of the whole
    matrix (a row's norm is at most the Frobenius norm); SpecFormer has no row
    form and uses its whole bound for both.
    """
    W = bound_weights(attn)
    if method == "specformer":
        whole = specformer_terms(X, *W, residual=residual, variant="sound").delta
        return AttentionBound(whole, whole, None)
    terms = lofast_terms(X, *W, residual=residual, exact=method == "lofast",
                         n_iter=POWER_ITERATIONS, tol=POWER_TOL)
    P = torch.softmax(terms.logits.to(torch.float64), dim=-1)  # (B, H, N, N)
    W_vo = value_output(*(w.to(torch.float64) for w in W[2:]))  # (H, D, D)
    z_cls = zeta_cls(P, W_vo).to(X.dtype)

    def whole(eps: Tensor) -> Tensor:
        return terms.delta(eps, LOFAST_VARIANT)

    def cls(eps: Tensor) -> Tensor:
        bound = terms.bound(eps)
        return torch.minimum(z_cls * eps + bound.delta_2_local, bound.total_local)

    return AttentionBound(whole, cls, terms)


def _lipschitz_block(block, X: Tensor, method: str) -> list[LayerStep]:
    norm1: LayerProject = block.norm1
    dims = (-1,) if norm1.mode == "token" else (-2, -1)
    attn_h0 = _attention_bound(norm1(X), block.attn, residual=False, method=method)
    # Samples whose projection is the identity on a ball around X (‖X‖ < R) may
    # use the residual form of ζ; it is computed only for them.
    norms = torch.linalg.vector_norm(X, dim=dims)  # (B, N) per token or (B,) whole
    inside = (norms.amax(dim=-1) if norm1.mode == "token" else norms) < norm1.radius
    attn_h1 = (
        _attention_bound(X[inside], block.attn, residual=True, method=method).whole
        if inside.any()
        else None
    )

    def attention_step(b: Budget) -> Budget:
        lip = layer_project_local_lipschitz(X, norm1.radius, b.all, norm1.mode)
        eps_in = lip * b.all
        delta = b.all + attn_h0.whole(eps_in)
        if attn_h1 is not None:
            identity = layer_project_is_identity(
                X[inside], norm1.radius, b.all[inside], norm1.mode
            )
            tight = torch.where(identity, attn_h1(b.all[inside]), delta[inside])
            delta = delta.clone()
            delta[inside] = torch.minimum(delta[inside], tight)
        return Budget(delta, b.cls + attn_h0.cls(eps_in))

    X_mid = X + block.attn(norm1(X))
    radius = block.norm2.radius

    def mlp_step(b: Budget) -> Budget:  # token-wise: SLL ∘ LayerProject, ≤ 1
        L_all = layer_project_local_lipschitz(X_mid, radius, b.all, "token")
        L_cls = layer_project_local_lipschitz(X_mid[:, :1], radius, b.cls, "token")
        return Budget(L_all * b.all, L_cls * b.cls)

    return [LayerStep("attention", attention_step, attn_h0.terms),
            LayerStep("sll", mlp_step)]


def _standard_block(block, X: Tensor, method: str) -> list[LayerStep]:
    ln1, ln2 = block.norm1, block.norm2
    attn_h0 = _attention_bound(ln1(X), block.attn, residual=False, method=method)

    def attention_step(b: Budget) -> Budget:
        eps_in = layernorm_local_lipschitz(X, ln1.weight, ln1.eps, b.all) * b.all
        return Budget(b.all + attn_h0.whole(eps_in), b.cls + attn_h0.cls(eps_in))

    X_mid = X + block.attn(ln1(X))
    mlp_lip = gelu_mlp_local_lipschitz(block.mlp.fc1.weight, block.mlp.fc2.weight)

    def mlp_step(b: Budget) -> Budget:  # token-wise: x + mlp(LN(x))
        L_all = layernorm_local_lipschitz(X_mid, ln2.weight, ln2.eps, b.all)
        L_cls = layernorm_local_lipschitz(X_mid[:, :1], ln2.weight, ln2.eps, b.cls)
        return Budget(b.all * (1 + mlp_lip * L_all), b.cls * (1 + mlp_lip * L_cls))

    return [LayerStep("attention", attention_step, attn_h0.terms),
            LayerStep("mlp", mlp_step)]


def _scale(factor: Tensor | float) -> Callable[[Budget], Budget]:
    return lambda b: Budget(b.all * factor, b.cls * factor)


def check_dot_attention(model: ViT, what: str) -> None:
    """Refuse, in one line, a model whose token mixing is not dot-product attention.

    LoFAST, SpecFormer's Thm 4.2 and the CROWN wrapper are derived for (or
    wrap) ``softmax(X W_q W_kᵀ Xᵀ/√d) X W_v W_o``; the variants of
    :mod:`lipvit.attention` compute other maps.

    Raises:
        UnsupportedModelError: ``model.config.attention`` is not ``"dot"``.
    """
    attention = model.config.attention
    if attention != "dot":
        raise UnsupportedModelError(
            f"{what} is derived for dot-product attention; this model uses "
            f"attention={attention!r}, which it does not bound"
        )


@torch.no_grad()
def network_bound(model: ViT, x: Tensor, method: Method = "lofast") -> NetworkBound:
    """Compose the layer bounds of ``model`` at clean images ``x`` ``(B, C, S, S)``.

    Returns a :class:`NetworkBound` whose ``delta_out(ε)`` upper-bounds
    ``‖logits(x') − logits(x)‖₂`` for every ``‖x' − x‖₂ ≤ ε`` (image space, in
    the units of ``x``; the model's normalisation is included). With
    ``method="lofast-fast"`` the attention terms ζ and ‖M_h(X)‖ are
    power-iteration estimates and the result is not a certificate. A model in
    lower precision is bounded through a float64 copy.
    """
    if method not in METHODS:
        raise ValueError(
            f"unknown bound method {method!r}; choose from {', '.join(METHODS)}"
        )
    check_dot_attention(model, f"the {method} network bound")
    model = float64_model(model)  # certificates are computed in float64
    cfg = model.config
    x = x.to(dtype=torch.float64)
    steps = [
        LayerStep("normalize", _scale(1 / model.std.min())),
        LayerStep("patch_embed", _scale(linear_norm(model.patch_embed.proj.weight))),
    ]
    X = model.embed(x)  # (B, N, D)
    block_fn = _lipschitz_block if cfg.family == "lipschitz" else _standard_block
    for k, block in enumerate(model.blocks):
        for step in block_fn(block, X, method):
            steps.append(LayerStep(f"block{k}.{step.name}", step.delta, step.terms))
        X = block(X)
    cls = X[:, :1]  # (B, 1, D): only the class token reaches the head
    norm = model.norm

    def final_norm(b: Budget) -> Budget:
        if cfg.family == "lipschitz":
            L = layer_project_local_lipschitz(cls, norm.radius, b.cls, "token")
        else:
            L = layernorm_local_lipschitz(cls, norm.weight, norm.eps, b.cls)
        return Budget(b.all, L * b.cls)

    steps.append(LayerStep("norm", final_norm))
    steps.append(LayerStep("head", _scale(linear_norm(model.head.weight))))
    logits = model.forward_head(model.norm(X))
    return NetworkBound(tuple(steps), logits, method, exact=method != "lofast-fast")
