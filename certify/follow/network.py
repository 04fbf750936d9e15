"""The ``margin`` certificate: the margin's exact gradient at the point plus
proven bounds on the remainders of the maps after it, cut anywhere in the
chain and never weaker than ``ball`` (docs/math.md §11).

The network is a chain ``z_k = h_k(z_{k−1})``. Linearise each map at its clean
input, ``Δz_k = J_k Δz_{k−1} + r_k``; unrolled, the move of a margin ``m = F_y −
F_j`` is exactly

    m(x′) − m(x) = ∇m(x) · (x′ − x) + Σ_k g_kᵀ r_k,                        (11.1)

``g_k`` the margin's exact gradient at map ``k``'s output (clean point), so
``m`` drops by at most ``ε ‖∇m(x)‖`` plus a bound on each ``−g_kᵀ r_k`` (MaxMin's
one-sided, eq. 11.3a; attention's on ``|g_kᵀ r_k|``). Each remainder is bounded
on the ball that map's input can reach (:mod:`.variation`; the radii from
``ball``'s composition, :func:`lipvit.certify.ball.network.ball_chain`). The
chain may be cut after any map instead (eq. 11.8): the margin's move from the
cut on is at most the cut's radius times the margin's gradient there, plus
the remainders after it; the cut after the last map is ``ball``'s bound. Each
margin takes the least of these.

Class attention's remainder is the smaller of its gradient-turn bound (eq.
11.5) and its second-order bound (eq. 11.9–11.10); a CaiT's head MaxMin
bounds each pair's move by the same first-order-plus-remainder along the
pair's direction (eq. 11.11), not by ``ball``'s radius of the class token.
The stem's MaxMin pairs are also linearised by their chords instead of their
gradients at the point (eq. 11.13, :meth:`MarginCertificate.chord_terms`);
each margin takes the least cut of both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from lipvit.lipschitz_blocks import (
    ClassAttention,
    GatedAttention,
    GatedMLP,
    class_attention_paths,
)
from lipvit.spectral import conv_operator_norm, spectral_norm

from ..ball.attention import class_ball, self_ball, self_local
from ..ball.network import BallChain, ball_chain
from ..certification import ROUNDING, bisect_radius
from ..global_bound import Chain, pair_constants, pair_margins, proven_chain
from .variation import (
    CHORD_REACHES,
    capped_maxmin_remainder,
    chord_max_min,
    chord_remainder,
    chord_slopes,
    class_attention_remainder,
    class_attention_variation,
    coupled_maxmin_remainder,
    lowered_gap,
    maxmin_remainder,
    pair_radius,
    projection_moves,
    self_attention_variation,
)


class Site(NamedTuple):
    """One map of the forward pass whose Jacobian can change over the ball:
    its clean input ``z`` (MaxMin: the pre-activation; attention: the tokens)
    and the margins' gradients ``g`` ``(K, B, ...)`` at its output (MaxMin: at
    its input, where :func:`.variation.maxmin_remainder` reads which pairs can
    lower the margin)."""

    module: nn.Module
    z: Tensor
    g: Tensor


def _record(model: nn.Module, x: Tensor, y: Tensor, targets: Tensor | None = None,
            create_graph: bool = False
            ) -> tuple[Tensor, Tensor, list[Site], Tensor]:
    """Logits, ``‖∇ₓ m_j‖`` ``(K, B)``, the :class:`Site` list of ``model``
    at ``x`` and the margins' gradients at the stem's tokens ``(K, B, N,
    D)`` (``None`` with ``create_graph``: training does not read them):
    forward hooks keep every site's input and output; one batched
    backward pass (a vector ``e_y − e_j`` per class: every class, or the
    classes ``targets`` ``(B, K)``) gives the margins' gradients at all of
    them. With ``create_graph`` everything stays differentiable (training)."""
    kept: list[tuple[nn.Module, Tensor, Tensor]] = []
    tokens: list[Tensor] = []  # the embedding's output (positions add nothing)
    maxmin_inputs = [*model.stem, model.head_hidden]
    maxmin_inputs += [m.fc1 for m in model.modules() if isinstance(m, GatedMLP)]

    def hook(module, args, out):
        # MaxMin follows the module: its input is the module's output.
        z = out if any(module is m for m in maxmin_inputs) else args[0]
        kept.append((module, z if create_graph else z.detach(), out))

    modules = [*maxmin_inputs, *(m for m in model.modules()
                                 if isinstance(m, GatedAttention | ClassAttention))]
    handles = [m.register_forward_hook(hook) for m in modules]
    if not create_graph:
        handles.append(model.embed.register_forward_hook(
            lambda module, args, out: tokens.append(out)))
    x = x.detach().requires_grad_(True)
    try:
        with torch.enable_grad():
            logits = model(x)
            eye = torch.eye(logits.shape[1], dtype=x.dtype, device=x.device)
            wrong = eye[:, None, :] if targets is None else eye[targets.mT]
            E = eye[y][None] - wrong  # (K, B, classes)
            grads = torch.autograd.grad(logits, [x, *(out for _, _, out in kept),
                                                 *tokens],
                                        grad_outputs=E, is_grads_batched=True,
                                        create_graph=create_graph)
    finally:
        for h in handles:
            h.remove()
    sites = [Site(m, z, g) for (m, z, _), g in zip(
        kept, grads[1:1 + len(kept)], strict=True)]
    if not create_graph:
        logits = logits.detach()
    return (logits, grads[0].flatten(2).norm(dim=-1), sites,
            grads[-1] if tokens else None)


class MarginCertificate:
    """``margin`` on a batch: one forward pass and one batched backward pass,
    then the certificate at any ``ε`` and the radius from them. Never weaker
    than ``ball`` (its bound is one of the cuts), hence than ``global``.

    Args:
        chain: the model's :func:`~lipvit.certify.global_bound.proven_chain`.
        model: a hybrid ViT or CaiT (certify a float64 copy, in eval mode).
        x: images ``(B, C, S, S)``; ``y``: labels ``(B,)``.
        targets: the wrong classes to bound, ``(B, K)`` (default: every class;
            ``y``'s own margin is ``+inf``).
        differentiable: keep the drops differentiable in the model's weights
            (training, :mod:`lipvit.training.margin_loss`): ``ball``'s chain
            then takes its cheaper bounds (``exact=False``, never smaller),
            and the operator norms the bounds read (the stem's, ``‖W₁‖``,
            ``‖W_a − W_b‖``) enter as constants of the current weights.
    """

    def __init__(self, chain: Chain, model: nn.Module, x: Tensor, y: Tensor, *,
                 targets: Tensor | None = None, differentiable: bool = False):
        self.chain, self.model, self.differentiable = chain, model, differentiable
        logits, self.gx_norm, self.sites, self.g_tokens = _record(
            model, x, y, targets, differentiable)
        self.x = x
        with torch.no_grad():
            one = torch.ones((), dtype=x.dtype, device=x.device)
            self.correct = logits.argmax(dim=1) == y
            # Each stem convolution's output radius over ε: the convolutions so far.
            self.stem_L, L = [], one
            for conv in model.stem:
                L = L * conv_operator_norm(conv.weight,
                                           conv.parametrizations.weight[0].size)
                self.stem_L.append(L)
            # Each stem pair's own reach per unit input move: ‖W_a[p] − W_b[p]‖.
            self.pair_norms = [_difference_rows(conv.weight) for conv in model.stem]
            self.W1 = {id(m.fc1): spectral_norm(m.fc1.weight) * (1 + 1e-12)
                       for m in model.modules() if isinstance(m, GatedMLP)}
            # ‖W_a − W_b‖ of each map MaxMin reads: its pairs' reach (eq. 11.3b).
            self.V = {id(s.module): _difference_norm(s.module) for s in self.sites
                      if not isinstance(s.module, GatedAttention | ClassAttention)}
        with torch.set_grad_enabled(differentiable):
            self.margins = pair_margins(logits, y)  # (B, classes), +inf at y
            self.pair = pair_constants(model.head.weight, one, y)  # ‖w_y − w_j‖
            if targets is not None:
                self.margins = self.margins.gather(1, targets)  # (B, K)
                self.pair = self.pair.gather(1, targets)
            self.inputs = [s.z for s in self.sites
                           if isinstance(s.module, GatedAttention | ClassAttention)]
            # The CaiT's head reads the class token: its pairs' moves (eq. 11.11).
            self._pairs = (self._pair_directions()
                           if isinstance(chain.maps[-1], ClassAttention) else None)
            self._soft0 = {}  # self-attention's softmax-path bound at the point
            for k, (attn, t) in enumerate(zip(chain.maps, self.inputs, strict=True)):
                if isinstance(attn, GatedAttention):
                    zero = torch.zeros_like(t[:, 0, 0])
                    self._soft0[k] = self._self_ball(k, t, zero).soft

    def _pair_directions(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """A CaiT's head MaxMin's pair differences read off the class token, ``v_p =
        W₁[p] − W₁[p + P]`` ``(P, H·d_v)``, ``‖∇_X (v_p · c)‖`` ``(P, B)`` at
        class attention's clean input ``X`` (eq. 11.11), their Gram matrix
        ``∇_X (v_p · c) · ∇_X (v_q · c)`` ``(B, P, P)`` (eq. 11.12) and the
        sign of each pair's difference ``d_p`` at the point ``(P, B)``, 0
        where its float error could flip it: a pair lowers the margin only
        where ``|d_p|`` shrinks, so its remainder is needed on one side
        (both where 0)."""
        W1 = self.model.head_hidden.weight  # (2P, H·d_v)
        a, b = W1.chunk(2, dim=0)
        v = a - b
        X = self.inputs[-1]
        if not self.differentiable:
            X = X.detach().requires_grad_(True)
        with torch.enable_grad():
            c = self.chain.maps[-1](X)  # (B, H·d_v)
            (grad,) = torch.autograd.grad(c, X, grad_outputs=v[:, None].expand(
                -1, *c.shape).contiguous(), is_grads_batched=True,
                create_graph=self.differentiable)
        grad = grad.flatten(2)  # (P, B, N·D)
        gram = torch.einsum("pbi,qbi->bpq", grad, grad)
        # The pairs' pre-activations as the forward pass recorded them.
        z = next(s.z for s in self.sites if s.module is self.model.head_hidden)
        z_a, z_b = z.detach().chunk(2, dim=-1)  # (B, P) each
        side = torch.where(lowered_gap(z_a, z_b) > 0, (z_a - z_b).sign(), 0.0).mT
        return v, grad.norm(dim=-1) * (1 + 1e-12), gram, side  # side (P, B)

    def _self_ball(self, k: int, t: Tensor, delta: Tensor):
        attn = self.chain.maps[k]
        W_q, W_k, W_v, _ = attn.weights()
        return self_ball(t, delta, W_q, W_k, W_v, self.chain.norms[k], attn.pos_bias,
                         attn.radius)

    def _class_term(self, site: Site, delta: Tensor) -> tuple[Tensor, Tensor | None]:
        """Class attention's ``−uᵀ r`` ``(K, B)`` on the ball of radius
        ``delta`` ``(B,)`` around its input, the smaller of (11.5)·δ (capped by
        ``‖u‖`` times twice the map's constant on the ball) and (11.9)–(11.10);
        and, on a CaiT whose head reads the class token, each head pair's
        remainder along ``sign(d_p) v_p`` ``(P, B)`` (both signs where
        ``d_p`` may be 0), (11.9)–(11.10): what ``Δ(v_p · c)`` adds to its
        first-order part ``∇_X(v_p · c) · ΔX`` towards shrinking ``|d_p|`` (eq.
        11.11; ``None`` otherwise). One ball, and one second-order bound for
        the margins and the pairs together."""
        attn, norms, t = self.chain.maps[-1], self.chain.norms[-1], site.z
        K = site.g.shape[0]
        g_norm = site.g.flatten(2).norm(dim=-1)  # (K, B)
        ball = class_ball(t, delta, attn.a(), attn.value, norms, attn.pos_bias,
                          attn.radius)
        V = class_attention_variation(t, delta, site.g, attn.a(), attn.value,
                                      ball.P0, ball.P_bar, ball.P_low, attn.radius)
        L_loc = sum(class_attention_paths(norms, ball.P_bar, ball.soft))  # (10.5)
        u, both = site.g, torch.zeros_like(g_norm, dtype=torch.bool)
        if self._pairs is not None:
            # Along sign(d_p) v_p: what lowers |d_p| (both sides where d_p is 0).
            side = self._pairs[3]  # (P, B)
            v = self._pairs[0][:, None] * torch.where(side == 0, 1.0, side)[..., None]
            u, both = torch.cat([u, v]), torch.cat([both, side == 0])
        second = class_attention_remainder(t, delta, u, attn.a(), attn.value, ball.P0,
                                           ball.P_bar, ball.P_low, attn.radius, both)
        rest = torch.minimum(torch.minimum(V, 2 * g_norm * L_loc) * delta, second[:K])
        if self._pairs is None:
            return rest, None
        return rest, second[K:] * (1 + 1e-12)

    def _self_term(self, k: int, site: Site, delta: Tensor) -> Tensor:
        """``|g_kᵀ r_k| ≤ V_k δ_k``, ``(K, B)``, of self-attention map ``k``
        (eq. 11.2, 11.4), ``V_k`` capped by ``‖g_k‖`` times twice the map's
        constant on the ball (``‖J′ − J‖ ≤ ‖J′‖ + ‖J‖``)."""
        attn, norms, t = self.chain.maps[k], self.chain.norms[k], site.z
        g_norm = site.g.flatten(2).norm(dim=-1)  # (K, B)
        ball = self._self_ball(k, t, delta)
        dJ = self_attention_variation(ball.P0, ball.P_bar, ball.P_low, ball.soft,
                                      self._soft0[k],
                                      projection_moves(t, delta, attn.radius),
                                      norms.value, norms.out)
        L_loc = self_local(ball, norms)
        dJ = torch.minimum(dJ, 2 * torch.minimum(L_loc, self.chain.L_A[k]))
        return g_norm * (self.chain.gate[k] / self.chain.scale[k]) * dJ * delta

    def _terms(self, eps: Tensor, bc: BallChain) -> tuple[list[Tensor], list]:
        """Per site in forward order, its remainder bound ``(K, B)`` (eq.
        11.3–11.5; the sites' input radii from ``ball``'s chain ``bc``) and the
        cut after it (``δ_out ‖g_out‖``, eq. 11.8; ``None`` where not taken)."""
        rest, cuts, attn_k, pair_rest = [], [], 0, None
        for site in self.sites:
            module, g_norm = site.module, site.g.flatten(2).norm(dim=-1)
            if any(module is conv for conv in self.model.stem):
                i = [conv is module for conv in self.model.stem].index(True)
                delta = eps * self.stem_L[i]
                reach = pair_radius(delta, eps * (self.stem_L[i - 1] if i else 1),
                                    self.V[id(module)])
                rest.append(maxmin_remainder(site.z, site.g, reach, -3))
                cuts.append(delta * g_norm)  # MaxMin keeps both norms
            elif isinstance(module, GatedAttention | ClassAttention):
                delta = eps * bc.L_in[attn_k]
                if isinstance(module, ClassAttention):  # the chain's last map
                    r, pair_rest = self._class_term(site, delta)
                    class_delta = delta
                else:
                    r = self._self_term(attn_k, site, delta)
                rest.append(r)
                cuts.append(eps * bc.L_mid[attn_k] * g_norm)
                attn_k += 1
            elif module is self.model.head_hidden:
                delta = eps * bc.L  # the features' radius, the head MaxMin's input's
                r = maxmin_remainder(site.z, site.g,
                                     pair_radius(delta, delta, self.V[id(module)]), -1)
                if pair_rest is not None:  # the class token's pairs (eq. 11.11–12)
                    _, grad_norm, gram, _ = self._pairs
                    moves = (class_delta * grad_norm + pair_rest) * (1 + 1e-12)
                    r = torch.minimum(r, capped_maxmin_remainder(site.z, site.g,
                                                                 moves.mT, -1))
                    r = torch.minimum(r, coupled_maxmin_remainder(
                        site.z, site.g, gram, grad_norm.mT, pair_rest.mT,
                        class_delta, -1))
                rest.append(r)
                cuts.append(None)  # after it: ``ball``'s bound, in :meth:`drops`
            else:  # a CaiT block's MLP, after the attention map just passed
                delta_in = eps * bc.L_mid[attn_k - 1]
                reach = pair_radius(self.W1[id(module)] * delta_in, delta_in,
                                    self.V[id(module)])
                rest.append(maxmin_remainder(site.z, site.g, reach, -1))
                cuts.append(None)
        return rest, cuts

    def terms(self, eps: Tensor) -> tuple[Tensor, list[Tensor], list, Tensor]:
        """The pieces :meth:`drops` combines at ``eps`` ``(B,)``: the
        first-order term ``ε ‖∇ₓ m_j‖`` ``(K, B)``, each site's remainder bound
        and cut (:meth:`_terms`) and ``ball``'s drop ``ε L(x, ε) ‖w_y − w_j‖``
        ``(K, B)``."""
        with torch.set_grad_enabled(self.differentiable):
            # Training reads ball's cheaper bounds (never smaller).
            bc = ball_chain(self.chain, self.inputs, eps, exact=not self.differentiable)
            rest, cuts = self._terms(eps, bc)
            ball = (eps * bc.L)[:, None] * self.pair  # (B, K)
            return eps * self.gx_norm, rest, cuts, ball.mT

    def _chord_linear(self, eps: Tensor, theta: float
                      ) -> tuple[Tensor, list[Tensor], list[tuple]]:
        """Eq. (11.13)'s linear part: the stem's MaxMin pairs linearised by
        chord slopes (:func:`.variation.chord_slopes` on ``theta`` of each
        pair's own reach ``‖v_p‖ δ_in``), the first-order term ``ε ‖∇̃ₓ
        m_j‖`` ``(K, B)``, per stem MaxMin the cut after it (``δ ‖g̃‖`` at its
        output, ``(K, B)``) and the arguments of
        :func:`.variation.chord_remainder` (``κ`` ``(K, B, P)``, ``d, s`` ``(B,
        P)``, ``R`` ``(B,)``)."""
        stem = self.sites[:len(self.model.stem)]  # the stem's sites come first
        d, slopes, delta_in, outs = [], [], [], []
        for i, site in enumerate(stem):
            a, b = site.z.chunk(2, dim=1)  # (B, c, S', S') each
            d.append(a - b)
            delta_in.append(eps * (self.stem_L[i - 1] if i else 1))
            reach = theta * self.pair_norms[i][:, None, None] * delta_in[i][
                :, None, None, None]
            slopes.append(chord_slopes(d[i], reach))

        def activation(z: Tensor, i: int) -> Tensor:
            outs.append(chord_max_min(z, slopes[i]))
            return outs[-1]

        x = self.x.detach().requires_grad_(True)
        with torch.enable_grad():
            t = self.model.tokens(x, activation)
            grads = torch.autograd.grad(t, [x, *outs], grad_outputs=self.g_tokens,
                                        is_grads_batched=True)
        pairs, cuts = [], []
        for i, (site, s, g) in enumerate(zip(stem, slopes, grads[1:], strict=True)):
            g1, g2 = g.chunk(2, dim=2)  # (K, B, c, S', S') at max and min
            R = 2**0.5 * pair_radius(eps * self.stem_L[i], delta_in[i],
                                     self.V[id(site.module)])  # Σ Δd_p² ≤ R²
            pairs.append(((g1 - g2).flatten(2), d[i].flatten(1), s.flatten(1), R))
            cuts.append(eps * self.stem_L[i] * g.flatten(2).norm(dim=-1))
        return eps * grads[0].flatten(2).norm(dim=-1), cuts, pairs

    def chord_terms(self, eps: Tensor, theta: float = CHORD_REACHES[0]
                    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Eq. (11.13): the stem's MaxMin pairs linearised by their chords
        instead of their gradients at the point (:meth:`_chord_linear`): the
        first-order term ``ε ‖∇̃ₓ m_j‖`` ``(K, B)``, and per stem MaxMin its
        two-sided remainder bound (:func:`.variation.chord_remainder`) and
        the cut after it,
        ``(K, B)`` each. The maps after the stem keep their exact Jacobians:
        their gradients, remainders and cuts are :meth:`terms`'."""
        first, cuts, pairs = self._chord_linear(eps, theta)
        return first, [self._chord_remainder(*p, None) for p in pairs], cuts

    @staticmethod
    def _chord_remainder(kappa: Tensor, d: Tensor, s: Tensor, R: Tensor,
                         need: Tensor | None) -> Tensor:
        """:func:`.variation.chord_remainder` at the points ``need`` ``(B,)``
        (every point if ``None``), ``+inf`` elsewhere; ``(K, B)``."""
        if need is None:
            return chord_remainder(kappa, d.expand_as(kappa), s.expand_as(kappa), R)
        out = torch.full_like(kappa[..., 0], torch.inf)
        if need.any():
            k = kappa[:, need]
            out[:, need] = chord_remainder(k, d[need].expand_as(k),
                                           s[need].expand_as(k), R[need])
        return out

    def drops(self, eps: Tensor) -> tuple[Tensor, Tensor]:
        """``(B, K)`` bounds of each margin's drop on the ε-ball, ``margin``'s
        (:func:`least_cut` of :meth:`terms`, and of the same terms with the
        stem's from :meth:`chord_terms` at each of
        :data:`.variation.CHORD_REACHES`, unless differentiable) and
        ``ball``'s ``ε L(x, ε) ‖w_y − w_j‖`` (the last cut), both rounded up.
        ``eps`` ``(B,)``.

        The chords' remainders are computed only where they can change
        :meth:`certified`: at correctly classified points that the gradient's
        linearisation leaves uncertified and where every margin is certified
        by it or by the chords' cut with the stem's remainders taken as 0.
        Elsewhere they are ``+inf`` (the bound stays a bound, and no point's
        verdict changes)."""
        first, rest, cuts, ball = self.terms(eps)
        best = least_cut(first, rest, cuts, ball)
        M = self.margins.mT  # (K, B)
        for theta in () if self.differentiable else CHORD_REACHES:
            # (training reads the larger bound)
            chord, stem_cuts, pairs = self._chord_linear(eps, theta)
            n = len(pairs)
            lowest = least_cut(chord, [torch.zeros_like(chord)] * n + rest[n:],
                               [*stem_cuts, *cuts[n:]], ball)
            passes = M > best * (1 + ROUNDING)
            need = self.correct & ~passes.all(dim=0) & (
                passes | (M > lowest * (1 + ROUNDING))).all(dim=0)
            stem_rest = [self._chord_remainder(*p, need) for p in pairs]
            best = torch.minimum(best, least_cut(chord, [*stem_rest, *rest[n:]],
                                                 [*stem_cuts, *cuts[n:]], ball))
        return best.mT * (1 + ROUNDING), ball.mT * (1 + ROUNDING)

    def certified(self, eps: Tensor | float) -> Tensor:
        """``(B,)`` bool: every wrong class's margin (rounded down) exceeds its
        drop bound."""
        eps = torch.as_tensor(eps, dtype=self.margins.dtype,
                              device=self.margins.device).expand(self.correct.shape[0])
        own, _ = self.drops(eps)
        return (self.margins > own).all(dim=1) & self.correct

    @torch.no_grad()
    def radius(self, *, rtol: float = 1e-3, certified_at=(),
               eps0: float = 1e-4) -> Tensor:
        """Certified radius per point, ``(B,)``, by bisection on
        :meth:`certified` (sound: certified at the value returned). Each
        term's bound over ``ε`` grows with ``ε`` (a cut's radius, a
        remainder's superlinear growth), so a margin's drop at ``ε`` is at
        least ``ε`` times its drop at ``eps0`` over ``eps0``: the search stays
        below ``min_j m_j eps0 / drop_j(eps0)`` (a bracket, not a claim: the
        result is certified wherever the bracket lies)."""
        zero = torch.zeros_like(self.margins[:, 0])
        own, _ = self.drops(torch.full_like(zero, eps0))
        top = (self.margins * eps0 / own.clamp_min(1e-300)).amin(dim=1)
        top = torch.where(self.correct & torch.isfinite(top), top.clamp_min(0), zero)
        return bisect_radius(self.certified, top > 0, dtype=top.dtype, rtol=rtol,
                             certified_at=certified_at, bracket=(zero, top))


def least_cut(first: Tensor, rest: list[Tensor], cuts: list, ball: Tensor) -> Tensor:
    """Eq. (11.8): each margin's drop bound ``(K, B)``, the least over the
    chain's cuts: the first-order term ``first`` plus every remainder in
    ``rest``, or a cut's ``δ_out ‖g_out‖`` (``cuts``, in forward order,
    ``None`` where not taken) plus the remainders after it, or ``ball``'s
    drop (the cut after the last map)."""
    after = torch.zeros_like(rest[0])  # the remainders after the current site
    best = ball
    for r, cut in zip(reversed(rest), reversed(cuts), strict=True):
        if cut is not None:
            best = torch.minimum(best, cut + after)
        after = after + r
    return torch.minimum(best, first + after)


def _difference_rows(weight: Tensor) -> Tensor:
    """``‖W_a[p] − W_b[p]‖`` per output pair ``p`` of a convolution whose
    outputs MaxMin pairs as halves ``a, b``, ``(P,)``: how far pair ``p``'s
    difference moves per unit move of the input (eq. 11.13)."""
    a, b = weight.chunk(2, dim=0)
    return (a - b).flatten(1).norm(dim=1)


def _difference_norm(layer: nn.Module) -> Tensor:
    """``‖W_a − W_b‖`` (rounded up) of a linear map or stride-1 convolution
    whose outputs MaxMin pairs as halves ``a, b`` (eq. 11.3b)."""
    a, b = layer.weight.chunk(2, dim=0)
    if a.ndim == 4:
        return conv_operator_norm(a - b, layer.parametrizations.weight[0].size) * (
            1 + 1e-12)
    return spectral_norm(a - b) * (1 + 1e-12)


def margin_certificate(model: nn.Module, x: Tensor, y: Tensor) -> MarginCertificate:
    """:class:`MarginCertificate` of ``model`` (a float64 hybrid ViT or CaiT in
    eval mode) at images ``x`` with labels ``y``."""
    return MarginCertificate(proven_chain(model), model, x, y)
