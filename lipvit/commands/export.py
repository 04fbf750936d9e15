"""``lipvit export``: a model to the transformers or timm layout, or to lipvit's."""

from __future__ import annotations

from pathlib import Path

import click

from lipvit.commands import _common as C


@click.command("export")
@C.ckpt_option()
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="the exported model, in its format's own shape: a folder "
              "(transformers), a .safetensors file (timm), a .pt checkpoint file "
              "(lipvit)")
@click.option("--format", "fmt", type=click.Choice(("transformers", "timm", "lipvit")),
              default="transformers", show_default=True)
@C.force_option
def export(ckpt: Path, out: Path, fmt: str, force: bool) -> None:
    """Write a model (any --ckpt lipvit reads) in another layout.

    transformers: config.json, preprocessor_config.json (image size and
    normalisation) and model.safetensors, which
    ViTForImageClassification.from_pretrained reads. timm: the weights under
    timm's VisionTransformer names plus a JSON with the heads count and
    normalisation. lipvit: a checkpoint every command reads. Only the standard
    family has a transformers or timm counterpart.
    """
    from lipvit.checkpoint import save_checkpoint
    from lipvit.interop import save_hf, save_timm

    loaded = C.load_checkpoint(ckpt)
    if fmt == "transformers":
        save_hf(loaded.model, out, force=force)
    elif fmt == "timm":
        save_timm(loaded.model, out, force=force)
    else:
        C.check_writable([out], force)
        save_checkpoint(out, loaded.model, dataset=loaded.dataset)
    click.echo(f"wrote {out} ({fmt} layout) from {ckpt}")
