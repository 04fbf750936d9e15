"""What ``lipvit train --cert-margin N`` costs a step (docs/certified-training.md
§7): on a CaiT checkpoint, one training batch of the first ``--batch``
Fashion-MNIST training images, the forward pass, the ``--cert-eps`` loss's
raised logits and the backward pass, with ``ball``'s loss
(:class:`lipvit.training.ball_loss.BallLoss`) and with ``margin``'s on ``N``
images of the batch (:class:`lipvit.training.margin_loss.MarginLoss`),
``--repeats`` times each (the first of each dropped: warm-up); prints the
median seconds of each and the difference per image bounded by ``margin``.

Usage (JSON in OUT/margin_loss_cost.json)::

    python bench/studies/margin_loss_cost.py --ckpt c2.pt --points 8 --threads 2
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.functional import cross_entropy

from lipvit.checkpoint import load_checkpoint
from lipvit.data import load_dataset
from lipvit.training.ball_loss import BallLoss
from lipvit.training.margin_loss import MarginLoss

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402


def step_seconds(model, loss, x, y, eps: float, repeats: int) -> float:
    """Median wall seconds of one forward, raised-logits and backward pass."""
    times = []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss.clear()
        raised = loss.raised_logits(model(x), x, y, eps)
        cross_entropy(raised, y).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, type=Path)
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--points", type=int, default=8)
    p.add_argument("--eps", type=float, default=0.1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    add_out(p, __file__)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_checkpoint(args.ckpt)
    model = loaded.model.float().train()
    data = load_dataset(loaded.dataset or "fashion-mnist", args.data_dir)
    x, y = data.x_train[:args.batch].float(), data.y_train[:args.batch]
    ball = step_seconds(model, BallLoss(model), x, y, args.eps, args.repeats)
    margin = step_seconds(model, MarginLoss(model, args.points), x, y, args.eps,
                          args.repeats)
    per_image = (margin - ball) / args.points
    print(f"step: ball {ball:.2f} s, margin on {args.points} images {margin:.2f} s; "
          f"{per_image:.3f} s an image bounded by margin ({args.threads} threads)")
    write_json(args.out, __file__, {
        "checkpoint": str(args.ckpt), "batch": args.batch, "points": args.points,
        "eps": args.eps, "threads": args.threads,
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "ball_step_seconds": ball, "margin_step_seconds": margin,
        "seconds_per_margin_image": per_image})


if __name__ == "__main__":
    main()
