"""The second-order Taylor model of a standard ViT's margins (docs/taylor.md §12).

:func:`logit_jet` pushes the image's jet (:mod:`lipvit.certify.taylor.jets`) through
the patch embedding, every block's LayerNorms, attention and GELU MLP, the final
LayerNorm and the head: the margins' exact gradient and Hessian in the image
and a sound bound on the rest at any ε. :class:`JetMargins` turns them into
margin-drop bounds, the quadratic part minimised exactly over the ball
(eq. 12.7) instead of bounded by norms.
"""

from __future__ import annotations

import math

import torch
from lipvit.certify.taylor import jets
from lipvit.certify.taylor.jets import Jet
from torch import Tensor, nn

from lipvit.model import MLP, Attention, ViT

#: Largest ``n² · (largest activation's element count)`` for which the jets are
#: built (float64: 8 bytes each, a few such tensors live at once).
JET_MAX = 2**25


def _sizes(model: ViT) -> tuple[int, int, int]:
    """``(n, N·D, widest)``: image dimension, token-matrix size and the largest
    activation's element count."""
    cfg = model.config
    n, N = cfg.in_chans * cfg.image_size**2, cfg.num_patches + 1
    widest = max(cfg.num_heads * N * N, N * cfg.mlp_hidden, 3 * N * cfg.embed_dim)
    return n, N * cfg.embed_dim, widest


def supports(model: ViT) -> bool:
    """Whether :class:`JetMargins` applies: a standard-family ViT with
    dot-product attention, and an image small enough for :data:`JET_MAX`."""
    cfg = model.config
    if cfg.family != "standard" or cfg.attention != "dot":
        return False
    if not all(isinstance(b.attn, Attention) and isinstance(b.mlp, MLP)
               and isinstance(b.norm1, nn.LayerNorm)
               and isinstance(b.norm2, nn.LayerNorm) for b in model.blocks):
        return False
    n, _, widest = _sizes(model)
    return n * n * widest <= JET_MAX


