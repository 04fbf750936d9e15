"""The network linearised at a batch of clean points: tangents pushed in batches.

``taylor``'s exact quantities are all of one kind: the clean point's Jacobian
applied to many tangents (the image's ``n`` basis vectors for
:func:`lipvit.certify.taylor.jacobian_norms.jacobian_norms`, one column per ReLU symbol
for :mod:`lipvit.certify.taylor.symbols`). Forward-mode AD through the model recomputes
the clean forward pass for every tangent and routes the attention through small batched
products; :class:`Linearized` computes the clean pass **once** for a batch of ``B``
images, keeps what the Jacobian needs (the token norms of each projection, the LayerNorm
statistics, each head's ``Q``, ``K``, ``V`` and softmax ``P``, each activation's
derivative) and applies each sample's Jacobian to its ``c`` tangents, ``(B, c, N, D)``
in all, with one large matrix product per operation for the whole batch (on a GPU each
operation is a kernel launch: their number per sample falls as ``1/B``).

The maps are the derivatives of exactly what
:func:`lipvit.certify.taylor.forward.forward` computes (tested against forward-mode AD
to float rounding):

* LayerProject ``p(x) = x R/max(‖x‖, R)``: ``J T = T`` inside the ball and
  ``(R/‖x‖)(T − x̂ x̂ᵀT)`` where ``‖x‖ ≥ R`` (autograd's side at ``‖x‖ = R``);
* LayerNorm with ``c = Πx``, ``σ = √(‖c‖²/D + η)``:
  ``J T = γ ⊙ (ΠT/σ − c (cᵀΠT)/(Dσ³))``;
* attention ``Σ_h P_h V_h W_o[h]`` with ``S_h = Q_h K_hᵀ/√d``:
  ``dS_h = (dQ_h K_hᵀ + Q_h dK_hᵀ)/√d``, ``dP_h = P_h ⊙ (dS_h − rowsum(P_h ⊙
  dS_h))``, ``d out = Σ_h (dP_h V_h + P_h dV_h) W_o[h]``;
* the activation: ``relu′(z) = [z > 0]`` (autograd's ``relu′(0) = 0``) or
  ``GELU′(z) = Φ(z) + z φ(z)``; the SLL's ``dX = dq − 2 (du/T) W``.

A push visits every site input in order, as it is computed, through a
callback, so a caller keeps only what it accumulates (Gram blocks, row norms)
and memory stays at one stream state of ``c`` tangents.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from lipvit.certify.crown.relaxations import gelu_grad
from lipvit.certify.taylor.forward import forward
from torch import Tensor, nn

from lipvit.layers import LayerProject
from lipvit.model import ViT

Visit = Callable[[str, int, Tensor], None]
"""``(kind, index, tangents)``: ``kind`` is ``"stream"`` (index ``m``, ``(B, c, N,
D)``), ``"attn_in"``, ``"logits"`` (``(B, c, H, N, N)``), ``"queries"`` and
``"keys"`` (``(B, c, H, N, d)``: ``p W_q[h]``, ``p W_k[h]``) or ``"act_in"``
(``(B, c, N, m)``), each indexed by block."""


def _project_tangent(x: Tensor, radius: float, mode: str) -> Callable[[Tensor], Tensor]:
    """Jacobian of :func:`lipvit.layers.layer_project` at ``x`` ``(B, N, D)``,
    applied to tangents ``(B, c, N, D)``."""
    dims = (-1,) if mode == "token" else (-2, -1)
    norm = torch.linalg.vector_norm(x, dim=dims, keepdim=True)[:, None]  # (B,1,N|1,1)
    outside = norm >= radius  # autograd's clamp_min passes the gradient at equality
    x_hat = x[:, None] / norm  # (B, 1, N, D)
    scale = torch.where(outside, radius / norm, torch.ones_like(norm))

    def apply(T: Tensor) -> Tensor:  # (B, c, N, D)
        radial = (T * x_hat).sum(dim=dims, keepdim=True)
        return scale * (T - torch.where(outside, radial, 0.0) * x_hat)

    return apply


def _layernorm_tangent(ln, x: Tensor) -> Callable[[Tensor], Tensor]:
    """Jacobian of ``nn.LayerNorm`` ``ln`` at ``x`` ``(B, N, D)`` (module
    docstring), applied to tangents ``(B, c, N, D)``."""
    D = x.shape[-1]
    c = (x - x.mean(-1, keepdim=True))[:, None]  # (B, 1, N, D)
    sigma = ((c * c).mean(-1, keepdim=True) + ln.eps).sqrt()  # (B, 1, N, 1)
    gamma = ln.weight if ln.weight is not None else torch.ones_like(x[0, 0])

    def apply(T: Tensor) -> Tensor:
        dc = T - T.mean(-1, keepdim=True)
        radial = (c * dc).sum(-1, keepdim=True) / (D * sigma**3)
        return gamma * (dc / sigma - c * radial)

    return apply


def _norm_tangent(norm, x: Tensor) -> Callable[[Tensor], Tensor]:
    if isinstance(norm, LayerProject):
        return _project_tangent(x, norm.radius, norm.mode)
    return _layernorm_tangent(norm, x)


@dataclass
class _Block:
    """What block ``k``'s Jacobian needs at the clean points of a batch of ``B``."""

    norm1: Callable[[Tensor], Tensor]
    norm2: Callable[[Tensor], Tensor]
    W_qkv: Tensor  # (D, 3·H·d): the q, k, v maps side by side, heads inside
    W_o: Tensor  # (H·d, D)
    Q_t: Tensor  # (B, H, d, N): Qᵀ/√d
    K_t: Tensor  # (B, H, d, N): Kᵀ/√d
    V: Tensor  # (B, H, N, d), without b_v: dP's rows sum to 0, so dP 1b_vᵀ = 0
    P: Tensor  # (B, H, N, N)
    PV: Tensor  # (B, H, N, d)
    W1: Tensor  # (m, D)
    slope: Tensor  # (B, N, m): the activation's derivative at z
    out: Tensor  # lipschitz: (m, D) = 2 W/T; standard: fc2's (D, m) transposed
    inputs: tuple[Tensor, Tensor]  # (B, N, D) ×2: the norms' clean inputs
    norms: tuple[nn.Module, nn.Module]  # the block's norm1, norm2

    def take(self, index: Tensor) -> _Block:
        """The samples ``index`` ``(b,)`` of the batch."""
        X, X_mid = (t[index] for t in self.inputs)
        return replace(self, norm1=_norm_tangent(self.norms[0], X),
                       norm2=_norm_tangent(self.norms[1], X_mid),
                       Q_t=self.Q_t[index], K_t=self.K_t[index], V=self.V[index],
                       P=self.P[index], PV=self.PV[index], slope=self.slope[index],
                       inputs=(X, X_mid))

    def sample(self, b: int) -> _Block:
        """Sample ``b``'s attention data, without the batch axis (the norms'
        maps stay the batch's)."""
        return replace(self, Q_t=self.Q_t[b], K_t=self.K_t[b], V=self.V[b],
                       P=self.P[b], PV=self.PV[b], slope=self.slope[b])


