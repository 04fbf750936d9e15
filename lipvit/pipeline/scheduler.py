"""Running a pipeline's steps: one after the other in this process
(:func:`run_step`), or up to ``--jobs`` at once, each in its own process, the
steps on the costliest chains first (:func:`run_parallel`); :func:`run_plan`
runs a plan either way and records the timings in ``OUT/pipeline.json``.

The parallel steps' processes are forked from a server that has imported
lipvit (and torch) once (``multiprocessing``'s forkserver): each step is then
``lipvit <command> <args>`` without an interpreter's ~2 s start, and the
server is a clean process (no CUDA context, no thread pool) to fork from.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lipvit.certify.memory import physical_memory
from lipvit.errors import LipvitError
from lipvit.files import write_json
from lipvit.pipeline.steps import Plan, Step, step_args, step_dependencies


def run_step(step: Step, force: bool) -> str:
    """Run ``step`` unless done; returns ``"skipped"``, ``"ran"`` or ``"resumed"``."""
    prepared = step_args(step, force)
    if prepared is None:
        return "skipped"
    args, status = prepared
    step.command.main(args=args, prog_name=step.prog, standalone_mode=False)
    step.record_settings()
    return status


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
    process: multiprocessing.process.BaseProcess


def _log_tail(path: Path) -> str:
    lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace")
             .replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no output)"


def _step_process(command: str, args: list[str], log: str, threads: int) -> None:
    """``python -m lipvit command args`` in a forked worker on ``threads`` CPU
    threads, its output (stdout and stderr) into ``log``; exits with the
    command's code."""
    import torch

    handle = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(handle, 1)
    os.dup2(handle, 2)
    os.close(handle)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    sys.argv = ["lipvit", command, *args]
    runpy.run_module("lipvit", run_name="__main__", alter_sys=True)  # exits


def _workers() -> multiprocessing.context.BaseContext:
    """Where the steps' processes come from: a forkserver that preloads the CLI
    (fresh interpreters where the platform has no forkserver)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["lipvit.cli"])
    return ctx


def _start(step: Step, args: list[str], number: int, status: str, log: Path,
           threads: int) -> _Running:
    log.parent.mkdir(parents=True, exist_ok=True)
    process = _workers().Process(target=_step_process,
                                 args=(step.command.name, list(args), str(log),
                                       threads))
    process.start()
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
            for job in [j for j in running if j.process.exitcode is not None]:
                running.remove(job)
                if job.process.exitcode:
                    raise LipvitError(
                        f"step {job.step.key} failed (exit {job.process.exitcode})"
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
            job.process.join()


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
        write_json(record_path, record, force=True)

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
    write_json(record_path, record, force=True)
    return record
