"""Where and how lipvit computes: device names and the CPU thread count.

:func:`resolve_device` turns ``"auto"``/``"cpu"``/``"cuda:N"`` into a device
(one line of error for a bad name or a missing GPU); :func:`cpu_threads` sets
the thread count for the duration of a computation on a model. Used by the
trainer and the commands (``lipvit.train`` re-exports both).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from lipvit.config import ViTConfig
from lipvit.model import build_model


def resolve_device(name: str) -> torch.device:
    """``"auto"`` → cuda when available else cpu; otherwise ``torch.device(name)``.

    Raises:
        ValueError: an unparsable name, or cuda asked for where there is none.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available")
    return device


@contextlib.contextmanager
def cpu_threads(
    model_cfg: ViTConfig, device: torch.device, threads: int = 0
) -> Iterator[None]:
    """Set the CPU thread count while working with a model of ``model_cfg``.

    ``threads`` 0 chooses: one thread for ViTs under a million parameters
    (their matrices are too small to split, and spinning threads lose badly on
    a shared machine), torch's default otherwise and for the hybrid ViT and
    CaiT (their convolutions over whole images split well). No effect off the
    CPU.
    """
    if device.type != "cpu":
        yield
        return
    n = threads
    if n == 0:
        n = 1 if _small_vit(model_cfg) else torch.get_num_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


SMALL_VIT = 1_000_000
"""Parameters under which a ViT computes on one CPU thread (:func:`cpu_threads`)."""


def _small_vit(cfg: ViTConfig) -> bool:
    """Whether ``cfg`` is a ViT (``arch="vit"``) of under :data:`SMALL_VIT`
    parameters. A larger one is told by its attention maps alone (``4D²`` per
    block); a smaller one is built on the CPU and counted (milliseconds; the
    global random state is kept)."""
    if cfg.arch != "vit" or 4 * cfg.embed_dim**2 * cfg.depth >= SMALL_VIT:
        return False
    with torch.random.fork_rng(devices=[]):
        return sum(p.numel() for p in build_model(cfg).parameters()) < SMALL_VIT
