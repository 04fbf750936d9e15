"""The allocator re-execution's environment: added once, the user's choice kept."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from lipvit.allocator import GUARD, TUNABLE, crown_allocator_env


def test_adds_the_tunable_and_the_guard():
    env = crown_allocator_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": f"{TUNABLE}=0", GUARD: "1"}
    # Once only: the re-executed process finds the guard.
    assert crown_allocator_env(env) is None


def test_keeps_other_tunables_and_the_users_value():
    env = crown_allocator_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}=0"
    assert crown_allocator_env({"GLIBC_TUNABLES": f"{TUNABLE}=65536"}) is None


def test_never_in_a_host_process(monkeypatch):
    # Under pytest the main module is not lipvit's: nothing is re-executed.
    import lipvit.allocator as allocator

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(GUARD, raising=False)
    monkeypatch.setattr(allocator.os, "execve", lambda *a: (_ for _ in ()).throw(
        AssertionError("re-executed")))
    allocator.reexec_with_crown_allocator()


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
                    reason="glibc only")
@pytest.mark.parametrize("method, starts", [("crown", 2), ("cascade", 2),
                                            ("lofast", 1)])
def test_lipvit_reexecutes_once_for_crown(tmp_path, method, starts):
    # -X importtime logs every import to stderr: a re-executed process imports
    # lipvit's CLI a second time (and then fails on the missing checkpoint).
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", GUARD)}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "lipvit", "certify", "--ckpt",
         str(tmp_path / "missing.pt"), "--eps", "0.1", "--method", method],
        cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True,
        text=True, timeout=120)
    assert done.returncode == 1 and "does not exist" in done.stderr
    assert done.stderr.count("| lipvit.cli\n") == starts
