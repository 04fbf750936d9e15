"""``lipvit info``: what a checkpoint holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import torch

from lipvit.checkpoint import FORMAT_VERSION, load_checkpoint
from lipvit.commands import _common as C
from lipvit.proven_summary import proven_text
from lipvit.train import head_sigmas


def describe_checkpoint(path: Path) -> dict[str, Any]:
    """Everything ``lipvit info`` reports, as plain data."""
    ckpt = load_checkpoint(path)
    sig = head_sigmas(ckpt.model)  # (L, 4, H), exact
    extra = ckpt.raw.get("extra") or {}
    msvp = ckpt.msvp
    return {
        "path": str(path),
        "origin": ckpt.raw.get("format"),
        "lipvit_version": ckpt.version,
        "format_version": ckpt.raw.get("format_version", FORMAT_VERSION),
        "dataset": ckpt.dataset,
        "model_config": ckpt.config.to_dict(),
        "parameters": sum(p.numel() for p in ckpt.model.parameters()),
        "normalization": ckpt.raw.get("normalization"),
        "msvp_lambdas": None if msvp is None else [float(x) for x in msvp["lambdas"]],
        "train_config": ckpt.train_config,
        "epochs_done": extra.get("epoch"),
        "finished": ckpt.summary is not None,
        "summary": None
        if ckpt.summary is None
        else {
            k: v
            for k, v in ckpt.summary.items()
            if k not in ("history", "model_config", "train_config")
        },
        "sigma_max": {
            "note": "exact (dense SVD) per head; per layer: mean and max over heads",
            "layers": [
                {
                    name: {
                        "mean": float(sig[layer, i].mean()),
                        "max": float(sig[layer, i].max()),
                    }
                    for i, name in enumerate(("W_q", "W_k", "W_v", "W_o"))
                }
                for layer in range(sig.shape[0])
            ],
        },
    }


def ablation_accuracy(path: Path, n: int | None, data_dir: Path | None
                      ) -> dict[str, Any]:
    """Test accuracy of the checkpoint's model, of
    :func:`lipvit.ablate_attention` of it, and (CaiT) of it with only its
    self-attention removed, on ``n`` test images (all by default). Raises
    ``ValueError`` for a model without attention blocks to remove (a ViT)."""
    from lipvit.ablation import ABLATED_KEY, ablate_attention, ablations

    ckpt = C.load_checkpoint(path)
    model = ckpt.model.eval()
    models = {"accuracy": model, **{ABLATED_KEY[which]: ablate_attention(model, which)
                                    for which in ablations(model)}}
    data = C.load_test_set(ckpt, n=n, data_dir=data_dir)
    out: dict[str, Any] = {"n": len(data.y)}
    with torch.no_grad():
        for key, m in models.items():
            right = sum(int((m(data.x[i:i + 500]).argmax(1) == data.y[i:i + 500]).sum())
                        for i in range(0, len(data.y), 500))
            out[key] = right / len(data.y)
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


@click.command("info")
@click.option(
    "--ckpt",
    "path",
    type=click.Path(path_type=Path),
    required=True,
    help="Checkpoint written by lipvit train, or a transformers/timm ViT.",
)
@C.json_option
@C.force_option
@click.option("--ablate-attention", is_flag=True,
              help="Also measure test accuracy with and without the attention "
                   "(hybrid ViT, CaiT: lipvit.ablate_attention).")
@click.option("--n", type=click.IntRange(min=1), default=None,
              help="Test images for --ablate-attention (default: all).")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              default=None, help="Dataset directory for --ablate-attention.")
@C.threads_option
def info_command(path: Path, json_path: Path | None, force: bool,
                 ablate_attention: bool, n: int | None, data_dir: Path | None) -> None:
    """Print what a checkpoint holds: configs, dataset, summary, exact sigma_max.

    --json FILE writes the same as JSON; with --json - standard output holds
    the JSON alone (the text, which says the same, is not printed)."""
    C.check_results([json_path], force)
    d = describe_checkpoint(path)
    if ablate_attention:
        d["ablation"] = ablation_accuracy(path, n, data_dir)
    if json_path is not None:
        C.write_json(json_path, d, force)
        if C.is_stdout(json_path):
            return
    cfg = d["model_config"]
    foreign = d["origin"] in ("transformers", "timm")
    lines = [
        f"checkpoint   {d['path']} (imported {d['origin']} ViT)"
        if foreign
        else f"checkpoint   {d['path']} (lipvit {d['lipvit_version']}, "
        f"format {d['format_version']})",
        f"dataset      {d['dataset']}",
        f"model        {cfg['family']} ViT: "
        + ", ".join(f"{k}={_fmt(v)}" for k, v in cfg.items() if k != "family"),
        f"parameters   {d['parameters']:,}",
        "msvp         none"
        if d["msvp_lambdas"] is None
        else f"msvp         {_fmt(d['msvp_lambdas'])} (lambda_q, lambda_k, lambda_v)",
    ]
    if d["train_config"]:
        lines.append(
            "training     "
            + ", ".join(f"{k}={_fmt(v)}" for k, v in d["train_config"].items())
        )
    s = d["summary"]
    if s is None and foreign:
        lines.append("status       imported (not trained by lipvit)")
    elif s is None:
        done = d["epochs_done"]
        lines.append(
            f"status       unfinished ({done} epochs saved; resume with "
            "lipvit train --resume)"
        )
    else:
        lines.append(
            f"summary      test acc {100 * s['test_acc']:.2f}%, train acc "
            f"{100 * (s.get('train_acc') or 0):.2f}%, loss {_fmt(s.get('loss'))}, "
            f"{s.get('epochs')} epochs in {s.get('seconds', 0):.1f} s "
            f"on {s.get('device')}"
        )
    if "ablation" in d:
        a = d["ablation"]
        lines.append(f"ablation     test accuracy {100 * a['accuracy']:.2f}%, with "
                     "every attention term removed "
                     f"{100 * a['ablated_accuracy']:.2f}%"
                     + (f", only the self-attention removed "
                        f"{100 * a['self_ablated_accuracy']:.2f}%"
                        if "self_ablated_accuracy" in a else "")
                     + f" ({a['n']} test images)")
    proven = None if s is None else s.get("proven", s.get("hybrid"))
    if proven is not None:  # hybrid ViT, CaiT: no W_q, W_k, W_v table
        lines.append(f"{proven.get('arch', 'hybrid'):<12} {proven_text(proven)}")
        click.echo("\n".join(lines))
        return
    lines.append("sigma_max    exact per head (mean / max over heads)")
    lines.append(
        "  layer      W_q               W_k               W_v               W_o"
    )
    for i, layer in enumerate(d["sigma_max"]["layers"]):
        cells = "  ".join(
            f"{layer[n]['mean']:7.4f} /{layer[n]['max']:7.4f}"
            for n in ("W_q", "W_k", "W_v", "W_o")
        )
        lines.append(f"  {i:<5}  {cells}")
    click.echo("\n".join(lines))
