"""glibc's allocator kept from returning freed memory: the page faults it saves,
the user's own tunables kept, and only in the ``lipvit`` program."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

import lipvit.allocator as allocator
import lipvit.cli as cli

GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"

HEAP = textwrap.dedent("""
    import ctypes, sys
    import torch
    from lipvit.allocator import keep_freed_memory

    class Info(ctypes.Structure):  # glibc's struct mallinfo2
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
            "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    info, libc.malloc.restype = libc.mallinfo2, ctypes.c_void_p
    info.restype = Info
    if sys.argv[1] == "keep":
        keep_freed_memory()
    mapped = info().hblkhd
    t = torch.empty(2 * 2**20, dtype=torch.float64).fill_(1)  # 16 MiB
    mapped = info().hblkhd - mapped
    del t
    p = libc.malloc(2**24)  # at the heap's top: freed, it joins the top
    ctypes.memset(p, 1, 2**24)
    heap = info().arena
    libc.free(ctypes.c_void_p(p))
    print(mapped, heap - info().arena)
""")


@pytest.mark.skipif(not GLIBC or platform.libc_ver()[1] < "2.33",
                    reason="glibc's mallinfo2 only")
def test_freed_memory_stays_on_the_heap():
    """A 16 MiB tensor: glibc's default maps it by itself (``mmap``, returned
    at ``free``); kept, it lies on the heap. A 16 MiB block at the heap's top:
    kept, it stays there once freed (not trimmed), for the next allocation to
    reuse without page faults."""
    size = 16 * 2**20

    def heap(mode: str) -> tuple[int, int]:
        done = subprocess.run([sys.executable, "-c", HEAP, mode], check=True,
                              capture_output=True, text=True, timeout=120)
        mapped, returned = done.stdout.split()
        return int(mapped), int(returned)

    assert heap("default")[0] >= size
    assert heap("keep") == (0, 0)


def test_the_users_tunables_are_kept(monkeypatch):
    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param, value))

    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: Libc())
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert allocator.keep_freed_memory()
    assert calls == [(allocator.M_MMAP_THRESHOLD, 32 * 2**20),
                     (allocator.M_TRIM_THRESHOLD, 2**30)]
    calls.clear()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    allocator.keep_freed_memory()
    assert calls == [(allocator.M_TRIM_THRESHOLD, 2**30)]


@pytest.mark.parametrize("program", [True, False])
def test_only_the_lipvit_program_sets_it(monkeypatch, program):
    """Under pytest the main module is not lipvit's: the CLI leaves the host's
    allocator alone; as ``lipvit`` it sets it before any command."""
    assert not allocator.is_lipvit_program()
    calls = []
    monkeypatch.setattr(cli, "is_lipvit_program", lambda: program)
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(1))
    result = CliRunner().invoke(cli.main, ["info", "--help"])
    assert result.exit_code == 0, result.output
    assert calls == ([1] if program else [])
