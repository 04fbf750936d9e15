"""How much memory a certificate may hold: ``--max-memory`` (docs/taylor.md §11).

``taylor`` holds its tangents, its samples' autograd graphs and their
second-order models within a budget in bytes; :func:`parse_memory` reads it
from the command line, :func:`memory_budget` gives the default where none is
set, and :func:`physical_memory` sizes the pipeline's parallel steps too.
"""

from __future__ import annotations

import math
import os

from lipvit.errors import LipvitError

DEFAULT_MAX_MEMORY = 4 * 2**30
"""Default bytes held at once (4 GiB, or a sixth of the machine's memory when
that is less): enough for ``cifar-lofast-6x384``, whose per-token Gram
matrices alone take 1 GB."""


class MemoryBudgetError(LipvitError):
    """The memory budget cannot hold even the smallest chunk of work."""


def physical_memory() -> int | None:
    """Bytes of physical memory, ``None`` where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_max_memory() -> int:
    """:data:`DEFAULT_MAX_MEMORY`, or a sixth of the physical memory if smaller."""
    total = physical_memory()
    return DEFAULT_MAX_MEMORY if total is None else min(DEFAULT_MAX_MEMORY, total // 6)


def memory_budget(max_memory: int | None) -> int:
    """``max_memory`` bytes, or :func:`default_max_memory` where ``None``."""
    return default_max_memory() if max_memory is None else max_memory


def parse_memory(text: str) -> int:
    """``"512M"``, ``"2G"``, ``"2GiB"`` or a byte count → bytes; a one-line
    error otherwise."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = (s[:-1], s[-1]) if s and s[-1] in units else (s, "")
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise LipvitError(f"--max-memory: cannot read {text!r} (e.g. 512M, 2G)"
                          ) from None
    if not math.isfinite(value) or value <= 0:
        raise LipvitError(f"--max-memory must be a positive size, got {text!r}")
    return int(value)
