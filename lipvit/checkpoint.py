"""One-file checkpoints: write atomically, read with ``torch.load(weights_only=True)``.

A checkpoint is a plain dict (strings, numbers, lists, dicts and tensors only, so
the safe loader reads it) with these keys:

- ``format`` (:data:`FORMAT`) and ``format_version`` (:data:`FORMAT_VERSION`);
- ``lipvit_version``: the package version that wrote it;
- ``model_config``: :meth:`lipvit.config.ViTConfig.to_dict`;
- ``state_dict``: the model's tensors on the CPU (parametrised weights are
  stored as their ``original``; the caps are re-applied on load, exactly);
- ``msvp``: the MSVP buffers ``lambdas``, ``u``, ``v`` (or ``None``);
- ``normalization``: ``{"mean": [...], "std": [...]}`` applied inside the model;
- ``dataset``: the dataset name (or ``None``);
- ``summary``: the training summary (``None`` while training runs);
- ``train_config``: the training configuration as a dict (or ``None``);
- ``optimizer`` and ``extra``: training state for ``--resume`` (or ``None``).
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lipvit.config import ViTConfig
from lipvit.errors import CheckpointError
from lipvit.model import ViT, build_model

FORMAT = "lipvit-checkpoint"
FORMAT_VERSION = 1

PathLike = str | Path


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        path: the file read.
        model: the :class:`~lipvit.model.ViT`, weights loaded, in eval mode.
        config: its :class:`~lipvit.config.ViTConfig`.
        dataset: name of the dataset it was trained on, or ``None``.
        summary: training summary dict, or ``None`` (training unfinished).
        train_config: training configuration dict, or ``None``.
        msvp: MSVP buffers (``lambdas``, ``u``, ``v``), or ``None``.
        version: lipvit version that wrote the file.
        raw: the whole dict as stored.
    """

    path: Path
    model: ViT
    config: ViTConfig
    dataset: str | None
    summary: dict[str, Any] | None
    train_config: dict[str, Any] | None
    msvp: dict[str, torch.Tensor] | None
    version: str
    raw: dict[str, Any]


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel / DataParallel wrapper."""
    return (
        model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    )


def _cpu(obj: Any) -> Any:
    """Deep copy of ``obj`` with every tensor detached on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def _dataset_name(dataset: Any) -> str | None:
    if dataset is None or isinstance(dataset, str):
        return dataset
    return str(dataset.name)


def save_checkpoint(
    path: PathLike,
    model: nn.Module,
    *,
    train_config: Any = None,
    msvp: nn.Module | None = None,
    optimizer_state: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    summary: dict[str, Any] | None = None,
    dataset: Any = None,
) -> Path:
    """Write ``model`` and its training context to ``path`` atomically.

    The file is written to a temporary file in the same directory, flushed to
    disk, then renamed over ``path`` (``os.replace``): a reader sees the old
    file or the new one, never a partial one.

    Args:
        path: destination file.
        model: a :class:`~lipvit.model.ViT` (possibly wrapped in DDP).
        train_config: a dataclass with ``to_dict()`` or a dict.
        msvp: the :class:`~lipvit.msvp.MSVP` module whose buffers are stored.
        optimizer_state: ``optimizer.state_dict()``.
        extra: further plain data (epoch, RNG states, ...).
        summary: training summary dict.
        dataset: a dataset name or a :class:`~lipvit.data.Dataset`.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    model = _unwrap(model)
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ViTConfig):
        raise TypeError("save_checkpoint needs a lipvit ViT (a model with a ViTConfig)")
    if train_config is not None and not isinstance(train_config, dict):
        train_config = train_config.to_dict()
    payload = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "lipvit_version": _version(),
        "model_config": cfg.to_dict(),
        "state_dict": _cpu(dict(model.state_dict())),
        "msvp": None if msvp is None else _cpu(dict(msvp.state_dict())),
        "normalization": {"mean": list(cfg.mean), "std": list(cfg.std)},
        "dataset": _dataset_name(dataset),
        "summary": summary,
        "train_config": train_config,
        "optimizer": _cpu(optimizer_state),
        "extra": _cpu(extra),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _version() -> str:
    from lipvit import __version__

    return __version__


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _one_line(err: BaseException) -> str:
    """All of an error's lines joined (torch's state-dict errors put the reasons
    on the lines after a heading that ends in a colon)."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    return " ".join(lines) if lines else type(err).__name__


