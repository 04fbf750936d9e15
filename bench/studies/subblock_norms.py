"""Exact clean-point sub-block Jacobian norms against the product bounds.

For the attention sub-block ``s ↦ s + attn(N(s))`` of every block, on the test
points of a checkpoint (the same seeded subsample as ``lipvit certify --n``):
the product bound ``1 + ‖J_a‖ ‖J_N‖``, the structured bound
(:func:`lipvit.certify.taylor.subblock.subblock_bound`, LayerProject or LayerNorm
blocks, softmax path by rows or by the weighted factorisation of
:mod:`lipvit.certify.taylor.softmax_norm`; both are what the ``taylor`` budget
recursion uses for large models), and the exact norm that
:func:`lipvit.certify.taylor.subblock.subblock_norms` computes from the whole
``(N·D) × (N·D)`` Jacobian (docs/taylor.md §8); ranges over the points. For a
standard model also the next block's LayerNorm composed with the feed-forward
sub-block, exact (``SubBlockNorms.into``) against the product of the norms.

With ``--paths``, the two paths the structured bound adds (the triangle
inequality), each against its own exact norm from dense Jacobians (one
``(N·D) × (N·D)`` matrix per point and block): the residual value path ``‖I +
K J_N‖`` (attention matrices held at the clean point) and the softmax path
``‖S J_N‖``, and the sum of the two exact norms over the exact sub-block norm:
the least any bound of the form (value path's bound + softmax path's bound)
can be.

With ``--radii``, also ``taylor``'s radius of each correctly classified point
as the certificate computes it and with the exact norms at every size (the
dense mode's size limit :data:`lipvit.certify.taylor.subblock.EXACT_MAX` lifted): what
the structured bounds cost in radius, and the time of each.

The tables also go to ``--out``/subblock_norms.json (each range as its
smallest and largest value).

Usage::

    python bench/studies/subblock_norms.py --ckpt msvp.pt --n 20 [--radii] [--paths]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from lipvit.certify.attention import bound_weights, value_output
from lipvit.certify.local import (
    layer_project_local_lipschitz,
    layernorm_local_lipschitz,
)
from lipvit.certify.lofast.layer import LoFASTTerms
from lipvit.certify.lofast.network import network_bound
from lipvit.certify.taylor import subblock
from lipvit.certify.taylor.certificate import taylor_bound
from lipvit.certify.taylor.forward import forward
from lipvit.certify.taylor.remainders import attention_jacobian_norm
from lipvit.certify.taylor.subblock import (
    subblock_bound,
    subblock_norms,
    subblock_parts,
    with_softmax_gains,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: helpers
from _out import add_out, write_json  # noqa: E402
from _points import float64_points  # noqa: E402


def _range(t: torch.Tensor) -> str:
    return f"{t.min():.4g}–{t.max():.4g}"


def _span(t: torch.Tensor) -> list[float]:
    """``[min, max]`` of ``t``: what :func:`_range` prints."""
    return [float(t.min()), float(t.max())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--radii", action="store_true")
    parser.add_argument("--paths", action="store_true")
    add_out(parser, __file__)
    args = parser.parse_args()
    model, x, y, _ = float64_points(args.ckpt, args.n)
    record: dict = {"args": vars(args)}
    if args.radii:
        record["radii"] = radii(model, x, y)
    if args.paths:
        record["paths"] = paths(model, x)
    _norms(args, model, x, record)
    write_json(args.out, __file__, record)


def _norms(args, model, x: torch.Tensor, record: dict) -> None:
    """The main tables (module docstring), printed and put into ``record``."""
    with torch.no_grad():
        clean = forward(model, x)[1]
        exact = subblock_norms(model, clean, max_size=x[0].numel() * 10**6)
        terms = network_bound(model, x, "lofast").attention_terms
        zero = torch.zeros(len(x), dtype=x.dtype)
        print(f"{args.ckpt}: n={len(x)}, N·D={clean.stream[0][0].numel()}")
        record.update(ckpt=args.ckpt, n=len(x), ND=clean.stream[0][0].numel(),
                      attention=[])
        print("| block | product bound 1 + ‖J_a‖‖J_N‖ | structured | exact ‖J_sub‖ "
              "| product / exact | structured / exact |")
        print("|---|---|---|---|---|---|")
        for k, block in enumerate(model.blocks):
            X, norm, ex = clean.stream[2 * k], block.norm1, exact.attn[:, k]
            if model.config.family == "lipschitz":
                L_N = layer_project_local_lipschitz(X, norm.radius, zero, norm.mode)
            else:
                L_N = layernorm_local_lipschitz(X, norm.weight, norm.eps, zero)
            product = 1 + attention_jacobian_norm(terms[k]) * L_N
            gains = with_softmax_gains(block, clean.attn_in[k], terms[k])
            bound = subblock_bound(block, X, gains)
            print(f"| {k} | {_range(product)} | {_range(bound)} | {_range(ex)} "
                  f"| {_range(product / ex)} | {_range(bound / ex)} |")
            record["attention"].append({
                "block": k, "product": _span(product), "structured": _span(bound),
                "exact": _span(ex), "product_over_exact": _span(product / ex),
                "structured_over_exact": _span(bound / ex)})
        if model.config.family == "lipschitz":
            return
        print("\nThe next LayerNorm through the feed-forward sub-block (token-wise):")
        print("| block | exact ‖J_N J_ff‖ | product ‖J_N‖ λ_ff |")
        print("|---|---|---|")
        record["norm_into_mlp"] = []
        for k, nxt in enumerate(model.blocks[1:]):
            L_N = layernorm_local_lipschitz(clean.stream[2 * k + 2], nxt.norm1.weight,
                                            nxt.norm1.eps, zero)
            print(f"| {k} | {_range(exact.into[k].amax(-1))} "
                  f"| {_range(L_N * exact.mlp[:, k].amax(-1))} |")
            record["norm_into_mlp"].append({
                "block": k, "exact": _span(exact.into[k].amax(-1)),
                "product": _span(L_N * exact.mlp[:, k].amax(-1))})


def paths(model, x: torch.Tensor) -> list[dict]:
    """The value and softmax paths' bounds against their exact norms, dense
    (printed, and returned as ranges)."""
    with torch.no_grad():
        clean = forward(model, x)[1]
        terms = network_bound(model, x, "lofast").attention_terms
    print("| block | value bound / exact | softmax bound / exact "
          "| exact value + exact softmax, over exact | bound / exact |")
    print("|---|---|---|---|---|")
    rows = []
    for k, block in enumerate(model.blocks):
        X = clean.stream[2 * k]
        with torch.no_grad():
            bound = subblock_parts(block, X, with_softmax_gains(
                block, clean.attn_in[k], terms[k]))
        exact = torch.stack([_exact_paths(block, X[i], terms[k], i)
                             for i in range(len(x))], 1)  # (3, B)
        print(f"| {k} | {_range(bound.value / exact[0])} "
              f"| {_range(bound.softmax / exact[1])} "
              f"| {_range((exact[0] + exact[1]) / exact[2])} "
              f"| {_range((bound.value + bound.softmax) / exact[2])} |")
        rows.append({
            "block": k, "value_bound_over_exact": _span(bound.value / exact[0]),
            "softmax_bound_over_exact": _span(bound.softmax / exact[1]),
            "exact_value_plus_softmax_over_exact": _span(
                (exact[0] + exact[1]) / exact[2]),
            "bound_over_exact": _span((bound.value + bound.softmax) / exact[2])})
    return rows


def _exact_paths(block, X: torch.Tensor, terms: LoFASTTerms, i: int) -> torch.Tensor:
    """Exact ``‖I + K J_N‖``, ``‖S J_N‖`` and ``‖I + J_a J_N‖`` of sample ``i``
    (``X`` its ``(N, D)`` block input) from dense Jacobians."""
    N, D = X.shape
    jac = torch.autograd.functional.jacobian
    J_N = jac(lambda s: block.norm1(s[None])[0], X).reshape(N * D, N * D)
    J_a = jac(lambda s: block.attn(block.norm1(s[None]))[0], X).reshape(N * D, N * D)
    P = torch.softmax(terms.logits[i], -1)  # (H, N, N)
    W_vo = value_output(*bound_weights(block.attn)[2:])  # (H, D, D)
    K = sum(torch.kron(P_h.contiguous(), W_h.T.contiguous())
            for P_h, W_h in zip(P, W_vo, strict=True))
    value = K @ J_N  # row-major vec(P Γ W) = (P ⊗ Wᵀ) vec(Γ)
    eye = torch.eye(N * D, dtype=X.dtype)
    return torch.stack([torch.linalg.matrix_norm(m, 2)
                        for m in (eye + value, J_a - value, eye + J_a)])


def radii(model, x: torch.Tensor, y: torch.Tensor) -> list[dict]:
    """``taylor``'s radii with the certificate's sub-block norms and with exact
    ones at every size (one thread), printed and returned."""
    torch.set_num_threads(1)
    right = model(x).argmax(1) == y
    x, y = x[right], y[right]
    limit = subblock.EXACT_MAX
    rows = []
    try:
        for name, size in (("as certified", limit), ("exact sub-blocks", 10**9)):
            subblock.EXACT_MAX = size
            start = time.process_time()
            r = taylor_bound(model, x, y).radius()
            seconds = time.process_time() - start
            print(f"{name}: radii {' '.join(f'{v:.3g}' for v in r.tolist())} "
                  f"(median {r.median():.3g}), {seconds:.0f} s CPU")
            rows.append({"norms": name, "radii": r.tolist(),
                         "median": float(r.median()), "cpu_s": seconds})
    finally:
        subblock.EXACT_MAX = limit
    return rows


if __name__ == "__main__":
    main()
