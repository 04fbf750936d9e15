"""ATen operations dispatched per sample by a certificate, at several batch sizes.

A CPU measure that predicts the GPU's: on a GPU each dispatched operation is
at least one kernel launch (microseconds), so a certificate whose operation
count per sample does not fall with the batch leaves the device idle however
large the batch. This counts every ATen operation that reaches the dispatcher
(a ``TorchDispatchMode``, below autograd) while :func:`certify_samples` runs
one method with ``--radius`` on a batch of random images of a random-weight
model (build, the margin drop at one ε, the radius search: what ``lipvit
certify`` runs), and prints operations and seconds per sample with their
ratios to batch 1, measured in the same run (wall-clock and the process's
CPU seconds: on a shared machine the CPU seconds are the steadier), and the
process's peak resident memory so far (batches run in increasing size).

    python bench/user/certify_ops.py                  # fmnist-3x64, batch 1, 8
    python bench/user/certify_ops.py --preset cifar-lofast-3x128 --batch 1,8,32
    python bench/user/certify_ops.py --method lofast --family standard

The counts are deterministic (the seeds fix weights and images), so a busy
machine changes the seconds, not the operations. The table also goes to
``--out``/certify_ops.json.
"""

from __future__ import annotations

import argparse
import platform
import resource
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from lipvit.certify.evaluate import certify_samples
from lipvit.certify.memory import parse_memory
from torch.utils._python_dispatch import TorchDispatchMode

import lipvit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402


class OpCounter(TorchDispatchMode):
    """Counts the ATen operations dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def measure(model, x, y, method: str, eps: float, max_memory: int | None
            ) -> tuple[int, float, float]:
    """``(operations, seconds, CPU seconds)`` of one ``certify_samples`` call on
    ``x``."""
    counter = OpCounter()
    t0, c0 = time.perf_counter(), time.process_time()
    with counter:
        certify_samples(model, x, y, [method], [eps], radius=True,
                        batch_size=x.shape[0], max_memory=max_memory)
    return counter.count, time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="fmnist-3x64")
    parser.add_argument("--family", default="lipschitz",
                        choices=("lipschitz", "standard"))
    parser.add_argument("--method", default="taylor", choices=("taylor", "lofast"))
    parser.add_argument("--batch", default="1,8", help="comma list of batch sizes")
    parser.add_argument("--eps", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-memory", default=None,
                        help="taylor's --max-memory (e.g. 8G: 32 samples of "
                             "cifar-lofast-3x128 in one call)")
    add_out(parser, __file__)
    args = parser.parse_args()
    memory = parse_memory(args.max_memory) if args.max_memory else None
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = lipvit.ViT(lipvit.preset(args.preset, family=args.family)).double().eval()
    cfg = model.config
    batches = [int(b) for b in args.batch.split(",")]
    g = torch.Generator().manual_seed(1)
    x_all = torch.rand(max(batches), cfg.in_chans, cfg.image_size, cfg.image_size,
                       generator=g, dtype=torch.float64)
    with torch.no_grad():
        y_all = model(x_all).argmax(1)
    print(f"{args.method} on {args.preset} ({args.family}, random weights), "
          f"eps {args.eps}, --radius, {args.threads} thread(s)")
    now = datetime.now(timezone.utc)
    print(f"machine: {platform.platform()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; {now:%Y-%m-%d %H:%M} UTC")
    record = {"method": args.method, "preset": args.preset, "family": args.family,
              "eps": args.eps, "machine": platform.platform(),
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "date": f"{now:%Y-%m-%d %H:%M} UTC", "args": vars(args), "rows": []}
    print(f"{'batch':>5}  {'ops/sample':>11}  {'ratio':>6}  {'s/sample':>9}  "
          f"{'ratio':>6}  {'CPU s/sample':>12}  {'ratio':>6}  {'peak RSS GiB':>12}",
          flush=True)
    base = None
    for b in batches:
        ops, seconds, cpu = measure(model, x_all[:b], y_all[:b], args.method,
                                    args.eps, memory)
        per = (ops / b, seconds / b, cpu / b)
        base = base or per
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB → GiB
        print(f"{b:>5}  {per[0]:>11.0f}  {per[0] / base[0]:>6.3f}  {per[1]:>9.3f}  "
              f"{per[1] / base[1]:>6.3f}  {per[2]:>12.3f}  {per[2] / base[2]:>6.3f}  "
              f"{peak:>12.2f}", flush=True)
        record["rows"].append({
            "batch": b, "ops_per_sample": per[0], "ops_ratio": per[0] / base[0],
            "s_per_sample": per[1], "s_ratio": per[1] / base[1],
            "cpu_s_per_sample": per[2], "cpu_ratio": per[2] / base[2],
            "peak_rss_gib": peak})
    write_json(args.out, __file__, record)


if __name__ == "__main__":
    main()
