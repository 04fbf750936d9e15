"""ζ's structured certificate against its Ritz value at a large preset.

``lofast`` bounds the key sensitivity ζ (LoFAST eq. 15) by the structured
subspace certificate (docs/structured-certificates.md §4) and, where that is
more than ``STRUCTURED_RTOL`` above its Ritz value (a lower estimate of ζ),
by a dense Cholesky certificate of the ``(N·D) × (N·D)`` Gram matrix, up to
``ZETA_CHOLESKY_MAX_N``. This prints, per block of a seeded random model, the
certificate, its Ritz value and their gap for the default subspace and for
one four times larger with four times the iterations (how much a dense
certificate could still gain is below the gap), with seconds of one thread.
ζ is taken in its attention-only form (``H = 0``), as ``lofast`` bounds every
block's attention at its normalised input.

The table also goes to ``--out``/zeta_gap.json.

Usage::

    python bench/studies/zeta_gap.py --preset cifar-lofast-6x384 --family standard
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch
from lipvit.certify.attention import attention_probs, bound_weights
from lipvit.certify.lofast.structured import zeta_certificate
from lipvit.certify.taylor.forward import forward

from lipvit import ViT, preset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _out
from _out import add_out, write_json  # noqa: E402

SUBSPACES = ((16, 12), (64, 48))  # (k, n_iter): the default, and 4× both


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cifar-lofast-6x384")
    ap.add_argument("--family", default="standard", choices=("standard", "lipschitz"))
    ap.add_argument("--threads", type=int, default=1)
    add_out(ap, __file__)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = preset(args.preset, family=args.family, num_classes=10)
    model = ViT(cfg).double().eval()
    x = torch.rand(1, cfg.in_chans, cfg.image_size, cfg.image_size,
                   dtype=torch.float64)
    with torch.no_grad():
        _, clean = forward(model, x)
    machine = platform.processor() or platform.machine()
    print(f"# {args.preset} {args.family}, random weights (seed 0), N·D = "
          f"{clean.attn_in[0][0].numel()}; {machine}, {args.threads} thread(s), "
          f"{date.today()}")
    print("block  " + "  ".join(f"upper(k={k})  ritz  gap  s" for k, _ in SUBSPACES))
    record = {"preset": args.preset, "family": args.family, "seed": 0,
              "ND": clean.attn_in[0][0].numel(), "machine": machine,
              "threads": args.threads, "date": str(date.today()), "rows": []}
    for b, block in enumerate(model.blocks):
        W_q, W_k, W_v, W_o = bound_weights(block.attn)
        P = attention_probs(clean.attn_in[b], W_q, W_k)  # (1, H, N, N)
        cols = []
        for k, n_iter in SUBSPACES:
            t0 = time.process_time()
            cert = zeta_certificate(P, W_v, W_o, residual=False, k=k, n_iter=n_iter)
            upper, ritz = float(cert.upper[0]), float(cert.ritz[0])
            seconds = time.process_time() - t0
            cols.append(f"{upper:.9f}  {ritz:.9f}  {upper / ritz - 1:.1e}  "
                        f"{seconds:.1f}")
            record["rows"].append({"block": b, "k": k, "n_iter": n_iter,
                                   "upper": upper, "ritz": ritz,
                                   "gap": upper / ritz - 1, "cpu_s": seconds})
        print(f"{b:>5}  " + "  ".join(cols), flush=True)
    write_json(args.out, __file__, record)


if __name__ == "__main__":
    main()
