"""``lipvit tightness``: every deviation bound against the PGD lower bound, across ε."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import torch
from tqdm import tqdm

from lipvit.commands import _common as C
from lipvit.train import cpu_threads

FILES = ("tightness.png", "tightness.csv", "tightness.json")
DEFAULT_EPS = ",".join(f"{k / 100:g}" for k in range(1, 11))  # 0.01, 0.02, ..., 0.1
CSV_COLUMNS = (
    "method",
    "label",
    "eps",
    "bound_mean",
    "bound_median",
    "bound_min",
    "bound_max",
    "bound_std",
    "pgd_mean",
    "pgd_median",
    "pgd_min",
    "pgd_max",
    "ratio",
    "ratio_median",
    "ratio_max",
    "exact",
    "violations",
)


threads_option = click.option(
    "--threads",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="CPU threads; 0: one for models under a million parameters (tiny models "
    "run fastest on one thread, far faster on a shared machine), else torch's default",
)


def output_paths(out: Path, pdf: bool = False) -> list[Path]:
    """The files ``lipvit tightness --out OUT`` writes."""
    return [out / f for f in FILES] + ([out / "tightness.pdf"] if pdf else [])


def write_outputs(
    result,
    out: Path,
    *,
    checkpoint: str,
    dataset: str,
    index,
    pdf: bool = False,
    force: bool = False,
) -> list[Path]:
    """Write the figure, CSV and JSON of a :class:`~.tightness.Tightness`."""
    from lipvit.analysis.plots import save_figure
    from lipvit.analysis.tightness import tightness_figure

    paths = output_paths(out, pdf)
    out.mkdir(parents=True, exist_ok=True)
    fig = tightness_figure(result)
    save_figure(fig, out / "tightness.png", pdf, force=force)
    rows = result.to_records()
    C.write_csv(out / "tightness.csv", rows, force=force, columns=CSV_COLUMNS)
    C.write_json(
        out / "tightness.json",
        {
            "checkpoint": checkpoint,
            "dataset": dataset,
            "n": result.n,
            "target": result.target,
            "layer": result.layer,
            "residual": result.residual,
            "description": result.description,
            "eps": result.eps,
            "pgd": {
                "steps": result.pgd_settings.steps,
                "restarts": result.pgd_settings.restarts,
                "seed": result.pgd_settings.seed,
                "note": "PGD finds a lower bound of the maximal deviation",
            },
            "methods": {
                name: {
                    "label": m.label,
                    "exact": m.exact,
                    "note": m.note,
                    "seconds": result.seconds.get(name),
                }
                for name, m in result.methods.items()
            },
            "seconds_pgd": result.seconds.get("pgd"),
            "notes": list(result.notes),
            "violations": result.violations(),
            "rows": rows,
            "traces": result.traces,
            "samples": {
                "index": [int(i) for i in index],
                "pgd": result.pgd.T,
                "bounds": {m: b.T for m, b in result.bounds.items()},
            },
        },
        force=force,
    )
    return paths


@click.command("tightness")
@C.ckpt_option()
@click.option(
    "--layer",
    type=click.IntRange(min=0),
    default=None,
    help="block index of the attention layer (default 0)",
)
@click.option(
    "--network",
    is_flag=True,
    help="bound the whole network (image to logits) instead of one layer",
)
@click.option(
    "--margins",
    "margin",
    is_flag=True,
    help="bound every wrong-class margin's drop (image to margins f_y − f_j at "
    "the predicted y), the quantity each certificate compares with the margin, "
    "against targeted PGD on the same margin",
)
@click.option(
    "--eps",
    "eps_text",
    default=DEFAULT_EPS,
    show_default=True,
    help="comma list of l2/Frobenius radii (at the attention input for a "
    "layer, in image units for --network)",
)
@click.option(
    "--methods",
    "methods_alias",
    default=None,
    hidden=True,
    help="deprecated spelling of --method",
)
@click.option(
    "--method",
    "methods_text",
    default=None,
    help="comma list of bounds (layer: naive, lofast-xi, lofast, lofast-half, "
    "lofast-local, specformer, crown; network: lofast, lofast-fast, "
    "specformer, crown; margin: taylor, lofast, lofast-fast, specformer, "
    "crown). Default: all but crown (CROWN is slow; add it by name where "
    "auto_LiRPA is installed) and, for --margin, lofast-fast",
)
@click.option(
    "--residual",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="layer map: auto = as in the model (H = I only where norm1 is the "
    "identity on the ball), on = H = I on the attention input (LoFAST "
    "Table 3), off = H = 0",
)
@click.option(
    "--n",
    "n",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="test samples (a fixed seeded subsample)",
)
@click.option("--pgd-steps", type=click.IntRange(min=1), default=200, show_default=True)
@click.option(
    "--pgd-restarts", type=click.IntRange(min=1), default=8, show_default=True
)
@click.option("--seed", type=int, default=0, show_default=True, help="PGD seed")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="output folder (tightness.png, tightness.csv, tightness.json)",
)
@C.device_option
@threads_option
@C.data_options
@C.pdf_option
@C.force_option
def tightness(
    ckpt: Path,
    layer: int | None,
    network: bool,
    margin: bool,
    eps_text: str,
    methods_alias: str | None,
    methods_text: str | None,
    residual: str,
    n: int,
    pgd_steps: int,
    pgd_restarts: int,
    seed: int,
    out: Path,
    device: str,
    threads: int,
    dataset: str | None,
    data_dir: Path | None,
    pdf: bool,
    force: bool,
) -> None:
    """Upper bounds on the output deviation against the PGD lower bound, across eps
    (LoFAST Fig. 1 and Table 3): mean and min-max over samples, ratio bound/PGD.
    With --margin: every certify method's bound on each wrong-class margin drop
    against targeted PGD on that margin."""
    from lipvit.analysis.margin_tightness import (
        DEFAULT_MARGIN_METHODS,
        MARGIN_METHODS,
        margin_tightness,
    )
    from lipvit.analysis.tightness import (
        DEFAULT_LAYER_METHODS,
        DEFAULT_NETWORK_METHODS,
        LAYER_METHODS,
        NETWORK_METHODS,
        PGDSettings,
        crown_available,
        layer_tightness,
        network_tightness,
    )

    if network + margin + (layer is not None) > 1:
        raise ValueError("give one of --layer, --network and --margin")
    if methods_alias is not None:
        if methods_text is not None:
            raise ValueError("give --method once (--methods is its old spelling)")
        click.echo("warning: --methods is deprecated; use --method", err=True)
        methods_text = methods_alias
    registry, defaults = (
        (MARGIN_METHODS, DEFAULT_MARGIN_METHODS) if margin
        else (NETWORK_METHODS, DEFAULT_NETWORK_METHODS) if network
        else (LAYER_METHODS, DEFAULT_LAYER_METHODS))
    eps = C.parse_floats(eps_text, "eps")
    methods = (
        C.parse_names(methods_text, registry, "bound method")
        if methods_text
        else [m for m in defaults if m != "crown"]
    )
    pgd = PGDSettings(pgd_steps, pgd_restarts, seed)
    C.check_writable(output_paths(out, pdf), force)
    loaded = C.load_checkpoint(ckpt, device)
    C.check_vit(loaded, "lipvit tightness")
    model = loaded.model.double()
    data = C.load_test_set(
        loaded, n=n, dataset=dataset, data_dir=data_dir, device=device
    )
    x = data.x.to(torch.float64)
    C.warn_large_eps(eps, x.shape[1:])
    whole = network or margin
    if not whole and layer is None:
        layer = 0
    if not whole and layer >= len(model.blocks):
        raise ValueError(
            f"--layer must be a block index in 0..{len(model.blocks) - 1}, got {layer}"
        )
    # PGD, one stage per ε, is most of the time: the percentage counts its stages.
    bar = tqdm(desc="bounds", total=len(eps), leave=False,
               disable=not sys.stderr.isatty(),
               bar_format="tightness: {percentage:3.0f}% {desc} ({elapsed})")
    with bar, cpu_threads(model.config, C.resolve_device(device), threads):

        def progress(stage: str) -> None:
            if stage.startswith("pgd") and bar.desc.startswith("pgd"):
                bar.update(1)  # the previous ε is done
            bar.set_description_str(stage)

        if margin:
            result = margin_tightness(model, x, eps, methods, pgd=pgd,
                                      progress=progress)
        elif network:
            result = network_tightness(
                model, x, eps, methods, pgd=pgd, progress=progress
            )
        else:
            res = {"auto": "auto", "on": True, "off": False}[residual]
            result = layer_tightness(
                model, x, layer, eps, methods, residual=res, pgd=pgd, progress=progress
            )
    paths = write_outputs(
        result,
        out,
        checkpoint=str(ckpt),
        dataset=data.dataset,
        index=data.index,
        pdf=pdf,
        force=force,
    )
    click.echo(f"{ckpt}  dataset={data.dataset}  n={result.n}  {result.description}")
    for note in result.notes:
        click.echo(f"note: {note}")
    if not methods_text and crown_available():
        click.echo(
            "note: crown is installed but slow; add it with --method "
            f"{','.join(defaults)}"
        )
    click.echo(
        C.format_table(
            ["method", "eps", "mean bound", "mean PGD", "bound/PGD", "exact"],
            [
                [
                    r["method"],
                    r["eps"],
                    r["bound_mean"],
                    r["pgd_mean"],
                    r["ratio"],
                    "yes" if r["exact"] else "no (estimate)",
                ]
                for r in result.to_records()
            ],
        )
    )
    bad = {
        m: v for m, v in result.violations().items() if v and result.methods[m].exact
    }
    if bad:
        click.echo(f"warning: a bound fell below PGD (unsound?): {bad}", err=True)
    click.echo(f"wrote {', '.join(str(p) for p in paths)}")
