"""Resuming a run: the RNG states a checkpoint carries and :func:`_restore`,
which loads the training state saved at the checkpoint after checking that it
was made with the same settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lipvit.checkpoint import load_checkpoint
from lipvit.config import ViTConfig
from lipvit.data import Dataset
from lipvit.errors import CheckpointError, LipvitError
from lipvit.model import ViT
from lipvit.msvp import MSVP
from lipvit.training.config import TrainConfig


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _restore(
    out: Path,
    model: ViT,
    msvp: MSVP | None,
    opt: torch.optim.Optimizer,
    model_cfg: ViTConfig,
    cfg: TrainConfig,
    data: Dataset,
    device: torch.device,
) -> tuple[int, list[dict[str, Any]], float]:
    """Load the training state saved at ``out``; returns (epoch, history, seconds)."""
    ckpt = load_checkpoint(out, device="cpu")
    raw = ckpt.raw
    if ckpt.config != model_cfg:
        raise LipvitError(
            f"cannot resume {out}: it was trained with another model "
            "configuration (use --force to start over)"
        )
    # A checkpoint from before a field existed was trained as its default does
    # (every field added later defaults to "off", e.g. cert_eps = 0).
    saved = {**TrainConfig().to_dict(), **(raw.get("train_config") or {})}
    mine = cfg.to_dict()
    for key in ("device", "deterministic", "threads"):  # may change between sessions
        saved.pop(key, None)
        mine.pop(key, None)
    if saved != mine:
        diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
        raise LipvitError(
            f"cannot resume {out}: training settings differ ({', '.join(diff)}); "
            "use the same options or --force to start over"
        )
    if ckpt.dataset != data.name:
        raise LipvitError(
            f"cannot resume {out}: trained on {ckpt.dataset}, not {data.name}"
        )
    extra, opt_state = raw.get("extra"), raw.get("optimizer")
    if not isinstance(extra, dict) or opt_state is None or "epoch" not in extra:
        raise CheckpointError(f"cannot resume {out}: it holds no training state")
    model.load_state_dict(raw["state_dict"])
    if msvp is not None:
        if raw.get("msvp") is None:
            raise CheckpointError(f"cannot resume {out}: it holds no MSVP buffers")
        msvp.load_state_dict(raw["msvp"])
    opt.load_state_dict(opt_state)
    if "rng" in extra:
        _set_rng_state(extra["rng"], device)
    return (
        int(extra["epoch"]),
        list(extra.get("history", [])),
        float(extra.get("elapsed", 0)),
    )
