"""Compare robust attentions on digits through the Python API (``lipvit compare``).

Trains one tiny ViT per (attention, MSVP on/off) — dot-product attention
(vanilla and SpecFormer's MSVP), L2 attention with tied W_q = W_k (L2Former),
LipschitzNorm (LNFormer), scaled cosine-similarity attention (LipsFormer) and
CoViT's token convolution — attacks them, measures the per-block Jacobian
spectral norm and writes the report; then prints the table.

    python examples/compare_attention.py --out /tmp/compare-demo
    python examples/compare_attention.py --fast --attention dot,l2,conv
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from lipvit.analysis.compare import (
    CompareSettings,
    markdown_table,
    run_compare,
    write_report,
)

from lipvit.config import ATTENTIONS
from lipvit.data import load_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: a temporary one)")
    parser.add_argument("--attention", default=",".join(ATTENTIONS),
                        help="comma list, must include dot")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--fast", action="store_true", help="a smoke run")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models: one thread is fastest

    given = {"attentions": tuple(args.attention.split(","))}
    if args.epochs is not None:
        given["epochs"] = args.epochs
    settings = (CompareSettings.fast_mode(**given) if args.fast
                else CompareSettings(**given))
    data = load_dataset(settings.dataset)
    out = args.out or Path(tempfile.mkdtemp(prefix="lipvit-compare-"))
    index = torch.arange(min(settings.n_attack, data.x_test.shape[0])).numpy()
    comp = run_compare(out, settings, data, index, log=print)
    paths = write_report(comp, out, "python examples/compare_attention.py")
    print(markdown_table(comp))
    print("per-block Jacobian figure:", paths[2])


if __name__ == "__main__":
    main()
