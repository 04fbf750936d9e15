"""Draw the tightness plot (LoFAST Fig. 1 analogue) for one attention layer.

Every bound on the layer's deviation (naive, LoFAST tight/ξ/½-softmax/local,
SpecFormer) against the PGD lower bound across ε, for the attention of a
lipschitz-family ViT at real digits inputs, saved as a PNG.

    python examples/tightness_plot.py --ckpt model.pt --out tightness.png
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from lipvit.analysis.tightness import PGDSettings, layer_tightness, tightness_figure

import lipvit
from lipvit.checkpoint import load_checkpoint
from lipvit.data import load_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ckpt",
        type=Path,
        default=None,
        help="a lipvit checkpoint (default: an untrained lipschitz ViT)",
    )
    parser.add_argument(
        "--n", type=int, default=int(os.environ.get("LIPVIT_EXAMPLE_N", "4"))
    )
    parser.add_argument(
        "--residual",
        action="store_true",
        help="H = I on the attention input (LoFAST Table 3 setting)",
    )
    parser.add_argument("--out", type=Path, default=Path("tightness.png"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    data = load_dataset("digits")
    if args.ckpt is not None:
        model = load_checkpoint(args.ckpt).model
    else:
        torch.manual_seed(0)
        model = lipvit.ViT(
            lipvit.preset(
                "digits-tiny", family="lipschitz", mean=data.mean, std=data.std
            )
        )
    model = model.double().eval()
    result = layer_tightness(
        model,
        data.x_test[: args.n].double(),
        0,
        [0.01, 0.02, 0.05, 0.1],
        ["naive", "lofast-xi", "lofast", "lofast-half", "lofast-local", "specformer"],
        residual=True if args.residual else "auto",
        pgd=PGDSettings(steps=50, restarts=2),
    )
    tightness_figure(result, path=args.out)
    for row in result.to_records():
        print(f"{row['method']:13} eps={row['eps']:<5} bound/PGD={row['ratio']:.4g}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
