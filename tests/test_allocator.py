"""The allocator re-execution's environment: added once, the user's choice kept."""

from __future__ import annotations

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
