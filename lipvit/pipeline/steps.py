"""The settings of a pipeline run and its step graph.

A :class:`Step` is one ``lipvit`` command with the files it writes and the
files of earlier steps it reads; it is done, like make, when its outputs are
newer than its inputs, and it records the settings its outputs were made with.
A :class:`Plan` holds the steps of a run; :func:`step_dependencies` links them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from lipvit.analysis.report import command_line
from lipvit.checkpoint import load_checkpoint
from lipvit.errors import CheckpointError, LipvitError
from lipvit.files import write_json


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
        write_json(self.settings_path,
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


def step_dependencies(plan: Plan) -> dict[str, set[str]]:
    """Each step's key → the keys of the steps that write one of its inputs."""
    writer = {path: step.key for step in plan.steps for path in step.outputs}
    return {step.key: {writer[p] for p in step.inputs if p in writer}
            for step in plan.steps}


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
