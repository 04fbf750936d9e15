"""Seconds of one attack on a lipschitz model with its parametrised weights
computed once per attack (:func:`lipvit.analysis.attacks.fixed_weights`, what
every attack in lipvit does) over the same attack with the weights
recomputed at every forward pass (torch's default), measured in the same run,
and the largest difference between the two attacks' points.

    python bench/user/attack_speed.py --ckpt c2.pt --n 60 --attack pgd-l2 --eps 0.5

The model in float64 (as ``lipvit certify`` and the gap table attack it), one
thread, ``--n`` test points of the checkpoint's dataset as ``lipvit certify
--n`` picks them; the two settings alternate ``--repeats`` times and the
least time of each is kept.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
from lipvit.analysis.attacks import perturb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402
from _points import float64_points  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, type=Path)
    p.add_argument("--n", type=int, default=60)
    p.add_argument("--attack", default="pgd-l2")
    p.add_argument("--eps", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=2)
    add_out(p, __file__)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, x, y, _ = float64_points(str(args.ckpt), args.n)
    runs = {"recomputed": perturb.__wrapped__, "fixed": perturb}
    seconds = {name: float("inf") for name in runs}
    points = {}
    for _ in range(args.repeats):
        for name, attack in runs.items():
            t0 = time.perf_counter()
            points[name] = attack(model, x, y, args.attack, args.eps, "l2",
                                  steps=args.steps, seed=0)
            seconds[name] = min(seconds[name], time.perf_counter() - t0)
    gap = float((points["fixed"] - points["recomputed"]).abs().max())
    ratio = seconds["recomputed"] / seconds["fixed"]
    machine = f"{platform.machine()}, 1 thread, torch {torch.__version__}"
    print(f"{args.attack} eps {args.eps}, {args.n} points, {args.steps} steps "
          f"({machine}): recomputed {seconds['recomputed']:.2f} s, fixed "
          f"{seconds['fixed']:.2f} s, {ratio:.2f}x; points differ by at most {gap:.1e}")
    write_json(args.out, __file__, {"checkpoint": args.ckpt, "n": args.n,
                                    "attack": args.attack, "eps": args.eps,
                                    "steps": args.steps, "machine": machine,
                                    "seconds": seconds, "speedup": ratio,
                                    "largest_point_difference": gap})


if __name__ == "__main__":
    main()
