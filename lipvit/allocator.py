"""glibc's allocator told to keep freed memory for reuse, in the ``lipvit`` program.

lipvit's bounds allocate and free many large temporaries (``taylor``'s jets
and ``|J|``, auto_LiRPA's bounds). glibc serves each large one with a fresh
``mmap`` and returns it with ``munmap``, and trims the heap's top past 128 KiB,
so every allocation costs its page faults again: a quarter of ``lipvit
certify --method taylor``'s wall time on the digits lipschitz ViT went to the
kernel (docs/results/speed.md). :func:`keep_freed_memory` sets, through
``mallopt``, ``mmap`` only for blocks over 32 MiB (``M_MMAP_THRESHOLD``, glibc's
largest: the rest on the heap, where freed memory is reused) and trimming only
past 1 GiB (``M_TRIM_THRESHOLD``). (No ``mmap`` at all, ``M_MMAP_MAX = 0``,
measured slower: the blocks over 32 MiB then cost more CPU time than their
page faults.)
The command line calls it at start when the process is ``lipvit`` itself
(``python -m lipvit``, the ``lipvit`` script, a pipeline's step), never in a
host such as a test runner or a user's script. Only on glibc Linux; a
setting the user chose in ``GLIBC_TUNABLES`` is kept.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
SETTINGS = ((M_MMAP_THRESHOLD, "glibc.malloc.mmap_threshold", 32 * 2**20),
            (M_TRIM_THRESHOLD, "glibc.malloc.trim_threshold", 2**30))


def keep_freed_memory() -> bool:
    """Set :data:`SETTINGS` through ``mallopt`` for this process's allocations
    from now on (each unless ``GLIBC_TUNABLES`` names it); False where the C
    library is not glibc."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    chosen = os.environ.get("GLIBC_TUNABLES", "")
    for param, tunable, value in SETTINGS:
        if tunable not in chosen:
            mallopt(param, value)
    return True


def is_lipvit_program() -> bool:
    """Whether this process is ``python -m lipvit`` or the ``lipvit`` script."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return (getattr(spec, "name", None) == "lipvit.__main__"
            or Path(sys.argv[0]).name == "lipvit")
