"""``lipvit train``: build the configurations, call :func:`lipvit.train.train`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from lipvit.commands import _common as C
from lipvit.config import ATTENTIONS, PRESETS, preset
from lipvit.data import DATASETS, default_dirs_text, load_dataset
from lipvit.errors import LipvitError
from lipvit.proven_summary import proven_text
from lipvit.train import (
    ARCH_DEFAULTS,
    FAMILY_DEFAULTS,
    summary_path,
    train,
    train_config_for,
)

DEFAULT_PRESET = {
    ("digits", "standard"): "digits-tiny",
    ("digits", "lipschitz"): "digits-small",
    ("fashion-mnist", "standard"): "fmnist-3x64",
    ("fashion-mnist", "lipschitz"): "fmnist-hybrid",
}
"""Preset used when ``--preset`` is not given, per (dataset, family). The
rule for the lipschitz family: the lipvit model that certifies most at the
headline radii ε = 0.25 and 0.5 in the dataset's measured table
(docs/figures/peer_lipschitz_cnn.json for Fashion-MNIST: the hybrid ViT, 73.3
/ 59.0 % against the CaiT's 67.0 / 46.7 % on 300 test points; an attending
model takes its place when one certifies more; tests/test_cli_train.py holds
this entry to that table). On digits the lipschitz family needs the wider,
deeper ``digits-small`` to pass 90 % test accuracy in a few CPU minutes; the
standard family gets ``digits-tiny`` and, on Fashion-MNIST, the 50-token
``fmnist-3x64``. Other datasets default to :data:`FALLBACK_PRESET`."""
FALLBACK_PRESET = "cifar-lofast-3x128"


def _shown(value: Any) -> str:
    """A default as the help shows it: ``off`` for None or False, ``on`` for True."""
    if value is None or value is False:
        return "off"
    return "on" if value is True else str(value)


def default_models() -> dict[str, tuple[str, str, str]]:
    """Each model a ``lipvit train`` builds with defaults of its own, as the
    help names it, with its ``(dataset, family, arch)``: the default preset
    of every (dataset, family), every preset whose architecture has defaults
    of its own (:data:`lipvit.train.ARCH_DEFAULTS`) and the families on other
    datasets."""
    models = {}
    for (dataset, family), name in DEFAULT_PRESET.items():
        models[f"{dataset} {family}"] = (dataset, family,
                                         PRESETS[name].get("arch", "vit"))
    for name, size in PRESETS.items():
        arch = size.get("arch", "vit")
        if arch in ARCH_DEFAULTS and name not in DEFAULT_PRESET.values():
            models[f"--preset {name}"] = ("fashion-mnist", "lipschitz", arch)
    for family in FAMILY_DEFAULTS:
        models[f"other {family}"] = ("", family, "vit")
    return models


def defaults_help(name: str) -> str:
    """The defaults of :class:`TrainConfig` field ``name`` for every model of
    :func:`default_models`, from :func:`lipvit.train.train_config_for` (what
    ``train`` uses), grouped by value: ``20 (fashion-mnist lipschitz, ...);
    12 (--preset fmnist-cait)``, or one value where all agree."""
    values: dict[str, list[str]] = {}
    for label, (dataset, family, arch) in default_models().items():
        value = getattr(train_config_for(family, dataset, arch=arch), name)
        values.setdefault(_shown(value), []).append(label)
    if len(values) == 1:
        return next(iter(values))
    return "; ".join(f"{v} ({', '.join(labels)})" for v, labels in values.items())


def preset_help() -> str:
    """The default preset of every (dataset, family), as the help shows it."""
    by_dataset: dict[str, list[str]] = {}
    for (dataset, family), name in DEFAULT_PRESET.items():
        by_dataset.setdefault(dataset, []).append(f"{name} ({family})")
    return "; ".join(f"{', '.join(v)} for {d}" for d, v in by_dataset.items())


HELP_GROUPS = {
    "Data and model": ("dataset", "data_dir", "preset_name", "family", "embed_dim",
                       "depth", "num_heads", "patch_size", "mlp_ratio", "attention",
                       "conv_kernel", "v_cap", "o_cap", "attn_project",
                       "attn_radius", "cls_content"),
    "Optimisation": ("epochs", "batch_size", "lr", "optimizer", "weight_decay",
                     "warmup", "label_smoothing", "grad_clip", "loss_scale",
                     "augment"),
    "Robust training": ("margin", "cert_eps", "cert_warmup", "cert_stream",
                        "cert_mix", "cert_margin", "relu_stability",
                        "stability_radius",
                        "adv_train", "adv_eps", "adv_steps", "noise_sd"),
    "MSVP (spectral penalty)": ("msvp_all", "msvp_q", "msvp_k", "msvp_v",
                                "msvp_iters"),
    "Run": ("out", "init_path", "resume", "force", "device", "threads", "seed",
            "deterministic", "progress", "help"),
}
"""``train --help``'s sections: each option's name in the group it is listed in."""


class GroupedCommand(click.Command):
    """A command whose ``--help`` lists its options in :data:`HELP_GROUPS`'
    sections (and any other in "Other options")."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter
                       ) -> None:
        help_option = self.get_help_option(ctx)
        records = {"help" if p is help_option else p.name: p.get_help_record(ctx)
                   for p in self.get_params(ctx)}
        placed: set[str] = set()
        for title, names in HELP_GROUPS.items():
            placed.update(names)
            rows = [records[n] for n in names if records.get(n)]
            with formatter.section(title):
                formatter.write_dl(rows)
        rest = [r for n, r in records.items() if n not in placed and r]
        if rest:
            with formatter.section("Other options"):
                formatter.write_dl(rest)


