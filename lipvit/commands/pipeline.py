"""``lipvit pipeline``: the whole study on one dataset, ending in ``report.md``.

Trains a vanilla standard ViT (``--msvp 0``), an MSVP standard ViT and a
lipschitz-family ViT (with MSVP; on Fashion-MNIST the hybrid ViT, whose
attention's constant is proven instead, :mod:`lipvit.hybrid`); attacks all
three; certifies the lipschitz and MSVP models (the hybrid by its global
constant); measures the tightness of the bounds (one attention layer and the
whole network) and compares the spectra of vanilla and MSVP; then writes
``OUT/report.md`` with the tables, the figures and the command of every part.

Every step *is* one ``lipvit`` command, run in this process through its click
entry point (``Command.main(args, standalone_mode=False)``: no shell, no new
interpreter), so the command the report prints for a step is exactly what ran
(the pipeline only adds ``--resume``/``--force``). With ``--jobs K`` up to K
steps whose inputs are ready run at once, each as that same command in its
own ``python -m lipvit`` process with its share of the CPU threads, writing
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

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from lipvit.commands import _common as C
from lipvit.config import PRESETS
from lipvit.data import DATASETS, default_dirs_text
from lipvit.errors import CheckpointError, LipvitError

MODELS = ("vanilla", "msvp", "lipschitz")


@dataclass(frozen=True)
class Settings:
    """Sizes of one pipeline run (defaults: about 4 minutes on digits on a 2-core
    CPU, two steps at a time, most of it certifying the standard model with
    ``taylor``'s second-order models on ``certify_n`` points; on
    ``fashion-mnist`` training takes 30–40 minutes per model on the 2-core CPU).

    ``fast`` shrinks everything to a smoke test (seconds on digits).
    """

    epochs: int | None = None  # None: `lipvit train`'s per-family defaults
    preset: str | None = None  # None: `lipvit train`'s per-family default preset
    msvp: float = 1e-3
    attacks: str = "pgd-l2,cw"
    attack_eps: str = "0.005,0.01,0.02,0.05,0.1,0.2,0.5"
    attack_n: int = 100
    attack_steps: int = 20
    certify_eps: str = "0.002,0.005,0.01,0.02,0.05"
    certify_n: int = 40
    certify_methods: str = "lofast,lofast-fast,specformer,taylor"  # radii: gap figure
    radius_attacks: str = "pgd-l2,apgd-t,cw"  # attack radii of the lipschitz model
    radius_steps: int = 20
    radius_restarts: int = 1
    crown_eps: str = "0.01"
    crown_n: int = 5
    tightness_eps: str = "0.01,0.02,0.03,0.05,0.07,0.1"
    tightness_n: int = 10
    tightness_pgd: tuple[int, int] = (100, 4)
    network_eps: str = "0.01,0.02,0.05,0.1"
    network_pgd: tuple[int, int] = (100, 4)
    margin_eps: str = "0.005,0.01,0.02,0.05"
    margin_n: int = 6
    margin_pgd: tuple[int, int] = (50, 2)
    spectrum_n: int = 16
    spectrum_eps: str = "0.01,0.1"
    spectrum_pgd: tuple[int, int] = (50, 2)

    @classmethod
    def for_dataset(cls, dataset: str = "digits") -> Settings:
        """Full sizes for ``dataset``: the defaults on digits (8×8 images); on real
        images (28×28 and up, ‖x‖ of tens in [0, 1] units) the ℓ2 radii the
        literature reports: attacks (PGD-ℓ2 and APGD) at 0.1–1.0 and
        certificates at 0.05–0.5."""
        if dataset == "digits":
            return cls()
        return cls(
            attacks="pgd-l2,apgd",
            attack_eps="0.1,0.25,0.5,1.0",
            certify_eps="0.05,0.1,0.25,0.5",
            network_eps="0.05,0.1,0.25,0.5",
            margin_eps="0.05,0.1,0.25,0.5",
        )

    @classmethod
    def fast_mode(cls, dataset: str = "digits") -> Settings:
        """Smoke-test sizes; off digits, one epoch of `lipvit train`'s presets for
        the dataset."""
        digits = dataset == "digits"
        return cls(
            epochs=2 if digits else 1,
            preset="digits-smoke" if digits else None,
            attacks="pgd-l2",
            attack_eps="0.5",
            attack_n=8,
            attack_steps=5,
            certify_eps="0.05,0.5",
            certify_n=8,
            radius_attacks="pgd-l2,cw",
            radius_steps=5,
            crown_n=0,
            tightness_eps="0.01,0.1",
            tightness_n=3,
            tightness_pgd=(10, 1),
            network_eps="0.01,0.1",
            network_pgd=(10, 1),
            margin_eps="0.01,0.1",
            margin_n=2,
            margin_pgd=(5, 1),
            spectrum_n=3,
            spectrum_eps="0.01",
            spectrum_pgd=(5, 1),
        )


@dataclass(frozen=True)
class Step:
    """One ``lipvit`` command of the pipeline, the files it writes (``outputs``) and
    the files it reads that earlier steps write (``inputs``)."""

    key: str
    title: str
    command: click.Command
    args: tuple[str, ...]
    outputs: tuple[Path, ...]
    train: bool = False
    inputs: tuple[Path, ...] = ()

    @property
    def prog(self) -> str:
        return f"lipvit {self.command.name}"

    def line(self) -> str:
        """The reproducing command line."""
        from lipvit.analysis.report import command_line

        return command_line([self.command.name, *self.args])

    def settings_hash(self) -> str:
        """Hash of the effective configuration: the command and all its options."""
        text = json.dumps([self.command.name, *self.args])
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

    @property
    def settings_path(self) -> Path:
        """``<first output>.settings.json``, written after the step ran."""
        first = self.outputs[0]
        return first.with_name(first.name + ".settings.json")

    def recorded(self) -> dict[str, Any] | None:
        """The settings record of existing outputs (``None``: no outputs, or none
        recorded)."""
        try:
            data = json.loads(self.settings_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return None
        return data if isinstance(data, dict) else None

    def stale(self) -> bool:
        """Outputs exist that were made with other (or unrecorded) settings."""
        if not any(p.exists() for p in self.outputs):
            return False
        recorded = self.recorded()
        return recorded is None or recorded.get("hash") != self.settings_hash()

    def record_settings(self) -> None:
        C.write_json(self.settings_path,
                     {"hash": self.settings_hash(), "command": self.line()}, force=True)

    def done(self) -> bool:
        """All outputs exist and are newer than every input (like make); for
        training, the outputs are a finished checkpoint and its summary."""
        if self.train:
            if not (_finished(self.outputs[0]) and self.outputs[1].exists()):
                return False
        elif not all(p.exists() for p in self.outputs):
            return False
        oldest = min(p.stat().st_mtime_ns for p in self.outputs)
        return all(p.exists() and p.stat().st_mtime_ns <= oldest for p in self.inputs)


def _finished(path: Path) -> bool:
    if not path.exists():
        return False
    from lipvit.checkpoint import load_checkpoint

    try:
        return load_checkpoint(path).summary is not None
    except CheckpointError:
        return False


@dataclass
class Plan:
    """The steps of a run and where things go."""

    out: Path
    settings: Settings
    steps: list[Step] = field(default_factory=list)

    def model(self, name: str) -> Path:
        return self.out / "models" / f"{name}.pt"


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
    from lipvit.commands.attack import attack
    from lipvit.commands.certify import certify
    from lipvit.commands.plot import plot
    from lipvit.commands.spectrum import output_paths as spectrum_paths
    from lipvit.commands.spectrum import spectrum
    from lipvit.commands.tightness import output_paths as tightness_paths
    from lipvit.commands.tightness import tightness
    from lipvit.commands.train import train_command

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
    # The hybrid ViT's attention carries a proven constant: no MSVP, and only
    # the global certificate bounds it (no CROWN, LoFAST or taylor steps).
    hybrid = lipschitz_arch(dataset, s.preset) == "hybrid"
    families = {
        "vanilla": ("standard", "0"),
        "msvp": ("standard", f"{s.msvp:g}"),
        "lipschitz": ("lipschitz", "0" if hybrid else f"{s.msvp:g}"),
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
        methods = "global" if hybrid and name == "lipschitz" else s.certify_methods
        args = (
            "--ckpt",
            str(ckpt),
            "--eps",
            s.certify_eps,
            "--method",
            methods,
            "--radius",
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
                f"certify {name} ({methods.replace(',', ', ')}; {s.certify_n} points, "
                "radii)",
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
    if crown and s.crown_n > 0 and not hybrid:
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
        ("margin-lipschitz", lip, ("--margin",), margin),
        ("margin-msvp", plan.model("msvp"), ("--margin",), margin),
    ):
        if hybrid and ckpt == lip:  # the hybrid has no LoFAST layer bounds
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
    from lipvit.commands.train import DEFAULT_PRESET, FALLBACK_PRESET

    name = preset or DEFAULT_PRESET.get((dataset, "lipschitz"), FALLBACK_PRESET)
    return PRESETS[name].get("arch", "vit")


def step_args(step: Step, force: bool) -> tuple[list[str], str] | None:
    """The arguments ``step`` runs with and ``"ran"`` or ``"resumed"``; ``None``
    where it is done (skipped)."""
    if step.done() and not force:
        return None
    args = list(step.args)
    status = "ran"
    if step.train:
        if force:
            args.append("--force")
        elif step.outputs[0].exists():
            args.append("--resume")
            status = "resumed"
    elif force or any(p.exists() for p in step.outputs):
        args.append("--force")  # a partial earlier run: redo the whole step
    return args, status


def run_step(step: Step, force: bool) -> str:
    """Run ``step`` unless done; returns ``"skipped"``, ``"ran"`` or ``"resumed"``."""
    prepared = step_args(step, force)
    if prepared is None:
        return "skipped"
    args, status = prepared
    step.command.main(args=args, prog_name=step.prog, standalone_mode=False)
    step.record_settings()
    return status


def step_dependencies(plan: Plan) -> dict[str, set[str]]:
    """Each step's key → the keys of the steps that write one of its inputs."""
    writer = {path: step.key for step in plan.steps for path in step.outputs}
    return {step.key: {writer[p] for p in step.inputs if p in writer}
            for step in plan.steps}


