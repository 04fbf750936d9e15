"""Sharding a command's samples over ``torchrun`` ranks, with per-shard resume files.

``torchrun --nproc_per_node K -m lipvit certify ...`` starts K processes with
``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` in their environment
(:func:`ranks_from_env`). Each rank takes a contiguous run of whole batches of
the samples (:func:`shard_slice`), so every batch it computes is one that a
single-process run computes too, and the merged result is the same. Ranks
exchange only small Python records (:func:`gather_to_root`), so the process
group is gloo on every device (CUDA ranks compute on their own GPU,
``cuda:LOCAL_RANK``, and never send tensors). A rank's finished shard is kept
in a file beside the output (:func:`shard_path`, written atomically) and is
reused by a rerun with the same settings: an interrupted run resumes per shard.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lipvit.files import atomic_path


@dataclass(frozen=True)
class Ranks:
    """This process's ``rank`` among ``world`` processes; ``local_rank`` on its node."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0


def ranks_from_env(env: Mapping[str, str] = os.environ) -> Ranks:
    """The torchrun ranks from ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (one
    process when they are absent).

    Raises:
        ValueError: values that are not integers or do not fit together.
    """
    if "WORLD_SIZE" not in env:
        return Ranks()
    try:
        world = int(env["WORLD_SIZE"])
        rank = int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise ValueError("RANK, WORLD_SIZE and LOCAL_RANK must be integers") from None
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ValueError(f"bad torchrun ranks: RANK={rank} WORLD_SIZE={world}")
    return Ranks(rank, world, local)


def rank_device(device: torch.device, ranks: Ranks) -> torch.device:
    """``cuda:LOCAL_RANK`` for a bare ``cuda`` with several ranks; else ``device``."""
    if device.type == "cuda" and device.index is None and ranks.world > 1:
        return torch.device("cuda", ranks.local_rank)
    return device


@contextlib.contextmanager
def process_group(ranks: Ranks) -> Iterator[None]:
    """A gloo process group for ``ranks`` (nothing for one process)."""
    if ranks.world == 1:
        yield
        return
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=ranks.rank, world_size=ranks.world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def shard_slice(n: int, batch_size: int, ranks: Ranks) -> slice:
    """Rank ``ranks.rank``'s contiguous samples of ``n``: whole batches of
    ``batch_size``, as evenly spread as possible (the first ranks get one more
    batch; ranks beyond the number of batches get an empty slice)."""
    batches = -(-n // batch_size)
    per, extra = divmod(batches, ranks.world)
    first = ranks.rank * per + min(ranks.rank, extra)
    count = per + (ranks.rank < extra)
    return slice(min(first * batch_size, n), min((first + count) * batch_size, n))


def shard_path(output: Path, ranks: Ranks) -> Path:
    """``<output>.shard-<rank>-of-<world>.json`` beside ``output``."""
    return output.with_name(f"{output.name}.shard-{ranks.rank}-of-{ranks.world}.json")


def load_shard(path: Path, settings: Mapping[str, Any]) -> Any | None:
    """The record saved at ``path`` by :func:`save_shard` with equal ``settings``;
    None if there is none, it is unreadable, or its settings differ."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("settings") != json.loads(
            json.dumps(settings)):
        return None
    return saved.get("record")


def save_shard(path: Path, settings: Mapping[str, Any], record: Any) -> None:
    """Write ``{"settings", "record"}`` to ``path`` atomically (replacing it).

    ``record`` holds plain Python values; floats keep every bit (and ±inf/NaN)
    through JSON's repr round trip.
    """
    text = json.dumps({"settings": settings, "record": record})
    with atomic_path(path, force=True) as tmp:
        tmp.write_text(text + "\n", encoding="utf-8")


def gather_to_root(obj: Any, ranks: Ranks) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on rank 0; None on the other ranks."""
    if ranks.world == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] | None = [None] * ranks.world if ranks.rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def barrier(ranks: Ranks) -> None:
    """Wait for every rank (nothing for one process)."""
    if ranks.world > 1:
        import torch.distributed as dist

        dist.barrier()