class Linearized:
    """The Jacobian of :func:`lipvit.certify.taylor.forward.forward` at a batch of
    images.

    Every sample's clean pass is computed once; a push applies each sample's
    Jacobian to its own ``c`` tangents with one batched product per
    operation for the whole batch.

    Args:
        model: a lipvit ViT (:func:`lipvit.certify.taylor.forward.check_supported`).
        x: images ``(B, C, S, S)``, the model's dtype.
    """

    def __init__(self, model: ViT, x: Tensor):
        self.model = model
        self.lipschitz = model.config.family == "lipschitz"
        with torch.no_grad():
            _, rec = forward(model, x)
            self.blocks = [self._block(k, rec) for k in range(len(model.blocks))]
        self.batch = x.shape[0]
        self.shape = rec.stream[0].shape[1:]  # (N, D)

    def _block(self, k: int, rec) -> _Block:
        block = self.model.blocks[k]
        X, X_mid, p, z = (rec.stream[2 * k], rec.stream[2 * k + 1], rec.attn_in[k],
                          rec.act_in[k])  # (B, N, D) ×3, (B, N, m)
        W_q, W_k, W_v, W_o = block.attn.head_weights()  # (H, D, d) ×3, (H, d, D)
        H, D, d = W_q.shape
        Q = torch.einsum("bnD,hDd->bhnd", p, W_q)
        K = torch.einsum("bnD,hDd->bhnd", p, W_k)
        V = torch.einsum("bnD,hDd->bhnd", p, W_v)
        P = torch.softmax(Q @ K.transpose(-1, -2) / math.sqrt(d), dim=-1)
        W_qkv = torch.cat([W.permute(1, 0, 2).reshape(D, H * d)
                           for W in (W_q, W_k, W_v)], dim=1)  # (D, 3Hd)
        W1 = block.mlp.fc1.weight
        if self.lipschitz:
            slope = (z > 0).to(z.dtype)
            out = 2.0 * W1 / block.mlp.T()[:, None]  # (m, D)
        else:
            slope = gelu_grad(z)
            out = block.mlp.fc2.weight.T  # (m, D)
        scale = 1 / math.sqrt(d)
        return _Block(_norm_tangent(block.norm1, X), _norm_tangent(block.norm2, X_mid),
                      W_qkv, W_o.reshape(H * d, D), (Q * scale).transpose(-1, -2),
                      (K * scale).transpose(-1, -2), V, P, P @ V, W1, slope, out,
                      (X, X_mid), (block.norm1, block.norm2))

    def take(self, index: Tensor) -> Linearized:
        """The same linearisation restricted to the samples ``index`` ``(b,)``,
        distinct and in order (a push then serves only them); itself where
        they are all of them."""
        if len(index) == self.batch:
            return self
        sub = copy.copy(self)
        sub.blocks = [b.take(index) for b in self.blocks]
        sub.batch = len(index)
        return sub

    @torch.no_grad()
    def embed(self, T: Tensor) -> Tensor:
        """Image tangents ``(c, C, S, S)`` → block 0's input tangents ``(c, N, D)``
        (the same map for every sample: the patch embedding is linear)."""
        pe = self.model.patch_embed
        patches = pe.patches(T / self.model.std)  # (c, N−1, C·p·p)
        tokens = patches @ pe.proj.weight.T  # (c, N−1, D)
        return F.pad(tokens, (0, 0, 1, 0))  # the class token does not move

    @torch.no_grad()
    def push(
        self, T: Tensor, first: int, visit: Visit, logits: bool = False,
        inject: tuple[str, Tensor] | None = None,
    ) -> None:
        """Apply each sample's Jacobian to its tangents ``T`` ``(B, c, N, D)`` of
        stream state ``s_{2·first}`` (block ``first``'s input; ``(c, N, D)``:
        the same tangents for every sample) through blocks ``first, …``;
        ``visit`` receives every site input's tangents ``(B, c, …)`` in order
        (the first stream state included). ``logits``: also visit each block's
        attention-logit tangents ``dS_h`` and its query and key tangents.
        ``inject = (site, U)``: add ``U`` ``(B, c, N, D)`` at block ``first``'s
        ``"norm1"`` or ``"norm2"`` output."""
        if T.dim() == 3:
            T = T.expand(self.batch, *T.shape)
        visit("stream", 2 * first, T)
        for k in range(first, len(self.blocks)):
            b = self.blocks[k]
            add = inject[1] if inject is not None and k == first else None
            site = inject[0] if add is not None else None
            p = b.norm1(T)
            if site == "norm1":
                p = p + add
            visit("attn_in", k, p)
            T = T + self._attention(b, p, k, visit, logits)
            visit("stream", 2 * k + 1, T)
            q = b.norm2(T)
            if site == "norm2":
                q = q + add
            z = q @ b.W1.T  # (B, c, N, m)
            visit("act_in", k, z)
            u = z * b.slope[:, None]
            T = q - u @ b.out if self.lipschitz else T + u @ b.out
            visit("stream", 2 * k + 2, T)

    def _attention(self, b: _Block, p: Tensor, k: int, visit: Visit,
                   logits: bool) -> Tensor:
        """``d out = Σ_h (dP_h V_h + P_h dV_h) W_o[h]`` with
        ``dP_h V_h = (P_h ⊙ dS_h) V_h − r_h ⊙ (P_h V_h)``, ``r_h = rowsum(P_h ⊙ dS_h)``;
        every product is one batched matrix product per sample and head over
        all its tangents."""
        B, c, N, D = p.shape
        H, d = b.Q_t.shape[1:3]
        qkv = (p.reshape(B * c * N, D) @ b.W_qkv).reshape(B, c, N, 3, H, d)
        dQ, dK = (qkv[:, :, :, i].permute(0, 3, 1, 2, 4).reshape(B, H, c * N, d)
                  for i in (0, 1))
        dS = (dQ @ b.K_t).reshape(B, H, c, N, N)  # dQ Kᵀ/√d
        dS.add_((dK @ b.Q_t).reshape(B, H, c, N, N).transpose(-1, -2))  # + Q dKᵀ/√d
        if logits:
            visit("logits", k, dS.transpose(1, 2))  # (B, c, H, N, N)
            for kind, T in (("queries", dQ), ("keys", dK)):  # (B, c, H, N, d)
                visit(kind, k, T.reshape(B, H, c, N, d).transpose(1, 2))
        # In place where no visitor holds dS (each pass over these tensors
        # is a pass through memory once a push outgrows the cache).
        P = b.P[:, :, None]  # (B, H, 1, N, N)
        G = dS * P if logits else dS.mul_(P)  # P ⊙ dS
        r = G.sum(-1, keepdim=True)
        out = (G.reshape(B, H, c * N, N) @ b.V).reshape(B, H, c, N, d)
        out.sub_(r * b.PV[:, :, None])
        dV = qkv[:, :, :, 2].permute(0, 3, 2, 1, 4).reshape(B, H, N, c * d)
        out.add_((b.P @ dV).reshape(B, H, N, c, d).transpose(2, 3))  # + P dV
        return out.permute(0, 2, 3, 1, 4).reshape(B, c, N, H * d) @ b.W_o


CACHE_BYTES = 4 * 2**20
"""Size of the largest per-push tensor (the ``(c, H, N, N)`` logit tangents)
that keeps a push in the processor's cache: pushes of that many tangents ran
2–3× faster than pushes of hundreds at 3×128 (one thread)."""

def push_size(lin: Linearized) -> int:
    """Tangents per sample and push: one sample's ``(c, H, N, N)`` logit
    tangents within :data:`CACHE_BYTES`, whatever the batch. On a GPU each
    operation is a kernel launch, so a push's operations serve ``B`` times
    as many tangents; on one CPU thread a push of 8 samples costs about what
    8 pushes of one do (at ``fmnist-3x64``, lipschitz, ε = 0.1 and 0.3:
    5.24 s a sample against 5.17; 13, 26 or 6 tangents a sample instead of
    52: 5.05, 5.08, 5.30)."""
    H, N = lin.blocks[0].P.shape[1:3] if lin.blocks else (1, lin.shape[0])
    return max(1, CACHE_BYTES // (8 * H * N * N))