def _users(deps: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each step's key → the keys of the steps that read its outputs."""
    users: dict[str, set[str]] = {key: set() for key in deps}
    for key, needs in deps.items():
        for need in needs:
            users[need].add(key)
    return users


def downstream_counts(deps: dict[str, set[str]]) -> dict[str, int]:
    """Each step's key → how many steps need it, directly or through others."""
    users = _users(deps)

    def reach(key: str, seen: set[str]) -> set[str]:
        for user in users[key] - seen:
            seen.add(user)
            reach(user, seen)
        return seen

    return {key: len(reach(key, set())) for key in deps}


COST_HINTS = {"train": 30.0, "certify": 100.0, "attack": 10.0, "tightness": 20.0,
              "spectrum": 15.0, "plot": 2.0}
"""Rough seconds of a step by its command (digits, one thread), for ordering
the ready steps where no earlier run's timings are recorded."""


def critical_paths(plan: Plan, deps: dict[str, set[str]],
                   seconds: dict[str, float]) -> dict[str, float]:
    """Each step's key → its cost plus the costliest chain of steps that wait on
    it: how long the run lasts at least once it starts. Costs: ``seconds``
    (an earlier run's timings) where recorded, else :data:`COST_HINTS`."""
    users = _users(deps)
    cost = {step.key: seconds.get(step.key, COST_HINTS.get(step.command.name, 10.0))
            for step in plan.steps}
    memo: dict[str, float] = {}

    def chain(key: str) -> float:
        if key not in memo:
            memo[key] = cost[key] + max((chain(u) for u in users[key]), default=0.0)
        return memo[key]

    return {key: chain(key) for key in deps}


def cpu_count() -> int:
    """CPUs this process may run on (the affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


JOB_MEMORY = 3 * 2**30
"""Memory one step may take at its peak (measured: 2.7 GB for the digits
lipschitz model's four certificates on 100 points, 2.8 GB training the
Fashion-MNIST hybrid): the default ``--jobs`` keeps that many per job."""


def default_jobs() -> int:
    """Steps at once by default: the CPUs, fewer where the physical memory
    holds fewer than that many steps of :data:`JOB_MEMORY`."""
    from lipvit.certify.tangents import physical_memory

    total = physical_memory()
    fit = cpu_count() if total is None else total // JOB_MEMORY
    return max(1, min(cpu_count(), fit))


@dataclass
class _Running:
    step: Step
    number: int
    status: str
    start: float
    log: Path
    process: subprocess.Popen


def _log_tail(path: Path) -> str:
    lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace")
             .replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no output)"


def _start(step: Step, args: list[str], number: int, status: str, log: Path,
           threads: int) -> _Running:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w", encoding="utf-8") as handle:  # the child keeps its own copy
        process = subprocess.Popen(
            [sys.executable, "-m", "lipvit", step.command.name, *args],
            stdout=handle, stderr=subprocess.STDOUT, env=env)
    return _Running(step, number, status, time.perf_counter(), log, process)


def run_parallel(
    plan: Plan, jobs: int, threads: int, *, force: bool,
    echo: Callable[[str], None], on_done: Callable[[Step, str, float], None],
    seconds: dict[str, float] | None = None,
) -> None:
    """Run the plan's steps, up to ``jobs`` at once, each in its own process with
    ``threads`` CPU threads, a step once every step writing its inputs is done.
    Among the ready steps, the one with the costliest chain of steps waiting on
    it goes first (:func:`critical_paths`, ``seconds`` an earlier run's
    timings: the slow certificates start as soon as their model is trained),
    then those more steps wait on, then plan order. A failed step stops the
    others and raises ``LipvitError`` naming its log; a rerun resumes."""
    deps = step_dependencies(plan)
    number = {step.key: i for i, step in enumerate(plan.steps, 1)}
    waiting = downstream_counts(deps)
    critical = critical_paths(plan, deps, seconds or {})
    total = len(plan.steps)
    pending = sorted(plan.steps, key=lambda s: (-critical[s.key], -waiting[s.key],
                                                number[s.key]))
    running, finished = [], set()
    try:
        while pending or running:
            for step in [s for s in pending if deps[s.key] <= finished]:
                if len(running) >= jobs:
                    break
                pending.remove(step)
                head = f"[{number[step.key]}/{total}] {step.title}"
                prepared = step_args(step, force)
                if prepared is None:
                    echo(f"{head}: outputs exist: skipped (--force redoes it)")
                    finished.add(step.key)
                    continue
                log = plan.out / "logs" / f"{step.key.replace('/', '-')}.log"
                running.append(_start(step, prepared[0], number[step.key],
                                      prepared[1], log, threads))
                echo(f"{head}: started ({log})")
            if not running:
                if pending and not any(deps[s.key] <= finished for s in pending):
                    raise LipvitError("pipeline steps wait on each other: "
                                      + ", ".join(s.key for s in pending))
                continue
            time.sleep(0.2)
            for job in [j for j in running if j.process.poll() is not None]:
                running.remove(job)
                if job.process.returncode:
                    raise LipvitError(
                        f"step {job.step.key} failed (exit {job.process.returncode})"
                        f": {_log_tail(job.log)}; its log: {job.log}; rerun the "
                        "same command to resume")
                job.step.record_settings()
                seconds = time.perf_counter() - job.start
                echo(f"[{job.number}/{total}] {job.step.title}: {job.status} in "
                     f"{seconds:.1f} s")
                on_done(job.step, job.status, seconds)
                finished.add(job.step.key)
    finally:
        for job in running:  # interrupted or failed: stop the others
            job.process.terminate()
            job.process.wait()


def check_settings(plan: Plan) -> None:
    """Refuse (``LipvitError``) a run directory whose outputs other settings made."""
    stale = [step for step in plan.steps if step.stale()]
    if not stale:
        return
    first = stale[0].recorded()
    was = first.get("command", "?") if first else "not recorded"
    raise LipvitError(
        f"{plan.out} holds outputs made with other settings ({len(stale)} of "
        f"{len(plan.steps)} steps: {', '.join(s.key for s in stale)}); "
        f"{stale[0].key} was made by: {was}; now it would be: {stale[0].line()}. "
        "Pass --force to redo them, or choose another --out"
    )


def write_report(plan: Plan, record: dict[str, Any]) -> Path:
    """Write ``OUT/report.md`` (always rewritten: it only reads the results)."""
    from lipvit.analysis.report import pipeline_report

    commands = {step.key: step.line() for step in plan.steps}
    path = plan.out / "report.md"
    with C.atomic_path(path, force=True) as tmp:
        tmp.write_text(
            pipeline_report(plan.out, commands, record).render(), encoding="utf-8"
        )
    return path


def _load_timings(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}


def run_plan(
    plan: Plan, *, force: bool, echo: Callable[[str], None], meta: dict[str, Any],
    jobs: int = 1, job_threads: int = 1,
) -> dict[str, Any]:
    """Run every step (``jobs`` > 1: :func:`run_parallel` with ``job_threads``
    each), recording timings in ``OUT/pipeline.json`` (returned)."""
    record_path = plan.out / "pipeline.json"
    record = _load_timings(record_path) if not force else {}
    record.update(meta)
    steps = record.setdefault("steps", {})
    earlier = {key: v["seconds"] for key, v in steps.items()
               if isinstance(v, dict) and isinstance(v.get("seconds"), (int, float))}
    for step in plan.steps:
        steps.setdefault(step.key, {}).update(command=step.line(), title=step.title)

    def on_done(step: Step, status: str, seconds: float) -> None:
        steps[step.key].update(seconds=seconds, status=status)
        C.write_json(record_path, record, force=True)

    if jobs > 1:
        run_parallel(plan, jobs, job_threads, force=force, echo=echo, on_done=on_done,
                     seconds=earlier)
    else:
        for i, step in enumerate(plan.steps, 1):
            echo(f"[{i}/{len(plan.steps)}] {step.title}")
            t0 = time.perf_counter()
            status = run_step(step, force)
            if status == "skipped":
                echo("  outputs exist: skipped (--force redoes it)")
            else:
                on_done(step, status, time.perf_counter() - t0)
                echo(f"  {status} in {steps[step.key]['seconds']:.1f} s")
    record["total_seconds"] = sum(v.get("seconds", 0.0) for v in steps.values())
    C.write_json(record_path, record, force=True)
    return record


@click.command("pipeline")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="run directory (models/, attack/, certify/, tightness/, spectrum/, report.md)",
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
    "per-dataset and per-family preset: digits-tiny/digits-small on digits, "
    "fmnist-3x64/fmnist-hybrid on fashion-mnist)",
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
    import dataclasses

    from lipvit.analysis.tightness import crown_available

    jobs = jobs or default_jobs()
    settings = Settings.fast_mode(dataset) if fast else Settings.for_dataset(dataset)
    overrides = {
        k: v
        for k, v in (("preset", preset), ("epochs", epochs), ("msvp", msvp_lambda))
        if v is not None
    }
    settings = dataclasses.replace(settings, **overrides)
    resolved = C.resolve_device(device)  # a bad device fails here, before any work
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
    import torch

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
        f"done in {wall:.1f} s (all steps, including earlier runs: "
        f"{record['total_seconds']:.1f} s); wrote {report}"
    )
