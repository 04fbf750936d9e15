"""``lipvit certify``: certified accuracy (and radii) of a checkpoint on test images."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click
import torch
from click.core import ParameterSource
from tqdm import tqdm

from lipvit.certify.evaluate import (
    ALL_METHODS,
    QUANTITIES,
    CertifyReport,
    certify_samples,
    check_methods,
    merge_records,
    report_record,
)
from lipvit.certify.memory import parse_memory
from lipvit.certify.methods import DEFAULT_METHODS, default_method, taylor_unsupported
from lipvit.certify.smoothing import SmoothingConfig
from lipvit.certify.taylor.forward import check_supported
from lipvit.certify.taylor.jacobian_norms import (
    EXACT_GRAM_MAX,
    jets_fit,
    jets_need,
    plan,
)
from lipvit.certify.taylor.margin_jets import supports
from lipvit.commands import _common as C
from lipvit.distributed import (
    barrier,
    gather_to_root,
    load_shard,
    process_group,
    rank_device,
    ranks_from_env,
    save_shard,
    shard_path,
    shard_slice,
)
from lipvit.train import cpu_threads

TAYLOR_METHODS = frozenset({"taylor", "cascade-taylor"})
"""The methods that run ``taylor`` (checked for its memory before any work)."""
SEARCHED_RADII = TAYLOR_METHODS | {"margin"}
"""The methods whose radius search is the costly part (``taylor``'s; ``margin``'s
bisection, about 8 certificates a point), so a run with one of them computes
radii only with ``--radius`` (other runs always do: the other bound methods'
radii are nearly free)."""


def _methods_help() -> str:
    by_method: dict[str, list[str]] = {}
    for arch, method in DEFAULT_METHODS.items():
        by_method.setdefault(method, []).append(
            "lipvit's ViT" if arch == "vit" else f"{arch}")
    return "; ".join(f"{m} ({', '.join(a)})" for m, a in by_method.items())


def _radius_rows(report: CertifyReport, radii: list[float]) -> list[list]:
    rows = []
    for method, radius in report.radii.items():
        rows.append(
            [
                method,
                float(radius.median()),
                *(float((radius >= r).float().mean()) for r in radii),
            ]
        )
    return rows


def _radius_lines(report: CertifyReport, radius: bool, index,
                  stronger: str | None = None) -> list[str]:
    """After the table: the median radius (``--radius``) and, when nothing is
    certified, what to try: first the ``stronger`` method (a sound method the
    model supports that certifies more, when it was not used), then a smaller
    ε (the largest ε any point reaches, where the radii are known)."""
    lines = []
    if radius and report.radii:
        medians = ", ".join(f"{m} {float(r.median()):.4g}"
                            for m, r in report.radii.items())
        lines.append(f"median certified radius: {medians}")
    if any(r.certified_accuracy > 0 for r in report.results):
        return lines
    if all(r.method == "smoothing" for r in report.results):
        lines.append("nothing is certified at these eps with smoothing: the smoothed "
                     "classifier abstains, errs or reaches less than eps on every "
                     "point (a model trained with --noise-sd near --sigma, or a "
                     "larger --n-noise, certifies more)")
        return lines
    used = ", ".join(dict.fromkeys(r.method for r in report.results))
    advice = (f"--method {stronger} (a stronger sound certificate, slower) may "
              "certify points here; else " if stronger else "")
    best = max(((float(r.max()), m, int(r.argmax())) for m, r in report.radii.items()),
               default=None)
    if best is None:
        lines.append(f"nothing is certified at these eps with {used}: {advice}use a "
                     "smaller --eps, or --radius for every point's certified radius")
    elif best[0] > 0:
        lines.append(
            f"nothing is certified at these eps with {used}: {advice}use a smaller "
            f"--eps: the largest eps any point reaches is {best[0]:.4g} ({best[1]}, "
            f"test index {int(index[best[2]])}); --radius gives every point's radius")
    else:
        lines.append(f"no point is certified at any eps with {used} (every margin "
                     "is too small for the bound)"
                     + (f": try --method {stronger}" if stronger else ""))
    return lines


@click.command("certify")
@C.ckpt_option()
@click.option(
    "--eps",
    "eps_text",
    multiple=True,
    required=True,
    help="l2 radius in image units ([0,1] pixels), or a comma list (repeatable)",
)
@click.option(
    "--method",
    "method_text",
    multiple=True,
    help=f"comma list or repeatable, from: {', '.join(ALL_METHODS)} [default: "
         f"{_methods_help()}; lofast for a ViT taylor cannot bound, with a "
         "one-line note]",
)
@click.option(
    "--radius",
    is_flag=True,
    help="also find each sample's certified radius (bisection; taylor: a "
         "safeguarded secant search)",
)
@click.option(
    "--radius-tol",
    type=click.FloatRange(min=0, min_open=True),
    default=1e-3,
    show_default=True,
    help="relative bisection tolerance (the sound lower end is kept)",
)
@C.n_option
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="samples per batch (taylor certifies a batch's samples together, as "
         "many at a time as --max-memory holds); smoothing: noisy copies per "
         "forward pass",
)
@click.option(
    "--max-memory",
    "max_memory_text",
    default=None,
    help="memory taylor may hold for its tangents, samples and second-order "
         "models, e.g. 512M, 4G [default: 4G, or a sixth of the machine's memory "
         "if less]",
)
@click.option(
    "--max-symbols",
    type=click.IntRange(min=0),
    default=None,
    help="taylor, lipschitz family: flippable ReLU units carried exactly per "
         "sample and block (more is tighter and slower; the rest are bounded in "
         "norm) [default: max(1024, 4 x image dimension)]",
)
@click.option(
    "--sigma",
    type=float,
    default=None,
    help="smoothing: noise standard deviation (pixels in [0, 1]) [default: the "
         "checkpoint's --noise-sd]",
)
@click.option(
    "--n0",
    type=int,
    default=None,
    help="smoothing: selection draws per point [default: 100]",
)
@click.option(
    "--n-noise",
    type=int,
    default=None,
    help="smoothing: estimation draws per point [default: 100000]",
)
@click.option(
    "--alpha",
    type=float,
    default=None,
    help="smoothing: failure probability per point, in (0, 1) [default: 0.001]",
)
@click.option(
    "--seed",
    type=int,
    default=None,
    help="smoothing: seeds each point's noise with its test-set index [default: 0]",
)
@C.device_option
@C.data_options
@C.json_option
@C.csv_option
@C.force_option
@C.threads_option
@C.results_to_stdout
def certify(
    ckpt: Path,
    eps_text: tuple[str, ...],
    method_text: tuple[str, ...],
    radius: bool,
    radius_tol: float,
    n: int | None,
    batch_size: int,
    max_memory_text: str | None,
    max_symbols: int | None,
    sigma: float | None,
    n0: int | None,
    n_noise: int | None,
    alpha: float | None,
    seed: int | None,
    device: str,
    dataset: str | None,
    data_dir: Path | None,
    json_path: Path | None,
    csv_path: Path | None,
    force: bool,
) -> None:
    """Certified accuracy at each EPS for each METHOD (LoFAST Prop. 1: margin > √2·δ).

    Without --method: the architecture's default (--method's help): `taylor`
    on lipvit's ViT where it can bound it (else `lofast`, with a one-line
    note), `ball` on the hybrid ViT, `margin` on the CaiT (never weaker than
    `ball`; it follows each margin through attention, about 25× slower:
    0.6 s a point per eps on the Fashion-MNIST CaiT, one thread). When
    nothing is certified the last line names a stronger method, if one was
    not used, before suggesting a smaller eps. taylor's and margin's radius searches
    (their costly part) run only with --radius: a run with taylor,
    cascade-taylor or margin computes radii only then; other runs always
    compute their (cheap) radii for the JSON.

    `lofast` is sound (exact ζ and ‖M_h(X)‖); `lofast-fast` uses power-iteration
    estimates and is labelled exact=false; `taylor` bounds every wrong-class
    margin to first order exactly plus certified remainders (on standard ViTs
    with small images, to second order exactly: docs/taylor.md §12);
    `crown` needs auto_LiRPA; `alpha-crown` is CROWN with auto_LiRPA's
    optimised ReLU slopes (never looser, a little slower); `cascade` runs CROWN only
    where LoFAST did not certify, `cascade-taylor` only where taylor did not.

    `smoothing` is randomized smoothing (Cohen et al. 2019, CERTIFY with
    Clopper-Pearson bounds): a PROBABILISTIC certificate (probability >= 1 -
    alpha per point) of the smoothed classifier, not of the network; --sigma
    (default: the checkpoint's --noise-sd), --n0, --n-noise, --alpha, --seed;
    --batch-size is then its noisy copies per forward pass. Its rows are
    labelled, never mixed with the deterministic certificates.

    `torchrun --nproc_per_node K -m lipvit certify ... --samples N` shards the
    samples over K ranks (whole batches each, gloo) and rank 0 writes the merged
    JSON/CSV, equal to a single-process run's except the seconds_per_sample
    timings (summed work per sample). With --json/--csv FILE each rank keeps
    its finished shard in <FILE>.shard-<rank>-of-<K>.json: a rerun with the
    same settings reuses it; the shard files are removed after the merge.
    """
    ranks = ranks_from_env()
    eps_list = C.parse_floats(eps_text, "eps")
    methods = C.parse_names(method_text, ALL_METHODS, "method") if method_text else []
    smoothing_options = {"--sigma": sigma, "--n0": n0, "--n-noise": n_noise,
                         "--alpha": alpha, "--seed": seed}
    _check_smoothing_options(methods, smoothing_options)
    C.check_results([json_path, csv_path], force)
    dev = rank_device(C.resolve_device(device), ranks)
    loaded = C.load_checkpoint(ckpt, dev)
    smoothing = (smoothing_config(loaded, ckpt, sigma, n0, n_noise, alpha, seed,
                                  batch_size) if "smoothing" in methods else None)
    model = loaded.model.double()
    data = C.load_test_set(
        loaded, n=n, dataset=dataset, data_dir=data_dir, device=dev
    )
    if not methods:
        method, note = default_method(model)
        methods = [method]
        if note and ranks.rank == 0:
            click.echo(note, err=True)
    check_methods(model, methods)  # before any method's own checks
    if ranks.rank == 0:
        C.warn_large_eps(eps_list, data.x.shape[1:])
    max_memory = None if max_memory_text is None else parse_memory(max_memory_text)
    taylor = bool(TAYLOR_METHODS & set(methods))
    if taylor:
        check_supported(model)
        plan(model, EXACT_GRAM_MAX, max_memory)  # refuses a too small budget now
        if ranks.rank == 0 and supports(model) and not jets_fit(model, max_memory):
            click.echo(f"note: taylor without its second-order models: they need "
                       f"{jets_need(model) / 2**30:.1f} GiB per sample (--max-memory)",
                       err=True)
    # Only a named --radius pays for taylor's or margin's radius search.
    radii = radius or not SEARCHED_RADII & set(methods)
    stronger = (None if taylor or "smoothing" in methods or taylor_unsupported(model)
                else "taylor")
    shard = shard_slice(len(data.y), batch_size, ranks)
    # Shards lie beside a file output (none for standard output, `-`).
    output = next((p for p in (json_path, csv_path) if p and not C.is_stdout(p)),
                  None)
    shard_file = shard_path(output, ranks) if ranks.world > 1 and output else None
    settings = shard_settings(ckpt, data, shard, methods, eps_list, radius_tol,
                              batch_size, dev, max_memory=max_memory,
                              max_symbols=max_symbols, radii=radii,
                              smoothing=smoothing)
    with process_group(ranks):
        record = load_shard(shard_file, settings) if shard_file else None
        if record is None:
            record = _certify_shard(model, data.x[shard], data.y[shard], methods,
                                    eps_list, radius_tol, batch_size, loaded.config,
                                    show=ranks.rank == 0, max_memory=max_memory,
                                    max_symbols=max_symbols, radii=radii,
                                    smoothing=smoothing, index=data.index[shard])
            if shard_file:
                save_shard(shard_file, settings, record)
        records = gather_to_root(record, ranks)
        if records is not None:
            _report(merge_records(records), ckpt, data, methods, eps_list, radius,
                    json_path, csv_path, force, stronger=stronger,
                    smoothing=smoothing)
        barrier(ranks)  # the merged outputs are written: the shards are done
        if shard_file:
            shard_file.unlink(missing_ok=True)


def _check_smoothing_options(methods: list[str], options: dict) -> None:
    """Refuse, in one line, smoothing's options without ``--method smoothing``
    and ``--radius-tol`` with it (its radius is in closed form)."""
    if "smoothing" not in methods:
        given = [flag for flag, value in options.items() if value is not None]
        if given:
            raise ValueError(f"{given[0]} applies to --method smoothing only")
        return
    source = click.get_current_context().get_parameter_source("radius_tol")
    if source not in (None, ParameterSource.DEFAULT):
        raise ValueError("--radius-tol does not apply to smoothing: its radius "
                               "is in closed form, sigma * Phi^-1(p_lower)")


def smoothing_config(loaded, ckpt: Path, sigma: float | None, n0: int | None,
                     n_noise: int | None, alpha: float | None, seed: int | None,
                     batch_size: int) -> SmoothingConfig:
    """``smoothing``'s settings from the options; ``sigma`` defaults to the noise
    the checkpoint was trained with (``lipvit train --noise-sd``).

    Raises:
        ValueError: no ``sigma`` and a checkpoint trained without noise, or a
            setting :class:`SmoothingConfig` refuses (one line each).
    """
    if sigma is None:
        sigma = float((loaded.train_config or {}).get("noise_sd") or 0.0)
        if not sigma > 0:
            raise ValueError(f"smoothing needs --sigma: {ckpt} was not trained with "
                             "noise (lipvit train --noise-sd)")
    given = {"n0": n0, "n_noise": n_noise, "alpha": alpha, "seed": seed}
    return SmoothingConfig(sigma=sigma, batch_size=batch_size,
                           **{k: v for k, v in given.items() if v is not None})


def shard_settings(ckpt: Path, data: C.TestSet, shard: slice, methods: list[str],
                   eps_list: list[float], radius_tol: float, batch_size: int,
                   device: torch.device, *, max_memory: int | None = None,
                   max_symbols: int | None = None, radii: bool = True,
                   smoothing: SmoothingConfig | None = None) -> dict:
    """What a shard's results depend on: a shard file saved with other settings
    is not reused (the checkpoint is identified by path, size and mtime;
    ``radii``: whether the record holds every method's radii; ``smoothing``:
    its settings)."""
    stat = Path(ckpt).stat()
    return {
        "checkpoint": [str(Path(ckpt).resolve()), stat.st_size, stat.st_mtime_ns],
        "dataset": data.dataset, "index": data.index[shard].tolist(),
        "methods": methods, "eps": eps_list, "radius_tol": radius_tol,
        "batch_size": batch_size, "device": device.type, "max_memory": max_memory,
        "max_symbols": max_symbols, "radii": radii,
        "smoothing": None if smoothing is None else dataclasses.asdict(smoothing),
    }


def _certify_shard(model, x, y, methods, eps_list, radius_tol, batch_size, config,
                   show: bool, max_memory: int | None = None,
                   max_symbols: int | None = None, radii: bool = True,
                   smoothing: SmoothingConfig | None = None,
                   index=None) -> dict:
    """:func:`certify_samples` on one shard (every method's radii with
    ``radii``), as a plain record."""
    if len(y) == 0:
        return {"n": 0}
    x = x.to(torch.float64)
    bar_format = "{l_bar}{bar}| {n:.1f}/{total_fmt} samples [{elapsed}<{remaining}]"
    with (
        cpu_threads(config, x.device),
        tqdm(total=len(y), desc="certify", bar_format=bar_format,
             leave=False, disable=not show or not sys.stderr.isatty()) as bar,
    ):
        report = certify_samples(
            model,
            x,
            y,
            methods,
            eps_list,
            radius=radii,  # cheap for the bound methods; shown with --radius
            radius_tol=radius_tol,
            batch_size=batch_size,
            # shares of a sample add up to the total only up to float rounding
            progress=lambda done: bar.update(min(done, bar.total - bar.n)),
            max_memory=max_memory,
            max_symbols=max_symbols,
            smoothing=smoothing,
            index=index,
        )
    return report_record(report)


EXACT_TEXT = {"deterministic": "yes", "estimate": "no (estimate)",
              "probabilistic": "no (probabilistic)"}
"""The ``exact`` column of the table, per guarantee."""


def _smoothing_lines(report: CertifyReport, smoothing: SmoothingConfig) -> list[str]:
    """What ``smoothing``'s rows mean, and the smoothed classifier's accuracy
    beside the network's."""
    abstained = int((report.smoothing.prediction < 0).sum())
    return [f"smoothing: {smoothing.describe()}; n0 = {smoothing.n0}, n_noise = "
            f"{smoothing.n_noise}",
            f"smoothed classifier: accuracy {report.smoothed_accuracy:.4f} "
            f"(abstentions count as wrong), {abstained} of {report.n} abstained "
            f"(abstain rate {report.abstain_rate:.4f}); network clean accuracy "
            f"{report.clean_accuracy:.4f}"]


def _headline(report: CertifyReport, ckpt: Path, dataset: str) -> str:
    """The line above the table: the network's clean accuracy, and with
    ``smoothing`` the smoothed classifier's accuracy, each named for its
    classifier."""
    if report.smoothing is None:
        return (f"{ckpt}  dataset={dataset}  n={report.n}  "
                f"clean accuracy={report.clean_accuracy:.4f}")
    return (f"{ckpt}  dataset={dataset}  n={report.n}  "
            f"network clean accuracy={report.clean_accuracy:.4f}  "
            f"smoothed classifier accuracy={report.smoothed_accuracy:.4f}  "
            f"abstain rate={report.abstain_rate:.4f}")


def smoothing_record(report: CertifyReport, smoothing: SmoothingConfig) -> dict:
    """The JSON's ``smoothing`` object: the settings, the guarantee in words and
    the smoothed classifier's ``smoothed_accuracy`` and ``abstain_rate`` on the
    ``n`` points (the top-level ``clean_accuracy`` stays the network's)."""
    return {**dataclasses.asdict(smoothing), "guarantee": smoothing.describe(),
            "smoothed_accuracy": report.smoothed_accuracy,
            "abstain_rate": report.abstain_rate}


def _report(report: CertifyReport, ckpt: Path, data: C.TestSet, methods: list[str],
            eps_list: list[float], radius: bool, json_path: Path | None,
            csv_path: Path | None, force: bool, stronger: str | None = None,
            smoothing: SmoothingConfig | None = None) -> None:
    """Print the tables and write the JSON/CSV of the merged report
    (``stronger``: the method to suggest when nothing is certified)."""
    rows = report.to_records()
    click.echo(_headline(report, ckpt, data.dataset))
    click.echo(
        C.format_table(
            ["method", "eps", "certified acc", "s/sample", "exact"],
            [
                [
                    r["method"],
                    C.format_eps(r["eps"]),
                    r["certified_accuracy"],
                    r["seconds_per_sample"],
                    EXACT_TEXT[r["guarantee"]],
                ]
                for r in rows
            ],
        )
    )
    if report.smoothing is not None and smoothing is not None:
        for line in _smoothing_lines(report, smoothing):
            click.echo(line)
    for line in _radius_lines(report, radius, data.index, stronger):
        click.echo(line)
    if not radius:
        report = dataclasses.replace(report, radii={})
    if report.radii:
        click.echo("\ncertified radius (the largest eps proven, to --radius-tol):")
        click.echo(
            C.format_table(
                ["method", "median radius", *(f"acc@r>={r:g}" for r in eps_list)],
                _radius_rows(report, eps_list),
            )
        )
    if json_path:
        C.write_json(
            json_path,
            {
                "checkpoint": str(ckpt),
                "dataset": data.dataset,
                "n": report.n,
                "clean_accuracy": report.clean_accuracy,
                "results": [r.to_dict() for r in report.results],
                "quantities": {m: QUANTITIES[m] for m in methods if m in QUANTITIES},
                **({} if smoothing is None
                   else {"smoothing": smoothing_record(report, smoothing)}),
                "samples": report.sample_records(data.index),
            },
            force,
        )
    if csv_path:
        C.write_csv(csv_path, rows, force)
