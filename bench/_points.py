"""Test points of a checkpoint for the float64 benches, and their radius searches."""

from __future__ import annotations

import math

from lipvit.commands import _common as C
from lipvit.errors import LipvitError


def float64_points(path: str, n: int):
    """``(model, x, y, index)``: the checkpoint's model in float64 and eval mode,
    and its test points subsampled as ``lipvit certify --n`` does (``index``:
    their positions in the test split). A missing or unreadable checkpoint
    or data set ends the bench with its one-line message."""
    try:
        ckpt = C.load_checkpoint(path)
        data = C.load_test_set(ckpt, n=n)
    except LipvitError as err:  # a missing or bad file: its message, no traceback
        raise SystemExit(f"error: {err}") from None
    return ckpt.model.double().eval(), data.x.double(), data.y, list(data.index)


def largest(ok, lo: float, hi: float, ratio: float) -> float | None:
    """The largest ε in ``[lo, hi]`` with ``ok(ε)``, by bisection in ``log ε``
    until ``hi / lo ≤ ratio`` (``ok`` assumed to hold below a threshold);
    ``None`` if ``ok(lo)`` fails."""
    if not ok(lo):
        return None
    while hi / lo > ratio:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
