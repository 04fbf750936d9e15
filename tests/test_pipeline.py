"""`lipvit pipeline --fast` end to end: every step's files, the report, resume."""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner
from lipvit.analysis.report import Report, md_table, pipeline_report

from lipvit.cli import main
from lipvit.commands.pipeline import build_plan
from lipvit.pipeline.scheduler import downstream_counts
from lipvit.pipeline.steps import Settings, step_dependencies

pytest.importorskip("torchattacks")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One fast pipeline run shared by the tests below (about 20-40 s on 2 cores)."""
    out = tmp_path_factory.mktemp("pipe") / "demo"
    r = CliRunner().invoke(main, ["pipeline", "--out", str(out), "--fast",
                                  "--jobs", "1"])
    assert r.exit_code == 0, r.output
    return out, r


def test_every_step_wrote_its_files(run_dir):
    out, r = run_dir
    plan = build_plan(out, Settings.fast_mode(), crown=False)
    for step in plan.steps:
        for path in step.outputs:
            assert path.is_file(), f"{step.key}: {path} missing"
    record = json.loads((out / "pipeline.json").read_text())
    assert record["fast"] is True
    for step in plan.steps:
        assert record["steps"][step.key]["status"] == "ran"
        assert record["steps"][step.key]["seconds"] > 0
    assert f"[{len(plan.steps)}/{len(plan.steps)}]" in r.output
    assert torch.get_num_threads() >= 1


def test_report_tables_links_and_commands(run_dir):
    out, _ = run_dir
    text = (out / "report.md").read_text()
    for heading in (
        "## Training",
        "## Robust accuracy under attack",
        "## Certified accuracy",
        "## Certification gap (lipschitz model)",
        "## Tightness of the bounds",
        "## Tightness of the certificate that decides",
        "### lipschitz model",
        "### msvp model",
        "## Spectra: vanilla versus MSVP",
        "## Timings",
    ):
        assert heading in text
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(links) >= 10  # 2 certified, 1 gap, 5 tightness, 2 spectrum figures
    assert "tightness/margin-msvp/tightness.png" in links
    # Every certified-accuracy figure says what each of its methods bounds.
    assert text.count("what each method bounds — ") == 3  # 2 certified, the gap
    assert "`taylor`: each wrong-class margin" in text
    assert re.search(r"Test points certified: lipschitz n = 8 \(clean accuracy "
                     r"[\d.]+ %\), msvp n = 8", text)
    assert "`lofast`: the logit vector (√2·δ_out)" in text
    assert "certify/gap.png" in links
    assert "| lofast | correct |" in text  # the gap table
    assert re.search(r"The last run: [\d.]+ s of wall time, 1 step at a time", text)
    for link in links:
        assert not Path(link).is_absolute() and (out / link).is_file(), link
    # The tightness table carries the ratio of every bound at every eps.
    data = json.loads((out / "tightness" / "layer" / "tightness.json").read_text())
    for row in data["rows"]:
        assert f"({row['ratio']:.4g}×)" in text
    # Every reproducing command parses as the command it names.
    commands = [ln for ln in text.splitlines() if ln.startswith("lipvit ")]
    assert len(commands) == len(build_plan(out, Settings.fast_mode()).steps)
    for line in commands:
        args = shlex.split(line)[1:]
        cmd, rest = main.get_command(None, args[0]), args[1:]
        if isinstance(cmd, click.Group):  # `lipvit plot certified ...`
            cmd, rest = cmd.get_command(None, rest[0]), rest[1:]
        assert cmd is not None
        with cmd.make_context(cmd.name, rest) as ctx:
            assert ctx.params


def test_second_run_skips_everything(run_dir):
    """Without --jobs: as many steps at a time as there are CPUs (fewer where
    the memory holds fewer steps)."""
    from lipvit.pipeline.scheduler import default_jobs

    out, _ = run_dir
    before = (out / "models" / "vanilla.pt").stat().st_mtime_ns
    r = CliRunner().invoke(main, ["pipeline", "--out", str(out), "--fast"])
    assert r.exit_code == 0, r.output
    assert r.output.count("outputs exist: skipped") == len(
        build_plan(out, Settings.fast_mode()).steps
    )
    assert (out / "models" / "vanilla.pt").stat().st_mtime_ns == before
    assert json.loads((out / "pipeline.json").read_text())["jobs"] == default_jobs()
    # The timings table says what each step ran.
    text = (out / "report.md").read_text()
    assert ("| certify/msvp | certify msvp (lofast, lofast-fast, specformer, taylor; "
            "8 points) |") in text
    assert ("| certify/lipschitz | certify lipschitz (lofast, lofast-fast, specformer, "
            "taylor; 8 points, radii) |") in text


def test_missing_or_stale_outputs_rerun_only_their_steps(run_dir):
    out, _ = run_dir
    (out / "tightness" / "network" / "tightness.csv").unlink()
    ckpt = out / "models" / "vanilla.pt"  # its dependants are the cheap ones
    now = time.time_ns()
    os.utime(ckpt, ns=(now, now))  # as if vanilla were retrained just now
    r = CliRunner().invoke(main, ["pipeline", "--out", str(out), "--fast",
                                  "--jobs", "1"])
    assert r.exit_code == 0, r.output
    assert (out / "tightness" / "network" / "tightness.csv").is_file()
    plan = build_plan(out, Settings.fast_mode())
    rerun = {
        "attack/vanilla",
        "tightness/layer-vanilla",
        "spectrum",
        "tightness/network",
    }
    titles = {step.title for step in plan.steps if step.key in rerun}
    ran, title = set(), None
    for line in r.output.splitlines():
        if re.match(r"\[\d+/\d+\] ", line):
            title = line.split("] ", 1)[1]
        elif line.startswith("  ran in"):
            ran.add(title)
    assert ran == titles
    assert all(step.done() for step in plan.steps)


def test_jobs_rerun_in_parallel_processes_after_their_inputs(run_dir):
    """``--jobs 2``: the same steps rerun as with one job, each as its own
    process (forked from the preloaded server) logging to OUT/logs/, none
    before the steps that write its inputs are done; the outputs are complete
    afterwards."""
    out, _ = run_dir
    ckpt = out / "models" / "vanilla.pt"
    now = time.time_ns()
    os.utime(ckpt, ns=(now, now))
    r = CliRunner().invoke(main, ["pipeline", "--out", str(out), "--fast",
                                  "--jobs", "2"])
    assert r.exit_code == 0, r.output
    plan = build_plan(out, Settings.fast_mode())
    by_title = {step.title: step for step in plan.steps}
    deps = step_dependencies(plan)
    events = []  # (kind, key) in output order
    for line in r.output.splitlines():
        m = re.match(r"\[\d+/\d+\] (.*): (started|ran in|outputs exist)", line)
        if m:
            events.append((m.group(2), by_title[m.group(1)].key))
    started = [k for kind, k in events if kind == "started"]
    assert set(started) == {"attack/vanilla", "tightness/layer-vanilla", "spectrum"}
    for kind, key in events:
        if kind == "started":
            done_before = {k for e, k in events[:events.index((kind, key))]
                           if e in ("ran in", "outputs exist")}
            assert deps[key] <= done_before, (key, deps[key], done_before)
    for key in started:
        log = out / "logs" / f"{key.replace('/', '-')}.log"
        assert log.is_file() and log.stat().st_size > 0
    assert all(step.done() for step in plan.steps)
    record = json.loads((out / "pipeline.json").read_text())
    assert record["jobs"] == 2 and record["steps"]["spectrum"]["status"] == "ran"


def test_default_jobs_are_the_cpus_the_memory_holds(monkeypatch):
    from lipvit.pipeline import scheduler as P

    monkeypatch.setattr(P, "cpu_count", lambda: 16)
    monkeypatch.setattr(P, "physical_memory", lambda: 16 * 2**30)
    assert P.default_jobs() == 5  # 16 GiB hold five steps of 3 GiB
    monkeypatch.setattr(P, "physical_memory", lambda: 256 * 2**30)
    assert P.default_jobs() == 16
    monkeypatch.setattr(P, "physical_memory", lambda: 2**30)
    assert P.default_jobs() == 1
    monkeypatch.setattr(P, "physical_memory", lambda: None)
    assert P.default_jobs() == 16


def test_jobs_start_the_model_most_steps_wait_on():
    """The lipschitz model feeds certification, the gap figure and tightness:
    with two jobs it trains first, beside the MSVP model."""
    plan = build_plan(Path("/nonexistent"), Settings.fast_mode())
    waiting = downstream_counts(step_dependencies(plan))
    trains = sorted((k for k in waiting if k.startswith("train/")),
                    key=lambda k: -waiting[k])
    assert trains == ["train/lipschitz", "train/msvp", "train/vanilla"]
    assert waiting["certify/lipschitz"] == 2  # its plot and the gap figure
    assert all(waiting[k] == 0 for k in waiting if k.startswith("plot/"))


def test_a_failed_job_names_its_log(tmp_path):
    from lipvit.commands.certify import certify
    from lipvit.errors import LipvitError
    from lipvit.pipeline.scheduler import run_parallel
    from lipvit.pipeline.steps import Plan, Step

    plan = Plan(tmp_path, Settings.fast_mode())
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    plan.steps += [
        Step("bad", "a certificate of a missing checkpoint", certify,
             ("--ckpt", str(tmp_path / "nope.pt"), "--eps", "0.1", "--json", str(a)),
             (a,)),
        Step("after", "a step reading it", certify,
             ("--ckpt", str(a), "--eps", "0.1", "--json", str(b)), (b,), inputs=(a,)),
    ]
    assert step_dependencies(plan) == {"bad": set(), "after": {"bad"}}
    assert downstream_counts(step_dependencies(plan)) == {"bad": 1, "after": 0}
    lines = []
    with pytest.raises(LipvitError, match="step bad failed .*does not exist.*bad.log"):
        run_parallel(plan, 2, 1, force=False, echo=lines.append,
                     on_done=lambda *a: None)
    log = tmp_path / "logs" / "bad.log"
    assert [ln.split(": ")[-1] for ln in lines] == [f"started ({log})"]
    assert not b.exists()


def test_changed_settings_are_refused_before_any_work(run_dir):
    out, _ = run_dir
    plan = build_plan(out, Settings.fast_mode())
    for step in plan.steps:  # every output has its settings beside it
        assert step.recorded()["hash"] == step.settings_hash()
        assert step.recorded()["command"] == step.line()
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    r = CliRunner().invoke(main, ["pipeline", "--out", str(out)])  # not --fast
    assert r.exit_code == 1, r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in r.output, r.output
    assert "other settings" in errors[0] and "--force" in errors[0]
    assert "train/vanilla" in errors[0] and "--epochs 2" in errors[0]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == mtimes
    # The full-size plan differs from the fast one in every step's settings
    # but the plots' (same command line; they are redone when their inputs are).
    full = build_plan(out, Settings())
    stale = {step.key for step in full.steps if step.stale()}
    assert stale == {step.key for step in full.steps if not step.key.startswith("plot")}


@pytest.mark.parametrize(
    "args",
    [
        ["--device", "nonsense"],
        ["--epochs", "0"],
        ["--msvp", "-1"],
        ["--preset", "no-such-preset"],
    ],
)
def test_bad_inputs(tmp_path, args):
    r = CliRunner().invoke(
        main, ["pipeline", "--out", str(tmp_path / "x"), "--fast", *args]
    )
    assert r.exit_code != 0
    assert "Traceback" not in r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, r.output


def test_report_writer_pieces(tmp_path):
    assert md_table(["a", "b"], [[1.23456, "x|y"]]) == (
        "| a | b |\n|---|---|\n| 1.235 | x\\|y |"
    )
    rep = Report("t", tmp_path)
    (tmp_path / "f").mkdir()
    rep.image(tmp_path / "f" / "p.png", "alt")
    rep.code(["lipvit x"])
    assert rep.render() == "# t\n\n![alt](f/p.png)\n\n```bash\nlipvit x\n```\n"
    empty = pipeline_report(tmp_path, {}, {"dataset": "digits"}).render()
    assert "## Training" not in empty  # sections without results are left out


@pytest.mark.parametrize("methods", [None, ["spawn"]])
def test_a_step_process_runs_lipvit_and_exits_with_its_code(tmp_path, monkeypatch,
                                                            methods):
    """A parallel step's process is ``python -m lipvit ARGS`` (forked from the
    preloaded server, or a fresh interpreter where there is none): its output
    in the log, its exit code the command's (1 for a user error)."""
    import multiprocessing

    from lipvit.pipeline import scheduler as P

    if methods is not None:
        monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: methods)
    ctx = P._workers()
    assert ctx.get_start_method() == (methods or ["forkserver"])[0]
    for args, code, text in ((["info", "--help"], 0, "Usage: lipvit info"),
                             (["info", "--ckpt", str(tmp_path / "missing.pt")], 1,
                              "does not exist")):
        log = tmp_path / "step.log"
        process = ctx.Process(target=P._step_process,
                              args=(args[0], args[1:], str(log), 1))
        process.start()
        process.join()
        assert process.exitcode == code
        assert text in log.read_text()
