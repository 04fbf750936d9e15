"""Logit equality of imported ViTs: transformers directories and timm-layout files.

For float32 and float64, a small random ``transformers`` ``ViTForImageClassification``
(every weight random, LayerNorms included) is saved with ``save_pretrained`` and
imported by ``lipvit.checkpoint.load_checkpoint``; a second one (LayerNorm
epsilon 1e-6, timm's) is written as a timm-layout ``.safetensors`` under timm's
documented key names (``tests/test_interop.py: timm_layout``) with a JSON
giving its heads count, and imported the same way. The table shows the largest
absolute logit difference from transformers' own forward pass over 256 random
images, next to the largest logit.

    pip install 'lipvit[hf]'
    python bench/user/interop_equality.py

The table also goes to ``--out``/interop_equality.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # _out
sys.path.insert(0, str(ROOT / "tests"))  # test_interop's random models

from _out import add_out, write_json  # noqa: E402
from test_interop import hf_logits, images, random_hf_vit, timm_layout  # noqa: E402

from lipvit.checkpoint import load_checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out(parser, __file__)
    args = parser.parse_args()
    import safetensors.torch

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lipvit-interop-") as tmp:
        root = Path(tmp)
        header = ("dtype", "importer", "max |logit diff|", "max |logit|")
        print(f"{header[0]:8}  {header[1]:12}  {header[2]:>16}  {header[3]:>11}")
        for dtype in (torch.float32, torch.float64):
            name = str(dtype).removeprefix("torch.")
            x = images(dtype, n=256)
            hf = random_hf_vit(dtype, seed=0)
            hf.save_pretrained(root / f"hf-{name}")
            timm_ref = random_hf_vit(dtype, seed=1, layer_norm_eps=1e-6)
            weights = root / f"timm-{name}.safetensors"
            safetensors.torch.save_file(timm_layout(timm_ref), str(weights))
            weights.with_suffix(".json").write_text(json.dumps({"num_heads": 4}))
            for importer, path, ref in (
                ("transformers", root / f"hf-{name}", hf),
                ("timm", weights, timm_ref),
            ):
                theirs = hf_logits(ref, x)
                with torch.no_grad():
                    ours = load_checkpoint(path).model(x)
                diff = float((ours - theirs).abs().max())
                top = float(theirs.abs().max())
                print(f"{name:8}  {importer:12}  {diff:16.3e}  {top:11.3g}")
                rows.append({"dtype": name, "importer": importer,
                             "max_abs_logit_diff": diff, "max_abs_logit": top})
    write_json(args.out, __file__, {"images": 256, "rows": rows})


if __name__ == "__main__":
    main()
