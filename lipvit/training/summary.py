"""What a run reports: one :class:`EpochLog` per epoch and the JSON summary
written next to the checkpoint (:func:`summary_path`, :func:`_summary`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from lipvit.config import ViTConfig
from lipvit.data import Dataset
from lipvit.proven_summary import proven_summary
from lipvit.training.config import TrainConfig
from lipvit.training.metrics import _unwrap, evaluate, sigma_summary


class EpochLog(NamedTuple):
    """What one epoch did (one entry of ``summary["history"]``)."""

    epoch: int
    loss: float
    msvp_penalty: float
    train_acc: float
    test_acc: float
    sigma_max_mean: float | None
    lr: float
    seconds: float
    cpu_seconds: float = 0.0  # process CPU time of the epoch (shared machines)
    relu_unstable: float | None = None  # fraction of SLL units not κ-stable
    cert_eps: float | None = None  # the certified-training radius at the epoch's end
    cert_acc: float | None = None  # training points whose margin beat the raise

    def line(self, epochs: int) -> str:
        """The log line printed after the epoch."""
        sigma = "n/a" if self.sigma_max_mean is None else f"{self.sigma_max_mean:.3f}"
        unstable = (
            "" if self.relu_unstable is None else f"  unstable {self.relu_unstable:.3f}"
        )
        if self.cert_eps is not None and self.cert_acc is not None:
            unstable += f"  cert {100 * self.cert_acc:5.1f}% @ {self.cert_eps:.3g}"
        return (
            f"epoch {self.epoch:>3}/{epochs}  loss {self.loss:.4f}  "
            f"msvp {self.msvp_penalty:.2e}{unstable}  "
            f"train {100 * self.train_acc:5.1f}%  "
            f"test {100 * self.test_acc:5.1f}%  sigma_max {sigma}  "
            f"lr {self.lr:.2e}  {self.seconds:.1f}s"
        )


def summary_path(out: str | Path) -> Path:
    """Where :func:`train` writes the JSON summary: ``out`` with suffix ``.json``."""
    return Path(out).with_suffix(".json")


def _summary(
    model: nn.Module,
    model_cfg: ViTConfig,
    cfg: TrainConfig,
    data: Dataset,
    out: Path,
    history: list[dict[str, Any]],
    elapsed: float,
    device: torch.device,
    world: int,
) -> dict[str, Any]:
    from lipvit import __version__

    last = history[-1] if history else {}
    proven = {}
    if model_cfg.arch != "vit":  # its constant and attention on 1000 test images
        proven = {"proven": proven_summary(_unwrap(model), data.x_test[:1000],
                                           data.y_test[:1000])}
    return {
        "lipvit_version": __version__,
        "checkpoint": str(out),
        "dataset": data.describe(),
        "family": model_cfg.family,
        "epochs": cfg.epochs,
        "test_acc": last["test_acc"]
        if history
        else evaluate(model, data.x_test, data.y_test),
        "train_acc": last.get("train_acc"),
        "loss": last.get("loss"),
        "msvp_penalty": last.get("msvp_penalty"),
        "sigma_max": sigma_summary(model),
        "params": sum(p.numel() for p in model.parameters()),
        "seconds": elapsed,
        "device": str(device),
        "world_size": world,
        "model_config": model_cfg.to_dict(),
        "train_config": cfg.to_dict(),
        "history": history,
        **proven,
    }
