"""``lipvit pipeline``: the whole study on one dataset, ending in ``report.md``.

Trains a vanilla standard ViT (``--msvp 0``), an MSVP standard ViT and a
lipschitz-family ViT (with MSVP; on Fashion-MNIST the CaiT, whose maps'
constants are proven instead, :mod:`lipvit.cait`); attacks all three;
certifies the lipschitz and MSVP models (the CaiT by ``ball`` and ``global``);
measures the tightness of the bounds (one attention layer and the
whole network) and compares the spectra of vanilla and MSVP; then writes
``OUT/report.md`` with the tables, the figures and the command of every part.

Every step *is* one ``lipvit`` command, run in this process through its click
entry point (``Command.main(args, standalone_mode=False)``: no shell, no new
interpreter), so the command the report prints for a step is exactly what ran
(the pipeline only adds ``--resume``/``--force``). With ``--jobs K`` up to K
steps whose inputs are ready run at once, each as that same command in its
own process (forked from one that imported lipvit once) with its share of
the CPU threads, writing
its output to ``OUT/logs/<step>.log``: a 2-core machine trains two models at
a time on one thread each, where one model on two threads gains little.
Like make, a step whose
output files all exist and are newer than its inputs (the checkpoints or
results it reads) is skipped; training resumes an unfinished checkpoint and
skips a finished one; ``--force`` redoes everything. Timings per step are kept
in ``OUT/pipeline.json``.

Settings. Beside the first output of every step lies ``<output>.settings.json``:
a hash of the step's effective configuration (its command line, which fixes
every option) and that line. A run whose steps' outputs exist but were made
with other settings (e.g. ``--fast`` before, not now) is refused before any
work, naming the steps; ``--force`` redoes them. So the report's "Reproduce"
lines are always the commands that made its numbers.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import click
import torch

from lipvit.analysis.report import pipeline_report
from lipvit.analysis.tightness import crown_available
from lipvit.commands import _common as C
from lipvit.commands.attack import attack
from lipvit.commands.certify import certify
from lipvit.commands.plot import plot
from lipvit.commands.spectrum import output_paths as spectrum_paths
from lipvit.commands.spectrum import spectrum
from lipvit.commands.tightness import output_paths as tightness_paths
from lipvit.commands.tightness import tightness
from lipvit.commands.train import (
    DEFAULT_PRESET,
    FALLBACK_PRESET,
    preset_help,
    train_command,
)
from lipvit.config import PRESETS
from lipvit.data import DATASETS, check_data_dir, default_dirs_text
from lipvit.errors import LipvitError
from lipvit.pipeline.scheduler import cpu_count, default_jobs, run_plan
from lipvit.pipeline.steps import Plan, Settings, Step, check_settings

MODELS = ("vanilla", "msvp", "lipschitz")


def build_plan(
    out: Path,
    settings: Settings,
    *,
    dataset: str = "digits",
    data_dir: Path | None = None,
    device: str = "auto",
    crown: bool = False,
    threads: int = 0,
) -> Plan:
    """All steps of a run in order (nothing is run); ``threads`` > 0 is passed to
    the commands that take ``--threads``."""
    s = settings
    plan = Plan(out, s)
    add = plan.steps.append
    data_dir_args = ("--data-dir", str(data_dir)) if data_dir else ()
    dev = ("--device", device, *data_dir_args)  # every command after training
    size = (("--preset", s.preset) if s.preset else ()) + (
        ("--epochs", str(s.epochs)) if s.epochs else ()
    )
    train_dev = device if device in ("auto", "cpu", "cuda") else "cuda"
    thr = ("--threads", str(threads)) if threads else ()
    # The hybrid ViT's and CaiT's maps carry proven constants: no MSVP, and
    # only ball and global bound them (no CROWN, LoFAST or taylor steps).
    proven = lipschitz_arch(dataset, s.preset) != "vit"
    families = {
        "vanilla": ("standard", "0"),
        "msvp": ("standard", f"{s.msvp:g}"),
        "lipschitz": ("lipschitz", "0" if proven else f"{s.msvp:g}"),
    }
    common = ("--dataset", dataset, *data_dir_args, "--device", train_dev,
              "--seed", "0", "--no-progress", *thr)

    for name, (family, lam) in families.items():
        ckpt = plan.model(name)
        args = ("--family", family, "--msvp", lam, *size, *common, "--out", str(ckpt))
        add(Step(f"train/{name}", f"train {name}", train_command, args,
                 (ckpt, ckpt.with_suffix(".json")), train=True))
    for name in MODELS:
        ckpt = plan.model(name)
        js, cs = out / "attack" / f"{name}.json", out / "attack" / f"{name}.csv"
        args = (
            "--ckpt",
            str(ckpt),
            "--attack",
            s.attacks,
            "--norm",
            "l2",
            "--eps",
            s.attack_eps,
            "--steps",
            str(s.attack_steps),
            "--n",
            str(s.attack_n),
            *dev,
            "--json",
            str(js),
            "--csv",
            str(cs),
        )
        add(
            Step(
                f"attack/{name}",
                f"attack {name} ({s.attacks.replace(',', ', ')}; {s.attack_n} points)",
                attack,
                args,
                (js, cs),
                inputs=(ckpt,),
            )
        )
    for name in ("lipschitz", "msvp"):
        ckpt = plan.model(name)
        js, cs = out / "certify" / f"{name}.json", out / "certify" / f"{name}.csv"
        methods = "ball,global" if proven and name == "lipschitz" else s.certify_methods
        # radii where the gap is drawn: the standard model's second-order
        # Taylor models make its radius search the costliest step of the job
        radii = name == "lipschitz"
        args = (
            "--ckpt",
            str(ckpt),
            "--eps",
            s.certify_eps,
            "--method",
            methods,
            *(("--radius",) if radii else ()),
            "--n",
            str(s.certify_n),
            *dev,
            "--json",
            str(js),
            "--csv",
            str(cs),
        )
        add(
            Step(
                f"certify/{name}",
                f"certify {name} ({methods.replace(',', ', ')}; {s.certify_n} points"
                f"{', radii' if radii else ''})",
                certify,
                args,
                (js, cs),
                inputs=(ckpt,),
            )
        )
        fig, attacked = out / "certify" / f"{name}.png", out / "attack" / f"{name}.json"
        args = (
            "certified",
            str(js),
            str(attacked),
            "--out",
            str(fig),
            "--title",
            f"{name}: certified (ℓ2) vs attacked accuracy",
        )
        add(
            Step(
                f"plot/{name}",
                f"plot certified accuracy of {name}",
                plot,
                args,
                (fig,),
                inputs=(js, attacked),
            )
        )
    lip = plan.model("lipschitz")
    cert, radius_js = out / "certify" / "lipschitz.json", out / "attack" / "radius.json"
    args = ("--ckpt", str(lip), "--radius", "--attack", s.radius_attacks, "--steps",
            str(s.radius_steps), "--restarts", str(s.radius_restarts), "--n",
            str(s.certify_n), *dev, "--json", str(radius_js), "--csv",
            str(radius_js.with_suffix(".csv")))
    add(Step("attack/radius", "attack radii of lipschitz (the certified samples)",
             attack, args, (radius_js, radius_js.with_suffix(".csv")), inputs=(lip,)))
    fig = out / "certify" / "gap.png"
    args = ("gap", str(cert), str(radius_js), "--out", str(fig), "--title",
            "lipschitz: certified radius vs attack radius")
    add(Step("plot/gap", "plot the certification gap of lipschitz", plot, args,
             (fig,), inputs=(cert, radius_js)))
    if crown and s.crown_n > 0 and not proven:
        js = out / "certify" / "lipschitz-crown.json"
        cs = out / "certify" / "lipschitz-crown.csv"
        args = (
            "--ckpt",
            str(lip),
            "--eps",
            s.crown_eps,
            "--method",
            "lofast,crown,cascade",
            "--n",
            str(s.crown_n),
            *dev,
            "--json",
            str(js),
            "--csv",
            str(cs),
        )
        add(
            Step(
                "certify/lipschitz-crown",
                "certify lipschitz with CROWN and the cascade",
                certify,
                args,
                (js, cs),
                inputs=(lip,),
            )
        )
    network_methods = (
        ("--method", "lofast,lofast-fast,specformer,crown") if crown else ()
    )
    vanilla = plan.model("vanilla")
    layer = (s.tightness_eps, s.tightness_n, s.tightness_pgd)
    margin = (s.margin_eps, s.margin_n, s.margin_pgd)
    for key, ckpt, extra, (eps, n, (steps, restarts)) in (
        ("layer", lip, ("--layer", "0"), layer),
        ("layer-residual", lip, ("--layer", "0", "--residual", "on"), layer),
        # MSVP makes the lipschitz model's attention uniform (a degenerate
        # layer); the vanilla model's is not.
        ("layer-vanilla", vanilla, ("--layer", "0"), layer),
        ("network", lip, ("--network", *network_methods),
         (s.network_eps, s.tightness_n, s.network_pgd)),
        # The certificate that decides: each method's bound on every wrong-class
        # margin's drop against targeted PGD, for both certified models.
        ("margin-lipschitz", lip, ("--margins",), margin),
        ("margin-msvp", plan.model("msvp"), ("--margins",), margin),
    ):
        if proven and ckpt == lip:  # no LoFAST layer bounds
            continue
        d = out / "tightness" / key
        name = ckpt.stem
        args = (
            "--ckpt",
            str(ckpt),
            *extra,
            "--eps",
            eps,
            "--n",
            str(n),
            "--pgd-steps",
            str(steps),
            "--pgd-restarts",
            str(restarts),
            *dev,
            *thr,
            "--out",
            str(d),
        )
        add(
            Step(
                f"tightness/{key}",
                f"tightness ({key}) of {name}",
                tightness,
                args,
                tuple(tightness_paths(d)),
                inputs=(ckpt,),
            )
        )
    d = out / "spectrum"
    msvp = plan.model("msvp")
    args = (
        "--ckpt",
        str(vanilla),
        "--ckpt",
        str(msvp),
        "--label",
        "vanilla",
        "--label",
        "msvp",
        "--n",
        str(s.spectrum_n),
        "--eps",
        s.spectrum_eps,
        "--pgd-steps",
        str(s.spectrum_pgd[0]),
        "--pgd-restarts",
        str(s.spectrum_pgd[1]),
        *dev,
        *thr,
        "--out",
        str(d),
    )
    add(
        Step(
            "spectrum",
            "spectra of vanilla and msvp",
            spectrum,
            args,
            tuple(spectrum_paths(d)),
            inputs=(vanilla, msvp),
        )
    )
    return plan


def lipschitz_arch(dataset: str, preset: str | None) -> str:
    """The ``arch`` of the lipschitz model ``lipvit train`` builds for
    ``dataset`` (``preset``, else its default preset)."""
    name = preset or DEFAULT_PRESET.get((dataset, "lipschitz"), FALLBACK_PRESET)
    return PRESETS[name].get("arch", "vit")


def write_report(plan: Plan, record: dict[str, Any]) -> Path:
    """Write ``OUT/report.md`` (always rewritten: it only reads the results)."""
    commands = {step.key: step.line() for step in plan.steps}
    path = plan.out / "report.md"
    with C.atomic_path(path, force=True) as tmp:
        tmp.write_text(
            pipeline_report(plan.out, commands, record).render(), encoding="utf-8"
        )
    return path


@click.command("pipeline")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="output folder of the run (models/, attack/, certify/, tightness/, "
         "spectrum/, report.md)",
)
@click.option("--force", is_flag=True, help="redo every step, even where outputs exist")
@click.option(
    "--fast",
    is_flag=True,
    help="smoke-test sizes (2 epochs of digits-smoke models on digits, a handful "
    "of samples): seconds",
)
@click.option(
    "--preset",
    default=None,
    type=click.Choice(tuple(PRESETS)),
    help="model size for all three models (default: `lipvit train`'s "
    f"per-dataset and per-family preset: {preset_help()})",
)
@click.option(
    "--epochs",
    type=click.IntRange(min=1),
    default=None,
    help="training epochs (default: `lipvit train`'s per-dataset and per-family "
    "defaults)",
)
@click.option(
    "--msvp",
    "msvp_lambda",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="MSVP weight λ of the msvp model  [default: 1e-3]",
)
@click.option(
    "--dataset",
    type=click.Choice(DATASETS),
    default="digits",
    show_default=True,
    help="digits: the quick default job; fashion-mnist: real 28×28 images, "
    "the presets and schedules of `lipvit train` (25–40 minutes of training "
    "per model on a 2-core CPU)",
)
@click.option(
    "--data-dir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help=f"directory of a dataset that is not embedded [{default_dirs_text()}]",
)
@C.device_option
@click.option(
    "--threads",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="CPU threads for every step; 0: one for digits on the CPU (the tiny "
    "models run fastest on one thread, and far faster on a shared "
    "machine), torch's default otherwise",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=None,
    help="steps run at once, each in its own process (a step starts when the "
    "steps it reads from are done; output in OUT/logs/); 1 runs them one after "
    "the other in this process. Each gets --threads, or else an equal share of "
    "the CPUs: a 2-core machine trains two models at a time on one thread each "
    "[default: the CPUs this process may use, fewer if the memory holds "
    f"fewer steps of 3 GB: {default_jobs()} here]",
)
@click.option(
    "--crown/--no-crown",
    default=None,
    help="also certify the lipschitz model with CROWN and the LoFAST→CROWN cascade "
    "(needs auto_LiRPA) [default: on a CUDA device when auto_LiRPA is installed; "
    "CROWN takes minutes per sample on a CPU]",
)
def pipeline(
    out: Path,
    force: bool,
    fast: bool,
    preset: str | None,
    epochs: int | None,
    msvp_lambda: float | None,
    dataset: str,
    data_dir: Path | None,
    device: str,
    threads: int,
    jobs: int | None,
    crown: bool | None,
) -> None:
    """Train vanilla, MSVP and lipschitz ViTs, attack, certify, measure tightness and
    spectra, and write OUT/report.md (steps whose outputs exist are skipped)."""
    jobs = jobs or default_jobs()
    settings = Settings.fast_mode(dataset) if fast else Settings.for_dataset(dataset)
    overrides = {
        k: v
        for k, v in (("preset", preset), ("epochs", epochs), ("msvp", msvp_lambda))
        if v is not None
    }
    settings = dataclasses.replace(settings, **overrides)
    resolved = C.resolve_device(device)  # a bad device fails here, before any work
    check_data_dir(dataset, data_dir)  # and a missing data directory
    available = crown_available()
    if crown and not available:
        raise LipvitError(
            "--crown needs auto_LiRPA; install it as the README says (pip install "
            "--no-deps auto_LiRPA==0.3 and its small runtime needs)"
        )
    if crown is None:
        crown = available and resolved.type == "cuda"
    plan = build_plan(
        out,
        settings,
        dataset=dataset,
        data_dir=data_dir,
        device=device,
        crown=crown,
        threads=threads,
    )
    C.check_output_dir(out)
    if not force:
        check_settings(plan)
    out.mkdir(parents=True, exist_ok=True)
    click.echo(
        f"lipvit pipeline: {len(plan.steps)} steps into {out}"
        + (" (fast mode)" if fast else "")
    )
    t0 = time.perf_counter()
    meta = {
        "settings": dataclasses.asdict(settings),
        "dataset": dataset,
        "device": device,
        "fast": fast,
        "crown_available": available,
        "crown": crown,
        "jobs": jobs,
    }
    before = torch.get_num_threads()
    digits_cpu = dataset == "digits" and resolved.type == "cpu"
    if threads or digits_cpu:
        torch.set_num_threads(threads or 1)
    job_threads = threads or (1 if digits_cpu else max(1, cpu_count() // jobs))
    try:
        record = run_plan(plan, force=force, echo=click.echo, meta=meta, jobs=jobs,
                          job_threads=job_threads)
    finally:
        torch.set_num_threads(before)
    wall = time.perf_counter() - t0
    record["last_run_seconds"] = wall
    C.write_json(out / "pipeline.json", record, force=True)
    report = write_report(plan, record)
    click.echo(
        f"done in {wall:.1f} s (the steps' own times summed, over parallel "
        f"jobs and the earlier runs whose results were kept: "
        f"{record['total_seconds']:.1f} s); wrote {report}"
    )
