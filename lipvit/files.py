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


def _check_parent(path: Path) -> None:
    """Refuse a path whose nearest existing ancestor is a file or not writable."""
    parent = path.parent
    while not parent.exists():
        if parent.is_symlink():  # a dangling link: mkdir would fail on it
            raise LipvitError(f"{parent}: a broken symbolic link")
        parent = parent.parent
    if not parent.is_dir():
        raise LipvitError(f"cannot write {path}: {parent} is a file, not a directory")
    _probe(parent, path)


def _probe(directory: Path, target: Path) -> None:
    """Create and remove a temporary file in ``directory`` (permission bits alone
    do not tell: root ignores them, and /proc or read-only mounts refuse anyway)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".lipvit-probe.", dir=directory)
    except OSError as err:
        raise LipvitError(
            f"cannot write {target}: cannot create a file in {directory} "
            f"({err.strerror})"
        ) from None
    os.close(fd)
    os.unlink(tmp)


def check_writable(paths: Iterable[str | os.PathLike | None], force: bool) -> None:
    """Refuse (``LipvitError``) outputs that cannot or must not be written.

    A path is refused if it is a directory, if it exists and ``force`` is off,
    or if the nearest existing directory on its way is a file or not writable
    (the missing directories would be created). Call it before long
    computations, so nothing is computed in vain.
    """
    for path in paths:
        if path is None:
            continue
        path = Path(path)
        if path.is_dir():
            raise LipvitError(f"{path} is a directory")
        if path.exists() and not force:
            raise LipvitError(f"{path} exists; pass --force to overwrite it")
        if path.exists() and not os.access(path, os.W_OK):
            raise LipvitError(f"cannot write {path}: permission denied")
        _check_parent(path)


def check_output_dir(path: str | os.PathLike) -> Path:
    """Refuse (``LipvitError``) an output directory that cannot be created or written.

    ``path`` may exist (a directory) or not (its missing parents are created
    later); an existing file, a file among its ancestors or an unwritable
    ancestor is refused before any work.
    """
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise LipvitError(f"{path} is a file, not a directory")
        _probe(path, path)
        return path
    _check_parent(path)
    return path


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
