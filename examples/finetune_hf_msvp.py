"""Fine-tune an imported Hugging Face ViT with the MSVP penalty, then export it back.

A small random ``transformers`` ``ViTForImageClassification`` (or ``--hf-dir``)
is imported into lipvit, trained on digits from its own weights with MSVP
(SpecFormer eq. 11) through :func:`lipvit.train.train` (``init=``; the same as
``lipvit train --init DIR --msvp λ``), and written back as a transformers
directory whose logits transformers reproduces. Printed: test accuracy and
the largest exact σ_max of W_q, W_k, W_v before and after.

    pip install 'lipvit[hf]'
    python examples/finetune_hf_msvp.py --epochs 20 --msvp 1e-3
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from lipvit.checkpoint import load_checkpoint
from lipvit.data import load_dataset
from lipvit.interop import save_hf, small_transformers_vit
from lipvit.train import evaluate, head_sigmas, train, train_config_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--epochs", type=int, default=int(os.environ.get("LIPVIT_EXAMPLE_EPOCHS", "20"))
    )
    parser.add_argument("--msvp", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    out = args.out or Path(tempfile.mkdtemp(prefix="lipvit-ft-"))
    directory = args.hf_dir
    if directory is None:
        directory = out / "random-vit"
        small_transformers_vit(args.seed).save_pretrained(directory)
    start = load_checkpoint(directory).model.float()
    data = load_dataset("digits")

    def report(name: str, model: torch.nn.Module) -> None:
        acc = evaluate(model, data.x_test, data.y_test)
        sigma = head_sigmas(model)[:, :3].max()  # exact, over layers, W_q/k/v, heads
        print(
            f"{name:10}  test acc {100 * acc:5.1f}%  max sigma(W_q,W_k,W_v) "
            f"{float(sigma):.4f}"
        )

    report("imported", start)
    cfg = train_config_for(
        "standard",
        epochs=args.epochs,
        device="cpu",
        msvp=(args.msvp,) * 3,
        seed=args.seed,
    )
    ckpt = out / "finetuned.pt"
    train(start.config, cfg, data, ckpt, init=start, progress=False, force=True)
    tuned = load_checkpoint(ckpt).model
    report("fine-tuned", tuned)

    import transformers

    save_hf(tuned, out / "finetuned-hf", force=True)
    back = transformers.ViTForImageClassification.from_pretrained(out / "finetuned-hf")
    x = data.x_test[:64]
    mean = torch.tensor(tuned.config.mean).reshape(1, -1, 1, 1)
    std = torch.tensor(tuned.config.std).reshape(1, -1, 1, 1)
    with torch.no_grad():
        diff = (back.eval()(pixel_values=(x - mean) / std).logits - tuned(x)).abs()
    print(
        f"exported to {out / 'finetuned-hf'}: max |logit difference| in "
        f"transformers {float(diff.max()):.2e}"
    )


if __name__ == "__main__":
    main()
