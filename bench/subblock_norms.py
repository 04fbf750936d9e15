"""Exact clean-point sub-block Jacobian norms against the product bounds (issue 12).

For the attention sub-block ``s ↦ s + attn(N(s))`` of every block, on the test
points of a checkpoint (the same seeded subsample as ``lipvit certify --n``):
the product bound ``1 + ‖J_a‖ ‖J_N‖``, the structured bound
(:func:`lipvit.certify.subblock.subblock_bound`, LayerProject or LayerNorm
blocks, softmax path by rows or by the weighted factorisation of
:mod:`lipvit.certify.softmax_norm`; both are what the ``taylor`` budget
recursion uses for large models), and the exact norm that
:func:`lipvit.certify.sites.subblock_norms` computes from the whole
``(N·D) × (N·D)`` Jacobian (docs/taylor.md §8); ranges over the points. For a
standard model also the next block's LayerNorm composed with the feed-forward
sub-block, exact (``SubBlockNorms.into``) against the product of the norms.

With ``--radii``, also ``taylor``'s radius of each correctly classified point
as the certificate computes it and with the exact norms at every size (the
dense mode's size limit :data:`lipvit.certify.sites.EXACT_MAX` lifted): what
the structured bounds cost in radius, and the time of each.

Usage::

    python bench/subblock_norms.py --ckpt msvp.pt --n 20 [--radii]
"""

from __future__ import annotations

import argparse
import time

import torch
from _points import float64_points
from lipvit.certify import sites
from lipvit.certify.local import (
    layer_project_local_lipschitz,
    layernorm_local_lipschitz,
)
from lipvit.certify.network import network_bound
from lipvit.certify.remainders import attention_jacobian_norm
from lipvit.certify.sites import forward, subblock_norms
from lipvit.certify.subblock import subblock_bound, with_softmax_gains
from lipvit.certify.taylor import taylor_bound


def _range(t: torch.Tensor) -> str:
    return f"{t.min():.4g}–{t.max():.4g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--radii", action="store_true")
    args = parser.parse_args()
    model, x, y, _ = float64_points(args.ckpt, args.n)
    if args.radii:
        radii(model, x, y)
    with torch.no_grad():
        clean = forward(model, x)[1]
        exact = subblock_norms(model, clean, max_size=x[0].numel() * 10**6)
        terms = network_bound(model, x, "lofast").attention_terms
        zero = torch.zeros(len(x), dtype=x.dtype)
        print(f"{args.ckpt}: n={len(x)}, N·D={clean.stream[0][0].numel()}")
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
        if model.config.family == "lipschitz":
            return
        print("\nThe next LayerNorm through the feed-forward sub-block (token-wise):")
        print("| block | exact ‖J_N J_ff‖ | product ‖J_N‖ λ_ff |")
        print("|---|---|---|")
        for k, nxt in enumerate(model.blocks[1:]):
            L_N = layernorm_local_lipschitz(clean.stream[2 * k + 2], nxt.norm1.weight,
                                            nxt.norm1.eps, zero)
            print(f"| {k} | {_range(exact.into[k].amax(-1))} "
                  f"| {_range(L_N * exact.mlp[:, k].amax(-1))} |")


def radii(model, x: torch.Tensor, y: torch.Tensor) -> None:
    """``taylor``'s radii with the certificate's sub-block norms and with exact
    ones at every size (one thread)."""
    torch.set_num_threads(1)
    right = model(x).argmax(1) == y
    x, y = x[right], y[right]
    limit = sites.EXACT_MAX
    try:
        for name, size in (("as certified", limit), ("exact sub-blocks", 10**9)):
            sites.EXACT_MAX = size
            start = time.process_time()
            r = taylor_bound(model, x, y).radius()
            print(f"{name}: radii {' '.join(f'{v:.3g}' for v in r.tolist())} "
                  f"(median {r.median():.3g}), {time.process_time() - start:.0f} s CPU")
    finally:
        sites.EXACT_MAX = limit


if __name__ == "__main__":
    main()
