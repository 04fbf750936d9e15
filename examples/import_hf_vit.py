"""Import a Hugging Face ``transformers`` ViT, inspect its spectra and certify it.

``transformers`` needs no hub access here: a small random
``ViTForImageClassification`` (8×8 grayscale, digits-sized, bias-free q/k/v,
since the attention bounds refuse query/key biases) is built and saved with
``save_pretrained`` unless ``--hf-dir`` names a saved one. lipvit imports the
directory (:func:`lipvit.checkpoint.load_checkpoint` reads it like its own
checkpoints), checks that the logits agree with transformers', then prints per
block the exact σ_max of the residual branch's Jacobian at test inputs, the
SpecFormer and LoFAST bounds of the attention layer at ε, and certifies the
network with the composed LoFAST bound (radius by bisection).

    pip install 'lipvit[hf]'
    python examples/import_hf_vit.py --n 16
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from lipvit.analysis import jacobian_spectrum
from lipvit.analysis.tightness import block_inputs
from lipvit.certify import (
    certified_radius,
    is_certified,
    lofast_bound,
    margin,
    network_bound,
    specformer_bound,
)

from lipvit import load_checkpoint, load_dataset
from lipvit.interop import small_transformers_vit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", type=Path, default=None)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--eps", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    import transformers

    with tempfile.TemporaryDirectory(prefix="lipvit-hf-") as tmp:
        directory = args.hf_dir
        if directory is None:  # saved into a directory removed on exit
            directory = Path(tmp) / "vit"
            small_transformers_vit(args.seed).save_pretrained(directory)
        model = load_checkpoint(directory).model.double()
        reference = transformers.ViTForImageClassification.from_pretrained(directory)
    reference = reference.double().eval()
    data = load_dataset("digits")
    x, y = data.x_test[: args.n].double(), data.y_test[: args.n]
    with torch.no_grad():
        cfg = model.config
        mean = torch.tensor(cfg.mean, dtype=x.dtype).reshape(1, -1, 1, 1)
        std = torch.tensor(cfg.std, dtype=x.dtype).reshape(1, -1, 1, 1)
        theirs = reference(pixel_values=(x - mean) / std).logits
        diff = float((model(x) - theirs).abs().max())
    print(
        f"{directory}: imported {cfg.depth} blocks, D={cfg.embed_dim}, "
        f"H={cfg.num_heads}, LayerNorm eps={cfg.norm_eps:g}; "
        f"max |logit difference| vs transformers (float64): {diff:.2e}"
    )

    spectrum = jacobian_spectrum(model, x, mode="exact")  # (L, B) exact σ_max
    with torch.no_grad():
        inputs = block_inputs(model, x)
    print(
        f"per block, mean over {args.n} test digits (attention bounds at "
        f"eps={args.eps:g} on the LayerNorm output):"
    )
    print(f"{'block':>5}  {'sigma_max(J_F)':>14}  {'SpecFormer':>11}  {'LoFAST':>9}")
    for k, block in enumerate(model.blocks):
        with torch.no_grad():
            Z = block.norm1(inputs[k])  # (B, N, D): the attention's input
        W = [w.detach() for w in block.attn.head_weights()]
        spec = specformer_bound(Z, *W, args.eps, residual=False)
        lofast = lofast_bound(Z, *W, args.eps, residual=False).total
        print(
            f"{k:5d}  {spectrum.sigma[k].mean():14.4f}  "
            f"{float(spec.mean()):11.4g}  {float(lofast.mean()):9.4g}"
        )

    bound = network_bound(model, x, "lofast")
    m = margin(bound.logits, y)
    radius = certified_radius(m, bound.delta_out, tol=1e-4)
    delta = bound.delta_out(args.eps)
    certified = is_certified(m, delta).double().mean()
    print(
        f"network (LoFAST): clean accuracy {float((m > 0).double().mean()):.3f}, "
        f"certified at eps={args.eps:g}: {float(certified):.3f}, "
        f"median certified radius {float(radius.median()):.4g}"
    )


if __name__ == "__main__":
    main()