def jet_bytes(model: ViT) -> int:
    """An estimate, from above, of the bytes one :class:`JetMargins` holds: the
    ``|J|`` of its back-substitution (about ``8·N·D + N·m`` target elements per
    block, each against half the non-linear elements, on average, upstream)
    and the building's largest coefficient tensors."""
    cfg = model.config
    n, ND, widest = _sizes(model)
    N, H, m = cfg.num_patches + 1, cfg.num_heads, cfg.mlp_hidden
    own = len(model.blocks) * (3 * H * N * N + 2 * H * N + 4 * N + 2 * ND + N * m)
    targets = len(model.blocks) * (8 * ND + N * m)
    return 8 * (targets * own // 2 + 4 * widest * n * n)


def embedding_jet(model: ViT, x: Tensor) -> Jet:
    """The first block's input tokens ``(N, D)`` at image ``x`` ``(C, S, S)``:
    an affine function of the image, so its jet is exact."""
    def embed(z: Tensor) -> Tensor:
        return model.embed(z.view(1, *x.shape))[0]  # (N, D)

    z = x.flatten()
    return jets.input_jet(embed(z), torch.func.jacfwd(embed)(z))  # L: (N, D, n)


def layer_norm(j: Jet, ln: nn.LayerNorm) -> Jet:
    """``γ (x − μ)/√(σ² + η) + β`` over the last axis of ``S`` (``(N, D)`` or
    ``(D,)``): centring (linear), the variance (a contraction), the inverse
    square root (:func:`~lipvit.certify.taylor.jets.inverse_sqrt`) and a product."""
    D = j.shape[-1]
    p = "t" if len(j.shape) == 2 else ""
    centre = torch.eye(D, dtype=j.c.dtype, device=j.c.device) - 1 / D
    xc = jets.affine(j, centre)
    var = jets.scale(jets.contract(f"{p}d,{p}d->{p}", xc, xc), 1 / D)
    inv = jets.apply(var, jets.inverse_sqrt(ln.eps))
    y = jets.contract(f"{p}d,{p}->{p}d", xc, inv)
    if ln.weight is not None:
        y = jets.scale(y, ln.weight)
    return y if ln.bias is None else jets.shift(y, ln.bias)


def softmax(j: Jet) -> Jet:
    """Softmax over the last axis of ``(H, N, N)``: ``exp`` (shifted by each
    row's largest centre logit), the row sums, ``1/x``, a product."""
    e = jets.apply(jets.shift(j, -j.c.amax(-1, keepdim=True)), jets.EXP)
    inv = jets.apply(jets.reduce_sum(e, -1), jets.RECIPROCAL)
    return jets.contract("hij,hi->hij", e, inv)


def attention(j: Jet, attn: Attention) -> Jet:
    """``attn`` on tokens ``(N, D)`` (:meth:`Attention.forward`, biases included)."""
    N, D = j.shape
    H, d = attn.num_heads, attn.head_dim
    qkv = jets.affine(j, attn.qkv.weight.T, attn.qkv.bias)  # (N, 3D)
    qkv = jets.restructure(qkv, lambda t, k: t.reshape(N, 3, H, d, *t.shape[2:]))
    q, k, v = (jets.restructure(qkv, lambda t, _, i=i: t[:, i]) for i in range(3))
    logits = jets.scale(jets.contract("ihd,jhd->hij", q, k), 1 / math.sqrt(d))
    out = jets.contract("hij,jhd->ihd", softmax(logits), v)  # (N, H, d)
    out = jets.restructure(out, lambda t, k: t.reshape(N, D, *t.shape[3:]))
    return jets.affine(out, attn.proj.weight.T, attn.proj.bias)


def mlp(j: Jet, m: MLP) -> Jet:
    """``fc2(GELU(fc1(x)))``."""
    h = jets.apply(jets.affine(j, m.fc1.weight.T, m.fc1.bias), jets.GELU)
    return jets.affine(h, m.fc2.weight.T, m.fc2.bias)


def logit_jet(model: ViT, x: Tensor) -> Jet:
    """The logits ``(K,)`` of ``model`` at image ``x`` ``(C, S, S)`` as a jet."""
    s = embedding_jet(model, x)
    for block in model.blocks:
        s = jets.add(s, attention(layer_norm(s, block.norm1), block.attn))
        s = jets.add(s, mlp(layer_norm(s, block.norm2), block.mlp))
    cls = jets.restructure(s, lambda t, k: t[0])  # (D,): the class token
    head = model.head
    return jets.affine(layer_norm(cls, model.norm), head.weight.T, head.bias)


class JetMargins:
    """Margin-drop bounds of one image from its logits' jet (eq. 12.6):
    ``f_y − f_j ≥ m_j + min_{‖δ‖≤ε} (g_jᵀδ + ½δᵀH_jδ) − r_j(ε)``.

    The rests are back-substituted
    (:class:`~lipvit.certify.taylor.jets.BackSubstitution`) at the margins and at every
    input of a non-linear operation with at most ``back_max`` elements (default
    ``N·max(D, m)``: the token matrices and the MLP's hidden units; the ``H·N²``
    attention matrices, where larger, keep their forward bounds). """

    def __init__(self, model: ViT, x: Tensor, y: int, back_max: float | None = None):
        cfg = model.config
        if back_max is None:
            back_max = (cfg.num_patches + 1) * max(cfg.embed_dim, cfg.mlp_hidden)
        with torch.enable_grad():
            logits = logit_jet(model, x)
            K = logits.shape[0]
            M = -torch.eye(K, dtype=x.dtype, device=x.device)
            M[y] += 1  # column j: e_y − e_j
            m = jets.affine(logits, M)
            order = jets.topological(m.node)
            inputs = {id(p): p for v in order if not v.linear for p in v.parents}
            targets = [p for p in inputs.values() if p.c.numel() <= back_max]
            self.back = jets.BackSubstitution(m.node, [*targets, m.node])
        for v in self.back.order:
            v.c = v.c.detach()  # the centres' graph is no longer needed
        self.out = m.node
        self.gradient, self.hessian = m.L, m.Q  # (K, n), (K, n, n)
        self.form = jets.QuadraticForm(m.L, m.Q)

    def remainder(self, eps: Tensor) -> Tensor:
        """``r_j(ε)`` ``(K,)``: a bound on the margins' rest beyond second order."""
        with torch.no_grad():
            r = self.back.bounds(eps)[id(self.out)][0]
        return torch.where(r.isnan(), math.inf, r)  # NaN: inf · 0 past a domain

    def drop(self, eps: Tensor) -> Tensor:
        """An upper bound on ``m_j − (f_y − f_j)(x + δ)`` over ``‖δ‖ ≤ ε``, ``(K,)``
        (0 at ``j = y``)."""
        with torch.no_grad():
            return (-self.form.minimum(eps) + self.remainder(eps)).clamp_min(0)
