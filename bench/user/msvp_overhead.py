"""Cost of the MSVP penalty: seconds per training step with it over without it.

Both steps are :func:`lipvit.train.train_step` (the trainer's own step: forward,
cross-entropy, penalty, backward, clipping, AdamW) on the same model size, batch
and device; the two models start from the same weights. Repeats are
interleaved (vanilla, MSVP, vanilla, ... with the order alternating) so that
load changes on a shared machine hit both alike, and the ratio of the medians
of the per-step times is reported, for wall-clock time and (useful on a shared
CPU) for the processor time of this process.

    python bench/user/msvp_overhead.py                  # both families, CPU
    python bench/user/msvp_overhead.py --family lipschitz --device cuda \\
        --batch-size 512

Prints one line per family and writes the figures to ``--out``/msvp_overhead.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from lipvit.config import PRESETS, preset
from lipvit.model import ViT
from lipvit.msvp import MSVP
from lipvit.train import TrainConfig, autocast_for, resolve_device, train_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    family: str,
    preset_name: str,
    batch_size: int,
    repeats: int,
    steps: int,
    lam: float,
    device: torch.device,
    seed: int = 0,
) -> dict[str, float]:
    """Median seconds per step without and with MSVP, and their ratio."""
    cfg = preset(preset_name, family=family)
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(
        batch_size, cfg.in_chans, cfg.image_size, cfg.image_size, generator=g
    ).to(device)
    y = torch.randint(0, cfg.num_classes, (batch_size,), generator=g).to(device)
    tc_plain = TrainConfig(msvp=(0.0, 0.0, 0.0))
    tc_msvp = TrainConfig(msvp=(lam, lam, lam))
    autocast = autocast_for(device)

    def build(with_msvp: bool):
        torch.manual_seed(seed)
        model = ViT(cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        msvp = MSVP(model, (lam, lam, lam)).to(device) if with_msvp else None
        return model, opt, msvp

    runs = {False: build(False), True: build(True)}
    wall: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}

    def run(with_msvp: bool, n: int) -> None:
        model, opt, msvp = runs[with_msvp]
        tc = tc_msvp if with_msvp else tc_plain
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            train_step(model, opt, x, y, tc, msvp, autocast=autocast)
        _sync(device)
        wall[with_msvp].append((time.perf_counter() - t0) / n)
        cpu[with_msvp].append((time.process_time() - c0) / n)

    for key in (False, True):  # warm-up
        run(key, max(2, steps // 2))
        wall[key].clear()
        cpu[key].clear()
    for r in range(repeats):
        for key in (False, True) if r % 2 == 0 else (True, False):
            run(key, steps)
    med = statistics.median
    return {
        "family": family,
        "preset": preset_name,
        "batch_size": batch_size,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "plain_s": med(wall[False]),
        "msvp_s": med(wall[True]),
        "ratio": med(wall[True]) / med(wall[False]),
        # Processor time of this process: on a shared CPU it is not inflated by
        # other processes' load (meaningless on a GPU, where the host waits).
        "plain_cpu_s": med(cpu[False]),
        "msvp_cpu_s": med(cpu[True]),
        "cpu_ratio": med(cpu[True]) / med(cpu[False]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--family", choices=("standard", "lipschitz", "both"), default="both"
    )
    parser.add_argument("--preset", choices=tuple(PRESETS), default="digits-tiny")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--steps", type=int, default=10, help="steps per repeat")
    parser.add_argument("--msvp", type=float, default=1e-3)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (torch.set_num_threads); 0 keeps torch's",
    )
    add_out(parser, __file__)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    families = ("standard", "lipschitz") if args.family == "both" else (args.family,)
    results = []
    for family in families:
        res = measure(
            family,
            args.preset,
            args.batch_size,
            args.repeats,
            args.steps,
            args.msvp,
            device,
        )
        results.append(res)
        print(
            f"{family:<9} {args.preset} batch {args.batch_size} on {res['device']} "
            f"({res['threads']} threads): {1e3 * res['plain_s']:.2f} ms/step plain, "
            f"{1e3 * res['msvp_s']:.2f} ms/step MSVP, ratio {res['ratio']:.3f} "
            f"(processor time: {1e3 * res['plain_cpu_s']:.2f} / "
            f"{1e3 * res['msvp_cpu_s']:.2f} ms, ratio {res['cpu_ratio']:.3f})"
        )
    write_json(args.out, __file__, results)


if __name__ == "__main__":
    main()
