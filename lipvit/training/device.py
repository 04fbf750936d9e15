"""Where and how a training run computes: rank, world size and device under
``torchrun``, deterministic algorithms, and bf16 autocast on CUDA.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch

from lipvit.runtime import resolve_device


def _distributed(device_name: str) -> tuple[int, int, torch.device]:
    """``(rank, world_size, device)``; initialises the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, resolve_device(device_name)
    import torch.distributed as dist

    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


@contextlib.contextmanager
def _deterministic(on: bool, device: torch.device) -> Iterator[None]:
    if not on:
        yield
        return
    if device.type == "cuda":
        # cuBLAS reads this when it starts; harmless when already set.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    cudnn_before = torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)
        torch.backends.cudnn.benchmark = cudnn_before


def autocast_for(
    device: torch.device,
) -> Callable[[], contextlib.AbstractContextManager]:
    """Factory of the autocast context of a training step: bf16 on CUDA, off else."""
    enabled = device.type == "cuda"

    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)

    return autocast
