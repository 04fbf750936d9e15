"""Certify a batch of digits with the composed LoFAST network bound.

``network_bound`` composes per-layer bounds into δ_out(x, ε) ≥ ‖logits(x′) −
logits(x)‖₂ over the ℓ2 ball; a sample is certified at ε when its margin exceeds
√2·δ_out (LoFAST Prop. 1), and its certified radius is found by bisection.
Without ``--ckpt`` a small lipschitz-family model is trained first.

    python examples/certify_batch.py --ckpt model.pt --n 32
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
from lipvit.analysis.tightness import token_budgets
from lipvit.certify.certification import certified_radius, is_certified, margin
from lipvit.certify.lofast.network import network_bound

import lipvit
from lipvit.checkpoint import load_checkpoint
from lipvit.data import load_dataset
from lipvit.train import train, train_config_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", type=Path, default=None)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument(
        "--epochs", type=int, default=int(os.environ.get("LIPVIT_EXAMPLE_EPOCHS", "10"))
    )
    args = parser.parse_args()
    torch.set_num_threads(1)

    data = load_dataset("digits")
    with tempfile.TemporaryDirectory(prefix="lipvit-cert-") as tmp:
        path = args.ckpt
        if path is None:  # trained into a directory removed on exit
            path = Path(tmp) / "lipschitz.pt"
            cfg = lipvit.preset(
                "digits-tiny", family="lipschitz", mean=data.mean, std=data.std
            )
            train(
                cfg,
                train_config_for("lipschitz", epochs=args.epochs, device="cpu"),
                data,
                path,
                progress=False,
            )
        model = load_checkpoint(path).model.double()
    x, y = data.x_test[: args.n].double(), data.y_test[: args.n]

    bound = network_bound(model, x, "lofast")  # ε-independent work, done once
    m = margin(bound.logits, y)
    print(f"{path}: clean accuracy {float((m > 0).double().mean()):.3f} on {args.n}")
    print(f"{'eps':>6}  {'mean delta_out':>14}  {'certified':>9}")
    for eps in (0.01, 0.05, 0.1, 0.2):
        delta = bound.delta_out(eps)  # (B,)
        print(
            f"{eps:6.2f}  {float(delta.mean()):14.5f}  "
            f"{float(is_certified(m, delta).double().mean()):9.3f}"
        )
    radius = certified_radius(m, bound.delta_out, rtol=1e-4)
    print(
        f"certified radius: median {float(radius.median()):.4f}, "
        f"max {float(radius.max()):.4f}"
    )
    print(
        "budget through the layers at eps = 0.05, first sample (whole token matrix "
        "/ class token; the head reads the class token):"
    )
    tokens, cls = token_budgets(bound.trace(0.05))  # (B, steps + 1) each
    names = ("input", *(s.name for s in bound.steps))
    for k, step in enumerate(names):
        extra = "" if cls is None else f" / {float(cls[0, k]):.5f}"
        print(f"  {step:22} {float(tokens[0, k]):.5f}{extra}")


if __name__ == "__main__":
    main()
