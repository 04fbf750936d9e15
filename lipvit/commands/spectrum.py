"""``lipvit spectrum``: weight and block-Jacobian spectra of several checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import numpy as np
import torch
from tqdm import tqdm

from lipvit.commands import _common as C
from lipvit.commands.tightness import threads_option
from lipvit.errors import UnsupportedModelError
from lipvit.train import cpu_threads

FILES = (
    "spectra.png",
    "jacobian.png",
    "spectrum.json",
    "weights.csv",
    "jacobian.csv",
    "deviation.csv",
)


def output_paths(out: Path, pdf: bool = False) -> list[Path]:
    """The files ``lipvit spectrum --out OUT`` writes."""
    pdfs = [out / "spectra.pdf", out / "jacobian.pdf"] if pdf else []
    return [out / f for f in FILES] + pdfs


def checkpoint_labels(paths: list[Path], labels: tuple[str, ...]) -> list[str]:
    """``--label`` values, or the file stems (the paths where stems repeat)."""
    if labels:
        if len(labels) != len(paths):
            raise ValueError(
                f"give one --label per --ckpt ({len(paths)}), got {len(labels)}"
            )
        names = list(labels)
    else:
        stems = [p.stem for p in paths]
        names = stems if len(set(stems)) == len(stems) else [str(p) for p in paths]
    if len(set(names)) != len(names):
        raise ValueError(f"checkpoint labels must differ, got {names}")
    return names


def write_outputs(
    results: dict,
    out: Path,
    *,
    checkpoints: dict[str, str],
    dataset: str,
    index,
    pdf: bool = False,
    force: bool = False,
) -> list[Path]:
    """Write figures, CSVs and JSON for label → :class:`~.spectrum.Spectrum`."""
    from lipvit.analysis.plots import plot_jacobian_violin, plot_spectra, save_figure
    from lipvit.analysis.spectrum import PENALISED, compare_weights

    paths = output_paths(out, pdf)
    out.mkdir(parents=True, exist_ok=True)
    # attention="conv" (CoViT) has no W_q, W_k, W_v: only its Jacobians count.
    weights = {
        label: s.weights for label, s in results.items() if s.weights["W_q"].size
    }
    if not weights:
        raise UnsupportedModelError(
            "no checkpoint has W_q, W_k, W_v (conv token mixing): add one with "
            "attention for the weight spectra"
        )
    title = "exact σ_max per head: " + " vs ".join(weights)
    fig = plot_spectra(weights, title=title)
    # Grouped by model (one colour each); the estimator is in the label and the
    # hatch: σ_max(J) exact (or a power-iteration estimate from below), and the
    # upper estimate √(‖J‖₁‖J‖∞) of eq. (16), hatched.
    violins, styles = {}, {}
    for m, (label, s) in enumerate(results.items()):
        kind = ("σ_max(J), exact" if s.jacobian.exact
                else "σ_max(J), power iteration (estimate from below)")
        exact_key, l1_key = f"{label}: {kind}", f"{label}: √(‖J‖₁‖J‖∞) (≥ σ_max)"
        violins[exact_key] = {
            f"block {k}": s.jacobian.sigma[k] for k in range(s.jacobian.sigma.shape[0])
        }
        violins[l1_key] = {
            f"block {k}": s.jacobian.l1_linf[k]
            for k in range(s.jacobian.l1_linf.shape[0])
        }
        styles[exact_key] = {"color": f"C{m}"}
        styles[l1_key] = {"color": f"C{m}", "hatch": "//"}
    n = next(iter(results.values())).jacobian.sigma.shape[1]
    vfig = plot_jacobian_violin(
        violins,
        y_label="‖J_F‖ per estimator (legend), F = block − id",
        title=f"block Jacobians at {n} test inputs",
        styles=styles,
    )
    save_figure(fig, out / "spectra.png", pdf, force=force)
    save_figure(vfig, out / "jacobian.png", pdf, force=force)
    w_rows = [r for label, s in results.items() for r in s.weight_records(label)]
    j_rows = [
        r for label, s in results.items() for r in s.jacobian.to_records(label, index)
    ]
    d_rows = [r for label, s in results.items() for r in s.deviation_records(label)]
    C.write_csv(out / "weights.csv", w_rows, force=force)
    C.write_csv(out / "jacobian.csv", j_rows, force=force)
    C.write_csv(
        out / "deviation.csv",
        d_rows,
        force=force,
        columns=[
            "checkpoint",
            "eps",
            "first_order_mean",
            "product_mean",
            "certified_mean",
            "pgd_mean",
            "first_order_over_pgd",
            "certified_over_pgd",
            "method",
        ],
    )
    labels = list(weights)
    comparison = (
        compare_weights(weights, labels[0], PENALISED + ("W_v W_o",))
        if len(labels) > 1
        else []
    )
    C.write_json(
        out / "spectrum.json",
        {
            "checkpoints": checkpoints,
            "dataset": dataset,
            "n": n,
            "index": [int(i) for i in index],
            "weights": {
                label: {m: v for m, v in w.items()} for label, w in weights.items()
            },
            "weights_note": "exact σ_max (dense SVD) per block (rows), head (columns)",
            "jacobian": {
                label: {
                    "method": s.jacobian.method,
                    "exact": s.jacobian.exact,
                    "sigma": s.jacobian.sigma,
                    "l1_linf": s.jacobian.l1_linf,
                    "sigma_mean": s.jacobian.sigma.mean(axis=1),
                    "sigma_std": s.jacobian.sigma.std(axis=1),
                    "l1_linf_mean": s.jacobian.l1_linf.mean(axis=1),
                    "seconds": s.jacobian.seconds,
                }
                for label, s in results.items()
            },
            "jacobian_note": "J is the Jacobian of F_k(X) = block_k(X) - X at the "
            "clean "
            "block input; sqrt(|J|_1 |J|_inf) is an upper bound of σ_max(J)",
            "deviation": {
                label: None
                if s.deviation is None
                else {
                    "eps": s.deviation.eps,
                    "gain": s.deviation.gain,
                    "method": s.deviation.method,
                    "first_order": s.deviation.first_order,
                    "product": s.deviation.product,
                    "certified": s.deviation.certified,
                    "pgd": s.deviation.pgd,
                }
                for label, s in results.items()
            },
            "deviation_note": "at the last block's output (before the final norm): "
            "first_order = eps * gain * exp(sum_k sigma_k) (Cauchy eq. 15, "
            "an estimate), product = eps * gain * prod_k (1 + sigma_k) (its discrete "
            "form, an estimate), certified = network_bound budget (upper bound), "
            "pgd = PGD deviation (lower bound)",
            "deviation_summary": d_rows,
            "comparison": {"reference": labels[0], "rows": comparison},
        },
        force=force,
    )
    return paths


@click.command("spectrum")
@C.ckpt_option(multiple=True)
@click.option(
    "--label",
    "labels",
    multiple=True,
    help="a name per --ckpt for tables and legends (default: file stems)",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="output folder (spectra.png, jacobian.png, spectrum.json, CSVs)",
)
@click.option(
    "--n",
    "n",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="test samples for the Jacobians (a fixed seeded subsample)",
)
@click.option(
    "--eps",
    "eps_text",
    default="0.01,0.1",
    show_default=True,
    help="image-space l2 radii of the first-order deviation comparison "
    "('none' to skip it)",
)
@click.option(
    "--jacobian",
    "jacobian_mode",
    type=click.Choice(["auto", "exact", "power"]),
    default="auto",
    show_default=True,
    help="σ_max(J): dense SVD (exact), power iteration (a lower estimate), "
    "or exact where the token matrix is small",
)
@click.option(
    "--method",
    type=click.Choice(["lofast", "lofast-fast", "specformer"]),
    default="lofast",
    show_default=True,
    help="attention bound of the certified budget",
)
@click.option("--pgd-steps", type=click.IntRange(min=1), default=50, show_default=True)
@click.option(
    "--pgd-restarts", type=click.IntRange(min=1), default=2, show_default=True
)
@C.device_option
@threads_option
@C.data_options
@C.pdf_option
@C.force_option
def spectrum(
    ckpt: tuple[Path, ...],
    labels: tuple[str, ...],
    out: Path,
    n: int,
    eps_text: str,
    jacobian_mode: str,
    method: str,
    pgd_steps: int,
    pgd_restarts: int,
    device: str,
    threads: int,
    dataset: str | None,
    data_dir: Path | None,
    pdf: bool,
    force: bool,
) -> None:
    """Exact σ_max of every head's W_q, W_k, W_v and W_v W_o per checkpoint (SpecFormer
    Fig. 2a), block-Jacobian σ_max and sqrt(‖J‖₁‖J‖∞) at test inputs (Cauchy-problem
    paper Fig. 3, Tables 1-2), and ε·exp(Σσ_k) beside the certified bound."""
    from lipvit.analysis.spectrum import PENALISED, compare_weights
    from lipvit.analysis.spectrum import spectrum as compute

    names = checkpoint_labels(list(ckpt), labels)
    eps = [] if eps_text.strip().lower() == "none" else C.parse_floats(eps_text, "eps")
    C.check_writable(output_paths(out, pdf), force)
    loaded = [C.load_checkpoint(p, device) for p in ckpt]
    for one in loaded:
        C.check_vit(one, "lipvit spectrum")
    data = None
    results = {}
    with tqdm(total=len(loaded), desc="spectrum", leave=False, unit="ckpt",
              disable=not sys.stderr.isatty()) as bar:
        for label, ck in zip(names, loaded, strict=True):
            d = C.load_test_set(
                ck, n=n, dataset=dataset, data_dir=data_dir, device=device
            )
            if data is not None and (
                d.dataset != data.dataset or not np.array_equal(d.index, data.index)
            ):
                raise ValueError(
                    "checkpoints must share the dataset and image size "
                    f"({label}: {d.dataset})"
                )
            data = d
            model = ck.model.double()
            with cpu_threads(model.config, C.resolve_device(device), threads):
                results[label] = compute(
                    model,
                    d.x.to(torch.float64),
                    eps,
                    jacobian=jacobian_mode,
                    method=method,
                    pgd_steps=pgd_steps,
                    pgd_restarts=pgd_restarts,
                    progress=lambda s, label=label: bar.set_postfix_str(
                        f"{label}: {s}"
                    ),
                )
            bar.update(1)
    paths = write_outputs(
        results,
        out,
        checkpoints=dict(zip(names, map(str, ckpt), strict=True)),
        dataset=data.dataset,
        index=data.index,
        pdf=pdf,
        force=force,
    )

    click.echo(f"dataset={data.dataset}  n={len(data.index)}")
    click.echo("exact σ_max per block, largest head:")
    click.echo(
        C.format_table(
            ["checkpoint", "block", "W_q", "W_k", "W_v", "W_v W_o"],
            [
                [
                    label,
                    k,
                    *(
                        float(s.weights[m][k].max())
                        for m in ("W_q", "W_k", "W_v", "W_v W_o")
                    ),
                ]
                for label, s in results.items()
                for k in range(s.weights["W_q"].shape[0])
            ],
        )
    )
    names = [lb for lb in names if results[lb].weights["W_q"].size]
    if len(names) > 1:
        rows = compare_weights(
            {lb: results[lb].weights for lb in names}, names[0], PENALISED
        )
        click.echo(f"\nlower than {names[0]} in every block (largest head):")
        click.echo(
            C.format_table(
                ["checkpoint", *PENALISED],
                [
                    [
                        label,
                        *(
                            "yes"
                            if all(
                                r[f"lower: {label}"] for r in rows if r["matrix"] == m
                            )
                            else "no"
                            for m in PENALISED
                        ),
                    ]
                    for label in names[1:]
                ],
            )
        )
    click.echo("\nresidual-branch Jacobian J_F per block (mean ± std over samples):")
    click.echo(
        C.format_table(
            ["checkpoint", "block", "sigma_max(J)", "std", "sqrt(|J|1|J|inf)", "sigma"],
            [
                [
                    label,
                    k,
                    float(s.jacobian.sigma[k].mean()),
                    float(s.jacobian.sigma[k].std()),
                    float(s.jacobian.l1_linf[k].mean()),
                    "exact" if s.jacobian.exact else "lower estimate",
                ]
                for label, s in results.items()
                for k in range(s.jacobian.sigma.shape[0])
            ],
        )
    )
    d_rows = [r for label, s in results.items() for r in s.deviation_records(label)]
    if d_rows:
        click.echo("\ndeviation of the last block's output (means over samples):")
        click.echo(
            C.format_table(
                [
                    "checkpoint",
                    "eps",
                    "eps*exp(sum sigma)",
                    "eps*prod(1+sigma)",
                    f"certified ({method})",
                    "PGD (lower bound)",
                ],
                [
                    [
                        r["checkpoint"],
                        r["eps"],
                        r["first_order_mean"],
                        r["product_mean"],
                        r["certified_mean"],
                        r["pgd_mean"],
                    ]
                    for r in d_rows
                ],
            )
        )
    click.echo(f"wrote {', '.join(str(p) for p in paths)}")
