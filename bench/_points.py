"""Test points of a checkpoint for the float64 benches."""

from __future__ import annotations

from lipvit.commands import _common as C


def float64_points(path: str, n: int):
    """``(model, x, y, index)``: the checkpoint's model in float64 and eval mode,
    and its test points subsampled as ``lipvit certify --n`` does (``index``:
    their positions in the test split)."""
    ckpt = C.load_checkpoint(path)
    data = C.load_test_set(ckpt, n=n)
    return ckpt.model.double().eval(), data.x.double(), data.y, list(data.index)
