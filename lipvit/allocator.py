"""glibc's allocator setting for CROWN: re-execute the command once with it.

auto_LiRPA allocates and frees many large temporaries per bound; glibc serves
each with a fresh ``mmap`` and returns it with ``munmap``, so every one costs
page faults again. ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0`` keeps them on the
heap, where freed memory is reused (measured 1.4–1.8× less CPU time per CROWN
sample; figures in docs/results/speed.md). glibc reads the variable only at process
start, so :func:`reexec_with_crown_allocator` replaces the process by the same
command with it set: once (a guard variable), on Linux with glibc, and only
when the process is ``lipvit`` itself (``python -m lipvit`` or the ``lipvit``
script), never a host such as a test runner.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

TUNABLE = "glibc.malloc.mmap_max"
GUARD = "LIPVIT_ALLOCATOR_REEXEC"


def crown_allocator_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """``env`` with ``glibc.malloc.mmap_max=0`` added to ``GLIBC_TUNABLES`` and
    the guard set; None if nothing is to be done (already re-executed, or the
    user chose a value for the tunable)."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if env.get(GUARD) or TUNABLE in tunables:
        return None
    setting = f"{TUNABLE}=0"
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{setting}" if tunables else setting,
            GUARD: "1"}


def _is_lipvit_program() -> bool:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return (getattr(spec, "name", None) == "lipvit.__main__"
            or Path(sys.argv[0]).name == "lipvit")


def reexec_with_crown_allocator() -> None:
    """Replace this process by itself with :func:`crown_allocator_env` (no
    return), when it is the ``lipvit`` program on glibc Linux and not already
    so configured; otherwise return at once."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return
    env = crown_allocator_env(os.environ)
    if env is None or not _is_lipvit_program():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
