"""The attention's remainder bound against what PGD finds (docs/taylor.md §7).

For every block's bare attention at its clean input (the test points of a
checkpoint, as ``lipvit certify --n`` picks them) and each input budget β:
``attention_remainder``'s bound with the terms LoFAST computes, the same with
the softmax gains ``taylor`` adds (rows, the logits' variance per head and
over all heads; ``with_softmax_gains``), and the largest remainder
``‖a(p + Δ) − a(p) − J_a Δ‖_F`` PGD finds over ``‖Δ‖_F ≤ β`` (a lower bound
of the true one); medians over the points of each bound / PGD.

Usage (the table is also written to ``--out``/attention_remainder.json)::

    python bench/studies/attention_remainder.py --ckpt msvp.pt --n 5 \\
        --beta 1e-3 1e-2 0.1
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import torch
from lipvit.analysis.pgd import pgd_deviation
from lipvit.certify.attention import attention, bound_weights
from lipvit.certify.lofast.network import network_bound
from lipvit.certify.taylor.forward import forward
from lipvit.certify.taylor.remainders import attention_remainder
from lipvit.certify.taylor.subblock import with_softmax_gains

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: helpers
from _out import add_out, write_json  # noqa: E402
from _points import float64_points  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--beta", type=float, nargs="+", default=[1e-3, 1e-2, 0.1])
    parser.add_argument("--steps", type=int, default=100)
    add_out(parser, __file__)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, x, _, _ = float64_points(args.ckpt, args.n)
    with torch.no_grad():
        clean = forward(model, x)[1]
    chain = network_bound(model, x, "lofast").attention_terms
    print(f"{args.ckpt}: n={len(x)}, {platform.machine()}, {platform.node()}, "
          f"{datetime.date.today()}; medians over the points")
    record = {"ckpt": args.ckpt, "n": len(x), "machine": platform.machine(),
              "node": platform.node(), "date": str(datetime.date.today()),
              "args": vars(args), "rows": []}
    print("| block | β | bound / PGD | with the softmax gains / PGD | PGD remainder |")
    print("|---|---|---|---|---|")
    for k, block in enumerate(model.blocks):
        p = clean.attn_in[k]
        W = bound_weights(block.attn)

        def bare(X, W=W):
            return attention(X, *W, residual=False)

        def remainder(U, p=p, bare=bare):  # batched: row r·B + b moves from p[b]
            p = p.repeat(len(U) // len(p), 1, 1)  # pgd_deviation's restarts
            return bare(U) - bare(p) - torch.func.jvp(bare, (p,), (U - p,))[1]

        gains = with_softmax_gains(block, p, chain[k])
        for beta in args.beta:
            b = torch.full((len(x),), beta, dtype=torch.float64)
            found = pgd_deviation(remainder, p, beta, steps=args.steps, restarts=2)
            plain = attention_remainder(chain[k], b) / found
            tight = attention_remainder(gains, b) / found
            print(f"| {k} | {beta:g} | {plain.median():.3g} | {tight.median():.3g} "
                  f"| {found.median():.3g} |")
            record["rows"].append({
                "block": k, "beta": beta, "bound_over_pgd": plain.median(),
                "with_softmax_gains_over_pgd": tight.median(),
                "pgd_remainder": found.median()})
    write_json(args.out, __file__, record)


if __name__ == "__main__":
    main()
