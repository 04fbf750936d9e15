"""How far the taylor certificate's relaxations can go: the sound radius against
an **oracle** (not a bound) whose stream budgets are first order.

The certified radius of ``taylor`` is limited by two kinds of slack: the stream
budgets ``β`` (norm bounds, docs/taylor.md §8), and the per-unit relaxations
of the ReLU flips (the chords, §5), which no budget removes. This bench
measures the first kind's share: it re-runs the radius search with every
stream budget replaced by ``min(β, c‖J_{m←x}‖ε)`` (whole and per token) and the
propagated remainders ``acc`` set to zero — the budgets of a network that is
linear up to ``c`` between the image and each stream state. PGD finds the
stream of the digits lipschitz model moving by ``‖J_{m←x}‖ε`` to within 2 %
at the certified radius, so ``c = 1.2`` is an optimistic, **unsound** stand-in
for the best budgets any method could prove. What the oracle leaves is the
chords' and the first-order term's share.

With ``--radius-json`` (the JSON of ``lipvit attack --radius`` on the same
checkpoint and ``--n``), both radii are also compared with the attack radius,
point by point (joined on the test-set index).

The tables also go to ``--out``/taylor_ceiling.json.

Usage::

    python bench/studies/taylor_ceiling.py --ckpt lip.pt --n 20 \\
        --radius-json radius.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from lipvit.analysis.pgd import pgd_deviation
from lipvit.certify.taylor import certificate as taylor
from lipvit.certify.taylor.forward import forward

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: helpers
from _out import add_out, write_json  # noqa: E402
from _points import float64_points  # noqa: E402


@contextmanager
def first_order_budgets(c: float):
    """Within the block, :func:`taylor.taylor_bound`'s stream budgets are the
    oracle's (module docstring): **not** sound."""
    sound = taylor._budget

    def oracle(e, jn, sym, m, acc, chain, acc_token=None):
        b = sound(e, jn, sym, m, acc, chain, acc_token)
        whole = torch.minimum(b.all, c * jn.stream[:, m] * e)
        token = torch.minimum(b.token, c * jn.stream_token[:, m] * e[:, None])
        return taylor.Budget(whole, torch.minimum(token, whole[:, None]),
                             torch.zeros_like(b.acc), torch.zeros_like(b.acc_token))

    taylor._budget = oracle
    try:
        yield
    finally:
        taylor._budget = sound


@contextmanager
def counting_flips(counts: list):
    """Within the block, every call of the certificate's ReLU flip range appends
    the number of units that can change sign, ``(B,)``, to ``counts``."""
    sound = taylor.flip_range

    def counted(z, delta):
        rho = sound(z, delta)
        counts.append((rho > 0).flatten(1).sum(1))
        return rho

    taylor.flip_range = counted
    try:
        yield
    finally:
        taylor.flip_range = sound


def _attack_radii(path: str, index: list[int]) -> torch.Tensor:
    """Attack radius per point of ``index`` (NaN where the JSON has none)."""
    with open(path) as f:
        samples = json.load(f)["samples"]
    by_index = {s["index"]: s["radius"] for s in samples if s["radius"] is not None}
    return torch.tensor([by_index.get(i, float("nan")) for i in index],
                        dtype=torch.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--factor", type=float, default=1.2,
                        help="the oracle's budgets: this times the first-order move")
    parser.add_argument("--rtol", type=float, default=1e-2)
    parser.add_argument("--radius-json", help="lipvit attack --radius JSON")
    parser.add_argument("--pgd-steps", type=int, default=30)
    add_out(parser, __file__)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, x, y, index = float64_points(args.ckpt, args.n)
    attack = _attack_radii(args.radius_json, index) if args.radius_json else None

    t0 = time.process_time()
    tb = taylor.taylor_bound(model, x, y)
    sound = tb.radius(rtol=args.rtol)
    t_sound = time.process_time() - t0
    t0 = time.process_time()
    with first_order_budgets(args.factor):
        oracle = taylor.taylor_bound(model, x, y).radius(rtol=args.rtol)
    t_oracle = time.process_time() - t0
    rows = [("taylor (sound)", sound, t_sound),
            (f"oracle budgets {args.factor}x first order (NOT sound)", oracle,
             t_oracle),
            ("first-order limit (estimate)", tb.first_order_radius(), 0.0)]

    print(f"{args.ckpt}: n={len(y)}, rtol={args.rtol}")
    print("| radius | median | median / attack radius | CPU s/sample |")
    print("|---|---|---|---|")
    record = {"ckpt": args.ckpt, "n": len(y), "rtol": args.rtol, "args": vars(args),
              "radii": []}
    for name, r, t in rows:
        ratio, of_attack = "—", None
        if attack is not None:
            ok = attack.isfinite() & (attack > 0)
            of_attack = (r[ok] / attack[ok]).median().item()
            ratio = f"{of_attack:.3f}"
        print(f"| {name} | {r.median().item():.4g} | {ratio} | {t / len(y):.2f} |")
        record["radii"].append({"radius": name, "median": r.median().item(),
                                "median_over_attack": of_attack,
                                "cpu_s_per_sample": t / len(y)})
    _budgets_at(model, x, tb, sound, args.pgd_steps, record)
    write_json(args.out, __file__, record)


def _budgets_at(model, x, tb, r, steps: int, record: dict) -> None:
    """Per stream state, medians over the certified points of the sound budget,
    the first-order move ``‖J_{m←x}‖`` and the largest move PGD finds, each
    over ε = the point's certified radius (printed and put into ``record``)."""
    flips: list = []
    with counting_flips(flips):
        _, budgets, _ = tb.walk(r)
    ok = r > 0
    if flips:  # a lipschitz model: one count per block
        units = tb.jacobians.act_in[0][0].numel()  # N·m ReLU units per block
        print(f"\nReLU units (of {units} per block) that can change sign at the "
              "certified radius, medians per block: "
              + " / ".join(f"{c[ok].median().item():.0f}" for c in flips))
        record["relu_units_per_block"] = units
        record["flippable_units_median"] = [c[ok].median().item() for c in flips]
    print(f"\nAt each point's certified radius ({int(ok.sum())} points), "
          "stream move / ε, medians:")
    print("| state | budget (sound) | first order ‖J‖ | PGD |")
    print("|---|---|---|---|")
    record["certified_points"] = int(ok.sum())
    record["stream_moves"] = []
    for m, b in enumerate(budgets):
        def state(u, m=m):
            return forward(model, u)[1].stream[m].flatten(1)
        found = pgd_deviation(state, x[ok], r[ok], steps=steps, restarts=2)
        first = tb.jacobians.stream[ok, m].median().item()
        print(f"| s_{m} | {(b.all[ok] / r[ok]).median().item():.2f} "
              f"| {first:.2f} | {(found / r[ok]).median().item():.2f} |")
        record["stream_moves"].append({
            "state": f"s_{m}", "budget": (b.all[ok] / r[ok]).median().item(),
            "first_order": first, "pgd": (found / r[ok]).median().item()})


if __name__ == "__main__":
    main()