def _key_list(keys: list[str], show: int = 6) -> str:
    if not keys:
        return "none"
    more = f" and {len(keys) - show} more" if len(keys) > show else ""
    return ", ".join(keys[:show]) + more


def load_checkpoint(path: PathLike, device: str | torch.device = "cpu") -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint`, or a foreign ViT.

    Only ``torch.load(weights_only=True)`` (or safetensors) is used: the file
    cannot run code. A transformers ``ViTForImageClassification`` directory or
    a timm-layout ``.safetensors`` / torch file is imported too
    (:mod:`lipvit.interop`); its record has no dataset, summary or MSVP state,
    and ``raw["format"]`` names its origin.

    Raises:
        CheckpointError: the file is missing, truncated, not a torch file, a
            torch file that is no lipvit checkpoint, from a newer lipvit, or
            its weights do not fit its configuration (one-line message).
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_dir() and not (path / "config.json").is_file():
        raise CheckpointError(
            f"checkpoint {path} is not a file (nor a transformers ViT directory "
            "with config.json)"
        )
    if path.is_dir() or path.suffix == ".safetensors":
        return _foreign(path, device)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} is not a file")
    try:
        raw = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        what = f" ({found.group(1)})" if found else ""
        raise CheckpointError(
            f"{path} was refused for safety: it holds Python objects{what} that a "
            "lipvit checkpoint never contains, and rebuilding them could run code; "
            "lipvit only reads tensors and plain data. Use a checkpoint written by "
            "`lipvit train`"
        ) from None
    except (
        RuntimeError,
        EOFError,
        ValueError,
        OSError,
        zipfile.BadZipFile,
        UnicodeDecodeError,
        KeyError,
        AttributeError,
        IndexError,
    ) as err:
        raise CheckpointError(
            f"{path} is not a readable checkpoint (truncated, corrupt or not a torch "
            f"file: {_first_line(err)})"
        ) from err
    if isinstance(raw, dict) and raw.get("format") != FORMAT:
        from lipvit.interop import is_hf_layout, is_timm_layout

        state = raw.get("state_dict", raw.get("model", raw))
        if isinstance(state, dict) and (is_hf_layout(state) or is_timm_layout(state)):
            return _foreign(path, device)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CheckpointError(f"{path} is a torch file but not a lipvit checkpoint")
    version = raw.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(f"{path}: checkpoint has no valid format_version")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written by lipvit {raw.get('lipvit_version', '?')} "
            f"(checkpoint format {version}); this lipvit {_version()} reads format "
            f"{FORMAT_VERSION} at most: upgrade lipvit"
        )
    try:
        cfg = ViTConfig.from_dict(raw["model_config"])
        model = build_model(cfg).to(device)
        fit = model.load_state_dict(raw["state_dict"], strict=False)
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(
            f"{path}: model configuration and weights do not fit: {_one_line(err)}"
        ) from err
    if fit.missing_keys or fit.unexpected_keys:
        raise CheckpointError(
            f"{path}: model configuration and weights do not fit: missing keys "
            f"{_key_list(fit.missing_keys)}; unexpected keys "
            f"{_key_list(fit.unexpected_keys)}"
        )
    model.eval()
    return Checkpoint(
        path=path,
        model=model,
        config=cfg,
        dataset=raw.get("dataset"),
        summary=raw.get("summary"),
        train_config=raw.get("train_config"),
        msvp=raw.get("msvp"),
        version=str(raw.get("lipvit_version", "?")),
        raw=raw,
    )


def _foreign(path: Path, device: str | torch.device) -> Checkpoint:
    """An imported transformers / timm ViT as a :class:`Checkpoint` record."""
    from lipvit.interop import load_foreign

    model, origin = load_foreign(path)
    cfg = model.config
    return Checkpoint(
        path=path,
        model=model.to(device).eval(),
        config=cfg,
        dataset=None,
        summary=None,
        train_config=None,
        msvp=None,
        version=origin,
        raw={
            "format": origin,
            "model_config": cfg.to_dict(),
            "normalization": {"mean": list(cfg.mean), "std": list(cfg.std)},
        },
    )