@click.command("train", cls=GroupedCommand)
@click.option(
    "--dataset", type=click.Choice(DATASETS), default="digits", show_default=True
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Directory with the dataset's distribution files (not for digits) "
    f"[{default_dirs_text()}].",
)
@click.option(
    "--preset",
    "preset_name",
    type=click.Choice(tuple(PRESETS)),
    default=None,
    help=f"Model size [default: {preset_help()}; {FALLBACK_PRESET} otherwise].",
)
@click.option(
    "--embed-dim", type=int, default=None, help="Token width D (overrides the preset)."
)
@click.option("--depth", type=int, default=None, help="Transformer blocks.")
@click.option("--num-heads", type=int, default=None, help="Attention heads H.")
@click.option("--patch-size", type=int, default=None, help="Patch side.")
@click.option(
    "--mlp-ratio", type=float, default=None, help="Feed-forward width over D."
)
@click.option(
    "--family",
    type=click.Choice(("standard", "lipschitz")),
    default="standard",
    show_default=True,
)
@click.option(
    "--attention",
    type=click.Choice(ATTENTIONS),
    default=None,
    help="Token mixing (standard family): dot, l2 (L2Former, tied W_q = W_k), "
    "lipnorm (LNFormer), scsa (LipsFormer), conv (CoViT) [default: dot].",
)
@click.option(
    "--conv-kernel",
    type=int,
    default=None,
    help="attention conv: odd kernel size of the token convolution [default: 3].",
)
@click.option(
    "--v-cap",
    type=float,
    default=None,
    help="lipschitz: cap on every head's ||W_v|| [default: 0.5].",
)
@click.option(
    "--o-cap",
    type=float,
    default=None,
    help="lipschitz: cap on every head's ||W_o|| [default: 0.5].",
)
@click.option(
    "--attn-project",
    type=click.Choice(("frobenius", "token")),
    default=None,
    help="lipschitz: projection before attention [default: frobenius].",
)
@click.option(
    "--attn-radius",
    type=float,
    default=None,
    help="lipschitz: radius of that projection [default: 1].",
)
@click.option(
    "--content-norm",
    "cls_content",
    type=float,
    default=None,
    help="cait: hold every class-attention head's content direction at this norm "
    "(its logits then look at the image) [default: free].",
)
@click.option(
    "--epochs", type=int, default=None, help=f"[default: {defaults_help('epochs')}]"
)
@click.option(
    "--batch-size",
    type=int,
    default=None,
    help=f"[default: {defaults_help('batch_size')}]",
)
@click.option(
    "--lr", type=float, default=None, help=f"[default: {defaults_help('lr')}]"
)
@click.option(
    "--optimizer",
    type=click.Choice(("adamw", "sgd")),
    default=None,
    help=f"[default: {defaults_help('optimizer')}]",
)
@click.option(
    "--weight-decay",
    type=float,
    default=None,
    help=f"[default: {defaults_help('weight_decay')}]",
)
@click.option(
    "--warmup",
    type=float,
    default=None,
    help=f"Warm-up epochs [default: {defaults_help('warmup')}].",
)
@click.option(
    "--label-smoothing",
    type=float,
    default=None,
    help=f"[default: {defaults_help('label_smoothing')}]",
)
@click.option(
    "--grad-clip",
    type=float,
    default=None,
    help=f"Clip the gradient norm; 0 disables [default: {defaults_help('grad_clip')}].",
)
@click.option(
    "--loss-scale",
    type=float,
    default=None,
    help="Cross-entropy on loss_scale * logits (inverse temperature; "
    f"predictions and certificates unaffected) [default: "
    f"{defaults_help('loss_scale')}].",
)
@click.option(
    "--margin",
    type=float,
    default=None,
    help="Lipschitz-margin training: the loss sees the true logit lowered by "
    f"this much (buys certified radius) [default: {defaults_help('margin')}].",
)
@click.option(
    "--relu-stability",
    type=float,
    default=None,
    help="Weight of the ReLU-stability penalty on the SLL units (lipschitz "
    "family): trains for the taylor certificate; 0 is off "
    f"[default: {defaults_help('relu_stability')}].",
)
@click.option(
    "--stability-radius",
    type=float,
    default=None,
    help="Per-token move at an SLL block's input that each unit should withstand "
    f"without changing sign [default: {defaults_help('stability_radius')}].",
)
@click.option(
    "--cert-eps",
    type=float,
    default=None,
    help="Certified training for the taylor certificate at this l2 radius "
    "(lipschitz family): the strongest wrong logit is raised by its exact "
    "first-order margin drop plus a bound on its ReLU units' flips at an assumed "
    "stream move (docs/certified-training.md); CaiT: for ball "
    f"[default: {defaults_help('cert_eps')}].",
)
@click.option(
    "--cert-warmup",
    type=float,
    default=None,
    help="Fraction of the training steps over which --cert-eps ramps up "
    f"linearly from 0 [default: {defaults_help('cert_warmup')}].",
)
@click.option(
    "--cert-stream",
    type=float,
    default=None,
    help="Per-token move at an SLL input per unit of image perturbation that "
    f"the --cert-eps loss assumes [default: {defaults_help('cert_stream')}].",
)
@click.option(
    "--cert-mix",
    type=float,
    default=None,
    help="Share of the --cert-eps loss in the cross-entropy; the rest is the "
    f"plain loss [default: {defaults_help('cert_mix')}].",
)
@click.option(
    "--cert-margin",
    type=click.IntRange(min=0),
    default=None,
    help="CaiT: bound the --cert-eps loss by margin (differentiable, about "
    "0.45 s an image on two CPU threads) on this many images of each batch, "
    "by ball on the rest; 0: ball alone "
    f"[default: {defaults_help('cert_margin')}].",
)
@click.option(
    "--noise-sd",
    type=float,
    default=None,
    help="Add Gaussian noise of this standard deviation (pixels in [0, 1]) to "
    "every training image, for randomized smoothing (Cohen et al. 2019; "
    "`lipvit certify --method smoothing` takes it as its sigma) "
    f"[default: {defaults_help('noise_sd')}].",
)
@click.option(
    "--augment/--no-augment",
    default=None,
    help="Random crop/flip suited to the dataset "
    f"[default: {defaults_help('augment')}].",
)
@click.option(
    "--msvp",
    "msvp_all",
    type=float,
    default=0.0,
    show_default=True,
    help="MSVP weight lambda for W_q, W_k and W_v (SpecFormer eq. 11).",
)
@click.option("--msvp-q", type=float, default=None, help="lambda_q (overrides --msvp).")
@click.option("--msvp-k", type=float, default=None, help="lambda_k (overrides --msvp).")
@click.option("--msvp-v", type=float, default=None, help="lambda_v (overrides --msvp).")
@click.option(
    "--msvp-iters",
    type=int,
    default=1,
    show_default=True,
    help="Power-iteration steps per training step.",
)
@click.option(
    "--adv-train",
    type=click.Choice(("none", "pgd-linf", "pgd-l2")),
    default="none",
    show_default=True,
    help="PGD adversarial training.",
)
@click.option(
    "--adv-eps",
    type=float,
    default=0.0,
    show_default=True,
    help="PGD radius (images in [0, 1]).",
)
@click.option("--adv-steps", type=int, default=10, show_default=True, help="PGD steps.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--deterministic", is_flag=True, help="Deterministic algorithms only.")
@click.option(
    "--device",
    type=click.Choice(("auto", "cpu", "cuda")),
    default="auto",
    show_default=True,
)
@click.option(
    "--threads",
    type=int,
    default=0,
    show_default=True,
    help="CPU threads; 0: one for small models, torch's default otherwise.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("model.pt"),
    show_default=True,
    help="Checkpoint file (.pt); the JSON summary goes next to it.",
)
@click.option(
    "--init",
    "init_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Fine-tune from these weights (a lipvit checkpoint, a transformers ViT "
    "directory or timm-layout weights); the architecture and input "
    "normalisation come from them.",
)
@click.option("--resume", is_flag=True, help="Continue the run saved at --out.")
@click.option("--force", is_flag=True, help="Overwrite an existing --out.")
@click.option(
    "--progress/--no-progress",
    default=True,
    show_default=True,
    help="Progress bar per epoch (stderr).",
)
def train_command(
    dataset: str,
    data_dir: Path | None,
    preset_name: str | None,
    family: str,
    out: Path,
    init_path: Path | None,
    resume: bool,
    force: bool,
    progress: bool,
    msvp_all: float,
    msvp_q: float | None,
    msvp_k: float | None,
    msvp_v: float | None,
    **options: Any,
) -> None:
    """Train a ViT (optionally with the MSVP penalty) and save a checkpoint.

    Writes OUT (model, configs, MSVP buffers, training state; rewritten after
    every epoch, so --resume continues an interrupted run) and OUT with suffix
    .json (the summary). One line per epoch: loss, MSVP penalty, train/test
    accuracy, mean exact sigma_max of W_q, W_k, W_v, learning rate, seconds.
    """
    size_keys = (
        "embed_dim",
        "depth",
        "num_heads",
        "patch_size",
        "mlp_ratio",
        "v_cap",
        "o_cap",
        "attn_project",
        "attn_radius",
        "attention",
        "conv_kernel",
        "cls_content",
    )
    if out.suffix != ".json":  # (a .json --out is refused by `train` itself)
        outputs = [out, summary_path(out)]
        C.check_writable(outputs, force=True)  # directories and parents
        existing = [p for p in outputs if p.exists()]
        if existing and not (resume or force):
            raise LipvitError(f"{existing[0]} exists; pass --resume to continue that "
                              "run or --force to overwrite it")
    size = {k: options.pop(k) for k in size_keys if options.get(k) is not None}
    for k in size_keys:
        options.pop(k, None)
    data = load_dataset(dataset, data_dir)
    init = None
    if init_path is not None:
        init = _init_model(init_path, preset_name, size, family)
        model_cfg = init.config
    else:
        name = preset_name or DEFAULT_PRESET.get((dataset, family), FALLBACK_PRESET)
        model_cfg = preset(
            name,
            family=family,
            image_size=data.image_size,
            in_chans=data.in_chans,
            num_classes=data.num_classes,
            mean=data.mean,
            std=data.std,
            **size,
        )
    lambdas = tuple(
        msvp_all if lam is None else lam for lam in (msvp_q, msvp_k, msvp_v)
    )
    train_cfg = train_config_for(family, dataset, arch=model_cfg.arch, msvp=lambdas,
                                 **options)
    summary = train(
        model_cfg,
        train_cfg,
        data,
        out,
        resume=resume,
        force=force,
        progress=progress,
        log=click.echo,
        init=init,
    )
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only rank 0 reports
        return
    sig = summary["sigma_max"]
    sigma = (
        proven_text(summary["proven"])
        if "proven" in summary
        else "no W_q, W_k, W_v (conv token mixing)"
        if sig["mean"] is None
        else f"mean sigma_max(W_q, W_k, W_v) {sig['mean']:.4f} (q "
        f"{sig['mean_q']:.4f}, k {sig['mean_k']:.4f}, v {sig['mean_v']:.4f})"
    )
    click.echo(
        f"saved {out} and {summary_path(out)}: test accuracy "
        f"{100 * summary['test_acc']:.1f}%, {sigma}, {summary['seconds']:.0f} s"
    )


def _init_model(path: Path, preset_name: str | None, size: dict, family: str) -> Any:
    """The model ``--init`` names; it fixes the architecture, so size flags clash."""
    from lipvit.checkpoint import load_checkpoint

    if preset_name is not None or size:
        given = ["--preset"] * (preset_name is not None) + [
            "--" + k.replace("_", "-") for k in size
        ]
        raise ValueError(
            f"--init takes the architecture from {path}; drop {', '.join(given)}"
        )
    model = load_checkpoint(path).model.float()
    if model.config.family != family:
        raise ValueError(
            f"--init {path} is a {model.config.family} model; pass "
            f"--family {model.config.family}"
        )
    return model
