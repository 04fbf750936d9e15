"""Train a small ViT on digits with the MSVP penalty and compare it with no penalty.

SpecFormer's Maximum Singular Value Penalization (eq. 11): the loss gets
``λ Σ_layers Σ_heads σ²(W_q[h]) + σ²(W_k[h]) + σ²(W_v[h])``. This script trains
the same architecture twice (λ = 0 and λ > 0) through the Python API and prints
test accuracy and the exact σ_max statistics of both.

    python examples/train_msvp.py --epochs 20 --msvp 1e-3 --out /tmp/msvp-demo
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

import lipvit
from lipvit.data import load_dataset
from lipvit.train import train, train_config_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--epochs", type=int, default=int(os.environ.get("LIPVIT_EXAMPLE_EPOCHS", "10"))
    )
    parser.add_argument("--msvp", type=float, default=1e-2, help="λ for W_q, W_k, W_v")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for the checkpoints (default: a temporary one)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models: one thread is fastest

    data = load_dataset("digits")
    cfg = lipvit.preset("digits-tiny", family="standard", mean=data.mean, std=data.std)
    out = args.out or Path(tempfile.mkdtemp(prefix="lipvit-msvp-"))
    results = {}
    for name, lam in (("vanilla", 0.0), ("msvp", args.msvp)):
        train_cfg = train_config_for(
            "standard", epochs=args.epochs, device="cpu", msvp=(lam, lam, lam)
        )
        results[name] = train(
            cfg, train_cfg, data, out / f"{name}.pt", force=True, progress=False
        )
    print(
        f"{'model':8}  {'λ':>7}  {'test acc':>8}  {'mean σ_max':>10}  {'max σ_max':>9}"
    )
    for name, s in results.items():
        lam = s["train_config"]["msvp"][0]
        print(
            f"{name:8}  {lam:7.0e}  {s['test_acc']:8.3f}  "
            f"{s['sigma_max']['mean']:10.4f}  {s['sigma_max']['max']:9.4f}"
        )
    print(f"checkpoints in {out}")


if __name__ == "__main__":
    main()
