"""Atomic file writing: JSON and any file written through a temporary path.

:func:`atomic_path` yields a temporary file beside the target and moves it onto
the target only on success (readers never see a half-written file), refusing to
replace an existing file unless ``force``; :func:`write_json` writes indented
JSON through it after :func:`to_jsonable` (numpy/tensor values to plain types,
NaN/±inf to ``null``). Used by the training loop (its JSON summary) and by the
CLI commands (``lipvit.commands._common`` re-exports these).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from lipvit.errors import LipvitError

_UMASK = os.umask(0)
os.umask(_UMASK)


def check_writable(paths: Iterable[str | os.PathLike | None], force: bool) -> None:
    """Refuse (``LipvitError``) if any of ``paths`` exists and ``force`` is off.

    Call it before long computations, so nothing is computed in vain.
    """
    for path in paths:
        if path is None:
            continue
        path = Path(path)
        if path.is_dir():
            raise LipvitError(f"{path} is a directory")
        if path.exists() and not force:
            raise LipvitError(f"{path} exists; pass --force to overwrite it")
        parent = next((p for p in path.absolute().parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise LipvitError(f"cannot write {path}: {parent} is not a directory")
        if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
            raise LipvitError(f"cannot write {path}: {parent} is not writable")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; move it onto ``path`` on success.

    Readers never see a half-written file; on an exception nothing is left
    behind. The parent directory is created.
    """
    path = Path(path)
    check_writable([path], force)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix,
                               dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the usual mode
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def to_jsonable(obj: Any) -> Any:
    """Plain JSON types: numpy scalars/arrays, tuples, paths; NaN/±inf → ``None``."""
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray | Tensor):
        return to_jsonable(obj.tolist())
    if isinstance(obj, bool | np.bool_):
        return bool(obj)
    if isinstance(obj, int | np.integer):
        return int(obj)
    if isinstance(obj, float | np.floating):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return obj


def write_json(path: str | os.PathLike, obj: Any, force: bool = False) -> Path:
    """Write ``obj`` as indented JSON atomically; no replacing without ``force``."""
    text = json.dumps(to_jsonable(obj), indent=2, allow_nan=False)
    with atomic_path(path, force) as tmp:
        tmp.write_text(text + "\n", encoding="utf-8")
    return Path(path)
