"""Cost of certified training (``--cert-eps``): seconds per epoch with it over without.

Both runs are the trainer itself (:func:`lipvit.train.train`: batches,
augmentation, the step, the epoch's test evaluation, σ_max summary and
checkpoint) on the same model, data and schedule, from the same initial
weights; only ``cert_eps`` differs. Runs are interleaved (plain, cert, cert,
plain, ...) so that load changes on a shared machine hit both alike, and the
ratio of the median epoch times is reported, for wall-clock time and for the
processor time of this process (steadier on a shared CPU). The ratio of the
median training-step times (:func:`lipvit.train.train_step`, interleaved the
same way) is printed beside it.

    python bench/user/cert_training_cost.py                # digits, lipschitz, 1 thread
    python bench/user/cert_training_cost.py --repeats 5 --out runs/cost

The figures it prints go to ``--out``/cert_training_cost.json. The target it
is held to: a certified-training epoch costs at most 3× a plain one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lipvit.certified_training import CertifiedLoss
from lipvit.commands.train import DEFAULT_PRESET
from lipvit.config import preset
from lipvit.data import load_dataset
from lipvit.model import ViT
from lipvit.msvp import MSVP
from lipvit.train import train, train_config_for, train_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402


def epoch_times(dataset: str, msvp: float, cert_eps: float, repeats: int,
                epochs: int, threads: int) -> dict[str, list[float]]:
    """Per-epoch wall and processor seconds of ``repeats`` interleaved runs each."""
    data = load_dataset(dataset)
    cfg = preset(DEFAULT_PRESET[(dataset, "lipschitz")], family="lipschitz",
                 image_size=data.image_size, in_chans=data.in_chans,
                 num_classes=data.num_classes, mean=data.mean, std=data.std)
    times: dict[str, list[float]] = {k: [] for k in
                                     ("plain", "cert", "plain_cpu", "cert_cpu")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for key in ("plain", "cert") if r % 2 == 0 else ("cert", "plain"):
                tc = train_config_for(
                    "lipschitz", dataset, epochs=epochs, msvp=(msvp,) * 3,
                    cert_eps=cert_eps if key == "cert" else 0.0, threads=threads,
                    device="cpu")
                summary = train(cfg, tc, data, Path(tmp) / f"{key}.pt", force=True,
                                progress=False)
                times[key] += [h["seconds"] for h in summary["history"]]
                times[key + "_cpu"] += [h["cpu_seconds"] for h in summary["history"]]
    return times


def step_times(dataset: str, msvp: float, cert_eps: float, repeats: int,
               steps: int) -> dict[str, list[float]]:
    """Per-step processor seconds of the training step alone, interleaved."""
    data = load_dataset(dataset)
    cfg = preset(DEFAULT_PRESET[(dataset, "lipschitz")], family="lipschitz",
                 image_size=data.image_size, in_chans=data.in_chans,
                 num_classes=data.num_classes, mean=data.mean, std=data.std)
    tc = train_config_for("lipschitz", dataset, msvp=(msvp,) * 3, cert_eps=cert_eps,
                          device="cpu")
    x, y = data.x_train[: tc.batch_size], data.y_train[: tc.batch_size]
    runs = {}
    for key in ("plain", "cert"):
        torch.manual_seed(0)
        model = ViT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        cert = CertifiedLoss(model, tc.cert_stream) if key == "cert" else None
        runs[key] = (model, opt, MSVP(model, (msvp,) * 3), cert)
    out: dict[str, list[float]] = {"plain": [], "cert": []}
    for r in range(repeats + 1):  # the first round warms up
        for key in ("plain", "cert") if r % 2 == 0 else ("cert", "plain"):
            model, opt, penalty, cert = runs[key]
            t0 = time.process_time()
            for _ in range(steps):
                train_step(model, opt, x, y, tc, penalty, cert=cert,
                           cert_eps=cert_eps if cert is not None else 0.0)
            if r > 0:
                out[key].append((time.process_time() - t0) / steps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--msvp", type=float, default=1e-3)
    parser.add_argument("--cert-eps", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=4,
                        help="runs of each kind (interleaved)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per run")
    parser.add_argument("--steps", type=int, default=10,
                        help="training steps per repeat of the step timing")
    parser.add_argument("--threads", type=int, default=1)
    add_out(parser, __file__)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    med = statistics.median
    t = epoch_times(args.dataset, args.msvp, args.cert_eps, args.repeats, args.epochs,
                    args.threads)
    s = step_times(args.dataset, args.msvp, args.cert_eps, 2 * args.repeats,
                   args.steps)
    res = {
        "dataset": args.dataset,
        "family": "lipschitz",
        "preset": DEFAULT_PRESET[(args.dataset, "lipschitz")],
        "msvp": args.msvp,
        "cert_eps": args.cert_eps,
        "threads": args.threads,
        "epochs_measured": len(t["plain"]),
        "plain_epoch_s": med(t["plain"]),
        "cert_epoch_s": med(t["cert"]),
        "epoch_ratio": med(t["cert"]) / med(t["plain"]),
        "plain_epoch_cpu_s": med(t["plain_cpu"]),
        "cert_epoch_cpu_s": med(t["cert_cpu"]),
        "epoch_cpu_ratio": med(t["cert_cpu"]) / med(t["plain_cpu"]),
        "plain_step_cpu_s": med(s["plain"]),
        "cert_step_cpu_s": med(s["cert"]),
        "step_cpu_ratio": med(s["cert"]) / med(s["plain"]),
    }
    print(
        f"{res['dataset']} lipschitz {res['preset']}, MSVP {args.msvp:g}, "
        f"{args.threads} thread(s): epoch {res['plain_epoch_s']:.2f} s plain, "
        f"{res['cert_epoch_s']:.2f} s --cert-eps {args.cert_eps:g}: ratio "
        f"{res['epoch_ratio']:.2f} (processor time {res['plain_epoch_cpu_s']:.2f} / "
        f"{res['cert_epoch_cpu_s']:.2f} s, ratio {res['epoch_cpu_ratio']:.2f}); "
        f"training step alone: {1e3 * res['plain_step_cpu_s']:.1f} / "
        f"{1e3 * res['cert_step_cpu_s']:.1f} ms, ratio {res['step_cpu_ratio']:.2f}"
    )
    write_json(args.out, __file__, res)


if __name__ == "__main__":
    main()
