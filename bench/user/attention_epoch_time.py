"""Training time of every attention variant, with and without MSVP, over vanilla.

Every configuration (``dot``, ``l2``, ``lipnorm``, ``scsa``, ``conv``; each but
``conv`` also with MSVP) trains with :func:`lipvit.train.train_step` (forward,
cross-entropy, penalty, backward, clipping, AdamW) on the same batch, model
size and device, all in this one process. Repeats go round-robin over the
configurations, the order rotating each round, so load changes on a shared
machine hit all alike; the ratio of each median per-step time to vanilla's
(``dot`` without MSVP) is the epoch-time ratio (an epoch is a fixed number of
such steps). Both wall-clock and this process's CPU time are reported (the
latter is the meaningful one on a shared CPU). SpecFormer reports 1.5× for
MSVP.

    python bench/user/attention_epoch_time.py           # digits-tiny, CPU
    python bench/user/attention_epoch_time.py --preset digits-small --out runs/epoch

Writes the rows it prints to ``--out``/attention_epoch_time.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from lipvit.config import ATTENTIONS, PRESETS, preset
from lipvit.model import ViT
from lipvit.msvp import MSVP
from lipvit.train import TrainConfig, train_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402


def configurations(attentions=ATTENTIONS) -> list[tuple[str, bool]]:
    """``(attention, msvp)`` pairs; ``conv`` has nothing for MSVP to penalise."""
    return [(a, m) for a in attentions for m in (False, True)
            if not (m and a == "conv")]


def measure(preset_name: str, batch_size: int, repeats: int, steps: int,
            lam: float, seed: int = 0) -> list[dict]:
    """Median seconds per training step of every configuration, and ratios."""
    base = preset(preset_name)
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(batch_size, base.in_chans, base.image_size, base.image_size,
                   generator=g)
    y = torch.randint(0, base.num_classes, (batch_size,), generator=g)
    states = {}
    for attention, with_msvp in configurations():
        torch.manual_seed(seed)
        model = ViT(preset(preset_name, attention=attention))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        lambdas = (lam,) * 3 if with_msvp else (0.0,) * 3
        msvp = MSVP(model, lambdas) if with_msvp else None
        states[attention, with_msvp] = (model, opt, msvp, TrainConfig(msvp=lambdas))
    wall = {k: [] for k in states}
    cpu = {k: [] for k in states}
    keys = list(states)
    for r in range(repeats + 1):  # round 0 warms up
        for key in keys[r % len(keys):] + keys[: r % len(keys)]:
            model, opt, msvp, tc = states[key]
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                train_step(model, opt, x, y, tc, msvp)
            if r:
                wall[key].append((time.perf_counter() - t0) / steps)
                cpu[key].append((time.process_time() - c0) / steps)
    med = statistics.median
    ref = ("dot", False)
    return [
        {
            "attention": a, "msvp": m, "step_s": med(wall[a, m]),
            "step_cpu_s": med(cpu[a, m]),
            "ratio": med(wall[a, m]) / med(wall[ref]),
            "cpu_ratio": med(cpu[a, m]) / med(cpu[ref]),
        }
        for a, m in keys
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=tuple(PRESETS), default="digits-tiny")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5, help="steps per repeat")
    parser.add_argument("--msvp", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads; 0 keeps torch's")
    add_out(parser, __file__)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    rows = measure(args.preset, args.batch_size, args.repeats, args.steps, args.msvp)
    print(f"{args.preset}, batch {args.batch_size}, CPU, "
          f"{torch.get_num_threads()} thread(s); ratios to dot without MSVP")
    print(f"{'attention':<9} {'msvp':<5} {'ms/step':>8} {'ratio':>6} "
          f"{'CPU ms/step':>11} {'CPU ratio':>9}")
    for r in rows:
        print(f"{r['attention']:<9} {'yes' if r['msvp'] else 'no':<5} "
              f"{1e3 * r['step_s']:8.2f} {r['ratio']:6.2f} "
              f"{1e3 * r['step_cpu_s']:11.2f} {r['cpu_ratio']:9.2f}")
    write_json(args.out, __file__, rows)


if __name__ == "__main__":
    main()
