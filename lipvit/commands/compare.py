"""``lipvit compare``: every attention × MSVP on/off, trained and evaluated alike.

Thin wiring of :mod:`lipvit.analysis.compare`: parse, build a
:class:`~lipvit.analysis.compare.CompareSettings`, run, write the report.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import click

from lipvit.commands import _common as C
from lipvit.config import ATTENTIONS, PRESETS
from lipvit.data import DATASETS


def reproduce_command(out: Path, settings) -> str:
    """The explicit ``python -m lipvit compare`` line that redoes ``settings``."""
    s = settings
    args = [
        "compare", "--out", str(out), "--dataset", s.dataset, "--preset", s.preset,
        "--attention", ",".join(s.attentions), "--msvp", f"{s.msvp:g}",
        "--epochs", str(s.epochs),
        "--eps-linf", ",".join(f"{e:.10g}" for e in s.eps_linf),
        "--eps-l2", ",".join(f"{e:g}" for e in s.eps_l2),
        "--n", str(s.n_attack), "--attack-steps", str(s.attack_steps),
        "--autoattack" if s.autoattack else "--no-autoattack",
        "--n-autoattack", str(s.n_autoattack),
        "--n-jacobian", str(s.n_jacobian), "--seed", str(s.seed),
    ]
    if s.fast:
        args.append("--fast")
    return "python -m lipvit " + shlex.join(args)


@click.command("compare")
@click.option(
    "--out", type=click.Path(file_okay=False, path_type=Path),
    default=Path("runs/compare"), show_default=True,
    help="Output folder (models/ holds checkpoints and cached evaluations).",
)
@click.option("--dataset", type=click.Choice(DATASETS), default="digits",
              show_default=True)
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              default=None, help="Directory of the dataset's files (not digits).")
@click.option("--preset", "preset_name", type=click.Choice(tuple(PRESETS)),
              default="digits-tiny", show_default=True, help="Model size.")
@click.option("--attention", "attention", default=",".join(ATTENTIONS),
              show_default=True,
              help="Comma list of attentions to compare (must include dot).")
@click.option("--msvp", type=float, default=1e-3, show_default=True,
              help="MSVP lambda (q, k, v) of the MSVP runs.")
@click.option("--epochs", type=int, default=None,
              help="Epochs per model [default: 15; 1 with --fast].")
@click.option("--eps-linf", default="2/255,8/255", show_default=True,
              help="l-inf attack radii (FGSM, PGD, AutoAttack).")
@click.option("--eps-l2", default="0.1,0.5", show_default=True,
              help="l2 attack radii (PGD-l2, AutoAttack) and certificate radii.")
@click.option("--n", "n", type=click.IntRange(min=1), default=None,
              help="Test images attacked and certified [default: 200; 16 "
              "with --fast].")
@click.option("--attack-steps", type=click.IntRange(min=1), default=None,
              help="PGD steps [default: 10; 2 with --fast].")
@click.option("--autoattack/--no-autoattack", default=False, show_default=True,
              help="Also run AutoAttack (standard, original counts: about a "
              "minute of CPU per model and radius on digits).")
@click.option("--n-autoattack", type=click.IntRange(min=1), default=None,
              help="Images AutoAttack runs on (the first of --n) [default: 25].")
@click.option("--n-jacobian", type=click.IntRange(min=1), default=None,
              help="Clean points of the block-Jacobian spectrum [default: 16].")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--fast", is_flag=True,
              help="Smoke run: 1 epoch, 16 images, 2 PGD steps.")
@C.force_option
@click.option("--progress/--no-progress", default=False, show_default=True,
              help="Training progress bars (stderr).")
@C.threads_option
def compare(out: Path, dataset: str, data_dir: Path | None, preset_name: str,
            attention: str, msvp: float, epochs: int | None, eps_linf: str,
            eps_l2: str, n: int | None, attack_steps: int | None,
            autoattack: bool, n_autoattack: int | None, n_jacobian: int | None,
            seed: int,
            fast: bool, force: bool, progress: bool) -> None:
    """Train one model per (attention, MSVP on/off) and compare them.

    Writes OUT/compare.csv, compare.json, jacobian.png, accuracy.png and
    report.md: clean, FGSM, PGD and AutoAttack accuracy at two l-inf and two l2
    radii, seconds per epoch and the ratio to vanilla, mean sigma_max of W_q,
    W_k, W_v, per-block Jacobian sigma_max and certified accuracy where a
    certificate exists. Rerunning resumes: finished models and evaluations are
    reused; other training settings (dataset, preset, msvp, epochs, seed) for
    the same OUT are refused unless --force; other evaluation settings redo
    the evaluations.
    """
    from lipvit.analysis.compare import (
        CompareSettings,
        markdown_table,
        run_compare,
        write_report,
    )
    from lipvit.data import load_dataset

    wall0, cpu0 = time.perf_counter(), time.process_time()
    given = {
        "epochs": epochs, "n_attack": n, "attack_steps": attack_steps,
        "n_autoattack": n_autoattack, "n_jacobian": n_jacobian,
    }
    common = dict(
        dataset=dataset, preset=preset_name,
        attentions=tuple(C.parse_names(attention, ATTENTIONS, "attention")),
        msvp=msvp, seed=seed, autoattack=autoattack,
        eps_linf=tuple(C.parse_floats(eps_linf, "--eps-linf")),
        eps_l2=tuple(C.parse_floats(eps_l2, "--eps-l2")),
        **{k: v for k, v in given.items() if v is not None},
    )
    settings = (CompareSettings.fast_mode(**common) if fast
                else CompareSettings(**common))
    data = load_dataset(dataset, data_dir)
    index = C.subsample(int(data.x_test.shape[0]), settings.n_attack)
    comp = run_compare(out, settings, data, index, force=force, progress=progress,
                       log=click.echo)
    command = reproduce_command(out, settings)
    comp.seconds["command_wall"] = time.perf_counter() - wall0
    comp.seconds["command_cpu"] = time.process_time() - cpu0
    paths = write_report(comp, out, command)

    click.echo(markdown_table(comp))
    click.echo(
        f"wall {comp.seconds['command_wall']:.0f} s, process CPU "
        f"{comp.seconds['command_cpu']:.0f} s; wrote "
        + ", ".join(str(p) for p in paths)
    )
